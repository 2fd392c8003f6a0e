"""Reading DisaggregatedServing objects from YAML, with errors that name the field."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import yaml
from pydantic import ValidationError

from xpyd.api.models import API_VERSION, KIND, DisaggregatedServing


class SpecError(ValueError):
    """An invalid DisaggregatedServing; the message names each offending field."""


def _path(loc: Iterable[int | str]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def format_validation_error(error: ValidationError, prefix: str = "") -> str:
    """One line per problem: `spec.kvTransfer.connector: Input should be ...`."""
    lines = []
    for problem in error.errors():
        message = problem["msg"].removeprefix("Value error, ")
        path = _path(problem["loc"])
        lines.append(f"{prefix}{path}: {message}" if path else f"{prefix}{message}")
    return "\n".join(lines)


def parse_serving(document: Mapping[str, Any], source: str = "") -> DisaggregatedServing:
    """Validate one object; raises SpecError naming the source and the offending fields."""
    where = f"{source}: " if source else ""
    if document.get("apiVersion") != API_VERSION or document.get("kind") != KIND:
        raise SpecError(f"{where}expected apiVersion {API_VERSION} and kind {KIND}, got "
                        f"{document.get('apiVersion')!r} and {document.get('kind')!r}")
    try:
        return DisaggregatedServing.model_validate(document)
    except ValidationError as error:
        name = document.get("metadata", {}).get("name", "?") if isinstance(document.get("metadata"), dict) else "?"
        raise SpecError(f"{where}invalid DisaggregatedServing {name!r}:\n"
                        + format_validation_error(error, prefix="  ")) from None


def load_servings(text: str, source: str = "", vllm_version: str | None = None) -> list[DisaggregatedServing]:
    """Every DisaggregatedServing in a multi-document YAML text; other kinds (a ConfigMap the
    sample ships with, say) are skipped, but a file without any DisaggregatedServing is an error.

    `vllm_version` replaces each spec's engine.vllmVersion before validation, so the rules that
    depend on the version apply to it.
    """
    try:
        documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as error:
        raise SpecError(f"{source}: not valid YAML: {error}") from None
    servings = []
    for index, document in enumerate(documents):
        if not isinstance(document, dict):
            raise SpecError(f"{source}: document {index + 1} is not a mapping")
        if document.get("kind") != KIND:
            continue
        if vllm_version is not None and isinstance(document.get("spec"), dict):
            spec = document["spec"]
            spec["engine"] = {**(spec.get("engine") or {}), "vllmVersion": vllm_version}
        servings.append(parse_serving(document, source))
    if not servings:
        raise SpecError(f"{source}: no {KIND} found")
    return servings
