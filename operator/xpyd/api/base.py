"""Shared machinery of the API models: camelCase wire names and cross-field rules.

A cross-field rule is written once as a `Rule`: its CEL expression goes into the CRD
(`x-kubernetes-validations`, enforced by the API server) and its Python mirror runs when a
model is validated (so `xpyd render` and the operator reject the same specs). A unit test
evaluates every CEL expression with a CEL interpreter against the Python mirror, so the two
cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, GetJsonSchemaHandler, model_validator
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema as cs


@dataclass(frozen=True)
class Rule:
    """A validation rule over one object of the API.

    `cel` is evaluated by the API server with `self` bound to the object (and `oldSelf` to the
    previous version for transition rules). `check` is its Python mirror on the model instance;
    transition rules take `(old, new)` instead and run only where an old object exists.
    """

    cel: str
    message: str
    check: Callable[[Any], bool] | None = None
    check_transition: Callable[[Any, Any], bool] | None = None
    field_path: str | None = None

    def to_crd(self) -> dict[str, str]:
        rule = {"rule": self.cel, "message": self.message}
        if self.field_path:
            rule["fieldPath"] = self.field_path
            rule["reason"] = "FieldValueInvalid"
        return rule


class APIModel(BaseModel):
    """Base of every spec model: camelCase names on the wire, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
    )

    rules: ClassVar[tuple[Rule, ...]] = ()

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: cs.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler(core_schema)
        if cls.rules:
            target = handler.resolve_ref_schema(schema)
            target["x-kubernetes-validations"] = [rule.to_crd() for rule in cls.rules]
        return schema

    @model_validator(mode="after")
    def _check_rules(self) -> Self:
        for rule in type(self).rules:
            if rule.check is not None and not rule.check(self):
                raise ValueError(rule.message)
        return self

    def to_wire(self) -> dict[str, Any]:
        """The object as the API server stores it (camelCase, defaults filled, unset optionals left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class StatusModel(BaseModel):
    """Base of status models: camelCase names, tolerant of fields a newer operator wrote."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


def transition_violations(model: APIModel, old: APIModel) -> list[str]:
    """Messages of every transition rule (e.g. immutable fields) that `old -> model` breaks.

    Walks both trees in parallel, the way the API server applies `oldSelf` rules to each object
    that exists in both versions.
    """
    problems: list[str] = []
    for rule in type(model).rules:
        if rule.check_transition is not None and not rule.check_transition(old, model):
            problems.append(rule.message)
    for name in type(model).model_fields:
        new_child, old_child = getattr(model, name), getattr(old, name)
        if isinstance(new_child, APIModel) and isinstance(old_child, APIModel):
            problems.extend(transition_violations(new_child, old_child))
    return problems
