"""The demo's data, pure: pool samples taken from the DisaggregatedServing's status, latency of the
requests finished so far, and what the summary, the JSON and the plot are made of.

Times are seconds from the start of the load (`t_s`); a sample holds the replicas the operator asks
for (`desired`) and has (`ready`) per role, the prefill queue the autoscaler observed and its last
decision, as `status` shows them at that moment.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from xpyd.api.naming import ROLES
from xpyd.bench import RequestRecord, SloMs
from xpyd.bench.report import is_good
from xpyd.common.stats import finite, percentile
from xpyd.sim.report import timeline_bin_s


@dataclass(frozen=True, slots=True)
class DecisionSample:
    """`status.autoscaler.lastDecision`: the sizes decided, why, and when (RFC 3339)."""

    time: str
    prefill: int
    decode: int
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class PoolSample:
    """The pool at one moment, as the DisaggregatedServing's status reports it."""

    t_s: float
    prefill_ready: int
    prefill_desired: int
    decode_ready: int
    decode_desired: int
    prefill_queue: float | None = None
    decision: DecisionSample | None = None

    def ready(self, role: str) -> int:
        """Ready replicas of `role` ("prefill" or "decode")."""
        return int(getattr(self, f"{role}_ready"))

    def desired(self, role: str) -> int:
        """Replicas of `role` the operator asks for."""
        return int(getattr(self, f"{role}_desired"))


def sample_from_status(obj: Mapping[str, Any], t_s: float) -> PoolSample:
    """A sample from a DisaggregatedServing object (missing status fields count as zero / unknown)."""
    status = obj.get("status") or {}
    roles = {role: status.get(role) or {} for role in ROLES}
    autoscaler = status.get("autoscaler") or {}
    observed = autoscaler.get("observed") or {}
    last = autoscaler.get("lastDecision")
    decision = None
    if isinstance(last, Mapping):
        decision = DecisionSample(time=str(last.get("time", "")), prefill=int(last.get("prefill", 0)),
                            decode=int(last.get("decode", 0)), reason=str(last.get("reason", "")),
                            message=str(last.get("message", "")))
    queue = observed.get("prefillQueue")
    return PoolSample(
        t_s=t_s,
        prefill_ready=int(roles["prefill"].get("readyReplicas", 0)),
        prefill_desired=int(roles["prefill"].get("desiredReplicas", roles["prefill"].get("replicas", 0))),
        decode_ready=int(roles["decode"].get("readyReplicas", 0)),
        decode_desired=int(roles["decode"].get("desiredReplicas", roles["decode"].get("replicas", 0))),
        prefill_queue=float(queue) if isinstance(queue, int | float) else None,
        decision=decision,
    )


@dataclass(frozen=True, slots=True)
class LatencySoFar:
    """The requests finished so far: how many, how many failed, TTFT and TPOT p90 of the rest (ms)."""

    finished: int
    failed: int
    ttft_p90_ms: float | None
    tpot_p90_ms: float | None


def _p90_ms(values_s: Sequence[float]) -> float | None:
    return finite(percentile(sorted(values_s), 0.9) * 1000.0, 3)


def latency_so_far(records: Sequence[RequestRecord]) -> LatencySoFar:
    """TTFT and TPOT p90 of the succeeded requests among `records` (None before the first)."""
    succeeded = [r for r in records if r.ok]
    return LatencySoFar(
        finished=len(records), failed=len(records) - len(succeeded),
        ttft_p90_ms=_p90_ms([r.ttft_s for r in succeeded if r.ttft_s is not None]),
        tpot_p90_ms=_p90_ms([t for r in succeeded if (t := r.tpot_s) is not None]),
    )


def replica_summary(samples: Sequence[PoolSample]) -> dict[str, dict[str, int]]:
    """Per role, the desired replicas at the first sample, their peak, and at the last sample."""
    if not samples:
        return {role: {"before": 0, "peak": 0, "after": 0} for role in ROLES}
    return {role: {"before": samples[0].desired(role), "peak": max(s.desired(role) for s in samples),
                   "after": samples[-1].desired(role)} for role in ROLES}


def scaling_actions(samples: Sequence[PoolSample]) -> int:
    """Changes of a role's desired size seen between samples, counted per role (as `xpyd sim` does)."""
    return sum((a.prefill_desired != b.prefill_desired) + (a.decode_desired != b.decode_desired)
               for a, b in itertools.pairwise(samples))


