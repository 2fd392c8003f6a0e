"""What `decide()` is configured with, and the one translation of a `DisaggregatedServing` into it.

- `AutoscalerConfig` (with `RoleBounds` and `Pace`): the profile's pool model, SLOs, bounds, pace,
  budget and the decision's constants; the simulator builds one directly (`sim.policies.xpyd_config`).
- `AutoscalerConfig.from_spec`: `spec.autoscaling` with the engines' profile and batching limits.
- `config_for`: a whole `DisaggregatedServing`: its autoscaling spec, the GPUs per replica, and the
  batching limits its decode engines' arguments set (`engine_arg`), with the metrics window.
- What a target attainment sets besides the headroom (`sizing_quantile`, `caution`: the scale-down
  window and N-1 margin it keeps), which the simulator's config uses too.
- `state_max_age_s`: how old a decision state restored from the status may be.

The operator (`controller.autoscale`) calls `config_for` and `state_max_age_s` and nothing else of
this translation, so a spec field reaches `decide()` in exactly one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xpyd.api.naming import PREFILL
from xpyd.autoscaler.forecast import Forecaster, HoltForecaster
from xpyd.autoscaler.sizing import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, PoolModel
from xpyd.common.args import last_flag_value
from xpyd.perf.model import PerfModel

if TYPE_CHECKING:
    from xpyd.api.models import AutoscalingSpec, DisaggregatedServing


@dataclass(frozen=True)
class RoleBounds:
    """Replica bounds of one role."""

    min_replicas: int = 1
    max_replicas: int = 64


@dataclass(frozen=True)
class Pace:
    """Scaling pace in one direction: the stabilisation window and the largest step."""

    window_s: float
    max_step: int


#: Scale-down caution without a target attainment, or with one of `CAUTIOUS_TARGET` and above: the
#: stabilisation window (the CRD's default, Kubernetes' HPA's) and the N-1 check's extra load.
DOWN_WINDOW_S = 300.0
DOWN_MARGIN = 0.1
#: The target attainments between which the scale-down caution a target keeps goes from none (the
#: shortest window, no extra load) to all of it.
LOOSE_TARGET = 0.80
CAUTIOUS_TARGET = 0.95
#: The window of a target of `LOOSE_TARGET` and under: two decision windows of the metrics.
SHORTEST_DOWN_WINDOW_S = 60.0


def caution(attainment: float | None) -> float:
    """The share of the scale-down caution (window and N-1 margin) a target attainment keeps: all of it
    without a target or at `CAUTIOUS_TARGET` and above, none at `LOOSE_TARGET` and under, linear between.
    Both guard against a rebound of the load after a scale-down; a target that allows more misses
    absorbs one in its error budget and gives the capacity back sooner instead."""
    if attainment is None:
        return 1.0
    return min(max((attainment - LOOSE_TARGET) / (CAUTIOUS_TARGET - LOOSE_TARGET), 0.0), 1.0)


def down_window_s(window_seconds: int | None, attainment: float | None) -> float:
    """The scale-down stabilisation window: `behavior.scaleDown.stabilizationWindowSeconds` when set,
    else the target's (`caution`) between `SHORTEST_DOWN_WINDOW_S` and `DOWN_WINDOW_S`."""
    if window_seconds is not None:
        return float(window_seconds)
    return SHORTEST_DOWN_WINDOW_S + (DOWN_WINDOW_S - SHORTEST_DOWN_WINDOW_S) * caution(attainment)


def down_margin(attainment: float | None) -> float:
    """The extra load the N-1 check sizes for: `DOWN_MARGIN` times the target's `caution`."""
    return DOWN_MARGIN * caution(attainment)


def sizing_horizon_s(startup_s: float, interval_s: float, window_s: float) -> float:
    """How far ahead scale-ups size: start-up, one interval, and half a window of metric lag."""
    return startup_s + interval_s + window_s / 2.0


def sizing_quantile(percentile: float, attainment: float | None) -> float:
    """The share of requests the model sizes each SLO for: the target attainment when there is one,
    else the SLO percentile."""
    return attainment if attainment is not None else percentile / 100.0


