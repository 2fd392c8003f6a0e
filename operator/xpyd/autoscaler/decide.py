"""`decide()`: the SLO-driven prefill/decode autoscaler's one decision, as a pure function.

    decision = decide(observation, config, state)     # then keep decision.state for the next call

Inputs: an `Observation` (what Prometheus and the Kubernetes API show: load, latency quantiles,
per-role queues, KV usage, token rates, replica counts including Pending), an `AutoscalerConfig`
(the profile, SLOs, bounds, pace, budget; `autoscaler.config`, where `config_for` builds it
from a `DisaggregatedServing`) and the previous `AutoscalerState` (forecasts, capacity corrections, the
recommendations of the stabilisation windows, when each role last grew). Nothing else is read and
nothing is mutated; the same code runs in the operator and in `xpyd sim --policy xpyd`.

The rules, in order (each named in the decision's CamelCase reason and message; `decide()` runs
them as named steps: `_wake`, `_check`, `_forecast`, `_corrections`, `_plan`, `_attribution`,
`_backlog_step`, `_pace`):

0. Scale from zero: requests held by the proxies (`Observation.held_requests`, from their pods at
   once, not from Prometheus) while a role has no ready replica bring both roles up together,
   sized for what is held (`ScaleFromZero`), as a backlog (rule 6): prefill drains the held prompt
   tokens within the sizing horizon, decode admits the held requests within it. No metrics
   are needed (a pool at zero has none), nothing shrinks here (but for a binding GPU budget: the
   larger role gives replicas back until both roles fit), and `scale_up.max_step` and the
   bounds apply. The release of the held requests, all at once when the pair serves, is a backlog:
   no burst (rule 4) is learnt from the windows that hold it.
1. Metrics check: missing, stale or contradictory metrics hold every role at its current size
   (`MetricsUnavailable`, `scaling_active=False`); bounds still apply, nothing else scales. Before the
   first finished request the pool holds as `NoTraffic` (requests arriving for two windows without
   any ISL/OSL reported is `MetricsUnavailable`); a later window without finished requests sizes from
   the ISL/OSL seen before. Engines idle while the proxy counts requests holds as `MetricsSettling`
   for up to two windows (unaligned scrapes of newly found engines), then as `MetricsUnavailable`.
2. Forecast: Holt's linear trend on λ and OSL, read at `now + startup + interval + window/2`
   (the window's mean lags by half a window); sizing uses max(now, forecast), so a falling
   forecast never sizes below what the current load needs. ISL is sized as seen (the larger of the
   window's mean and its smoothed level), not carried along its trend: prefill's demand is λ·ISL,
   and two trends multiplied overshoot at the top of every rise (`benchmarks/forecast_error.py`;
   what it changed in the evaluation: docs/evaluation.md).
3. Capacity correction per role: `k = observed / modelled capacity`, EWMA-smoothed and clamped to
   [0.5, 1.5]; updated only from windows with enough requests and a steady pool (nothing starting or
   draining). Prefill: the prompt-token rate delivered per ready replica over the modelled saturated
   rate for the window's prompt mix (`PoolModel.mix_tokens_per_s`), learnt while the engines stayed
   saturated (requests waiting at both ends of the window, the median request queueing) and
   otherwise only when it proves more capacity than `k` assumes (a delivered rate is a lower bound
   on capacity); decode: modelled ITL at the observed batch / observed ITL.
   Prefix cache: prefill computes only the prompt tokens its engines do not find cached, so prefill is
   sized on computed tokens. The window's prefill hit rate `h` (vLLM's `prefix_cache_hits /
   prefix_cache_queries`; 0 when nothing was looked up) makes the computed share `c = 1 - h` (at
   least `MIN_COMPUTED_SHARE`): `k` is learnt on computed tokens (delivered prompt tokens times `c`)
   and every prefill judgement below uses `k / c`, a replica serving `1 / c` times the prompt tokens
   it computes (demand, bursts, attribution, backlog and the N-1 check alike). The KV transfer and
   decode's KV stay sized on the whole prompt.
4. Demand: prefill replicas from λ·ISL with queueing headroom (`sizing.PoolModel.size_prefill`:
   M/G/c, Allen-Cunneen tail over the prompt-length mix, TTFT target at the SLO percentile,
   including transfer and one decode step); decode replicas from the ITL/KV frontier at
   `ISL + OSL/2` (`size_decode`). Their quotient is the recommended P:D ratio. Bursts the steady
   model cannot see (batched arrivals) are remembered per window from the prefill queue-time tail
   while TTFT breaches under moderate load (`Burst`: the work ahead of the window's requests, and how
   many requests it covered), weighted by age (e-folding `burst_memory_s`), and judged against the
   requests seen over the same memory (before the first decision: the current rate, as a prior of
   no bursts): prefill gets at least the fewest replicas at which, were they to recur, their misses
   and the steady model's fit the SLO's error budget together (`PoolModel.burst_replicas`). A
   one-off burst that replicas ordered now could not have served sizes little; one recurring in
   every window sizes for its tail. Arrivals that bunch within a slot (the proxies' histogram of the
   prompt tokens sharing each request's 0.25/1/4 s slot, `autoscaler.arrivals`) give prefill at least
   the replicas that drain the slot work at the SLO percentile, scaled by the learnt headroom,
   within the queue budget plus the slot (`arrivals.replicas_for`); the N-1 check asks it of the
   smaller size with its extra load.
5. Attribution: a TTFT breach with a prefill backlog (queued work that takes more than half the
   TTFT target to drain on the replicas sharing it, or a growing one) is prefill's
   (`PrefillQueueing`); a queue one engine holds beside idle ones is none (`pinned_queue`: more
   replicas would take none of it; the decision says so). A TTFT breach with a
   short prefill queue while decode admission is blocked (KV nearly full, at `max_num_seqs`, or
   requests waiting beyond the KV hand-offs in flight) is decode's (`DecodeAdmission`); a TPOT
   breach is decode's (`TpotOverTarget`). The guilty role gets at least one replica more than it
   has (unless replicas of it are already starting, or, for TPOT, the window still reaches back to
   before its last scale-up's replicas served), the other role none for that symptom.
6. Backlog: each role also gets what serves the load and drains the work queued now (`_backlog`):
   prefill the queued prompt tokens plus what keeps queueing until replicas ordered now serve,
   decode the requests waiting for admission, each drained within the sizing horizon, and at most
   the load's replicas plus the ready ones (`pinned_limit`: queued work stays on its engine). A
   queue one prefill engine holds is left to it, and that engine to it (`shared_queue`).
   Recommended while the queue lasts, never remembered by the stabilisation windows.
7. Stability: up at once (minimum over the up-window, but never below the backlog's size, by at
   most `scale_up.max_step`); down only to
   the maximum recommendation over the down-window, by at most `scale_down.max_step`, never within
   the grace period after the role grew, and only if the model says both SLOs hold at the smaller
   size with `down_margin` more load (the N-1 check). A target attainment lowers the margin, and
   shortens the window unless the spec sets it (`config.caution`).
8. Reality: replicas Pending for lack of GPUs are not capacity and stop further scale-up of their
   role only (`InsufficientGPUs`, reported as Degraded); starting replicas count as coming capacity
   for at most twice the start-up time; min/max bounds apply last, at once.
9. GPU budget: when P and D together want more GPUs than the budget, GPUs go one at a time to the
   role whose predicted SLO violation the next replica reduces most (`GPUBudgetBinding`).

Scale to zero (only with `idle_s`, which `from_spec` sets when minReplicas is 0 on both roles), right
after the metrics check: a pool with nothing arriving in the window, held, running or waiting is
idle; once the decisions have seen it idle for `idle_s` both roles go to zero at once
(`ScaleToZero`; any request or held one restarts the count). A pool at zero stays there
(`IdleAtZero`) until requests are held (rule 0) or arrive without being held (no waiting room, or a
full one: both roles to their minimum of one, `ScaleFromZero`). Missing metrics never scale a pool
to zero: they hold it (rule 1).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from xpyd.api.conditions import IDLE_AT_ZERO, INSUFFICIENT_GPUS
from xpyd.api.naming import DECODE, PREFILL

# The configuration lives in `config` (with the spec's translation); its names stay importable from here.
from xpyd.autoscaler.arrivals import ArrivalNeed, replicas_for
from xpyd.autoscaler.attainment import AttainmentState, learn, window_attainment
from xpyd.autoscaler.config import AutoscalerConfig as AutoscalerConfig
from xpyd.autoscaler.config import Pace as Pace
from xpyd.autoscaler.config import RoleBounds as RoleBounds
from xpyd.autoscaler.forecast import SeriesState, ahead, seen
from xpyd.autoscaler.observation import Observation, Quantiles, RoleObservation
from xpyd.autoscaler.sizing import Burst, DecodeSizing, PrefillSizing, PromptMix

# Reasons (CamelCase, as in status conditions and Events; `InsufficientGPUs` is the Degraded
# condition's and `IdleAtZero` the Ready condition's, both from `xpyd.api.conditions`).
METRICS_UNAVAILABLE = "MetricsUnavailable"
PREFILL_QUEUEING = "PrefillQueueing"
DECODE_ADMISSION = "DecodeAdmission"
TPOT_OVER_TARGET = "TpotOverTarget"
PREFILL_DEMAND = "PrefillDemand"
DECODE_DEMAND = "DecodeDemand"
SCALE_DOWN = "DemandFell"
SCALE_DOWN_DEFERRED = "ScaleDownStabilizing"
SCALE_DOWN_UNSAFE = "ScaleDownUnsafe"
SCALE_DOWN_GRACE = "ScaleDownGracePeriod"
GPU_BUDGET = "GPUBudgetBinding"
BOUNDS = "ReplicaBounds"
WITHIN_TARGETS = "WithinTargets"
NO_TRAFFIC = "NoTraffic"
METRICS_SETTLING = "MetricsSettling"
SCALE_FROM_ZERO = "ScaleFromZero"
SCALE_TO_ZERO = "ScaleToZero"

#: The least share of prompt tokens prefill is taken to compute, however high its hit rate: a window
#: of repeated prompts (a benchmark, a health check) must not size prefill at next to nothing.
MIN_COMPUTED_SHARE = 0.1

#: Output tokens assumed for held requests while no answer has been seen yet (decode's batch at
#: their context, `ISL + OSL/2`, sizes decode when the pool starts from zero).
DEFAULT_WAKE_OSL = 256.0

# Which reason speaks for the whole decision when several apply (first wins).
_PRIORITY = (SCALE_FROM_ZERO, SCALE_TO_ZERO, IDLE_AT_ZERO,
             METRICS_UNAVAILABLE, INSUFFICIENT_GPUS, GPU_BUDGET, PREFILL_QUEUEING, DECODE_ADMISSION,
             TPOT_OVER_TARGET, PREFILL_DEMAND, DECODE_DEMAND, BOUNDS, SCALE_DOWN, SCALE_DOWN_UNSAFE,
             SCALE_DOWN_GRACE, SCALE_DOWN_DEFERRED, WITHIN_TARGETS, NO_TRAFFIC, METRICS_SETTLING)


# --- state and decision ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoleState:
    """What `decide` remembers about one role."""

    correction: float = 1.0
    correction_updates: int = 0
    recommendations: tuple[tuple[float, int], ...] = ()   # (time, recommendation) within the windows
    last_scale_up_s: float = -math.inf
    waiting: float = math.nan                             # the queue gauge at the last decision
    starting_since_s: float = math.nan                    # since when replicas have been starting
    bursts: tuple[Burst, ...] = ()                        # prefill: work that queued together, per window
    requests_seen: float = 0.0                            # prefill: requests seen, decayed like the bursts
    seen_since_s: float = math.nan                        # since when requests have been counted


@dataclass(frozen=True)
class ScaleUpBasis:
    """What the last sizing decision sized with, for `react.react` between decisions: the prompt and
    output lengths, the load sized for, each prefill replica's saturated capacity on the prompt mix
    (its correction and the prefix cache's computed share included) and decode's correction."""

    time_s: float
    isl: float
    osl: float
    rate: float                      # req/s sized for (forecast and headroom included)
    rate_now: float                  # req/s over the window
    prefill_tokens_per_s: float      # prompt tokens/s one saturated prefill replica serves
    k_decode: float
    prefill_replicas: int = 0        # what the load sized for needs, per role (a backlog's `pinned_limit`)
    decode_replicas: int = 0

    @property
    def offered_tokens_per_s(self) -> float:
        return max(self.rate, self.rate_now) * self.isl


@dataclass(frozen=True)
class AutoscalerState:
    """What `decide` carries from one decision to the next (a value: `decide` returns a new one)."""

    time_s: float = -math.inf
    rate: SeriesState = field(default_factory=SeriesState)
    isl: SeriesState = field(default_factory=SeriesState)
    osl: SeriesState = field(default_factory=SeriesState)
    isl_quantiles: Quantiles = field(default_factory=Quantiles)
    suspect_since_s: float = math.nan     # since when the metrics contradict themselves (or lack ISL/OSL)
    idle_since_s: float = math.nan        # since when the decisions have seen the pool idle (scale to zero)
    woken_s: float = -math.inf            # when the pool last started from zero (its held requests' release)
    attainment: AttainmentState = field(default_factory=AttainmentState)   # the hour's attainment, the headroom
    basis: ScaleUpBasis | None = None     # what the last sizing decision sized with (`react` reads it)
    prefill: RoleState = field(default_factory=RoleState)
    decode: RoleState = field(default_factory=RoleState)

    def role(self, name: str) -> RoleState:
        return self.prefill if name == PREFILL else self.decode


@dataclass(frozen=True)
class RoleDecision:
    """One role's outcome."""

    current: int          # replicas in force: ready + starting + Pending
    replicas: int         # the decision
    recommended: int      # the model's and the feedback's recommendation, before pace and bounds
    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    """A decision: the sizes, why, the recommended P:D ratio, and the state for the next call."""

    prefill: RoleDecision
    decode: RoleDecision
    reason: str
    message: str
    recommended_ratio: str
    state: AutoscalerState
    scaling_active: bool = True        # False while holding on missing metrics (ScalingActive=False)
    degraded_reason: str | None = None  # InsufficientGPUs while a role has Pending pods
    budget_binding: bool = False

    @property
    def changed(self) -> bool:
        return self.prefill.replicas != self.prefill.current or self.decode.replicas != self.decode.current


# --- helpers -----------------------------------------------------------------------------------------


def quantile_at(quantiles: Quantiles, percentile: float) -> float:
    """The observed quantile at `percentile` from p50/p90/p99 (linear between them)."""
    points = ((50.0, quantiles.p50), (90.0, quantiles.p90), (99.0, quantiles.p99))
    if percentile <= 50.0:
        return quantiles.p50
    if percentile >= 99.0:
        return quantiles.p99
    for (p_low, low), (p_high, high) in itertools.pairwise(points):
        if percentile <= p_high:
            return low + (high - low) * (percentile - p_low) / (p_high - p_low)
    return quantiles.p99


def pd_ratio(prefill: int, decode: int) -> str:
    """`P:D` reduced by their greatest common divisor, e.g. "1:3"."""
    common = math.gcd(prefill, decode) or 1
    return f"{prefill // common}:{decode // common}"


def _kilo(value: float) -> str:
    return f"{value / 1e3:.1f}k" if abs(value) >= 1e3 else f"{value:.0f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}ms" if seconds >= 0.1 else f"{seconds * 1e3:.1f}ms"


def metrics_problem(observation: Observation, state: AutoscalerState) -> str | None:
    """Why the observation cannot be trusted (missing, stale, contradictory), or None."""
    if not math.isfinite(observation.time_s) or not observation.window_s > 0:
        return "no metrics window (no scrape in range)"
    if observation.time_s <= state.time_s:
        return f"metrics at t={observation.time_s:.0f}s are not newer than the last decision's"
    rate = observation.request_rate
    if not math.isfinite(rate) or rate < 0:
        return "request rate missing"
    for name, role in ((PREFILL, observation.prefill), (DECODE, observation.decode)):
        counts = (role.replicas, role.ready, role.starting, role.pending, role.draining,
                  role.num_requests_running, role.num_requests_waiting, role.num_requests_waiting_max)
        if any(not math.isfinite(v) or v < 0 for v in counts):
            return f"{name} replica or queue gauges missing or negative"
        if role.ready > role.replicas:
            return f"{name}: {role.ready} ready of {role.replicas} replicas"
        if not 0.0 <= role.kv_cache_usage_perc <= 1.0 or not 0.0 <= role.kv_cache_usage_perc_max <= 1.0:
            return f"{name} KV-cache usage outside 0-1"
    return None


def metrics_suspicion(observation: Observation) -> str | None:
    """A contradiction that scrape timing explains for a window or two (the proxy's counters seen before
    a newly scraped engine's: rate() needs two samples), and a real problem (engines scraped under
    other labels, a broken exporter) when it persists. None when the observation is consistent."""
    arrived = observation.request_rate * observation.window_s
    for name, role in ((PREFILL, observation.prefill), (DECODE, observation.decode)):
        if (role.ready > 0 and arrived >= 10 and role.requests_per_s <= 0 and role.num_requests_running <= 0
                and role.num_requests_waiting <= 0):
            return f"{name} engines report no work while the proxy saw {arrived:.0f} requests in the window"
    return None


# --- corrections -------------------------------------------------------------------------------------


def _thin(observation: Observation, config: AutoscalerConfig) -> bool:
    """The window saw too few prefill requests to teach anything about capacity or the cache."""
    return observation.prefill.requests_per_s * observation.window_s < config.min_requests


def _releasing(observation: Observation, config: AutoscalerConfig, state: AutoscalerState) -> bool:
    """The window may still hold the release of the requests held while the pool started from zero
    (all at once: a backlog, not a pattern to learn)."""
    return observation.time_s - state.woken_s < config.startup_s + observation.window_s + 2 * config.interval_s


def computed_share(observation: Observation, config: AutoscalerConfig) -> float:
    """The share of prompt tokens prefill computes: 1 - the window's prefill prefix-cache hit rate,
    at least MIN_COMPUTED_SHARE; 1 (every token computed) from a window with fewer requests than a
    correction needs, where a few repeated prompts (health checks) would read as a cache that serves
    everything."""
    if _thin(observation, config):
        return 1.0
    return max(MIN_COMPUTED_SHARE, 1.0 - observation.prefill.prefix_cache_hit_rate)


def _observed_prefill_correction(observation: Observation, config: AutoscalerConfig, state: RoleState,
                                 mix: PromptMix, computed: float = 1.0) -> float | None:
    """Prefill capacity seen in this window, as a multiple of the modelled saturated rate for the
    window's prompt mix (long prompts cost more per token, and the model already knows it), or None.

    A replica's prompt-token rate is what it was asked for unless it had a queue; so the delivered
    rate per ready replica measures capacity only while the engines stayed saturated: requests
    waiting at both ends of the window and the median request queueing beyond the queue-time
    histogram's first bucket. Otherwise it is only a lower bound, used when it proves more capacity
    than the current correction assumes. (Fitting a queueing model to latencies instead confuses
    small-batch step overhead at moderate load with lost capacity: it reads k well under 1 where the
    saturated rate is exact, and then over-provisions at high load.)"""
    role = observation.prefill
    rate = role.prompt_tokens_per_s
    if role.ready < 1 or role.starting or role.draining or _thin(observation, config) or not rate > 0:
        return None
    delivered = rate * computed / (role.ready * config.model.mix_tokens_per_s(mix))
    saturated = (role.num_requests_waiting >= role.ready and math.isfinite(state.waiting)
                 and state.waiting >= role.ready
                 and quantile_at(role.request_queue_time_seconds, 50.0) > config.queue_time_floor_s)
    if saturated or delivered > state.correction:
        return delivered
    return None


def _observed_decode_correction(observation: Observation, config: AutoscalerConfig, context: float) -> float | None:
    role = observation.decode
    itl = role.inter_token_latency_seconds.mean
    if role.ready < 1 or role.starting or role.draining or not itl > 0:
        return None
    if role.generation_tokens_per_s * observation.window_s < 50 * config.min_requests:
        return None
    batch = role.generation_tokens_per_s * itl / role.ready   # Little's law: tokens/s = batch / ITL
    if batch < 2:
        return None
    modelled = config.model.perf.itl_seconds(max(1, round(batch)), context)
    return modelled / itl


def _smoothed(role: RoleState, observed: float | None, config: AutoscalerConfig) -> RoleState:
    if observed is None or not math.isfinite(observed):
        return role
    clamped = min(max(observed, config.correction_min), config.correction_max)
    value = role.correction + config.correction_alpha * (clamped - role.correction)
    return replace(role, correction=value, correction_updates=role.correction_updates + 1)


# --- the decision ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """The load a decision sizes for and the sizings it gives."""

    rate_now: float
    rate: float
    isl: float
    osl: float
    mix: PromptMix
    prefill: PrefillSizing
    decode: DecodeSizing
    bursts: tuple[tuple[float, Burst], ...]   # remembered bursts with their weights (age decay)
    expected_requests: float          # the requests the burst memory's span brings at the current rate
    burst_replicas: int               # prefill replicas keeping the bursts' misses within the error budget
    arrivals: ArrivalNeed = field(default_factory=ArrivalNeed)   # prefill replicas the bunched arrivals need
    slot_work: Mapping[float, float] = field(default_factory=dict)   # what `arrivals` was sized for (`_slot_work`)
    k_prefill: float = 1.0
    backlog: Mapping[str, int] = field(default_factory=dict)   # per role: replicas the queued work needs

    @property
    def prefill_replicas(self) -> int:
        return max(self.prefill.replicas, self.burst_replicas, self.arrivals.replicas)


def _plan(config: AutoscalerConfig, rate_now: float, rate: float, isl: float, osl: float, mix: PromptMix,
          k_prefill: float, k_decode: float, bursts: tuple[tuple[float, Burst], ...],
          expected_requests: float, slot_work: Mapping[float, float] | None = None) -> _Plan:
    """The sizings of the load `rate` (the forecast with the headroom; `rate_now` the window's): each
    role's demand, the remembered bursts' prefill, and the prefill the bunched arrivals need
    (`slot_work`: window seconds -> slot work to size for, see `_slot_work`)."""
    model = config.model
    cap = max(config.prefill.max_replicas, 1)
    decode = model.size_decode(rate, isl, osl, k_decode)
    prefill = model.size_prefill(rate, mix, decode.itl_s, k_prefill, max_replicas=cap)
    burst = model.burst_replicas(bursts, expected_requests, mix, decode.itl_s, k_prefill, max_replicas=cap, rate=rate)
    work = dict(slot_work or {})
    need = _arrival_need(config, work, mix, decode.itl_s, k_prefill)
    return _Plan(rate_now, rate, isl, osl, mix, prefill, decode, bursts, expected_requests, burst, need, work,
                 k_prefill)


def _arrival_need(config: AutoscalerConfig, slot_work: Mapping[float, float], mix: PromptMix, decode_itl_s: float,
                  k_prefill: float) -> ArrivalNeed:
    """The prefill replicas that drain `slot_work` within the queue budget plus each slot."""
    model = config.model
    budget_s = model.queue_budget_s(mix, decode_itl_s, k_prefill)
    return replicas_for(slot_work, model.saturated_tokens_per_s(k_prefill), budget_s,
                        max_replicas=max(config.prefill.max_replicas, 1))


def hold(observation: Observation, config: AutoscalerConfig, state: AutoscalerState, problem: str,
         reason: str = METRICS_UNAVAILABLE) -> Decision:
    """Every role at its current size (bounds still apply at once), because of `problem`. With the
    default reason the metrics cannot be trusted (`scaling_active=False`); with NO_TRAFFIC they can,
    there is just nothing to size yet. The operator calls it when Prometheus cannot be read at all."""
    roles = []
    for name, role in ((PREFILL, observation.prefill), (DECODE, observation.decode)):
        current = role.replicas + role.pending
        bounds = config.bounds(name)
        wanted = min(max(current, bounds.min_replicas), bounds.max_replicas)
        role_reason, message = reason, f"{name[0].upper()} held at {current}: {problem}"
        if wanted != current:
            role_reason = BOUNDS
            message = f"{name[0].upper()} {current}->{wanted} (min {bounds.min_replicas}, max {bounds.max_replicas})"
        roles.append(RoleDecision(current, wanted, current, role_reason, message))
    prefill, decode = roles
    # A hold sizes nothing: `react` has no basis to judge with until the next sizing decision.
    return Decision(prefill, decode, reason, f"holding replicas: {problem}",
                    pd_ratio(max(prefill.replicas, 1), max(decode.replicas, 1)), replace(state, basis=None),
                    scaling_active=reason != METRICS_UNAVAILABLE)


def decide(observation: Observation, config: AutoscalerConfig, state: AutoscalerState) -> Decision:
    """The replicas each role should have now, why, and the state for the next call (pure).

    The rules of the module docstring, as named steps: the wake-up (rule 0), the metrics check
    (rule 1) and scale to zero (`_check`), the target attainment's headroom (`_attainment`), then
    `_forecast` (rule 2), `_corrections` (rule 3), the demand (rule 4, `_plan`), `_attribution`
    (rule 5), `_backlog_step` (rule 6) and `_pace` (rules 7-9)."""
    if waking(observation):
        return _wake(observation, config, state)
    checked = _check(observation, config, state)
    if isinstance(checked, Decision):
        return checked
    pinned = _pinned(observation, config, checked)
    state = _attainment(observation, config, checked, pinned)
    load = _forecast(observation, config, state)
    if isinstance(load, Decision):
        return load
    observation = load.observation
    corrections = _corrections(observation, config, state, load)
    scale = 1.0 + headroom(config, state)
    plan = _plan(config, load.rate_now, load.rate * scale, load.isl, load.osl, load.mix,
                 corrections.k_prefill, corrections.k_decode, corrections.bursts, corrections.expected_requests,
                 _slot_work(observation, config, scale))
    sizes = _Sizes.of(plan, observation, config)
    _attribution(observation, config, state, plan, corrections, sizes, pinned)
    plan = _backlog_step(observation, config, state, plan, corrections, sizes, pinned)
    return _pace(observation, config, state, load, corrections, plan, sizes)


def _slot_work(observation: Observation, config: AutoscalerConfig, scale: float) -> dict[float, float]:
    """The slot work prefill is sized to drain (`autoscaler.arrivals`): per window length, the prompt
    tokens sharing a request's slot at the SLO percentile, times `scale` (one plus the learnt
    headroom, so the target's feedback reaches this term as it does the demand's). The forecast's
    growth is not applied: in the evaluation it bought conv and code attainment only at a higher price
    than a higher target does."""
    return {window: scale * quantile_at(quantiles, config.percentile)
            for window, quantiles in observation.arrival_prompt_tokens}


def headroom(config: AutoscalerConfig, state: AutoscalerState) -> float:
    """The share of extra load the demand is sized for: the learnt headroom with a target attainment,
    else none."""
    return state.attainment.headroom if config.attainment is not None else 0.0


def _saturated_prefill(observation: Observation, config: AutoscalerConfig, state: AutoscalerState) -> float:
    """Prompt tokens/s one busy prefill replica serves at the last decision's correction."""
    return config.model.saturated_tokens_per_s(state.prefill.correction / computed_share(observation, config))


def _isl(observation: Observation, state: AutoscalerState) -> float:
    """The window's mean prompt length, or the forecast's level when no request finished in it."""
    return observation.isl_mean if observation.isl_mean > 0 else state.isl.level


def _pinned(observation: Observation, config: AutoscalerConfig, state: AutoscalerState) -> bool:
    """Whether one prefill engine holds a queue the others do not share (`pinned_queue`, at the
    saturated rate): the one judgement the attainment, attribution and backlog steps all use."""
    return pinned_queue(observation.prefill, _isl(observation, state), _saturated_prefill(observation, config, state),
                        config)


def _excused(observation: Observation, config: AutoscalerConfig, state: AutoscalerState, share: float,
             pinned: bool) -> float:
    """The share of the window's requests whose misses no headroom could have prevented, while one
    prefill engine holds a queue the others do not share (`pinned`): the requests that engine serves
    from that queue over the span (at its saturated rate, at most the requests it holds); `learn`
    excuses at most the window's misses."""
    span = _span(observation, state)
    requests = observation.request_rate * span
    if not (pinned and requests > 0 and math.isfinite(share)):
        return 0.0
    drained = _saturated_prefill(observation, config, state) / _isl(observation, state) * span
    return min(drained, fullest_queue(observation.prefill)) / requests


def _attainment(observation: Observation, config: AutoscalerConfig, state: AutoscalerState,
                pinned: bool) -> AutoscalerState:
    """The window's attainment (both SLOs, from the client histograms' buckets) added to the hour's,
    and, with a target, the headroom moved towards it (`autoscaler.attainment`). Windows holding the
    release of a start from zero, or with every role at its maximum, move no headroom; while one prefill
    engine holds a queue the others do not share (`pinned`), the misses it serves teach as met (`_excused`);
    until the pool first settles on the autoscaler's sizes (`_settled_s`), a miss moves it up in
    proportion to the share of the ordered pool that served (`served_share`)."""
    model = config.model
    share = window_attainment(observation.ttft_buckets, observation.tpot_buckets, model.ttft_target_s,
                              model.tpot_target_s)
    woken = _releasing(observation, config, state)
    capped = (observation.prefill.replicas >= config.prefill.max_replicas
              and observation.decode.replicas >= config.decode.max_replicas)
    settled_s = _settled_s(observation, config, state)
    served = 1.0 if math.isfinite(settled_s) else served_share(observation)
    excused = _excused(observation, config, state, share, pinned)
    learnt = learn(replace(state.attainment, settled_s=settled_s), observation.time_s, share,
                   observation.request_rate * _span(observation, state), config.attainment, config.min_requests,
                   teach=not (woken or capped), served=served, excused=excused)
    return replace(state, attainment=learnt)


def _settled_s(observation: Observation, config: AutoscalerConfig, state: AutoscalerState) -> float:
    """When the pool first settled on the autoscaler's sizes since it began or last woke from zero:
    the first decision, after an earlier sizing decision since then (a hold sizes nothing: a pool
    created before its traffic holds until the traffic comes), whose window reaches back before no
    role's last scale-up (`_unsettled`); NaN while it has not."""
    since = state.attainment.settled_s
    if since > state.woken_s:
        return since
    now = observation.time_s
    sized = state.basis is not None and state.basis.time_s > state.woken_s
    settled = sized and not any(_unsettled(state.role(name), now, config) for name in (PREFILL, DECODE))
    return now if settled else math.nan


def served_share(observation: Observation) -> float:
    """The share of the ordered pool that serves: ready over ordered (ready, starting, and not yet placed),
    the smaller of the two roles' (1 for a role with none ordered)."""
    return min(role.ready / ordered if (ordered := role.replicas + role.pending) > 0 else 1.0
               for role in (observation.prefill, observation.decode))


def _attainment_message(config: AutoscalerConfig, state: AutoscalerState, now: float) -> str:
    if config.attainment is None:
        return ""
    hour = state.attainment.last_hour(now)
    measured = f"{hour:.1%}" if math.isfinite(hour) else "not measured yet"
    return (f"; attainment {measured} over the last hour (target {config.attainment:.1%}), headroom "
            f"{state.attainment.headroom:+.0%}")


def _check(observation: Observation, config: AutoscalerConfig, state: AutoscalerState) -> Decision | AutoscalerState:
    """Rule 1 and scale to zero: a hold when the metrics cannot be trusted (or are settling), a
    decision to, at or from zero, else the state the other rules start from."""
    problem = metrics_problem(observation, state)
    if problem is not None:
        return hold(observation, config, state, problem)
    now = observation.time_s
    suspicion = metrics_suspicion(observation)
    if suspicion is not None:
        since = state.suspect_since_s if math.isfinite(state.suspect_since_s) else now
        waited = replace(state, time_s=now, suspect_since_s=since)
        if now - since >= 2 * observation.window_s:
            return hold(observation, config, waited, f"{suspicion} (for {now - since:.0f}s)")
        return hold(observation, config, waited, f"{suspicion}: waiting a window for the scrapes to agree",
                    METRICS_SETTLING)
    if config.idle_s is not None:
        return _zero(observation, config, state)
    return state


@dataclass(frozen=True)
class _Load:
    """Rule 2's outcome: the load to size for (max of now and the forecast over the horizon), the
    forecasts' new states, and the observation with the ISL/OSL seen before standing in for a window
    in which no request finished."""

    observation: Observation
    rate_now: float
    rate: float
    isl: float
    osl: float
    rate_series: SeriesState
    isl_series: SeriesState
    osl_series: SeriesState
    isl_quantiles: Quantiles
    mix: PromptMix        # the prompt mix sized for (forecast ISL)
    mix_now: PromptMix    # the window's own prompt mix (judgements of what the window shows)


def _forecast(observation: Observation, config: AutoscalerConfig, state: AutoscalerState) -> _Load | Decision:
    """Rule 2: Holt's forecasts of rate and OSL read over the sizing horizon, ISL as seen; a hold
    (NoTraffic, or MetricsUnavailable after two windows of arrivals without ISL/OSL) before any request
    finished."""
    forecaster = config.forecaster
    now = observation.time_s
    rate_now = observation.request_rate
    rate_series = forecaster.update(state.rate, now, rate_now)
    isl_series = forecaster.update(state.isl, now, observation.isl_mean)
    osl_series = forecaster.update(state.osl, now, observation.osl_mean)
    isl_quantiles = observation.isl_quantiles if observation.isl_quantiles.p50 > 0 else state.isl_quantiles
    horizon = config.horizon_s
    rate = max(rate_now, forecaster.predict(rate_series, horizon) if rate_series.samples else 0.0)
    # ISL is not carried along its trend (module docstring, rule 2).
    isl = seen(isl_series, observation.isl_mean)
    osl = ahead(forecaster, osl_series, observation.osl_mean, horizon)
    if not (isl > 0 and osl > 0):   # no finished request has ever been seen: nothing to size, hold
        since = state.suspect_since_s if math.isfinite(state.suspect_since_s) else now
        new_state = replace(state, time_s=now, rate=rate_series, suspect_since_s=since if rate_now > 0 else math.nan)
        if rate_now > 0 and now - since >= 2 * observation.window_s:
            return hold(observation, config, new_state, f"{rate_now:.2f} req/s arriving for {now - since:.0f}s but "
                        "no ISL/OSL reported (no vllm:request_prompt_tokens / request_generation_tokens series)")
        return hold(observation, config, new_state, "no request has been seen yet (ISL/OSL unknown)", NO_TRAFFIC)
    if not (observation.isl_mean > 0 and observation.osl_mean > 0):
        # A window in which no request finished (idle, or only long answers in flight) has no ISL/OSL
        # of its own: what was seen before stands in, for this decision's judgements only.
        observation = replace(observation, isl_mean=observation.isl_mean if observation.isl_mean > 0 else isl,
                              osl_mean=observation.osl_mean if observation.osl_mean > 0 else osl)
    mix = PromptMix.from_quantiles(isl, isl_quantiles, config.default_isl_cs2)
    mix_now = PromptMix.from_quantiles(observation.isl_mean, isl_quantiles, config.default_isl_cs2) \
        if observation.isl_mean > 0 else mix
    return _Load(observation, rate_now, rate, isl, osl, rate_series, isl_series, osl_series, isl_quantiles, mix,
                 mix_now)


@dataclass(frozen=True)
class _Corrections:
    """Rule 3's outcome: the roles' states with their corrections (and prefill's burst memory), the
    capacity multiples every judgement uses, and the remembered bursts with their weights."""

    prefill_state: RoleState
    decode_state: RoleState
    k_prefill: float      # prefill's correction over the computed share: prompt tokens served per modelled one
    k_decode: float
    bursts: tuple[tuple[float, Burst], ...]
    expected_requests: float


def _corrections(observation: Observation, config: AutoscalerConfig, state: AutoscalerState,
                 load: _Load) -> _Corrections:
    """Rule 3 (and rule 4's burst memory, which judges bursts with the corrected capacity): the
    capacity corrections this window teaches, the prefix cache's computed share, the bursts."""
    computed = computed_share(observation, config)
    prefill_state = _smoothed(state.prefill,
                              _observed_prefill_correction(observation, config, state.prefill, load.mix_now, computed),
                              config)
    context_now = (observation.isl_mean + observation.osl_mean / 2.0) if observation.isl_mean > 0 \
        else load.isl + load.osl / 2
    decode_state = _smoothed(state.decode, _observed_decode_correction(observation, config, context_now), config)
    k_prefill, k_decode = prefill_state.correction / computed, decode_state.correction
    breach = _ttft_breach(observation, config, load.mix_now, k_prefill, k_decode)
    prefill_state, weighted, expected = _burst_memory(observation, config, state, prefill_state, load.rate_series,
                                                      _burst(observation, config, state, k_prefill, breach))
    return _Corrections(prefill_state, decode_state, k_prefill, k_decode, weighted, expected)


@dataclass
class _Sizes:
    """Each role's recommendation as the steps build it, with its reason and message, what the
    stabilisation windows remember (the load's sizes, not the queue's), and what the decision's
    message says after the roles' (a role's message is replaced when it holds)."""

    recommended: dict[str, int]
    reasons: dict[str, str]
    messages: dict[str, str]
    remembered: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, plan: _Plan, observation: Observation, config: AutoscalerConfig) -> _Sizes:
        """Rule 4: the demand's sizes."""
        return cls({PREFILL: plan.prefill_replicas, DECODE: plan.decode.replicas},
                   {PREFILL: PREFILL_DEMAND, DECODE: DECODE_DEMAND},
                   {PREFILL: _prefill_message(plan, observation.prefill.replicas, config),
                    DECODE: _decode_message(plan, observation.decode.replicas)})


