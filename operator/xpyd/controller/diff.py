"""Does a live object already hold everything the operator would apply?

Server-side apply only sets the fields it is given, and the API server adds defaults and other
managers' fields, so the question is "is desired a subset of live", not equality. Answering it
locally is what lets a converged reconcile send no write at all.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

from kubernetes.utils import parse_quantity


def _same_scalar(desired: Any, live: Any) -> bool:
    if desired == live:
        return True
    # Quantities come back canonicalised ("0.5" -> "500m", 1 -> "1").
    if isinstance(desired, str | int) and isinstance(live, str | int) and not isinstance(desired, bool):
        try:
            return Decimal(parse_quantity(desired)) == Decimal(parse_quantity(live))  # type: ignore[no-untyped-call]
        except (ValueError, InvalidOperation, TypeError):
            return False
    return False


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == []


def _omitted(value: Any) -> bool:
    """Whether the server may leave the field out when it has this value: empty, or a zero number or
    false (`omitempty`: a Deployment without minReadySeconds has 0). An empty string stays a value."""
    return _empty(value) or (isinstance(value, bool | int | float) and not value)


def is_subset(desired: Any, live: Any) -> bool:
    """True when every field of `desired` has the same value in `live`.

    Empty maps and lists, zero numbers and false match absent fields (the server omits them).
    Lists of named items (containers, env, ports, volumes) match by name, as the server merges
    them; other lists match position by position and must have the same length.
    """
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return _empty(desired) and _empty(live)
        return all(
            is_subset(value, live.get(key)) if key in live else _omitted(value) for key, value in desired.items()
        )
    if isinstance(desired, list):
        if not isinstance(live, list):
            return _empty(desired) and _empty(live)
        if desired and all(isinstance(item, dict) and "name" in item for item in desired):
            by_name = {item.get("name"): item for item in live if isinstance(item, dict)}
            return all(is_subset(item, by_name.get(item["name"])) for item in desired)
        return len(desired) == len(live) and all(is_subset(d, v) for d, v in zip(desired, live, strict=True))
    return _same_scalar(desired, live)
