"""The pure half of `xpyd bench`: per-request records, SLO checks, the summary and the exit code.

Definitions (DESIGN.md's report keys, as `xpyd sim` writes them):
- TTFT: from sending a request to its first streamed token; ITL: between successive token events;
  TPOT: `(e2e - TTFT) / (output tokens - 1)`, the mean decode interval (undefined for one token).
- A request is *good* when it succeeded and meets both targets; a one-token answer has no TPOT and
  meets the TPOT target vacuously. Failed and dropped requests are never good.
- `attainment`: good requests / requests attempted (dropped ones included), 0-1.
- `goodput_rps`: good requests per wall second of the run (first send to last answer).
- `gpu_hours`, `goodput_per_gpu_hour`, `scaling_actions`: a client cannot see them; they are null
  here and callers that know the cluster (the demo, e2e) fill them in.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# The percentile and millisecond-summary conventions of `xpyd sim`'s report, so both reports compare.
from xpyd.common.stats import summary_ms

EXIT_ATTAINMENT = 3
"""Exit code when attainment is below `--min-attainment` (2 is taken by bad arguments)."""
SEND_LAG_WARNING_MS = 100.0
"""A send this late after its arrival time means the load generator, not the server, set the pace."""


@dataclass(frozen=True, slots=True)
class SloMs:
    """Latency targets of one request, in milliseconds."""

    ttft_ms: float = 500.0
    tpot_ms: float = 50.0

    def __post_init__(self) -> None:
        for name, value in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms)):
            if not value > 0 or not math.isfinite(value):
                raise ValueError(f"the {name} target must be a positive number of milliseconds, not {value}")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What happened to one request. Times are seconds; `scheduled_s`/`sent_s` count from the run's start.

    `error_kind` is a short class for counting (`dropped`, `timeout`, `connect`, `connection`, `http_503`,
    `stream_error`, `protocol`, `incomplete`), `error` the detail; both are None on success.
    """

    index: int
    scheduled_s: float
    sent_s: float
    isl: int
    osl: int
    ok: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    itl_s: tuple[float, ...] = ()
    status: int | None = None
    error_kind: str | None = None
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None without a TTFT or with one token."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-ready dict, with its TPOT."""
        record = asdict(self)
        record["itl_s"] = list(self.itl_s)
        record["tpot_s"] = self.tpot_s
        return record


def meets_ttft(record: RequestRecord, slo: SloMs) -> bool:
    """Succeeded with a first token within the TTFT target."""
    return record.ok and record.ttft_s is not None and record.ttft_s * 1000.0 <= slo.ttft_ms


def meets_tpot(record: RequestRecord, slo: SloMs) -> bool:
    """Succeeded with a TPOT within the target (vacuously true for one-token answers)."""
    tpot = record.tpot_s
    return record.ok and (tpot is None or tpot * 1000.0 <= slo.tpot_ms)


def is_good(record: RequestRecord, slo: SloMs) -> bool:
    """Succeeded and meets both targets."""
    return meets_ttft(record, slo) and meets_tpot(record, slo)


def _share(count: int, total: int) -> float:
    return round(count / total, 6) if total else 0.0


