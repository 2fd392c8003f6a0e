"""`oracle`: the hindsight lower bound on GPU-hours (`docs/evaluation.md`).

The trace is cut into windows (60 s). For each window, by simulation from a warm state (the
previous `warmup_s` of the true arrivals replayed first, at the same sizes) it finds the fewest
prefill replicas for which `attainment` of the window's feasible requests meet the TTFT target
with decode unconstrained, and the fewest decode replicas for which `attainment` of them meet the
TPOT target with prefill unconstrained. A request is feasible for TTFT when an idle pool serves it
within the target (`PerfModel.ttft_seconds(isl, disaggregated=True)`); the others miss it whatever
the sizes, and no size is spent on them. Start-up is ignored: the policy asks for each window's
sizes `startup_delay_s + interval_s` ahead (run it with a zero start-up delay for the bound itself).
Since each role is sized with the other unconstrained, running both minimal together may attain a
little less than `attainment`: it is a bound, not a policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from xpyd.autoscaler.observation import Desired, Observation, Slo
from xpyd.autoscaler.sizing import PoolModel, PromptMix
from xpyd.perf.model import PerfModel
from xpyd.sim.core import EngineConfig
from xpyd.sim.simulator import SimConfig, simulate
from xpyd.traces import TraceRequest

WINDOW_S = 60.0
WARMUP_S = 60.0
ATTAINMENT = 0.95
MAX_REPLICAS = 256


@dataclass(frozen=True)
class OracleWindow:
    """The fewest replicas meeting the targets for the arrivals in [start_s, end_s)."""

    start_s: float
    end_s: float
    prefill: int
    decode: int
    requests: int


def oracle_windows(trace: Sequence[TraceRequest], perf: PerfModel, slo: Slo, engine: EngineConfig | None = None,
                   window_s: float = WINDOW_S, warmup_s: float = WARMUP_S,
                   attainment: float = ATTAINMENT) -> list[OracleWindow]:
    """Per-window minimal sizes by simulation (see the module docstring)."""
    engine = engine or EngineConfig()
    model = PoolModel(perf, slo.ttft_s, slo.tpot_s, max_num_batched_tokens=engine.max_num_batched_tokens,
                      max_num_seqs=engine.max_num_seqs)
    end = trace[-1].arrival_s
    count = int(end // window_s) + 1
    windows: list[OracleWindow] = []
    for index in range(count):
        start = index * window_s
        stop = start + window_s
        inside = [r for r in trace if start <= r.arrival_s < stop]
        if not inside:
            windows.append(OracleWindow(start, stop, 1, 1, 0))
            continue
        origin = max(0.0, start - warmup_s)
        replay = [TraceRequest(r.arrival_s - origin, r.isl, r.osl) for r in trace if origin <= r.arrival_s < stop]
        first = len(replay) - len(inside)
        feasible = [i for i, r in enumerate(replay) if i >= first
                    and perf.ttft_seconds(r.isl, disaggregated=True) <= slo.ttft_s]
        good_tpot = [i for i, r in enumerate(replay) if i >= first and r.osl > 1]
        rate = len(inside) / window_s
        mix = PromptMix.from_samples([r.isl for r in inside])
        osl = sum(r.osl for r in inside) / len(inside)
        decode_guess = model.size_decode(rate, mix.mean, osl).replicas
        prefill_floor = max(1, math.floor(rate * mix.mean / model.saturated_tokens_per_s()))
        decode_floor = max(1, math.floor(decode_guess / 2))
        roomy_decode = 2 * decode_guess + 2
        roomy_prefill = 2 * prefill_floor + 3

        prefill = prefill_floor
        while (prefill < MAX_REPLICAS
               and _share(replay, perf, slo, engine, prefill, roomy_decode, feasible) < attainment):
            prefill += 1
        decode = decode_floor
        while decode < MAX_REPLICAS and _share(replay, perf, slo, engine, max(prefill, roomy_prefill), decode,
                                               good_tpot, tpot=True) < attainment:
            decode += 1
        windows.append(OracleWindow(start, stop, prefill, decode, len(inside)))
    return windows


def _share(replay: Sequence[TraceRequest], perf: PerfModel, slo: Slo, engine: EngineConfig, prefill: int,
           decode: int, requests: Sequence[int], tpot: bool = False) -> float:
    """Share of `requests` (indices into `replay`) meeting the TTFT (or TPOT) target at these sizes."""
    if not requests:
        return 1.0
    config = SimConfig(prefill=prefill, decode=decode, slo=slo, startup_delay_s=0.0, interval_s=1e6, engine=engine)
    result = simulate(replay, perf, config)
    if tpot:
        per_token = result.tpot_s()
        return sum(1 for i in requests if per_token[i] <= slo.tpot_s) / len(requests)
    return sum(1 for i in requests if result.ttft_s[i] <= slo.ttft_s) / len(requests)


def oracle_gpu_hours(windows: Sequence[OracleWindow], prefill_gpus: int = 1, decode_gpus: int = 1) -> float:
    """The bound itself: every window's sizes for the window's length, in GPU-hours."""
    return sum((w.prefill * prefill_gpus + w.decode * decode_gpus) * (w.end_s - w.start_s) for w in windows) / 3600.0


@dataclass(frozen=True)
class OraclePolicy:
    """Follows the precomputed windows, asking `lead_s` (start-up + interval) ahead for every window
    the next replicas will serve."""

    windows: tuple[OracleWindow, ...]
    lead_s: float

    def decide(self, observation: Observation) -> Desired:
        """The largest sizes among the windows overlapping [now, now + lead)."""
        now = observation.time_s
        ahead = [w for w in self.windows if w.end_s > now and w.start_s < now + self.lead_s] or [self.windows[-1]]
        return Desired(max(w.prefill for w in ahead), max(w.decode for w in ahead))

    @property
    def initial(self) -> Desired:
        """The first window's sizes: what the pool should start with."""
        return Desired(self.windows[0].prefill, self.windows[0].decode)