def _attribution(observation: Observation, config: AutoscalerConfig, state: AutoscalerState, plan: _Plan,
                 corrections: _Corrections, sizes: _Sizes, pinned: bool) -> None:
    """Rule 5: an SLO breach (or a building prefill backlog) gives the guilty role one replica more
    than it has, unless replicas of it are starting or (TPOT) the window predates its last growth. A
    queue one prefill engine holds (`pinned`) is no prefill breach, and the decision says so."""
    now = observation.time_s
    feedback = _attribute(observation, config, plan, state.prefill, corrections.k_prefill, pinned)
    if pinned:
        prefill = observation.prefill
        taught = ", and the requests it serves from it teach the headroom as met" if config.attainment is not None \
            else ""
        sizes.notes.append(f"one prefill engine holds {fullest_queue(prefill):.0f} of the "
                           f"{prefill.num_requests_waiting:.0f} requests waiting: queued work stays on its "
                           f"engine, so that queue orders no replica{taught}")
    for role_name, (reason, message) in feedback.items():
        role = observation.prefill if role_name == PREFILL else observation.decode
        capacity = _capacity(role, state.role(role_name), now, config)
        bumped = capacity + 1 if role.starting == 0 else role.replicas
        if role.starting:
            message += f" ({role.starting} already starting: not adding more for this symptom)"
        elif reason == TPOT_OVER_TARGET and _unsettled(state.role(role_name), now, config):
            bumped = role.replicas
            message += (f" (the window still holds the pool before its last scale-up at "
                        f"t={state.role(role_name).last_scale_up_s:.0f}s: not adding more for this symptom)")
        sizes.recommended[role_name] = max(sizes.recommended[role_name], bumped)
        sizes.reasons[role_name], sizes.messages[role_name] = reason, message