def gpu_hours(samples: Sequence[PoolSample], gpus_per_replica: int = 1) -> float:
    """GPU time of the ready engines between the first and the last sample (each sample's count
    held until the next), in hours."""
    seconds = sum((a.prefill_ready + a.decode_ready) * (b.t_s - a.t_s) for a, b in itertools.pairwise(samples))
    return seconds * gpus_per_replica / 3600.0


@dataclass(frozen=True, slots=True)
class DecisionRun:
    """Consecutive decisions with the same sizes and reason: the first one's time (load seconds) and
    message, and how many there were."""

    t_s: float
    prefill: int
    decode: int
    reason: str
    message: str
    count: int


def decision_runs(samples: Sequence[PoolSample]) -> list[DecisionRun]:
    """The distinct decisions the samples saw (by decision time), consecutive repeats of the same
    sizes and reason folded into one run."""
    runs: list[DecisionRun] = []
    seen: set[str] = set()
    for sample in samples:
        decision = sample.decision
        if decision is None or decision.time in seen:
            continue
        seen.add(decision.time)
        last = runs[-1] if runs else None
        if last is not None and (last.prefill, last.decode, last.reason) == (decision.prefill, decision.decode,
                                                                             decision.reason):
            runs[-1] = DecisionRun(last.t_s, last.prefill, last.decode, last.reason, last.message, last.count + 1)
        else:
            runs.append(DecisionRun(round(sample.t_s, 1), decision.prefill, decision.decode, decision.reason,
                                    decision.message, 1))
    return runs


def load_timeline(records: Sequence[RequestRecord], duration_s: float, slo: SloMs, bins: int = 20) -> dict[str, Any]:
    """Per bin of send time: requests sent per second, those of them that met both SLOs per second,
    and the TTFT / TPOT p90 (ms) of the succeeded ones (None for a bin without any)."""
    width = timeline_bin_s(max(duration_s, 1.0), bins)
    count = max(1, math.ceil(max(duration_s, max((r.sent_s for r in records), default=0.0)) / width))
    sent = [0] * count
    good = [0] * count
    ttft: list[list[float]] = [[] for _ in range(count)]
    tpot: list[list[float]] = [[] for _ in range(count)]
    for record in records:
        index = min(int(record.sent_s // width), count - 1)
        sent[index] += 1
        good[index] += is_good(record, slo)
        if record.ok and record.ttft_s is not None:
            ttft[index].append(record.ttft_s)
        if (per_token := record.tpot_s) is not None:
            tpot[index].append(per_token)
    return {"bin_s": width, "t_s": [i * width for i in range(count)],
            "requests_rps": [n / width for n in sent], "good_rps": [n / width for n in good],
            "ttft_p90_ms": [_p90_ms(values) for values in ttft],
            "tpot_p90_ms": [_p90_ms(values) for values in tpot]}


def replica_timeline(samples: Sequence[PoolSample]) -> dict[str, list[float] | list[int]]:
    """The samples' replica counts as columns (for the plot and the JSON)."""
    columns: dict[str, list[float] | list[int]] = {"t_s": [round(s.t_s, 2) for s in samples]}
    for role in ROLES:
        columns[f"{role}_ready"] = [s.ready(role) for s in samples]
        columns[f"{role}_desired"] = [s.desired(role) for s in samples]
    return columns


def demo_report(bench_summary: Mapping[str, Any], samples: Sequence[PoolSample], records: Sequence[RequestRecord],
                events: Sequence[Mapping[str, Any]], settings: Mapping[str, Any], slo: SloMs) -> dict[str, Any]:
    """The JSON summary: the bench summary with the cluster-side keys filled in (GPU-hours of ready
    engines, good requests per GPU-hour, scaling actions), the replicas before/peak/after, the
    decisions, the Events and the timelines behind the plot."""
    hours = gpu_hours(samples)
    good = bench_summary.get("good_requests")
    return {
        **bench_summary,
        "gpu_hours": round(hours, 6),
        "goodput_per_gpu_hour": round(good / hours, 3) if isinstance(good, int) and hours > 0 else None,
        "scaling_actions": scaling_actions(samples),
        "replicas": replica_summary(samples),
        "decisions": [asdict(run) for run in decision_runs(samples)],
        "events": [dict(event) for event in events],
        "load_timeline": load_timeline(records, float(settings.get("load_s") or 0.0), slo),
        "replica_timeline": replica_timeline(samples),
        "demo": dict(settings),
    }
