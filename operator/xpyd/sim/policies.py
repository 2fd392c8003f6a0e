"""The autoscaling policies `xpyd sim --policy NAME` can replay, all behind the simulator's `Policy` seam.

- `xpyd`: `decide()` itself (`XpydPolicy` keeps its state and the decisions' reasons).
- `static-peak`, `static-mean`: fixed sizes from t=0, from the oracle's search (`oracle.oracle_schedule`):
  each role's largest size over the windows, and each role's time-weighted mean size rounded up. They
  read the trace from `PolicyContext.trace`, which the simulator fills: sizing for the peak needs
  hindsight. `simulate_policy` starts the run at their sizes: a fixed pool is there from the start.
- `queue-threshold`: what users configure with KEDA today (`QueueThresholdPolicy`).
- `dynamo-sla`: NVIDIA Dynamo's throughput planner (`dynamo.DynamoSlaPolicy`).
- `oracle`: the hindsight bound's windows (`oracle.OraclePolicy`), asked for start-up + interval ahead,
  from the sizes the first windows need; the schedule is verified as it runs, under the run's start-up
  (`oracle_schedule`'s `run`), and a schedule that misses the target there raises `OracleRefusal`.
- `NowcastPolicy` (the evaluation's reference, not a `--policy`): each oracle window's sizes plus a
  fixed headroom, asked for only once the window has begun: what knowing the present exactly, but
  not the future, buys under the start-up delay.

- `static`: the sizes it is given (`StaticPolicy`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from xpyd.autoscaler.config import Pace, down_margin, down_window_s
from xpyd.autoscaler.decide import (
    AutoscalerConfig,
    AutoscalerState,
    Decision,
    RoleBounds,
    decide,
)
from xpyd.autoscaler.observation import Desired, Observation
from xpyd.autoscaler.react import react
from xpyd.autoscaler.sizing import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, PoolModel
from xpyd.perf.model import PerfModel
from xpyd.sim.core import EngineConfig, EnginePerf
from xpyd.sim.dynamo import DynamoSlaPolicy
from xpyd.sim.oracle import (
    OraclePolicy,
    OracleRefusal,
    OracleSchedule,
    OracleWindow,
    SchedulePolicy,
    oracle_schedule,
    refusal,
)
from xpyd.sim.policy import Policy, PolicyContext, PolicyFactory, StaticPolicy
from xpyd.sim.simulator import ProgressCallback, SimConfig, SimResult, simulate
from xpyd.traces import TraceRequest

SIM_MAX_REPLICAS = 64
"""Per-role maximum in the simulator (the CRD's defaults, 8 and 16, would cap the evaluation)."""


def _perf(context: PolicyContext, policy: str) -> PerfModel:
    if not isinstance(context.perf, PerfModel):
        raise ValueError(f"policy {policy!r} needs a PerfModel (a measured profile), not {type(context.perf).__name__}")
    return context.perf


def pool_model(context: PolicyContext) -> PoolModel:
    """The steady-state model for a simulated run: its profile, SLOs and engine arguments, each SLO
    sized at the target attainment's share (as `AutoscalerConfig.from_spec` does with a target)."""
    engine = context.engine
    return PoolModel(
        perf=_perf(context, "xpyd"), ttft_target_s=context.slo.ttft_s, tpot_target_s=context.slo.tpot_s,
        quantile=context.attainment,
        max_num_batched_tokens=engine.max_num_batched_tokens if engine else DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=engine.max_num_seqs if engine else DEFAULT_MAX_NUM_SEQS)


def xpyd_config(context: PolicyContext) -> AutoscalerConfig:
    """The `xpyd` policy's config in the simulator: the CRD's defaults (pace, windows) with the run's
    SLOs, interval and start-up delay, bounds 1..`SIM_MAX_REPLICAS` (0.. with `context.idle_s`: the
    pool scales to zero after that idle time), no GPU budget, and `context.attainment` as the target
    attainment (the share of requests meeting both SLOs: the headroom is learnt online). As
    `AutoscalerConfig.from_spec` does for a spec that leaves the scale-down window unset, the target
    sets the share each SLO is sized at and the scale-down caution (window and N-1 margin)."""
    attainment = context.attainment
    bounds = RoleBounds(0 if context.idle_s is not None else 1, SIM_MAX_REPLICAS)
    return AutoscalerConfig(model=pool_model(context), prefill=bounds, decode=bounds,
                            interval_s=context.interval_s, startup_s=context.startup_delay_s, idle_s=context.idle_s,
                            scale_down=Pace(down_window_s(None, attainment), 1), down_margin=down_margin(attainment),
                            attainment=attainment, react_s=context.react_s)


@dataclass
class XpydPolicy:
    """`decide()` in the simulator, and `react()` between its calls: keeps the state from one call to
    the next and every decision made, with the time it was made (a `react()` decision's state keeps
    the time of the `decide()` before it)."""

    config: AutoscalerConfig
    state: AutoscalerState = field(default_factory=AutoscalerState)
    decisions: list[tuple[float, Decision, bool]] = field(default_factory=list)   # (time, decision, by react)

    def desired_sizes(self, observation: Observation) -> Desired:
        """Run `decide()`, keep its new state, return its sizes."""
        decision = decide(observation, self.config, self.state)
        self.state = decision.state
        self.decisions.append((observation.time_s, decision, False))
        return Desired(decision.prefill.replicas, decision.decode.replicas)

    @property
    def react_s(self) -> float | None:
        return self.config.react_s

    def react(self, observation: Observation) -> Desired | None:
        """Run `react()` on the gauges: the sizes it grows to (its state kept, the decision too), or None."""
        decision = react(observation, self.config, self.state)
        if decision is None:
            return None
        self.state = decision.state
        self.decisions.append((observation.time_s, decision, True))
        return Desired(decision.prefill.replicas, decision.decode.replicas)


@dataclass(frozen=True)
class NowcastPolicy:
    """The oracle's sizes for the window holding `now` (none ahead of it), plus `extra` replicas of
    each role: a policy that knows each window's exact needs as soon as the window begins. Its
    replicas then serve only after the start-up delay, which is the part of the oracle's advantage
    no causal policy can have; the headroom is what must cover it."""

    windows: tuple[OracleWindow, ...]
    extra: Desired = field(default_factory=lambda: Desired(0, 0))

    def __post_init__(self) -> None:
        if not self.windows:
            raise ValueError("the nowcast needs the oracle's windows")
        if self.extra.prefill < 0 or self.extra.decode < 0:
            raise ValueError(f"the nowcast's headroom cannot be negative: {self.extra}")

    def desired_sizes(self, observation: Observation) -> Desired:
        """The sizes of the window holding `observation.time_s` (the last after the trace), plus `extra`."""
        now = SchedulePolicy(self.windows).desired_sizes(observation)
        return Desired(now.prefill + self.extra.prefill, now.decode + self.extra.decode)

    @property
    def initial(self) -> Desired:
        """The first window's sizes with the headroom: what the pool starts with."""
        return self.desired_sizes(Observation(time_s=self.windows[0].start_s, window_s=0.0))


@dataclass(frozen=True)
class FixedPolicy:
    """Fixed sizes, named for what they were sized for."""

    desired: Desired

    def desired_sizes(self, observation: Observation) -> Desired:
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

    def desired_sizes(self, observation: Observation) -> Desired:
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


def _schedule(context: PolicyContext, policy: str) -> OracleSchedule:
    if not context.trace:
        raise ValueError(f"{policy} needs the trace (PolicyContext.trace)")
    return oracle_schedule(context.trace, _perf(context, policy), context.slo, context.engine,
                           attainment=context.attainment)


def _static(peak: bool) -> PolicyFactory:
    def factory(context: PolicyContext) -> Policy:
        schedule = _schedule(context, "static-peak" if peak else "static-mean")
        return FixedPolicy(schedule.peak if peak else schedule.mean)
    return factory


def _dynamo(context: PolicyContext) -> Policy:
    return DynamoSlaPolicy(_perf(context, "dynamo-sla"), context.slo.ttft_s, context.slo.tpot_s, context.initial)


def _oracle(context: PolicyContext) -> Policy:
    run = SimConfig(slo=context.slo, startup_delay_s=context.startup_delay_s, interval_s=context.interval_s,
                    engine=context.engine or EngineConfig())
    return _verified_oracle(context, run)[0]


def _verified_oracle(context: PolicyContext, run: SimConfig) -> tuple[OraclePolicy, OracleSchedule]:
    """The oracle's policy and its schedule, verified as `run` runs it (start-up and interval included);
    raises `OracleRefusal` when that replay does not meet the target attainment in every window."""
    if not context.trace:
        raise ValueError("the oracle needs the trace (PolicyContext.trace)")
    schedule = oracle_schedule(context.trace, _perf(context, "the oracle"), run.slo, run.engine,
                               attainment=context.attainment, seed=run.seed, run=run)
    reason = refusal(schedule, run.slo, context.attainment)
    if reason is not None:
        raise OracleRefusal(reason)
    assert schedule.lead_s is not None
    return OraclePolicy(schedule.windows, schedule.lead_s), schedule


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
                    progress: ProgressCallback | None = None, idle_s: float | None = None,
                    attainment: float = PolicyContext.attainment,
                    react_s: float | None = PolicyContext.react_s) -> SimResult:
    """Replay `trace` under the registered policy `name`, built with the config's sizes, SLO and timing
    (the hindsight baselines also get the trace and the engines' arguments). A fixed policy
    (`static-peak`, `static-mean`) starts at its own sizes: its pool is there from t=0; so does the
    `oracle`, whose run is its verifying replay under this config (`OracleRefusal`, a ValueError, when
    that replay misses the target attainment in any window). With `idle_s`
    the `xpyd` policy scales the pool to zero (the config's `min_replicas` must be 0); `attainment` is
    its target attainment, `react_s` how often it reacts to the gauges between decisions (None: never)."""
    if idle_s is not None and config.min_replicas != 0:
        raise ValueError("scaling to zero (idle_s) needs SimConfig.min_replicas 0")
    context = PolicyContext(initial=Desired(config.prefill, config.decode), slo=config.slo, perf=perf,
                            interval_s=config.interval_s, startup_delay_s=config.startup_delay_s, trace=trace,
                            engine=config.engine, idle_s=idle_s, attainment=attainment, react_s=react_s)
    if name == "oracle":   # its run is the replay that verified it, from its own sizes (OracleRefusal if it missed)
        return _verified_oracle(context, config)[1].result
    policy = build_policy(name, context)
    if isinstance(policy, FixedPolicy):
        config = replace(config, prefill=policy.desired.prefill, decode=policy.desired.decode)
    return simulate(trace, perf, config, policy, progress, name=name)