def _backlog_step(observation: Observation, config: AutoscalerConfig, state: AutoscalerState, plan: _Plan,
                  corrections: _Corrections, sizes: _Sizes, pinned: bool) -> _Plan:
    """Rule 6: the replicas that drain the work already queued within the drain budget as well as
    serve the load; recommended while the queue lasts, never remembered by the windows. Returns the
    plan with each role's backlog size (the pace never goes below it)."""
    backlog = _backlog(observation, config, plan, state.prefill, corrections.k_prefill, corrections.k_decode, pinned)
    plan = replace(plan, backlog={name: replicas for name, (replicas, _) in backlog.items()})
    sizes.remembered = dict(sizes.recommended)
    for role_name, (replicas, message) in backlog.items():
        if replicas > sizes.recommended[role_name]:
            sizes.recommended[role_name] = replicas
            queued_now = (observation.prefill if role_name == PREFILL else observation.decode).num_requests_waiting > 0
            if queued_now and sizes.reasons[role_name] in (PREFILL_DEMAND, DECODE_DEMAND):
                sizes.reasons[role_name] = PREFILL_QUEUEING if role_name == PREFILL else DECODE_ADMISSION
            sizes.messages[role_name] = f"{sizes.messages[role_name]}; {message}"
    return plan


def _pace(observation: Observation, config: AutoscalerConfig, state: AutoscalerState, load: _Load,
          corrections: _Corrections, plan: _Plan, sizes: _Sizes) -> Decision:
    """Rules 7-9: pace, grace, the N-1 check, Pending pods and bounds per role, then the GPU budget;
    the decision with its leading reason and the state for the next call."""
    now = observation.time_s
    roles: dict[str, RoleDecision] = {}
    role_states: dict[str, RoleState] = {}
    blocked: list[str] = []
    for role_name, role_state in ((PREFILL, corrections.prefill_state), (DECODE, corrections.decode_state)):
        role = observation.prefill if role_name == PREFILL else observation.decode
        role_state = _remember(role_state, role, now, sizes.remembered[role_name], config)
        decision, is_blocked = _stabilise(role_name, role, role_state, sizes.recommended[role_name],
                                          sizes.reasons[role_name], sizes.messages[role_name], now, config, plan,
                                          corrections.k_prefill, corrections.k_decode)
        if is_blocked:
            blocked.append(role_name)
        if decision.replicas > decision.current:
            role_state = replace(role_state, last_scale_up_s=now)
        roles[role_name] = decision
        role_states[role_name] = role_state

    budget_binding = False
    if config.gpu_budget is not None:
        roles, budget_binding = _apply_budget(roles, config, plan, corrections.k_prefill)

    new_state = AutoscalerState(time_s=now, rate=load.rate_series, isl=load.isl_series, osl=load.osl_series,
                                isl_quantiles=load.isl_quantiles, idle_since_s=state.idle_since_s,
                                woken_s=state.woken_s, attainment=state.attainment,
                                basis=ScaleUpBasis(now, observation.isl_mean, observation.osl_mean, plan.rate,
                                                   plan.rate_now,
                                                   config.model.mix_tokens_per_s(plan.mix, corrections.k_prefill),
                                                   corrections.k_decode, plan.prefill_replicas, plan.decode.replicas),
                                prefill=role_states[PREFILL], decode=role_states[DECODE])
    prefill, decode = roles[PREFILL], roles[DECODE]
    candidates = [r for r in (prefill, decode) if r.replicas != r.current] or [prefill, decode]
    lead = min(candidates, key=lambda r: _PRIORITY.index(r.reason))
    reason = GPU_BUDGET if budget_binding else lead.reason
    # The role that leads the decision speaks first (Events and the status show the message's start).
    message = "; ".join([*(r.message for r in sorted((prefill, decode), key=lambda r: r is not lead)), *sizes.notes])
    if config.idle_s is not None and math.isfinite(state.idle_since_s):
        message += f"; idle {now - state.idle_since_s:.0f}s of the {config.idle_s:.0f}s before scaling to zero"
    message += _attainment_message(config, state, now)
    return Decision(prefill, decode, reason, message, pd_ratio(plan.prefill_replicas, plan.decode.replicas),
                    new_state, scaling_active=True,
                    degraded_reason=INSUFFICIENT_GPUS if blocked else None, budget_binding=budget_binding)


