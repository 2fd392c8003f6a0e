"""`dynamo-sla`: a re-implementation of NVIDIA Dynamo's SLA (throughput-based) planner, for comparison.

Read from ai-dynamo/dynamo `components/src/dynamo/planner/utils/` (`planner_core.py`,
`prefill_planner.py`, `decode_planner.py`, `disagg_planner.py`, `perf_interpolation.py`,
`load_predictor.py`) and `planner/defaults.py`. What it does, and how each step maps here:

- Every `adjustment_interval` (default 180 s; the first one after the planner starts) it reads the
  frontend's metrics averaged over that interval: request count, mean ISL and OSL, mean TTFT, mean
  ITL and mean request duration. Here: the non-overlapping 60 s windows of the observations inside
  the last 180 s, weighted by their request (or token) counts. It skips the adjustment when a mean is
  missing (no traffic).
- Predictors: `load_predictor` defaults to `arima` (pmdarima's `auto_arima`), which returns the
  last value until it has 5 points and for constant data. `ArimaLikePredictor` does the same and then
  picks, by AIC, among small ARIMA models fitted by least squares ((0,1,0), (1,0,0) with mean,
  (1,1,0) with drift): an approximation of auto-ARIMA's order search, not pmdarima itself.
- Correction factors: prefill `p_correction = TTFT_avg / interpolate_ttft(ISL)` (the profile's
  prefill time), applied as `min(1, p_correction)` to the prefill demand; decode
  `d_correction = ITL_avg / interpolate_itl(concurrency, ISL + OSL/2)` with concurrency =
  `num_req / num_d · request_duration / interval`, applied as `ITL target / d_correction`.
- Replicas: `num_P = ceil(req · ISL / interval · min(1, p_corr) / prefill_thpt_per_gpu(ISL) /
  gpus_per_P)` with the profile's single-prompt throughput at ISL (`isl / ttft`, the profile's
  `prefill_tokens_per_s_per_gpu` column); `num_D = ceil(req · OSL / interval /
  decode_thpt_per_gpu(corrected ITL, ctx = ISL + OSL/2) / gpus_per_D)` with the best throughput
  whose ITL meets the target (`PerfModel.max_batch_for_itl`, no margin or KV headroom). At least
  `min_endpoint` (1) each; the GPU budget (`max_gpu_budget`, default 8) is not applied here so that
  every policy runs without one; then the sizes are applied as they are (no stabilisation).
- `margin` (not Dynamo's; the evaluation's knob for this policy's frontier): both roles are sized
  for `(1 + margin)` times the predicted request count. The default 0 is Dynamo's planner as it is.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from xpyd.autoscaler.observation import Desired, Observation
from xpyd.perf.model import PerfModel

ADJUSTMENT_INTERVAL_S = 180.0
MIN_ENDPOINT = 1
ARIMA_MIN_POINTS = 5


def _least_squares(xs: list[list[float]], ys: list[float]) -> tuple[list[float], float]:
    """Coefficients and residual variance of ys ~ xs (normal equations; 1 or 2 regressors)."""
    k = len(xs[0])
    ata = [[sum(row[i] * row[j] for row in xs) for j in range(k)] for i in range(k)]
    aty = [sum(row[i] * y for row, y in zip(xs, ys, strict=True)) for i in range(k)]
    if k == 1:
        coefficients = [aty[0] / ata[0][0]] if ata[0][0] else [0.0]
    else:
        det = ata[0][0] * ata[1][1] - ata[0][1] * ata[1][0]
        if abs(det) < 1e-12:
            coefficients = [sum(ys) / len(ys), 0.0] if xs[0][0] == 1.0 else [0.0, 0.0]
        else:
            coefficients = [(aty[0] * ata[1][1] - aty[1] * ata[0][1]) / det,
                            (ata[0][0] * aty[1] - ata[1][0] * aty[0]) / det]
    residuals = [y - sum(c * x for c, x in zip(coefficients, row, strict=True)) for row, y in zip(xs, ys, strict=True)]
    return coefficients, max(sum(r * r for r in residuals) / len(residuals), 1e-12)


@dataclass
class ArimaLikePredictor:
    """Dynamo's default load predictor, approximated: last value until `ARIMA_MIN_POINTS` points
    (and for constant data), then the AIC-best of a few small ARIMA models, one step ahead."""

    values: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        value = 0.0 if math.isnan(value) else value
        if value == 0.0 and not any(self.values):   # leading idle period skipped, as Dynamo does
            return
        self.values.append(value)

    def predict(self) -> float:
        values = self.values
        if not values:
            return 0.0
        if len(values) < ARIMA_MIN_POINTS or len(set(values)) == 1:
            return values[-1]
        candidates: list[tuple[float, float]] = []   # (AIC, forecast)
        diffs = [b - a for a, b in itertools.pairwise(values)]
        n = len(diffs)
        # (0,1,0): random walk.
        variance = max(sum(d * d for d in diffs) / n, 1e-12)
        candidates.append((n * math.log(variance), values[-1]))
        # (1,0,0) with mean: x_t = c + phi x_{t-1}.
        (c, phi), variance = _least_squares([[1.0, x] for x in values[:-1]], values[1:])
        candidates.append((n * math.log(variance) + 4, c + phi * values[-1]))
        # (1,1,0) with drift: d_t = c + phi d_{t-1}.
        if len(diffs) >= 3:
            (c, phi), variance = _least_squares([[1.0, d] for d in diffs[:-1]], diffs[1:])
            candidates.append(((n - 1) * math.log(variance) + 4, values[-1] + c + phi * diffs[-1]))
        return max(0.0, min(candidates)[1])


@dataclass
class DynamoSlaPolicy:
    """Dynamo's throughput-based SLA planner in disaggregated mode (see the module docstring)."""

    perf: PerfModel
    ttft_target_s: float
    itl_target_s: float
    initial: Desired
    adjustment_interval_s: float = ADJUSTMENT_INTERVAL_S
    prefill_gpus: int = 1
    decode_gpus: int = 1
    correction: bool = True
    margin: float = 0.0
    desired: Desired = field(init=False)
    next_adjustment_s: float = field(init=False)
    p_correction: float = field(default=1.0, init=False)
    d_correction: float = field(default=1.0, init=False)
    history: list[Observation] = field(default_factory=list, init=False)
    num_req: ArimaLikePredictor = field(default_factory=ArimaLikePredictor, init=False)
    isl: ArimaLikePredictor = field(default_factory=ArimaLikePredictor, init=False)
    osl: ArimaLikePredictor = field(default_factory=ArimaLikePredictor, init=False)

    def __post_init__(self) -> None:
        if not self.margin > -1.0:
            raise ValueError(f"the margin must be above -1 (sizing for a positive load), not {self.margin:g}")
        self.desired = self.initial
        self.next_adjustment_s = self.adjustment_interval_s

    def desired_sizes(self, observation: Observation) -> Desired:
        """Hold the last sizes between adjustments; at each adjustment, re-plan from the interval's means."""
        self.history.append(observation)
        now = observation.time_s
        if now + 1e-9 < self.next_adjustment_s:
            return self.desired
        self.next_adjustment_s = now + self.adjustment_interval_s
        metrics = self._interval_metrics(now)
        self.history = [o for o in self.history if o.time_s > now - self.adjustment_interval_s]
        if metrics is None:
            return self.desired
        num_req, isl, osl, ttft, itl, duration = metrics
        for predictor, value in ((self.num_req, num_req), (self.isl, isl), (self.osl, osl)):
            predictor.add(value)
        if any(math.isnan(v) for v in (ttft, itl, isl, osl)):
            return self.desired
        num_d_workers = max(observation.decode.ready, 0)
        if self.correction:
            self.p_correction = ttft / self.perf.prefill_seconds(max(1, round(isl)))
            if num_d_workers:
                concurrency = num_req / num_d_workers * duration / self.adjustment_interval_s
                expected_itl = self.perf.itl_seconds(max(1, round(concurrency)), isl + osl / 2)
                self.d_correction = itl / expected_itl
        next_req, next_isl, next_osl = self.num_req.predict(), self.isl.predict(), self.osl.predict()
        next_req *= 1.0 + self.margin
        if not (next_isl > 0 and next_osl > 0):
            return self.desired
        self.desired = Desired(self._num_prefill(next_req, next_isl), self._num_decode(next_req, next_isl, next_osl))
        return self.desired

    def _num_prefill(self, num_req: float, isl: float) -> int:
        demand = num_req * isl / self.adjustment_interval_s * min(1.0, self.p_correction)
        per_gpu = self.perf.prefill_tokens_per_second(max(1, round(isl)))
        return max(MIN_ENDPOINT, math.ceil(demand / per_gpu / self.prefill_gpus))

    def _num_decode(self, num_req: float, isl: float, osl: float) -> int:
        itl = self.itl_target_s / self.d_correction if self.d_correction > 0 else self.itl_target_s
        context = isl + osl / 2
        batch = self.perf.max_batch_for_itl(itl, context)
        if batch < 1:
            return MIN_ENDPOINT
        per_gpu = self.perf.decode_tokens_per_second(batch, context)
        demand = num_req * osl / self.adjustment_interval_s
        return max(MIN_ENDPOINT, math.ceil(demand / per_gpu / self.decode_gpus))

    def _interval_metrics(self, now: float) -> tuple[float, float, float, float, float, float] | None:
        """Request count, ISL, OSL, TTFT, ITL, request duration over the last interval, from the
        non-overlapping observation windows inside it (newest first)."""
        picked: list[Observation] = []
        edge = now
        for observation in reversed(self.history):
            start = observation.time_s - observation.window_s
            if observation.time_s <= edge + 1e-9 and start >= now - self.adjustment_interval_s - 1e-9:
                picked.append(observation)
                edge = start
        span = sum(o.window_s for o in picked)
        if not picked or span <= 0:
            return None
        counts = [o.request_rate * o.window_s for o in picked]
        total = sum(counts)
        if total <= 0:
            return 0.0, math.nan, math.nan, math.nan, math.nan, math.nan

        def mean(values: list[float], weights: list[float]) -> float:
            pairs = [(v, w) for v, w in zip(values, weights, strict=True) if math.isfinite(v) and w > 0]
            weight = sum(w for _, w in pairs)
            return sum(v * w for v, w in pairs) / weight if weight > 0 else math.nan

        isl = mean([o.isl_mean for o in picked], counts)
        osl = mean([o.osl_mean for o in picked], counts)
        ttft = mean([o.ttft_seconds.mean for o in picked], counts)
        tokens = [o.decode.generation_tokens_per_s * o.window_s for o in picked]
        itl = mean([o.decode.inter_token_latency_seconds.mean for o in picked], tokens)
        tpot = mean([o.tpot_seconds.mean for o in picked], counts)
        duration = ttft + max(osl - 1.0, 0.0) * tpot if math.isfinite(tpot) else ttft
        return total * self.adjustment_interval_s / span, isl, osl, ttft, itl, duration