def summarize(records: Sequence[RequestRecord], slo: SloMs, wall_s: float) -> dict[str, Any]:
    """The summary as a JSON-ready dict (DESIGN.md's keys first). `wall_s`: the run's length."""
    total = len(records)
    succeeded = [r for r in records if r.ok]
    good = sum(1 for r in records if is_good(r, slo))
    tpots = [t for r in succeeded if (t := r.tpot_s) is not None]
    output_tokens = sum(r.output_tokens for r in succeeded)
    errors = Counter(r.error_kind or "unknown" for r in records if not r.ok)
    lags = [r.sent_s - r.scheduled_s for r in records if r.error_kind != "dropped"]
    return {
        "requests": total,
        "attainment": _share(good, total),
        "goodput_rps": round(good / wall_s, 6) if wall_s > 0 else None,
        "gpu_hours": None,
        "goodput_per_gpu_hour": None,
        "ttft_ms": summary_ms([r.ttft_s for r in succeeded if r.ttft_s is not None]),
        "tpot_ms": summary_ms(tpots),
        "scaling_actions": None,
        "itl_ms": summary_ms([gap for r in succeeded for gap in r.itl_s]),
        "e2e_ms": summary_ms([r.e2e_s for r in succeeded if r.e2e_s is not None]),
        "good_requests": good,
        "succeeded": len(succeeded),
        "failed": total - len(succeeded),
        "dropped": errors.get("dropped", 0),
        "errors": dict(sorted(errors.items())),
        "attainment_ttft": _share(sum(1 for r in records if meets_ttft(r, slo)), total),
        "attainment_tpot": _share(sum(1 for r in records if meets_tpot(r, slo)), total),
        "duration_s": round(wall_s, 3),
        "request_rps": round(total / wall_s, 6) if wall_s > 0 else None,
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / wall_s, 3) if wall_s > 0 else None,
        "max_send_lag_ms": round(max(lags) * 1000.0, 3) if lags else None,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
    }


def build_report(summary: Mapping[str, Any], records: Iterable[RequestRecord],
                 config: Mapping[str, Any]) -> dict[str, Any]:
    """The `--report` JSON: the summary, the run's configuration and every request's record."""
    return {**summary, "config": dict(config), "records": [r.to_json() for r in records]}


def exit_code(attainment: float, min_attainment: float | None) -> int:
    """0, or EXIT_ATTAINMENT when attainment falls below the required share."""
    return EXIT_ATTAINMENT if min_attainment is not None and attainment < min_attainment else 0


def format_summary(summary: Mapping[str, Any], title: str) -> str:
    """A few human lines about a summary (no trailing newline)."""
    def ms(stats: Mapping[str, float | None]) -> str:
        return "  ".join(f"{q} {stats[q]:,.1f}" if stats[q] is not None else f"{q} -"
                         for q in ("p50", "p90", "p99", "mean"))

    def rate(value: float | None, unit: str) -> str:
        return f"{value:,.2f} {unit}" if value is not None else f"- {unit}"

    slo = summary["slo"]
    lines = [
        f"xpyd bench: {title}",
        f"  {summary['requests']:,} requests in {summary['duration_s']:,.2f} s "
        f"({rate(summary['request_rps'], 'req/s')}): {summary['succeeded']:,} succeeded, "
        f"{summary['failed']:,} failed ({summary['dropped']:,} dropped)",
        f"  attainment {summary['attainment']:.1%} (TTFT <= {slo['ttft_ms']:g} ms: {summary['attainment_ttft']:.1%},"
        f" TPOT <= {slo['tpot_ms']:g} ms: {summary['attainment_tpot']:.1%})"
        f"  goodput {rate(summary['goodput_rps'], 'req/s')}",
        f"  TTFT ms  {ms(summary['ttft_ms'])}",
        f"  TPOT ms  {ms(summary['tpot_ms'])}",
        f"  ITL ms   {ms(summary['itl_ms'])}",
        f"  E2E ms   {ms(summary['e2e_ms'])}",
        f"  output {summary['output_tokens']:,} tokens ({rate(summary['output_tokens_per_s'], 'tok/s')})",
    ]
    lag_ms = summary["max_send_lag_ms"]
    if lag_ms is not None and lag_ms > SEND_LAG_WARNING_MS:
        lines.append(f"  warning: requests went out up to {lag_ms:,.0f} ms after their arrival time "
                     "(the client could not keep up: its numbers include its own delay)")
    if summary["errors"]:
        lines.append("  errors: " + ", ".join(f"{kind} {count:,}" for kind, count in summary["errors"].items()))
    return "\n".join(lines)


def attainment_message(attainment: float, min_attainment: float) -> str:
    """The one line printed with EXIT_ATTAINMENT."""
    return f"attainment {attainment:.1%} is below --min-attainment {min_attainment:.1%}"