def _span(observation: Observation, state: AutoscalerState) -> float:
    """The time this decision's window adds to what earlier decisions saw (windows overlap)."""
    if not math.isfinite(state.time_s):
        return observation.window_s
    return min(observation.time_s - state.time_s, observation.window_s)


def _burst_memory(observation: Observation, config: AutoscalerConfig, state: AutoscalerState,
                  prefill_state: RoleState, rate_series: SeriesState,
                  bursts: tuple[Burst, ...]) -> tuple[RoleState, tuple[tuple[float, Burst], ...], float]:
    """The prefill state with the bursts and the requests seen, the bursts weighted by age (e-folding
    `burst_memory_s`) and the requests they are judged against: the requests seen, weighted alike,
    and, for the part of the memory before the first decision, the current rate (a prior: no bursts
    before any evidence). Bursts are thus counted per request seen, neither forgotten when the load
    falls nor taken for the whole future when only a minute has been seen."""
    now = observation.time_s
    memory = config.burst_memory_s
    if memory <= 0:
        return replace(prefill_state, bursts=()), (), 0.0
    decay = math.exp(-(now - state.time_s) / memory) if math.isfinite(state.time_s) else 1.0
    seen = state.prefill.requests_seen * decay + observation.request_rate * _span(observation, state)
    since = state.prefill.seen_since_s
    if not math.isfinite(since) and observation.request_rate > 0:
        since = now
    level = rate_series.level if math.isfinite(rate_series.level) else observation.request_rate
    prior = max(level, 0.0) * memory * (math.exp(-(now - since) / memory) if math.isfinite(since) else 1.0)
    weighted = tuple((math.exp(-(now - b.time_s) / memory), b) for b in bursts)
    return replace(prefill_state, bursts=bursts, requests_seen=seen, seen_since_s=since), weighted, seen + prior