@dataclass(frozen=True)
class AutoscalerConfig:
    """Everything `decide` needs besides the observation and its own state."""

    model: PoolModel
    prefill: RoleBounds = field(default_factory=RoleBounds)
    decode: RoleBounds = field(default_factory=RoleBounds)
    gpu_budget: int | None = None
    prefill_gpus: int = 1
    decode_gpus: int = 1
    interval_s: float = 30.0
    window_s: float = 60.0            # the metrics window (rate() range) the observation covers
    startup_s: float = 120.0
    scale_up: Pace = field(default_factory=lambda: Pace(0.0, 4))
    scale_down: Pace = field(default_factory=lambda: Pace(DOWN_WINDOW_S, 1))
    grace_s: float | None = None      # no scale-down this long after a role grew (None: startup + 2 intervals)
    down_margin: float = DOWN_MARGIN  # the N-1 check sizes for this much more load
    forecaster: Forecaster = field(default_factory=HoltForecaster)
    correction_alpha: float = 0.3
    correction_min: float = 0.5
    correction_max: float = 1.5
    min_requests: int = 30            # requests a window needs before it moves a correction
    default_isl_cs2: float = 1.0      # prompt-length variability when the observation has no quantiles
    queue_drain_share: float = 0.5    # prefill backlog: queued work draining in more than this share of TTFT
    burst_memory_s: float = 300.0     # bursts seen count for this long (e-folding), against this span's requests
    burst_records: int = 16           # the most bursts remembered (the oldest go first)
    burst_max_utilisation: float = 0.8  # windows busier than this on average teach no burst
    queue_time_floor_s: float = 0.3   # vllm:request_queue_time_seconds' first bucket: below it no wait is visible
    idle_s: float | None = None       # idle this long, both roles go to zero (None: never; minReplicas 0 on both)
    attainment: float | None = None   # the share of requests to meet both SLOs (None: no learnt headroom)
    react_s: float | None = None      # between decisions, `react` scales up on the gauges this often (None: never)

    @property
    def grace_period_s(self) -> float:
        return self.grace_s if self.grace_s is not None else self.startup_s + 2.0 * self.interval_s

    @property
    def horizon_s(self) -> float:
        """How far ahead scale-ups size (`sizing_horizon_s`)."""
        return sizing_horizon_s(self.startup_s, self.interval_s, self.window_s)

    @property
    def percentile(self) -> float:
        return 100.0 * self.model.quantile

    def bounds(self, role: str) -> RoleBounds:
        return self.prefill if role == PREFILL else self.decode

    @classmethod
    def from_spec(cls, spec: AutoscalingSpec, perf: PerfModel, *, prefill_gpus: int = 1, decode_gpus: int = 1,
                  max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                  max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, window_s: float = 60.0) -> AutoscalerConfig:
        """The config of a `DisaggregatedServing`'s `spec.autoscaling` with the engines' profile. A
        target attainment sets the share each SLO is sized at (`sizing_quantile`), the N-1 check's
        margin (`down_margin`: not in the API) and, unless the spec sets it, the scale-down window
        (`down_window_s`)."""
        attainment = spec.slo.attainment
        model = PoolModel(perf=perf, ttft_target_s=spec.slo.ttft_ms / 1e3, tpot_target_s=spec.slo.tpot_ms / 1e3,
                          quantile=sizing_quantile(spec.slo.percentile, attainment),
                          max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
        behavior = spec.behavior
        up_window = behavior.scale_up.stabilization_window_seconds
        return cls(
            model=model,
            prefill=RoleBounds(spec.prefill.min_replicas, spec.prefill.max_replicas),
            decode=RoleBounds(spec.decode.min_replicas, spec.decode.max_replicas),
            gpu_budget=spec.gpu_budget, prefill_gpus=prefill_gpus, decode_gpus=decode_gpus,
            interval_s=float(spec.interval_seconds), window_s=window_s, startup_s=float(spec.startup_seconds),
            scale_up=Pace(float(up_window or 0), behavior.scale_up.max_step),
            scale_down=Pace(down_window_s(behavior.scale_down.stabilization_window_seconds, attainment),
                            behavior.scale_down.max_step),
            down_margin=down_margin(attainment),
            idle_s=float(spec.scale_to_zero.idle_seconds)
            if spec.prefill.min_replicas == 0 and spec.decode.min_replicas == 0 else None,
            attainment=attainment,
            react_s=react_cadence(spec.react_seconds, spec.interval_seconds))


def react_cadence(react_seconds: float, interval_seconds: float) -> float | None:
    """How often `react` looks at the gauges between decisions: `reactSeconds`, or None (never) when it
    is 0 or at least `intervalSeconds` (the next decision comes first)."""
    return float(react_seconds) if 0 < react_seconds < interval_seconds else None


def state_max_age_s(spec: AutoscalingSpec) -> float:
    """How old a decision state restored from the status may be and still be used: what it remembers
    matters for a scale-down window and a couple of decisions."""
    window = down_window_s(spec.behavior.scale_down.stabilization_window_seconds, spec.slo.attainment)
    return window + 2.0 * spec.interval_seconds


def engine_arg(args: list[str], flag: str, default: int) -> int:
    """The last value of `--flag N` or `--flag=N` in vllm serve args, else `default`."""
    value = last_flag_value(args, flag)
    return int(value) if value is not None and value.isdigit() else default


def config_for(serving: DisaggregatedServing, perf: PerfModel) -> AutoscalerConfig:
    """The decision config of a DisaggregatedServing: its autoscaling spec, the engines' profile and
    the batching limits its engine arguments set (decode's, which bind the ITL frontier)."""
    spec = serving.spec
    args = [*spec.engine.extra_args, *spec.decode.extra_args]
    return AutoscalerConfig.from_spec(
        spec.autoscaling, perf, prefill_gpus=spec.prefill.gpus_per_replica,
        decode_gpus=spec.decode.gpus_per_replica,
        max_num_batched_tokens=engine_arg(args, "--max-num-batched-tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS),
        max_num_seqs=engine_arg(args, "--max-num-seqs", DEFAULT_MAX_NUM_SEQS),
        window_s=float(spec.autoscaling.prometheus.window_seconds))
