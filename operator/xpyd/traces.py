"""Request traces: arrival time, prompt length (ISL), output length (OSL) and prefix blocks.

Two shapes are read, told apart by content (a first line starting with `{` is JSON Lines):

- CSV with a header, like the Azure LLM inference traces: `TIMESTAMP,ContextTokens,GeneratedTokens`
  (UTF-8 with or without a BOM, `\\n` or `\\r\\n`). Timestamps are ISO-like date-times (any number of
  fractional digits) or plain numbers of seconds.
- JSON Lines like Mooncake's: `{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}`.
  Numeric timestamps are milliseconds (Mooncake's unit); ISO strings are accepted too.

Column and key names are matched case-insensitively with common aliases (see `_ALIASES`), so other
traces in either shape load too. An OSL of 0 counts as 1 (a request always returns its first token).
Arrival times are seconds from the trace's first request; `load_trace` takes a window, compresses
time (`speedup`) and scales the arrival rate (`rate_scale`, `scale_rate`: more requests at the same
time scale, for large pools on a trace replayed in real time).
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: when it arrives (s), its prompt and output lengths, its prefix block ids."""

    arrival_s: float
    isl: int
    osl: int
    prefix_blocks: tuple[int, ...] = ()


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


_ALIASES: dict[str, tuple[str, ...]] = {
    "time": ("timestamp", "arrival_time", "arrival_s", "time"),
    "isl": ("contexttokens", "input_length", "prompt_tokens", "input_tokens", "isl"),
    "osl": ("generatedtokens", "output_length", "completion_tokens", "output_tokens", "osl"),
    "blocks": ("hash_ids",),
}


def load_trace(path: str | Path, *, speedup: float = 1.0, start_s: float = 0.0,
               duration_s: float | None = None, rate_scale: int = 1, seed: int = 0) -> list[TraceRequest]:
    """Read a trace and take the window [start_s, start_s + duration_s) of trace time, sorted by arrival.

    Arrivals are re-based to the window's start and divided by `speedup`; then each request becomes
    `rate_scale` requests (`scale_rate`, jitter seeded with `seed`). Raises TraceError for an
    unreadable or malformed file or an empty window, ValueError for bad arguments.
    """
    if not speedup > 0 or not math.isfinite(speedup):
        raise ValueError(f"speedup must be a positive number, not {speedup}")
    _check_rate_scale(rate_scale)
    if start_s < 0 or not math.isfinite(start_s):
        raise ValueError(f"start must be a non-negative number of seconds, not {start_s}")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"duration must be a positive number of seconds, not {duration_s}")
    requests = read_trace(path)
    end_s = math.inf if duration_s is None else start_s + duration_s
    out = [TraceRequest((r.arrival_s - start_s) / speedup, r.isl, r.osl, r.prefix_blocks)
           for r in requests if start_s <= r.arrival_s < end_s]
    if not out:
        raise TraceError(f"{path}: no requests in the window [{start_s:g} s, {end_s:g} s) "
                         f"(the trace spans {requests[-1].arrival_s:.1f} s)")
    return scale_rate(out, rate_scale, seed=seed)


def scale_rate(requests: Sequence[TraceRequest], factor: int, *, seed: int = 0) -> list[TraceRequest]:
    """Each request as `factor` requests with its lengths and prefix blocks: `factor` times the
    arrival rate at the same time scale, sorted by arrival.

    The first copy keeps the request's arrival time `t`; the other `factor - 1` arrive at `t + u`,
    `u` uniform in [0, gap / factor) from a generator seeded with `seed`, where `gap` is the mean
    inter-arrival gap of `requests` (their span over their count less one; 0 for one request).
    So copies land before the request's successor would on average, and every burst and trend
    keeps its shape, `factor` times as tall. `factor` 1 returns the requests unchanged.
    """
    _check_rate_scale(factor)
    if factor == 1:
        return list(requests)
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    span = ordered[-1].arrival_s - ordered[0].arrival_s if ordered else 0.0
    jitter_s = span / (len(ordered) - 1) / factor if len(ordered) > 1 else 0.0
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    for request in ordered:
        out.append(request)
        for _ in range(factor - 1):
            out.append(TraceRequest(request.arrival_s + rng.random() * jitter_s, request.isl, request.osl,
                                    request.prefix_blocks))
    out.sort(key=lambda r: r.arrival_s)
    return out