def _burst(observation: Observation, config: AutoscalerConfig, state: AutoscalerState, k: float,
           ttft_breach: bool) -> tuple[Burst, ...]:
    """The bursts remembered after this window: the earlier ones still within the memory, and this
    window's if its requests queued in a burst. A burst is the window's prefill queue-time quantiles
    turned into work ahead (times the pool's saturated rate: a burst spread over `ready` replicas
    waits about its work / their capacity) with the requests the window adds since the last decision
    (windows overlap). Learnt only while TTFT breaches its target and the window's average load is
    well under capacity (so the wait came from bursts, not overload, which the demand and feedback
    terms size), from a steady pool, and when the tail at the SLO percentile is over the queue-time
    histogram's first bucket (under it no wait is visible)."""
    now = observation.time_s
    memory = config.burst_memory_s
    kept = tuple(b for b in state.prefill.bursts if memory > 0 and now - b.time_s < 5.0 * memory)
    prefill = observation.prefill
    steady = prefill.starting == 0 and prefill.draining == 0 and not math.isfinite(state.prefill.starting_since_s)
    if memory <= 0 or prefill.ready < 1 or not ttft_breach or not steady:
        return kept
    if _releasing(observation, config, state):
        return kept
    per_replica = config.model.saturated_tokens_per_s(k)
    capacity = prefill.ready * per_replica
    offered = observation.request_rate * observation.isl_mean
    backlog_s = prefill.num_requests_waiting * observation.isl_mean / capacity
    if offered > config.burst_max_utilisation * capacity or backlog_s > config.model.ttft_target_s:
        return kept       # sustained overload, not bursts: the demand and feedback terms size that
    waits = prefill.request_queue_time_seconds
    wait = quantile_at(waits, config.percentile)
    if not wait > config.queue_time_floor_s:
        return kept
    last = kept[-1] if kept else None
    if last is not None and prefill.ready > last.replicas:
        before = quantile_at(Quantiles(last.work_p50, last.work_p90, last.work_p99), config.percentile)
        if wait >= 0.7 * before / (last.replicas * per_replica):
            # More replicas did not cut the wait: it is not work spread over the pool (e.g. prompts too
            # long to share out), so more replicas would not help either. Learn nothing from it.
            return kept
    burst = Burst(now, observation.request_rate * _span(observation, state), prefill.ready,
                  waits.p50 * capacity, waits.p90 * capacity, waits.p99 * capacity)
    return (*kept, burst)[-max(config.burst_records, 1):]


def _ttft_limit(config: AutoscalerConfig, mix: PromptMix, decode_itl_s: float, k_prefill: float) -> float:
    """The TTFT a breach is judged against: the target, or a little over what an idle pool gives at
    the SLO percentile when prompts that long cannot meet the target at all."""
    model = config.model
    return max(model.ttft_target_s, 1.05 * model.ttft_floor(mix, decode_itl_s, k_prefill))


def _ttft_breach(observation: Observation, config: AutoscalerConfig, mix: PromptMix, k_prefill: float,
                 k_decode: float) -> bool:
    _, itl, _ = config.model.decode_frontier(mix.mean + max(observation.osl_mean, 1.0) / 2.0, k_decode)
    limit = _ttft_limit(config, mix, itl, k_prefill)
    return quantile_at(observation.ttft_seconds, config.percentile) > limit


