"""The autoscaler's decision state as JSON, so that it survives an operator restart. Pure.

`decide()` carries an `AutoscalerState` from one decision to the next: the forecasts, the
capacity corrections, the recommendations inside the stabilisation windows, the last scale-up, the
prompt bursts. The operator keeps it in `status.autoscaler.state` (`encode`), and a process that
has no state of its own for a DisaggregatedServing (it restarted, or took over from another
replica) reads it back (`decode`) instead of starting empty, which would forget the windows (a
scale-down would wait a whole window again) and the bursts (a prompt burst would be sized as new).

Times in the state are wall-clock seconds (`time.time()`), so they mean the same in another process.
Floats that JSON cannot hold (NaN, infinities: "not seen yet") are written as the strings "NaN",
"Infinity" and "-Infinity". The encoding is versioned (`VERSION`); a state of another version, or
one that does not parse, is not used (the caller starts empty and says so).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Final, TypeVar

from xpyd.autoscaler.decide import AutoscalerState
from xpyd.common.jsontypes import JSON

#: The encoding's version: raised whenever a field changes meaning (new fields with defaults do not).
VERSION: Final = 1
_NON_FINITE: Final = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

T = TypeVar("T")


def encode(state: AutoscalerState) -> JSON:
    """The state as a JSON object (every float finite or one of the strings above)."""
    return {"version": VERSION, **_encode(state)}


def decode(data: Any) -> AutoscalerState:
    """The state `encode` wrote; ValueError when it is of another version or does not fit the
    state's fields (fields it lacks take their defaults: an older encoding of the same version)."""
    if not isinstance(data, dict):
        raise ValueError(f"the autoscaler state is not an object: {type(data).__name__}")
    if data.get("version") != VERSION:
        raise ValueError(f"the autoscaler state is of version {data.get('version')!r}, not {VERSION}")
    return _dataclass(AutoscalerState, {k: v for k, v in data.items() if k != "version"}, "state")


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_encode(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def _dataclass(cls: type[T], data: Any, where: str) -> T:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: not an object")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(data) - fields
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    values = {name: _value(hints[name], raw, f"{where}.{name}") for name, raw in data.items()}
    try:
        return cls(**values)
    except TypeError as error:  # a field without a default is missing
        raise ValueError(f"{where}: {error}") from None


def _value(hint: Any, raw: Any, where: str) -> Any:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass(hint, raw, where)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        if not isinstance(raw, list):
            raise ValueError(f"{where}: not a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_value(args[0], item, f"{where}[{i}]") for i, item in enumerate(raw))
        if len(raw) != len(args):
            raise ValueError(f"{where}: {len(raw)} items, not {len(args)}")
        return tuple(_value(a, item, f"{where}[{i}]") for i, (a, item) in enumerate(zip(args, raw, strict=True)))
    if origin in (types.UnionType, typing.Union):
        if raw is None and type(None) in args:
            return None
        (other,) = [a for a in args if a is not type(None)]
        return _value(other, raw, where)
    if hint is float:
        if isinstance(raw, str) and raw in _NON_FINITE:
            return _NON_FINITE[raw]
        if isinstance(raw, int | float) and not isinstance(raw, bool):
            return float(raw)
        raise ValueError(f"{where}: not a number: {raw!r}")
    if hint is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
        raise ValueError(f"{where}: not an integer: {raw!r}")
    raise ValueError(f"{where}: cannot decode a {hint!r}")