def surge(requests: Sequence[TraceRequest], start_s: float, end_s: float, factor: int, *,
          seed: int = 0) -> list[TraceRequest]:
    """The requests with those arriving in [start_s, end_s) each `factor` times (`scale_rate` on that
    span alone): a surge with sharp edges whose traffic keeps the trace's own shape and lengths."""
    _check_rate_scale(factor)
    if not end_s > start_s:
        raise ValueError(f"a surge must end after it starts, not [{start_s:g} s, {end_s:g} s)")
    inside = [r for r in requests if start_s <= r.arrival_s < end_s]
    outside = [r for r in requests if not start_s <= r.arrival_s < end_s]
    return sorted(outside + (scale_rate(inside, factor, seed=seed) if inside else []), key=lambda r: r.arrival_s)


def scale_prompts(requests: Sequence[TraceRequest], factor: float, *, max_isl: int) -> list[TraceRequest]:
    """Every prompt `factor` times as long (rounded, at most `max_isl` tokens), outputs unchanged: a
    long-context variant of a trace with its arrivals (prefix blocks are dropped: they no longer match)."""
    if not factor > 0 or not math.isfinite(factor):
        raise ValueError(f"prompt scale must be a positive number, not {factor}")
    if max_isl < 1:
        raise ValueError(f"max_isl must be at least 1, not {max_isl}")
    return [TraceRequest(r.arrival_s, max(1, min(max_isl, round(r.isl * factor))), r.osl) for r in requests]


def _check_rate_scale(factor: int) -> None:
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise ValueError(f"rate scale must be a whole number of requests per request (1 or more), not {factor!r}")


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Every request of a trace file, sorted by arrival, with times in seconds from the first request."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as error:
        raise TraceError(f"{path}: cannot read: {error.strerror or error}") from error
    except UnicodeDecodeError as error:
        raise TraceError(f"{path}: not UTF-8 text: {error.reason} at byte {error.start}") from error
    lines = text.splitlines()
    first = next((line.strip() for line in lines if line.strip()), "")
    if not first:
        raise TraceError(f"{path}: empty trace")
    rows = _read_jsonl(path, lines) if first.startswith("{") else _read_csv(path, lines)
    rows.sort(key=lambda row: row[0])
    origin = rows[0][0]
    return [TraceRequest(time - origin, isl, osl, blocks) for time, isl, osl, blocks in rows]


_Row = tuple[float, int, int, tuple[int, ...]]


def _read_csv(path: Path, lines: list[str]) -> list[_Row]:
    reader = csv.reader(lines)
    header_line = 0
    header: list[str] = []
    for number, fields in enumerate(reader, start=1):
        if any(f.strip() for f in fields):
            header, header_line = [f.strip().lower() for f in fields], number
            break
    columns = {key: _find_column(header, names) for key, names in _ALIASES.items()}
    missing = [key for key in ("time", "isl", "osl") if columns[key] is None]
    if missing:
        wanted = "; ".join(f"{key}: one of {', '.join(_ALIASES[key])}" for key in missing)
        raise TraceError(f"{path}:{header_line}: CSV header {','.join(header)!r} lacks a column ({wanted})")
    rows: list[_Row] = []
    for number, fields in enumerate(reader, start=header_line + 1):
        if not any(f.strip() for f in fields):
            continue
        if len(fields) < len(header):
            raise TraceError(f"{path}:{number}: expected {len(header)} fields, found {len(fields)}")
        values = {key: fields[index] for key, index in columns.items() if index is not None}
        rows.append(_row(path, number, values, numeric_time_unit=1.0))
    if not rows:
        raise TraceError(f"{path}: no requests after the header")
    return rows