def _capacity(role: RoleObservation, role_state: RoleState, now: float, config: AutoscalerConfig) -> int:
    """Replicas that serve or soon will: ready, plus starting ones unless they are overdue."""
    overdue = math.isfinite(role_state.starting_since_s) and now - role_state.starting_since_s > 2 * config.startup_s
    return role.ready if overdue else role.replicas


def _remember(role_state: RoleState, role: RoleObservation, now: float, recommendation: int,
              config: AutoscalerConfig) -> RoleState:
    keep = max(config.scale_up.window_s, config.scale_down.window_s)
    history = (*((t, r) for t, r in role_state.recommendations if t > now - keep), (now, recommendation))
    starting_since = role_state.starting_since_s if role.starting else math.nan
    if role.starting and not math.isfinite(starting_since):
        starting_since = now
    return replace(role_state, recommendations=history, waiting=role.num_requests_waiting,
                   starting_since_s=starting_since)


def _unsettled(role_state: RoleState, now: float, config: AutoscalerConfig) -> bool:
    """Whether the metrics window still reaches back to before the replicas of the role's last
    scale-up could serve (it grew, then they started, then a whole window had to pass): a latency
    quantile over that window shows the smaller pool, and growing again for it would overshoot."""
    return now - config.window_s < role_state.last_scale_up_s + config.startup_s


def drain_budget_s(config: AutoscalerConfig) -> float:
    """How soon queued work should be gone: within the sizing horizon (start-up, one interval, half
    a window). Draining within one interval instead ordered far more than the load needs for as long
    as the grace period and the step-by-step scale-down keep them: in the evaluation's cold starts
    +66% GPU-hours at 120 s start-up and twice as many at 300 s, for under two points of attainment
    (`docs/evaluation.md`)."""
    return max(config.horizon_s, config.model.ttft_target_s)


def until_serving(role: RoleObservation, role_state: RoleState, now: float, config: AutoscalerConfig) -> float:
    """How long until replicas ordered now serve: the start-up delay, or what is left of it for the
    replicas already starting (they serve first)."""
    if role.starting and math.isfinite(role_state.starting_since_s):
        return max(0.0, config.startup_s - (now - role_state.starting_since_s))
    return config.startup_s


def fullest_queue(role: RoleObservation) -> float:
    """The fullest engine's waiting requests; 0 when unknown: an older collector, or a maximum the sum
    contradicts (above it, or below the mean over the engines scraped, ready and draining)."""
    waiting, fullest = role.num_requests_waiting, role.num_requests_waiting_max
    engines = max(role.ready + role.draining, 1)
    return fullest if waiting / engines <= fullest <= waiting else 0.0


def queue_drain_s(role: RoleObservation, isl: float, per_replica: float) -> float:
    """How long a prefill queue takes to drain on the replicas that share it, `isl` prompt tokens per
    request at `per_replica` tokens/s each: the queue outside the fullest engine (`fullest_queue`) over
    the other engines scraped (ready and draining: the sum and the maximum are over both), or the whole
    queue over the ready replicas with one ready or no per-engine maximum known. Queued work stays on
    its engine (the proxy routes each request once), so one engine's long queue beside idle ones shows
    that engine was sent more than its share before the others served, not a pool too small: more
    replicas would take none of it."""
    ready = max(role.ready, 1)
    waiting, fullest = role.num_requests_waiting, fullest_queue(role)
    per_engine = (waiting - fullest) / (role.ready + role.draining - 1) if ready > 1 and fullest > 0 \
        else waiting / ready
    return per_engine * isl / per_replica


def pinned_queue(role: RoleObservation, isl: float, per_replica: float, config: AutoscalerConfig) -> bool:
    """Whether one engine holds most of the queue (at least half the waiting requests), so long that
    every request it serves from it misses (more than the TTFT target of work at `per_replica` prompt
    tokens/s, `isl` tokens a request), while the queue the others share drains within the attribution's
    tolerance (`queue_drain_share` of the target, `queue_drain_s`): misses from such a queue are no
    pool's shortage, and more replicas would take none of it. (An engine a little fuller than the others,
    as routing leaves them, is not.) `decide` and `react` both judge by it."""
    if not (isl > 0 and per_replica > 0 and role.ready > 1):
        return False
    target_s = config.model.ttft_target_s
    fullest = fullest_queue(role)
    return (2 * fullest >= role.num_requests_waiting and fullest * isl / per_replica > target_s
            and queue_drain_s(role, isl, per_replica) <= config.queue_drain_share * target_s)


def shared_queue(role: RoleObservation, pinned: bool) -> tuple[float, int]:
    """The waiting requests more replicas could relieve and the ready replicas serving the load beside
    them: without a queue one engine holds, the whole queue and every ready replica; with one
    (`pinned_queue`), the queue outside it and the other ready replicas (that engine drains its own
    queue, serving nothing else until it has)."""
    if not pinned:
        return role.num_requests_waiting, role.ready
    return role.num_requests_waiting - fullest_queue(role), max(role.ready - 1, 0)


def pinned_limit(need: int, load_replicas: int, ready: int) -> tuple[int, str]:
    """A backlog's `need` within the most replicas it can use, and a note when that binds: those the load
    needs plus the ready ones. Queued work stays on the engine that holds it (the proxy routes each
    request once; a vLLM engine serves only its own queue), so replicas ordered now take only later
    arrivals, and when they serve at most the ready replicas are still busy with the backlog. Without
    this limit a backlog on the one replica of a pool created far smaller than its load ordered replicas
    to drain it that could never take any of it."""
    limit = load_replicas + ready
    if need <= limit:
        return need, ""
    return limit, (f" (at most the load's {load_replicas} plus the {ready} ready that hold the queue: queued "
                   f"work stays on its engine)")


def _backlog(observation: Observation, config: AutoscalerConfig, plan: _Plan, prefill_state: RoleState,
             k_prefill: float, k_decode: float, pinned: bool) -> dict[str, tuple[int, str]]:
    """Per role, the replicas that serve the load and drain the work queued now, plus what keeps
    queueing until replicas ordered now serve (start-up), within `drain_budget_s`.

    Prefill: the queued prompt tokens (requests waiting x ISL) and the excess of the offered prompt
    rate over the ready replicas' capacity (on the prompt mix) until replicas ordered now serve
    (`until_serving`), over the drain budget (`drain_budget_s`), on top of the offered rate, in
    saturated replicas; each decision sizes the whole backlog it foresees, so a queue that grows as
    foreseen while replicas start orders nothing more. Decode: the requests waiting for admission
    (less those whose KV is in flight), over the drain budget, as extra arrival rate of the decode
    model (decode's arrivals are what prefill delivers, so its queue is not extrapolated). Each role
    gets at most the load's replicas plus the ready ones (`pinned_limit`). A queue one prefill engine
    holds (`pinned`) is none of prefill's backlog: that engine drains it, serving nothing else. Only
    roles whose queue needs more than the load alone are returned. They are recommended while the
    queue lasts, but the stabilisation windows do not remember them: the queue is work to drain, not
    load to expect again."""
    model = config.model
    drain_s = drain_budget_s(config)
    out: dict[str, tuple[int, str]] = {}
    prefill = observation.prefill
    isl = observation.isl_mean if observation.isl_mean > 0 else plan.isl
    per_replica = model.mix_tokens_per_s(plan.mix, k_prefill)
    offered = max(plan.rate, plan.rate_now) * isl
    queued, serving = shared_queue(prefill, pinned)
    queued *= isl
    until_s = until_serving(prefill, prefill_state, observation.time_s, config)
    building = max(0.0, offered - serving * per_replica) * until_s
    if queued + building > 0:
        need = (offered + (queued + building) / drain_s) / per_replica
        bounded = min(max(1, math.ceil(need - 1e-9)), max(config.prefill.max_replicas, 1))
        replicas, note = pinned_limit(bounded, plan.prefill_replicas, prefill.ready)
        if replicas > plan.prefill_replicas:
            out[PREFILL] = (replicas, f"backlog {_kilo(queued)} prompt tokens queued + {_kilo(building)} building "
                                      f"over {until_s:.0f}s of start-up, drained within {drain_s:.0f}s on "
                                      f"top of {_kilo(offered)} tok/s: P {replicas} x {_kilo(per_replica)} tok/s{note}")
    decode = observation.decode
    # Requests whose KV is still in flight wait in decode's queue too: they are not a backlog.
    waiting = max(0.0, decode.num_requests_waiting - plan.rate_now * model.perf.kv_transfer_seconds(round(isl)))
    if waiting > 0:
        sizing = model.size_decode(plan.rate + waiting / drain_s, plan.isl, plan.osl, k_decode)
        replicas, note = pinned_limit(sizing.replicas, plan.decode.replicas, decode.ready)
        if replicas > plan.decode.replicas:
            out[DECODE] = (replicas, f"backlog {waiting:.0f} requests waiting for decode admission, admitted "
                                     f"within {drain_s:.0f}s on top of the load: D {replicas}{note}")
    return out


