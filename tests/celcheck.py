"""A small offline model of how the API server treats a DisaggregatedServing under the CRD's
schema: structural defaulting, then every `x-kubernetes-validations` rule evaluated with a real
CEL interpreter. Lets unit tests check the CRD's rules without an API server (the e2e suite
checks the real one). `judged` puts the models' own verdict (`xpyd.api.load`, what `xpyd render`
and the operator run) beside it: the two must agree on every case."""

from __future__ import annotations

import copy
from typing import Any

import cel

from xpyd.api.crd import build_crd
from xpyd.api.load import SpecError, parse_serving

Schema = dict[str, Any]
ROOT_SCHEMA: Schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
"""The CRD's schema of a DisaggregatedServing, as `xpyd crd` generates it."""


def model_errors(obj: dict[str, Any]) -> list[str]:
    """What the models refuse in `obj`, one line a problem (none: valid)."""
    try:
        parse_serving(copy.deepcopy(obj))
    except SpecError as error:
        return str(error).splitlines()[1:]
    return []


def judged(obj: dict[str, Any], message: str | None = None) -> list[str]:
    """Check that the models and the CRD's CEL rules judge `obj` alike: both accept it (`message`
    None) or both refuse it with a problem containing `message`. Returns the CEL's problems."""
    problems, cel_problems = model_errors(obj), server_view(ROOT_SCHEMA, obj)
    if message is None:
        assert problems == [] and cel_problems == [], (problems, cel_problems)
    else:
        assert any(message in line for line in problems), problems
        assert any(message in line for line in cel_problems), cel_problems
    return cel_problems


def apply_defaults(schema: Schema, obj: Any) -> Any:
    """Fill in defaults the way the API server does: absent fields get their default, then the
    defaults inside it."""
    obj = copy.deepcopy(obj)
    if isinstance(obj, dict):
        for name, prop in schema.get("properties", {}).items():
            if name not in obj and "default" in prop:
                obj[name] = copy.deepcopy(prop["default"])
            if name in obj:
                obj[name] = apply_defaults(prop, obj[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            obj = {key: apply_defaults(extra, value) for key, value in obj.items()}
    elif isinstance(obj, list) and "items" in schema:
        obj = [apply_defaults(schema["items"], item) for item in obj]
    return obj


def violations(schema: Schema, obj: Any, old: Any = None) -> list[str]:
    """Messages of every rule `obj` breaks; transition rules only when `old` is given."""
    found: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        transition = "oldSelf" in rule["rule"]
        if transition and old is None:
            continue
        context = {"self": obj, **({"oldSelf": old} if transition else {})}
        if not cel.evaluate(rule["rule"], context):
            found.append(rule["message"])
    if isinstance(obj, dict):
        for name, prop in schema.get("properties", {}).items():
            if name in obj:
                old_child = old.get(name) if isinstance(old, dict) else None
                found += violations(prop, obj[name], old_child)
    elif isinstance(obj, list) and "items" in schema:
        for item in obj:
            found += violations(schema["items"], item)
    return found


def server_view(root_schema: Schema, obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """Default `obj` (and `old`) and return the rule violations, as the API server would report."""
    defaulted = apply_defaults(root_schema, obj)
    old_defaulted = apply_defaults(root_schema, old) if old is not None else None
    return violations(root_schema, defaulted, old_defaulted)
