"""The autoscaling policies `xpyd sim --policy NAME` can replay, all behind the simulator's `Policy` seam.

- `xpyd`: `decide()` itself (`XpydPolicy` keeps its state and the decisions' reasons).
- `static-peak`, `static-mean`: fixed sizes from the same model (`sizing.PoolModel`) for the trace's
  busiest 60 s window (per role) and for its mean load. The peak includes the window's bursts: the
  rate-only steady state is Poisson (M/G/c) and blind to batched arrivals (on `azure_code_2023` it
  gives the busiest window the mean's 2 prefill replicas while 188 prompts, 404k tokens, arrive
  within 10 ms), so prefill also gets the replicas `decide()`'s burst term would give that window,
  with the work queued ahead of each request measured from the trace (`queued_work`) instead of
  read from the queue-time histogram. They read the trace from `PolicyContext.trace`, which the
  simulator fills: sizing for the peak needs hindsight.
- `queue-threshold`: what users configure with KEDA today (`QueueThresholdPolicy`).
- `dynamo-sla`: NVIDIA Dynamo's throughput planner (`dynamo.DynamoSlaPolicy`).
- `oracle`: the hindsight bound (`oracle.OraclePolicy`), computed from `PolicyContext.trace`.

- `static`: the sizes it is given (`StaticPolicy`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from xpyd.autoscaler.decide import (
    AutoscalerConfig,
    AutoscalerState,
    Decision,
    RoleBounds,
    decide,
)
from xpyd.autoscaler.observation import Desired, Observation
from xpyd.autoscaler.sizing import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, Burst, PoolModel, PromptMix
from xpyd.perf.model import PerfModel
from xpyd.sim.core import EnginePerf
from xpyd.sim.dynamo import DynamoSlaPolicy
from xpyd.sim.oracle import OraclePolicy, oracle_windows
from xpyd.sim.policy import Policy, PolicyContext, PolicyFactory, StaticPolicy
from xpyd.sim.simulator import ProgressCallback, SimConfig, SimResult, simulate
from xpyd.traces import TraceRequest

SIM_PERCENTILE = 95.0
"""The SLO percentile `xpyd` targets in the simulator (the evaluation asks 95% of requests to meet both)."""
SIM_MAX_REPLICAS = 64
"""Per-role maximum in the simulator (the CRD's defaults, 8 and 16, would cap the evaluation)."""
STATIC_WINDOW_S = 60.0
STATIC_MAX_REPLICAS = 256


def _perf(context: PolicyContext, policy: str) -> PerfModel:
    if not isinstance(context.perf, PerfModel):
        raise ValueError(f"policy {policy!r} needs a PerfModel (a measured profile), not {type(context.perf).__name__}")
    return context.perf


def pool_model(context: PolicyContext, percentile: float = SIM_PERCENTILE) -> PoolModel:
    """The steady-state model for a simulated run: its profile, SLOs and engine arguments."""
    engine = context.engine
    return PoolModel(
        perf=_perf(context, "xpyd"), ttft_target_s=context.slo.ttft_s, tpot_target_s=context.slo.tpot_s,
        quantile=percentile / 100.0,
        max_num_batched_tokens=engine.max_num_batched_tokens if engine else DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=engine.max_num_seqs if engine else DEFAULT_MAX_NUM_SEQS)


def xpyd_config(context: PolicyContext, percentile: float = SIM_PERCENTILE) -> AutoscalerConfig:
    """The `xpyd` policy's config in the simulator: the CRD's defaults (pace, windows) with the run's
    SLOs, interval and start-up delay, bounds 1..`SIM_MAX_REPLICAS`, no GPU budget."""
    bounds = RoleBounds(1, SIM_MAX_REPLICAS)
    return AutoscalerConfig(model=pool_model(context, percentile), prefill=bounds, decode=bounds,
                            interval_s=context.interval_s, startup_s=context.startup_delay_s)


@dataclass
class XpydPolicy:
    """`decide()` in the simulator: keeps the state between calls and every decision made."""

    config: AutoscalerConfig
    state: AutoscalerState = field(default_factory=AutoscalerState)
    decisions: list[Decision] = field(default_factory=list)

    def decide(self, observation: Observation) -> Desired:
        """Run `decide()`, keep its new state, return its sizes."""
        decision = decide(observation, self.config, self.state)
        self.state = decision.state
        self.decisions.append(decision)
        return Desired(decision.prefill.replicas, decision.decode.replicas)


def trace_windows(trace: Sequence[TraceRequest], window_s: float = STATIC_WINDOW_S) -> list[list[TraceRequest]]:
    """The trace's requests grouped by arrival into consecutive windows (empty ones kept)."""
    count = int(trace[-1].arrival_s // window_s) + 1
    windows: list[list[TraceRequest]] = [[] for _ in range(count)]
    for request in trace:
        windows[int(request.arrival_s // window_s)].append(request)
    return windows


def queued_work(model: PoolModel, requests: Sequence[TraceRequest], replicas: int) -> Burst:
    """The prompt work ahead of each request when it arrives, were the requests served by `replicas`
    at the saturated rate (work arriving together drains at the pool's rate), as a `Burst`: what
    `decide()` reads from the queue-time histogram, here measured from the trace."""
    drain = replicas * model.saturated_tokens_per_s()
    backlog, last, ahead = 0.0, requests[0].arrival_s, []
    for request in requests:
        backlog = max(0.0, backlog - drain * (request.arrival_s - last))
        last = request.arrival_s
        ahead.append(backlog)
        # A prompt longer than the pool can share out in one engine step per replica occupies one
        # replica, not the pool: it queues the others by what one step takes from each replica.
        backlog += min(request.isl, replicas * model.max_num_batched_tokens)
    ahead.sort()

    def at(share: float) -> float:
        return ahead[min(len(ahead) - 1, int(share * len(ahead)))]

    return Burst(requests[0].arrival_s, float(len(requests)), replicas, at(0.5), at(0.9), at(0.99))


def size_for(model: PoolModel, requests: Sequence[TraceRequest], span_s: float, bursts: bool = True) -> Desired:
    """The model's sizes for these requests arriving over `span_s` seconds: the steady-state sizes,
    and with `bursts` at least the prefill replicas whose queued work (`queued_work`) leaves these
    requests' misses (bursts' and steady queueing's together) within the error budget, as `decide()`
    sizes for the bursts it remembers."""
    if not requests or span_s <= 0:
        return Desired(1, 1)
    rate = len(requests) / span_s
    mix = PromptMix.from_samples([r.isl for r in requests])
    osl = sum(r.osl for r in requests) / len(requests)
    decode = model.size_decode(rate, mix.mean, osl)
    prefill = model.size_prefill(rate, mix, decode.itl_s).replicas
    if bursts:
        def misses(replicas: int) -> float:
            burst = ((1.0, queued_work(model, requests, replicas)),)
            return (model.burst_miss_share(burst, float(len(requests)), replicas, mix, decode.itl_s)
                    + 1.0 - model.prefill_attainment(replicas, rate, mix, decode.itl_s))
        while prefill < STATIC_MAX_REPLICAS and misses(prefill) > 1.0 - model.quantile:
            prefill += 1
    return Desired(prefill, decode.replicas)


def static_sizes(model: PoolModel, trace: Sequence[TraceRequest], peak: bool,
                 window_s: float = STATIC_WINDOW_S) -> Desired:
    """Sizes for the busiest window (each role its own maximum; prefill including the window's
    bursts) or for the whole trace's mean load (rate, prompt mix and output length: no bursts)."""
    if not trace:
        raise ValueError("static-peak/static-mean need the trace (PolicyContext.trace)")
    if not peak:
        return size_for(model, trace, max(trace[-1].arrival_s, window_s), bursts=False)
    sizes = [size_for(model, window, window_s) for window in trace_windows(trace, window_s) if window]
    return Desired(max(s.prefill for s in sizes), max(s.decode for s in sizes))


@dataclass(frozen=True)
class FixedPolicy:
    """Fixed sizes, named for what they were sized for."""

    desired: Desired

    def decide(self, observation: Observation) -> Desired:
        """The fixed sizes."""
        return self.desired


@dataclass
class QueueThresholdPolicy:
    """KEDA/HPA on queue and KV gauges, as deployed in the field (`docs/evaluation.md`):

    prefill `desired = ceil(sum(vllm:num_requests_waiting) / 5)` (AverageValue 5 per pod), decode
    `desired = ceil(D · mean(vllm:kv_cache_usage_perc) / 0.8)` (Utilization-style target 0.8), each
    moved at most one replica per 3 min up and per 5 min down (HPA scaling policies), at least 1.
    """

    initial: Desired
    queue_per_pod: float = 5.0
    kv_usage_target: float = 0.8
    up_period_s: float = 180.0
    down_period_s: float = 300.0
    last_up: dict[str, float] = field(default_factory=lambda: {"prefill": -math.inf, "decode": -math.inf})
    last_down: dict[str, float] = field(default_factory=lambda: {"prefill": -math.inf, "decode": -math.inf})

    def decide(self, observation: Observation) -> Desired:
        """One HPA step per role."""
        now = observation.time_s
        prefill, decode = observation.prefill, observation.decode
        wanted = {
            "prefill": math.ceil(prefill.num_requests_waiting / self.queue_per_pod),
            "decode": math.ceil(decode.replicas * decode.kv_cache_usage_perc / self.kv_usage_target - 1e-9),
        }
        out: dict[str, int] = {}
        for role, current in (("prefill", prefill.replicas), ("decode", decode.replicas)):
            target = max(1, wanted[role])
            if target > current and now - self.last_up[role] >= self.up_period_s:
                out[role] = current + 1
                self.last_up[role] = now
            elif target < current and now - self.last_down[role] >= self.down_period_s:
                out[role] = current - 1
                self.last_down[role] = now
            else:
                out[role] = current
        return Desired(out["prefill"], out["decode"])


def _xpyd(context: PolicyContext) -> Policy:
    return XpydPolicy(xpyd_config(context))


def _static(peak: bool) -> PolicyFactory:
    def factory(context: PolicyContext) -> Policy:
        return FixedPolicy(static_sizes(pool_model(context), context.trace, peak))
    return factory


def _dynamo(context: PolicyContext) -> Policy:
    return DynamoSlaPolicy(_perf(context, "dynamo-sla"), context.slo.ttft_s, context.slo.tpot_s, context.initial)


def _oracle(context: PolicyContext) -> Policy:
    if not context.trace:
        raise ValueError("the oracle needs the trace (PolicyContext.trace)")
    windows = oracle_windows(context.trace, _perf(context, "oracle"), context.slo, context.engine)
    return OraclePolicy(tuple(windows), context.startup_delay_s + context.interval_s)


POLICIES: Mapping[str, PolicyFactory] = MappingProxyType({
    "static": lambda context: StaticPolicy(context.initial),
    "xpyd": _xpyd,
    "static-peak": _static(peak=True),
    "static-mean": _static(peak=False),
    "queue-threshold": lambda context: QueueThresholdPolicy(context.initial),
    "dynamo-sla": _dynamo,
    "oracle": _oracle,
})


def build_policy(name: str, context: PolicyContext) -> Policy:
    """The policy called `name` (a key of POLICIES). Raises ValueError for an unknown name."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})")
    return factory(context)


def simulate_policy(name: str, trace: Sequence[TraceRequest], perf: EnginePerf, config: SimConfig,
                    progress: ProgressCallback | None = None) -> SimResult:
    """Replay `trace` under the registered policy `name`, built with the config's sizes, SLO and timing
    (the hindsight baselines also get the trace and the engines' arguments)."""
    context = PolicyContext(initial=Desired(config.prefill, config.decode), slo=config.slo, perf=perf,
                            interval_s=config.interval_s, startup_delay_s=config.startup_delay_s, trace=trace,
                            engine=config.engine)
    return simulate(trace, perf, config, build_policy(name, context), progress, name=name)