def _prefill_message(plan: _Plan, replicas: int, config: AutoscalerConfig) -> str:
    sizing = plan.prefill
    forecast = f" (forecast; now {plan.rate_now:.1f})" if plan.rate > plan.rate_now * 1.01 else ""
    need = plan.arrivals
    if need.replicas > max(sizing.replicas, plan.burst_replicas):
        return (f"arrivals bunch: sized for {_kilo(need.tokens)} prompt tokens sharing the "
                f"p{config.percentile:g} request's {need.window_s:g}s slot, which P {need.replicas} x "
                f"{_kilo(config.model.saturated_tokens_per_s(plan.k_prefill))} tok/s drain within the queue budget "
                f"{_ms(config.model.queue_budget_s(plan.mix, plan.decode.itl_s, plan.k_prefill))} + {need.window_s:g}s "
                f"(steady load alone needs {sizing.replicas} at rho {sizing.utilisation:.2f}); P has {replicas}")
    if plan.burst_replicas > sizing.replicas:
        fewer = config.model.burst_miss_share(plan.bursts, plan.expected_requests, plan.burst_replicas - 1, plan.mix,
                                              plan.decode.itl_s, plan.k_prefill)
        largest = max(quantile_at(Quantiles(b.work_p50, b.work_p90, b.work_p99), config.percentile)
                      for _, b in plan.bursts)
        return (f"{len(plan.bursts)} remembered burst(s) (up to {_kilo(largest)} prompt tokens ahead of the "
                f"p{config.percentile:g} request) would keep {fewer:.1%} of the ~{plan.expected_requests:.0f} "
                f"requests they are judged against (those of the {config.burst_memory_s:.0f}s memory) waiting past the "
                f"queue budget "
                f"with P {plan.burst_replicas - 1}: P {plan.burst_replicas} x {_kilo(sizing.tokens_per_s_per_replica)} "
                f"tok/s keeps it within {1 - config.model.quantile:.0%} (steady load alone needs {sizing.replicas} "
                f"at rho {sizing.utilisation:.2f}); P has {replicas}")
    return (f"lambda {plan.rate:.1f} req/s{forecast} x ISL {plan.isl:.0f} = {_kilo(sizing.demand_tokens_per_s)} tok/s "
            f"needs P {sizing.replicas} x {_kilo(sizing.tokens_per_s_per_replica)} tok/s at rho "
            f"{sizing.utilisation:.2f} for TTFT p{config.percentile:g} <= {_ms(config.model.ttft_target_s)} "
            f"(predicted attainment {sizing.attainment:.3f}); P has {replicas}")


def _decode_message(plan: _Plan, replicas: int) -> str:
    sizing = plan.decode
    return (f"lambda*OSL {_kilo(plan.rate * plan.osl)} tok/s needs D {sizing.replicas} x "
            f"{_kilo(sizing.tokens_per_s_per_replica)} tok/s at b*={sizing.batch} ({sizing.limit}-bound, ITL "
            f"{_ms(sizing.itl_s)}, ctx {plan.isl + plan.osl / 2:.0f}); D has {replicas}")


def _attribute(observation: Observation, config: AutoscalerConfig, plan: _Plan, prefill_state: RoleState,
               k_prefill: float, pinned: bool) -> dict[str, tuple[str, str]]:
    """Which role a breach (or a building prefill backlog) points at, with the evidence; never prefill
    for a queue one engine holds (`pinned`)."""
    model = config.model
    percentile = config.percentile
    out: dict[str, tuple[str, str]] = {}
    prefill, decode = observation.prefill, observation.decode
    ttft = quantile_at(observation.ttft_seconds, percentile)
    tpot = quantile_at(observation.tpot_seconds, percentile)
    ttft_limit = _ttft_limit(config, plan.mix, plan.decode.itl_s, k_prefill)
    ttft_breach = ttft > ttft_limit

    ready = max(prefill.ready, 1)
    isl = observation.isl_mean if observation.isl_mean > 0 else plan.isl
    per_replica = model.mix_tokens_per_s(plan.mix, k_prefill)
    drain_s = queue_drain_s(prefill, isl, per_replica)
    backlog = drain_s > config.queue_drain_share * model.ttft_target_s
    growing = (math.isfinite(prefill_state.waiting) and prefill.num_requests_waiting > prefill_state.waiting
               and drain_s > config.queue_drain_share * model.ttft_target_s / 2)
    p_label = f"p{percentile:g}"
    if not pinned and (ttft_breach or growing) and (backlog or growing):
        what = f"TTFT {p_label} {_ms(ttft)} > {_ms(ttft_limit)}" if ttft_breach else "prefill queue growing"
        out[PREFILL] = (PREFILL_QUEUEING,
                        f"{what} with prefill waiting {prefill.num_requests_waiting:.0f} ({_ms(drain_s)} of work per "
                        f"replica): P {prefill.replicas}->{max(prefill.replicas + 1, plan.prefill_replicas)} "
                        f"(lambda*ISL {_kilo(plan.rate_now * isl)} tok/s vs {prefill.ready}x"
                        f"{_kilo(per_replica)} at rho {plan.rate_now * isl / (ready * per_replica):.2f})")
    elif ttft_breach:
        in_transfer = plan.rate_now * model.perf.kv_transfer_seconds(round(isl))
        kv_full = decode.kv_cache_usage_perc_max >= 0.95
        seqs_full = decode.ready > 0 and decode.num_requests_running >= 0.95 * model.max_num_seqs * decode.ready
        decode_queue = quantile_at(decode.request_queue_time_seconds, percentile)
        admission_wait = (decode.num_requests_waiting > 4 * in_transfer + 2 * decode.ready
                          and decode_queue > config.queue_time_floor_s)
        if kv_full or seqs_full or admission_wait:
            out[DECODE] = (DECODE_ADMISSION,
                           f"TTFT {p_label} {_ms(ttft)} > {_ms(ttft_limit)} with prefill queue short "
                           f"({prefill.num_requests_waiting:.0f} waiting) but decode waiting "
                           f"{decode.num_requests_waiting:.0f}, KV max {decode.kv_cache_usage_perc_max:.2f}, running "
                           f"{decode.num_requests_running:.0f}: D {decode.replicas}->"
                           f"{max(decode.replicas + 1, plan.decode.replicas)}")
    if tpot > model.tpot_target_s:
        out[DECODE] = (TPOT_OVER_TARGET,
                       f"TPOT {p_label} {_ms(tpot)} > {_ms(model.tpot_target_s)}: D {decode.replicas}->"
                       f"{max(decode.replicas + 1, plan.decode.replicas)} (lambda*OSL "
                       f"{_kilo(plan.rate_now * plan.osl)} tok/s vs {decode.ready}x"
                       f"{_kilo(plan.decode.tokens_per_s_per_replica)} at b*={plan.decode.batch})")
    return out


def _stabilise(role_name: str, role: RoleObservation, role_state: RoleState, recommended: int, reason: str,
               message: str, now: float, config: AutoscalerConfig, plan: _Plan, k_prefill: float,
               k_decode: float) -> tuple[RoleDecision, bool]:
    """Pace, grace, N-1, Pending and bounds for one role; returns the decision and whether scale-up
    was blocked by Pending pods."""
    letter = role_name[0].upper()
    current = role.replicas + role.pending
    bounds = config.bounds(role_name)
    history = role_state.recommendations
    wanted = current
    blocked = False
    if recommended > current:
        up_window = [r for t, r in history if t > now - config.scale_up.window_s] or [recommended]
        target = max(min(min(up_window), recommended), plan.backlog.get(role_name, 0))
        wanted = min(max(target, current), current + config.scale_up.max_step)
        if role.pending > 0 and wanted > current:
            wanted, blocked = current, True
            reason = INSUFFICIENT_GPUS
            message = (f"{role.pending} {role_name} pod(s) Pending for GPUs: {letter} held at {current} "
                       f"(wanted {recommended}; not counted as capacity, scale-down still allowed)")
        elif wanted == current:
            reason, message = WITHIN_TARGETS, f"{letter} stays {current} (up-window minimum {target}): {message}"
    elif recommended < current:
        down_window = [r for t, r in history if t > now - config.scale_down.window_s] or [recommended]
        target = max(max(down_window), recommended)
        candidate = max(target, current - config.scale_down.max_step)
        covered = now - history[0][0] if history else 0.0
        if covered + config.interval_s < config.scale_down.window_s - 1e-9:
            reason = SCALE_DOWN_DEFERRED
            message = (f"{letter} stays {current}: recommends {recommended} but only {covered:.0f}s of the "
                       f"{config.scale_down.window_s:.0f}s stabilisation window have been seen")
        elif target >= current:
            reason = SCALE_DOWN_DEFERRED
            message = (f"{letter} stays {current}: recommends {recommended} but the {config.scale_down.window_s:.0f}s "
                       f"stabilisation window's maximum is {target}")
        elif now - role_state.last_scale_up_s < config.grace_period_s:
            reason = SCALE_DOWN_GRACE
            message = (f"{letter} stays {current}: grew {now - role_state.last_scale_up_s:.0f}s ago "
                       f"(grace {config.grace_period_s:.0f}s)")
        else:
            safe, check = _n_minus_one(role_name, candidate, config, plan, k_prefill, k_decode)
            if safe:
                wanted = candidate
                reason = SCALE_DOWN
                message = f"{letter} {current}->{candidate}: {check}"
            else:
                reason = SCALE_DOWN_UNSAFE
                message = f"{letter} stays {current}: N-1 check fails: {check}"
    else:
        reason = WITHIN_TARGETS if reason in (PREFILL_DEMAND, DECODE_DEMAND) else reason
    bounded = min(max(wanted, bounds.min_replicas), bounds.max_replicas)
    if bounded != wanted:
        reason = BOUNDS
        message = (f"{letter} {current}->{bounded}: bounded by min {bounds.min_replicas} / max "
                   f"{bounds.max_replicas} (wanted {wanted}); {message}")
    return RoleDecision(current, bounded, recommended, reason, message), blocked