def _read_jsonl(path: Path, lines: list[str]) -> list[_Row]:
    rows: list[_Row] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as error:
            raise TraceError(f"{path}:{number}: not JSON: {error.msg} (column {error.colno})") from error
        if not isinstance(obj, dict):
            raise TraceError(f"{path}:{number}: expected a JSON object, found {type(obj).__name__}")
        lowered = {str(key).lower(): value for key, value in obj.items()}
        values: dict[str, object] = {}
        for key, names in _ALIASES.items():
            name = next((n for n in names if n in lowered), None)
            if name is not None:
                values[key] = lowered[name]
            elif key != "blocks":
                raise TraceError(f"{path}:{number}: missing {key!r} (one of {', '.join(names)})")
        rows.append(_row(path, number, values, numeric_time_unit=0.001))
    return rows


def _find_column(header: list[str], names: Iterable[str]) -> int | None:
    return next((header.index(name) for name in names if name in header), None)


def _row(path: Path, number: int, values: Mapping[str, object], numeric_time_unit: float) -> _Row:
    where = f"{path}:{number}"
    time = _time(where, values["time"], numeric_time_unit)
    isl = _count(where, "input length", values["isl"])
    if isl < 1:
        raise TraceError(f"{where}: input length must be at least 1, not {isl}")
    osl = max(1, _count(where, "output length", values["osl"]))
    blocks: tuple[int, ...] = ()
    raw_blocks = values.get("blocks")
    if raw_blocks is not None:
        if not isinstance(raw_blocks, list) or not all(isinstance(b, int) for b in raw_blocks):
            raise TraceError(f"{where}: hash_ids must be a list of integers")
        blocks = tuple(raw_blocks)
    return time, isl, osl, blocks


def _time(where: str, value: object, numeric_unit: float) -> float:
    if isinstance(value, bool):
        raise TraceError(f"{where}: timestamp must be a number or a date-time, not {value!r}")
    if isinstance(value, int | float):
        seconds = float(value) * numeric_unit
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text) * numeric_unit
        except ValueError:
            seconds = _datetime_seconds(where, text)
    else:
        raise TraceError(f"{where}: timestamp must be a number or a date-time, not {value!r}")
    if not math.isfinite(seconds):
        raise TraceError(f"{where}: timestamp {value!r} is not finite")
    return seconds


def _datetime_seconds(where: str, text: str) -> float:
    # fromisoformat takes at most 6 fractional digits; Azure's traces have 7 (100 ns ticks).
    head, dot, tail = text.partition(".")
    fraction = ""
    if dot:
        digits = len(tail) - len(tail.lstrip("0123456789"))
        fraction, tail = tail[:digits], tail[digits:]
    try:
        moment = datetime.fromisoformat(head + tail)
    except ValueError as error:
        raise TraceError(f"{where}: bad timestamp {text!r}: {error}") from error
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)   # naive times: no local-time (DST) shifts
    return moment.timestamp() + (float("0." + fraction) if fraction else 0.0)


def _count(where: str, what: str, value: object) -> int:
    if isinstance(value, bool):
        raise TraceError(f"{where}: {what} must be an integer, not {value!r}")
    if isinstance(value, int):
        count = value
    elif isinstance(value, float) and value.is_integer():
        count = int(value)
    elif isinstance(value, str):
        try:
            count = int(value.strip())
        except ValueError as error:
            raise TraceError(f"{where}: {what} must be an integer, not {value!r}") from error
    else:
        raise TraceError(f"{where}: {what} must be an integer, not {value!r}")
    if count < 0:
        raise TraceError(f"{where}: {what} must not be negative, not {count}")
    return count