def _n_minus_one(role_name: str, replicas: int, config: AutoscalerConfig, plan: _Plan, k_prefill: float,
                 k_decode: float) -> tuple[bool, str]:
    """Would `replicas` still meet the role's SLO with `down_margin` more than the planned load?"""
    model = config.model
    load = 1.0 + config.down_margin
    if role_name == PREFILL:
        attainment = model.prefill_attainment(replicas, plan.rate * load, plan.mix, plan.decode.itl_s, k_prefill)
        rho = plan.rate * load * plan.mix.mean / (replicas * model.mix_tokens_per_s(plan.mix, k_prefill))
        arrivals = _arrival_need(config, {window: load * tokens for window, tokens in plan.slot_work.items()},
                                 plan.mix, plan.decode.itl_s, k_prefill)
        safe = (attainment >= model.quantile and rho <= model.max_utilisation and replicas >= plan.burst_replicas
                and replicas >= arrivals.replicas)
        return safe, (f"at {replicas} replicas and {load:.1f}x load predicted TTFT attainment {attainment:.3f} "
                      f"(>= {model.quantile:.2f}) at rho {rho:.2f}, bursts need {plan.burst_replicas}, "
                      f"bunched arrivals {arrivals.replicas}")
    sizing = model.size_decode(plan.rate * load, plan.isl, plan.osl, k_decode)
    safe = sizing.replicas <= replicas
    return safe, (f"at {replicas} replicas and {load:.1f}x load decode needs {sizing.replicas} "
                  f"(b*={sizing.batch}, in flight {sizing.in_flight:.0f})")


def _apply_budget(roles: dict[str, RoleDecision], config: AutoscalerConfig, plan: _Plan,
                  k_prefill: float) -> tuple[dict[str, RoleDecision], bool]:
    """Fit P and D into the GPU budget, giving each GPU to the role it helps most."""
    budget = config.gpu_budget
    assert budget is not None
    gpus = {PREFILL: config.prefill_gpus, DECODE: config.decode_gpus}
    wanted = {name: roles[name].replicas for name in roles}
    if sum(wanted[name] * gpus[name] for name in wanted) <= budget:
        return roles, False
    model = config.model

    def violation(name: str, replicas: int) -> float:
        if name == PREFILL:
            return 1.0 - model.prefill_attainment(replicas, plan.rate, plan.mix, plan.decode.itl_s, k_prefill)
        return model.decode_shortfall(replicas, plan.decode)

    given = {name: min(config.bounds(name).min_replicas, wanted[name]) for name in wanted}
    while True:
        used = sum(given[name] * gpus[name] for name in given)
        options = [(name, (violation(name, given[name]) - violation(name, given[name] + 1)) / gpus[name])
                   for name in (PREFILL, DECODE) if given[name] < wanted[name] and used + gpus[name] <= budget]
        if not options:
            break
        best = max(options, key=lambda option: option[1])[0]
        given[best] += 1
    out = dict(roles)
    for name, decision in roles.items():
        if given[name] != decision.replicas:
            out[name] = replace(decision, replicas=given[name], reason=GPU_BUDGET, message=(
                f"{name[0].upper()} {decision.current}->{given[name]} (wanted {decision.replicas}): GPU budget "
                f"{budget} binds; each GPU went to the role whose predicted SLO violation it cut most"))
    return out, True


# --- scaling to zero and back --------------------------------------------------------------------------


def waking(observation: Observation) -> bool:
    """Whether rule 0 decides: requests are held while a role has no ready replica (no metrics needed)."""
    return observation.held_requests > 0 and _cold(observation)


def _cold(observation: Observation) -> bool:
    """Whether the pool cannot serve now: a role has no ready replica."""
    return observation.prefill.ready == 0 or observation.decode.ready == 0


def _idle(observation: Observation) -> bool:
    """Nothing arrived in the window, and nothing is held, running or waiting anywhere."""
    roles = (observation.prefill, observation.decode)
    return (observation.request_rate <= 0 and observation.held_requests <= 0
            and all(r.num_requests_running <= 0 and r.num_requests_waiting <= 0 for r in roles))


def _wake(observation: Observation, config: AutoscalerConfig, state: AutoscalerState) -> Decision:
    """Requests held at a pool that cannot serve: both roles up together, each to at least one and to
    what the held requests need (rule 0 of the module docstring); never down, but for a binding GPU
    budget, where the larger role gives replicas back until both fit."""
    now = observation.time_s
    held, tokens = observation.held_requests, observation.held_prompt_tokens
    known_isl = state.isl.level if state.isl.level > 0 else 1.0
    isl = tokens / held if tokens > 0 else known_isl
    osl = state.osl.level if state.osl.level > 0 else DEFAULT_WAKE_OSL
    model = config.model
    per_replica = model.mix_tokens_per_s(PromptMix.from_quantiles(isl, None, config.default_isl_cs2),
                                         state.prefill.correction)
    drain_s = drain_budget_s(config)
    decode = model.size_decode(held / drain_s, isl, osl, state.decode.correction)
    needs = {PREFILL: math.ceil(held * isl / (per_replica * drain_s) - 1e-9), DECODE: decode.replicas}
    why = {PREFILL: f"{_kilo(held * isl)} prompt tokens drained within {drain_s:.0f}s at {_kilo(per_replica)} tok/s",
           DECODE: f"{held:.0f} requests admitted within {drain_s:.0f}s at b*={decode.batch} ({decode.limit}-bound, "
                   f"OSL {osl:.0f})"}
    sizes: dict[str, int] = {}
    for name, role in ((PREFILL, observation.prefill), (DECODE, observation.decode)):
        current = role.replicas + role.pending
        bounds = config.bounds(name)
        wanted = max(current, min(max(needs[name], 1), current + config.scale_up.max_step))
        sizes[name] = min(max(wanted, bounds.min_replicas, 1), bounds.max_replicas)
    # Not `_apply_budget`: that one gives each GPU to the role whose predicted SLO violation it cuts
    # most, which needs a plan (arrival rate, prompt mix, decode sizing) that a pool without a ready
    # replica has not got. Here the larger role (in GPUs) gives one back until the pool fits, neither
    # role below one replica: both must be up to serve the held requests at all.
    gpus = {PREFILL: config.prefill_gpus, DECODE: config.decode_gpus}
    while config.gpu_budget is not None and sum(sizes[n] * gpus[n] for n in sizes) > config.gpu_budget:
        larger = max((n for n in sizes if sizes[n] > 1), key=lambda n: sizes[n] * gpus[n], default=None)
        if larger is None:
            break
        sizes[larger] -= 1
    roles: dict[str, RoleDecision] = {}
    role_states: dict[str, RoleState] = {}
    for name, role in ((PREFILL, observation.prefill), (DECODE, observation.decode)):
        current = role.replicas + role.pending
        letter = name[0].upper()
        starting = f" ({role.starting + role.pending} starting)" if sizes[name] == current else ""
        roles[name] = RoleDecision(current, sizes[name], max(needs[name], 1), SCALE_FROM_ZERO,
                                   f"{letter} {current}->{sizes[name]}{starting}: {why[name]}")
        role_state = state.role(name)
        role_states[name] = replace(role_state, last_scale_up_s=now) if sizes[name] > current else role_state
    missing = [n for n, r in ((PREFILL, observation.prefill), (DECODE, observation.decode)) if r.ready == 0]
    message = (f"{held:.0f} request(s) held by the proxies ({_kilo(tokens)} prompt tokens) while "
               f"{' and '.join(missing)} {'have' if len(missing) > 1 else 'has'} no ready replica: "
               f"{roles[PREFILL].message}; {roles[DECODE].message}")
    new_state = replace(state, idle_since_s=math.nan, prefill=role_states[PREFILL], decode=role_states[DECODE],
                        woken_s=now if any(sizes[n] > roles[n].current for n in sizes) else state.woken_s)
    return Decision(roles[PREFILL], roles[DECODE], SCALE_FROM_ZERO, message,
                    pd_ratio(sizes[PREFILL], sizes[DECODE]), new_state)


def _zero(observation: Observation, config: AutoscalerConfig, state: AutoscalerState) -> Decision | AutoscalerState:
    """The scale-to-zero rule (module docstring): a decision when it decides (to zero, from zero on
    arrivals nobody held, or at zero), else the state with the idle time counted, for the other rules."""
    assert config.idle_s is not None
    now = observation.time_s
    pool = (observation.prefill, observation.decode)
    current = [role.replicas + role.pending for role in pool]
    if not any(current):
        if observation.request_rate > 0:  # arriving, not held: no waiting room, or a full one
            sizes = [min(max(1, config.bounds(name).min_replicas), config.bounds(name).max_replicas)
                     for name in (PREFILL, DECODE)]
            message = f"{observation.request_rate:.2f} req/s arrive at a pool at zero (none held by the proxies)"
            roles = [RoleDecision(0, size, size, SCALE_FROM_ZERO, f"{name[0].upper()} 0->{size}: {message}")
                     for name, size in zip((PREFILL, DECODE), sizes, strict=True)]
            woken = replace(state, time_s=now, idle_since_s=math.nan, woken_s=now,
                            prefill=replace(state.prefill, last_scale_up_s=now),
                            decode=replace(state.decode, last_scale_up_s=now))
            return Decision(roles[0], roles[1], SCALE_FROM_ZERO, message, pd_ratio(*sizes), woken)
        message = "P and D at zero: nothing arrived in the window, nothing held, running or waiting"
        roles = [RoleDecision(0, 0, 0, IDLE_AT_ZERO, message) for _ in pool]
        return Decision(roles[0], roles[1], IDLE_AT_ZERO, message, "0:0", replace(state, time_s=now))
    if not _idle(observation):
        return replace(state, idle_since_s=math.nan)
    since = state.idle_since_s if math.isfinite(state.idle_since_s) else now
    if now - since < config.idle_s:
        return replace(state, idle_since_s=since)
    message = (f"idle for {now - since:.0f}s (at least {config.idle_s:.0f}s): nothing arrived in the "
               f"{observation.window_s:.0f}s window, nothing held, running or waiting")
    roles = [RoleDecision(n, 0, 0, SCALE_TO_ZERO, f"{name[0].upper()} {n}->0: {message}")
             for name, n in zip((PREFILL, DECODE), current, strict=True)]
    return Decision(roles[0], roles[1], SCALE_TO_ZERO, message, "0:0", replace(state, time_s=now, idle_since_s=since))
