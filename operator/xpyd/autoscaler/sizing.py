"""The steady-state model the autoscaler sizes pools with (`docs/autoscaling.md`).

Prefill: a pool of `c` batching engines fed by a least-outstanding-tokens router behaves like an
M/G/c queue whose servers process prompt tokens at the engine's *saturated* rate: under load an
engine fills each step with up to `max_num_batched_tokens` tokens, so one prompt occupies the pool
for `S(L) = L · p(B) / B` (`B` = the token budget, `p` = the profile's prefill time; a prompt longer
than `B` is chunked and costs its own `p(L)`). Waiting follows Erlang C with the Allen-Cunneen tail
`P(W > t) ≈ C(c, a) · exp(-t · 2 (c/S̄ - λ) / (1 + cs2))`. A request's TTFT is that wait plus what
its own prompt costs once started: `p(L)` alone, the KV transfer and one decode step. The attainment
of the TTFT target is taken over the prompts that *can* meet it (whose TTFT on an idle pool is under
the target): a prompt too long for the target misses it whatever the pool size, and sizing for it
would only burn GPUs.

Decode: the largest batch `b*` whose ITL at context `ISL + OSL/2` stays under the TPOT target times
a margin, with that batch's KV within the headroom and under `max_num_seqs`; Little's law gives the
pool's concurrency `N = λ · OSL · ITL(b*)` and `D = ceil(N / b*)`.

Both take a capacity correction `k` (observed / modelled capacity, see `decide`): prefill time is
divided by it, decode ITL at a batch is divided by it.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from xpyd.autoscaler.observation import Quantiles
from xpyd.perf.model import PerfModel
from xpyd.perf.queueing import erlang_c

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""vLLM V1's default token budget of one engine step."""
DEFAULT_MAX_NUM_SEQS = 256
"""vLLM V1's default cap on running sequences."""
MIX_SAMPLES = 48
"""Prompt-length samples a `PromptMix` keeps (quantiles of the distribution)."""
_Z90 = statistics.NormalDist().inv_cdf(0.9)


@dataclass(frozen=True)
class PromptMix:
    """Prompt lengths as equally likely samples (tokens), whose mean is the observed mean ISL."""

    isl_tokens: tuple[float, ...]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.isl_tokens)

    @classmethod
    def from_quantiles(cls, isl_mean: float, quantiles: Quantiles | None = None, default_cs2: float = 1.0,
                       samples: int = MIX_SAMPLES) -> PromptMix:
        """A lognormal through the observed median and p90 (`histogram_quantile` of
        `vllm:request_prompt_tokens`), rescaled to the observed mean; without usable quantiles, a
        lognormal with squared coefficient of variation `default_cs2`."""
        if not isl_mean > 0:
            raise ValueError(f"mean prompt length must be positive, not {isl_mean}")
        sigma = math.sqrt(math.log1p(default_cs2))
        if quantiles is not None and quantiles.p50 > 0 and quantiles.p90 > quantiles.p50:
            sigma = math.log(quantiles.p90 / quantiles.p50) / _Z90
        normal = statistics.NormalDist()
        shape = [math.exp(sigma * normal.inv_cdf((i + 0.5) / samples)) for i in range(samples)]
        scale = isl_mean / statistics.fmean(shape)
        return cls(tuple(max(1.0, scale * x) for x in shape))

    @classmethod
    def from_samples(cls, values: Sequence[float], samples: int = MIX_SAMPLES) -> PromptMix:
        """Evenly spaced order statistics of measured prompt lengths (e.g. a trace window)."""
        if not values:
            raise ValueError("no prompt lengths")
        ordered = sorted(values)
        n = len(ordered)
        if n <= samples:
            return cls(tuple(float(v) for v in ordered))
        return cls(tuple(float(ordered[min(n - 1, int((i + 0.5) * n / samples))]) for i in range(samples)))


@dataclass(frozen=True)
class Burst:
    """Prompt work that queued together: the work ahead of a window's requests when they arrived
    (tokens at its p50/p90/p99: the queue-time quantiles times the pool's saturated rate then), the
    requests the window covered and the pool size it was seen at."""

    time_s: float
    requests: float
    replicas: int
    work_p50: float
    work_p90: float
    work_p99: float

    def share_waiting_over(self, tokens: float) -> float:
        """Share of the burst's requests with more than `tokens` of work ahead: the quantiles joined
        linearly from (p0, 0) and extended past p99 at the p90-p99 slope."""
        values = list(itertools.accumulate((0.0, self.work_p50, self.work_p90, self.work_p99), max))
        values.append(values[-1] + (values[-1] - values[-2]) / 9.0)
        percentiles = (0.0, 50.0, 90.0, 99.0, 100.0)
        for (p_low, low), (p_high, high) in itertools.pairwise(zip(percentiles, values, strict=True)):
            if tokens < high:
                return 1.0 - (p_low + (p_high - p_low) * (tokens - low) / (high - low)) / 100.0
        return 0.0


WeightedBurst = tuple[float, Burst]
"""A burst with the weight its requests count with (e.g. its age's decay)."""


@dataclass(frozen=True)
class PrefillSizing:
    """A prefill pool size and what the model predicts for it."""

    replicas: int
    utilisation: float            # offered load / replicas (saturated-rate service)
    attainment: float             # predicted share of feasible requests meeting the TTFT target
    feasible_share: float         # share of requests an idle pool serves within the target
    tokens_per_s_per_replica: float
    demand_tokens_per_s: float


@dataclass(frozen=True)
class DecodeSizing:
    """A decode pool size from the ITL/KV frontier."""

    replicas: int
    batch: int                    # b*: sequences per replica at the frontier
    itl_s: float                  # ITL at b* (corrected)
    tokens_per_s_per_replica: float
    in_flight: float              # λ · OSL · ITL(b*): sequences the pool holds
    limit: str                    # what bounds b*: "ITL", "KV" or "max_num_seqs"


@dataclass(frozen=True)
class PoolModel:
    """The profile plus the engine arguments and SLO shape that sizing needs."""

    perf: PerfModel
    ttft_target_s: float
    tpot_target_s: float
    quantile: float = 0.9             # the share of (feasible) requests that must meet each target
    itl_margin: float = 0.9           # decode ITL budget as a share of the TPOT target
    kv_headroom: float = 0.9          # share of the KV cache decode may fill
    max_utilisation: float = 0.75     # never plan prefill busier than this, whatever the tail says
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS

    # --- prefill -------------------------------------------------------------------------------

    def saturated_tokens_per_s(self, k: float = 1.0) -> float:
        """Prompt tokens/s one prefill replica delivers with a queue (full token budget per step)."""
        budget = self.max_num_batched_tokens
        return k * budget / self.perf.prefill_seconds(budget)

    def mix_tokens_per_s(self, mix: PromptMix, k: float = 1.0) -> float:
        """Prompt tokens/s one busy prefill replica delivers on this mix: the saturated rate for
        prompts within the token budget, each longer prompt at its own `p(L)` (attention over a long
        context costs more per token)."""
        return mix.mean / statistics.fmean(self.service_seconds(x, k) for x in mix.isl_tokens)

    def service_seconds(self, isl: float, k: float = 1.0) -> float:
        """How long one prompt occupies a busy replica (its share of batched steps)."""
        chunk = max(isl, float(self.max_num_batched_tokens))
        return isl * self.perf.prefill_seconds(round(chunk)) / chunk / k

    def fixed_seconds(self, isl: float, decode_itl_s: float, k: float = 1.0) -> float:
        """TTFT of a prompt on an idle prefill pool: its prefill, the KV transfer, one decode step."""
        tokens = max(1, round(isl))
        return self.perf.prefill_seconds(tokens) / k + self.perf.kv_transfer_seconds(tokens) + decode_itl_s

    def ttft_floor(self, mix: PromptMix, decode_itl_s: float, k: float = 1.0) -> float:
        """The TTFT quantile (`quantile`) of an idle pool: what no prefill size can beat."""
        fixed = sorted(self.fixed_seconds(x, decode_itl_s, k) for x in mix.isl_tokens)
        return fixed[min(len(fixed) - 1, math.ceil(self.quantile * len(fixed)) - 1)]

    def queue_budget_s(self, mix: PromptMix, decode_itl_s: float, k: float = 1.0) -> float:
        """How long the median feasible prompt may queue: the TTFT target less its idle-pool TTFT."""
        fixed = sorted(f for f in (self.fixed_seconds(x, decode_itl_s, k) for x in mix.isl_tokens)
                       if f <= self.ttft_target_s)
        if not fixed:
            return 0.0
        return self.ttft_target_s - fixed[len(fixed) // 2]

    def burst_replicas(self, bursts: Sequence[WeightedBurst], expected_requests: float, mix: PromptMix,
                       decode_itl_s: float, k: float = 1.0, max_replicas: int = 1024, rate: float = 0.0) -> int:
        """Fewest replicas at which the remembered bursts, were they to recur, would make at most the
        error budget (`1 - quantile`) of `expected_requests` wait beyond the queue budget.

        Each burst is the work-ahead distribution one window's requests saw (`Burst`), with the
        requests it covered (already weighted by the caller, e.g. for age); a burst spread over `c`
        replicas makes a request wait its work ahead / (`c` x the saturated rate), so a share
        `Burst.share_waiting_over(c x rate x budget)` of them misses. With `expected_requests` the
        requests the same span brings (e.g. the rate over the memory), this is the burst part of the
        SLO's error budget; steady queueing is `size_prefill`'s."""
        budget = self.queue_budget_s(mix, decode_itl_s, k)
        if budget <= 0 or not any(w > 0 and b.requests > 0 for w, b in bursts):
            return 1
        allowed = 1.0 - self.quantile
        replicas = 1
        while replicas < max_replicas and (
                self.burst_miss_share(bursts, expected_requests, replicas, mix, decode_itl_s, k)
                + 1.0 - self.prefill_attainment(replicas, rate, mix, decode_itl_s, k)) > allowed:
            replicas += 1
        return replicas

    def burst_miss_share(self, bursts: Sequence[WeightedBurst], expected_requests: float, replicas: int,
                         mix: PromptMix, decode_itl_s: float, k: float = 1.0) -> float:
        """Share of `expected_requests` that the remembered bursts would keep waiting past the queue
        budget on `replicas` (see `burst_replicas`)."""
        budget = self.queue_budget_s(mix, decode_itl_s, k)
        drained = replicas * self.saturated_tokens_per_s(k) * max(budget, 0.0)
        missed = sum(w * b.requests * b.share_waiting_over(drained) for w, b in bursts if w > 0 and b.requests > 0)
        if missed <= 0:
            return 0.0
        return missed / expected_requests if expected_requests > 0 else 1.0

    def _wait(self, replicas: int, rate: float, mix: PromptMix, k: float) -> tuple[float, float] | None:
        """(P(wait), the tail's decay per second) of the M/G/c queue, None when it is saturated:
        `P(W > t) = P(wait) · exp(-decay · t)` (Erlang C, Allen-Cunneen)."""
        service = [self.service_seconds(x, k) for x in mix.isl_tokens]
        mean_service = statistics.fmean(service)
        offered = rate * mean_service
        if replicas <= 0 or offered >= replicas:
            return None
        cs2 = statistics.pvariance(service) / mean_service**2
        return erlang_c(replicas, offered), 2.0 * (replicas / mean_service - rate) / (1.0 + cs2)

    def prefill_attainment(self, replicas: int, rate: float, mix: PromptMix, decode_itl_s: float,
                           k: float = 1.0) -> float:
        """Predicted share of feasible requests whose TTFT meets the target with `replicas`."""
        if rate <= 0:
            return 1.0
        wait = self._wait(replicas, rate, mix, k)
        if wait is None:
            return 0.0
        wait_probability, decay = wait
        slack = [self.ttft_target_s - self.fixed_seconds(x, decode_itl_s, k) for x in mix.isl_tokens]
        feasible = [s for s in slack if s >= 0]
        if not feasible:
            return 1.0
        return 1.0 - statistics.fmean(wait_probability * math.exp(-decay * s) for s in feasible)

    def ttft_quantile(self, replicas: int, rate: float, mix: PromptMix, decode_itl_s: float, k: float = 1.0) -> float:
        """The TTFT at `quantile` over every request (feasible or not) that the model predicts on
        `replicas`: the quantile of the M/G/c wait plus each prompt's idle-pool TTFT (inf when saturated)."""
        fixed = [self.fixed_seconds(x, decode_itl_s, k) for x in mix.isl_tokens]
        wait = self._wait(replicas, rate, mix, k) if rate > 0 else (0.0, 1.0)
        if wait is None:
            return math.inf
        wait_probability, decay = wait
        tail = 1.0 - self.quantile

        def exceeding(t: float) -> float:
            return statistics.fmean(1.0 if t < x else wait_probability * math.exp(-decay * (t - x)) for x in fixed)

        low = min(fixed)
        high = max(fixed) + (math.log(wait_probability / tail) / decay if wait_probability > tail else 0.0)
        for _ in range(60):  # bisection to well below a microsecond
            middle = (low + high) / 2
            low, high = (middle, high) if exceeding(middle) > tail else (low, middle)
        return high

    def size_prefill(self, rate: float, mix: PromptMix, decode_itl_s: float, k: float = 1.0,
                     max_replicas: int = 1024) -> PrefillSizing:
        """Fewest replicas whose predicted attainment meets `quantile` and utilisation stays under
        `max_utilisation` (`max_replicas` if none does)."""
        per_replica = self.mix_tokens_per_s(mix, k)
        demand = rate * mix.mean
        offered = rate * statistics.fmean(self.service_seconds(x, k) for x in mix.isl_tokens)
        feasible = statistics.fmean(
            1.0 if self.fixed_seconds(x, decode_itl_s, k) <= self.ttft_target_s else 0.0 for x in mix.isl_tokens)
        replicas = max(1, math.ceil(offered / self.max_utilisation - 1e-9))
        while True:
            attainment = self.prefill_attainment(replicas, rate, mix, decode_itl_s, k)
            if attainment >= self.quantile or replicas >= max_replicas:
                return PrefillSizing(replicas, offered / replicas, attainment, feasible, per_replica, demand)
            replicas += 1

    # --- decode --------------------------------------------------------------------------------

    def decode_frontier(self, context_tokens: float, k: float = 1.0) -> tuple[int, float, str]:
        """(b*, ITL at b*, what bounds b*) at this context with capacity correction `k`."""
        perf = self.perf
        context = max(context_tokens, 1.0)
        fits = min(perf.max_batch_for_kv(context, self.kv_headroom), self.max_num_seqs)
        best = perf.max_batch_for_itl(self.tpot_target_s * self.itl_margin * k, context, self.kv_headroom)
        batch = max(1, min(best, fits))
        limit = "ITL" if best < fits else "max_num_seqs" if fits == self.max_num_seqs else "KV"
        return batch, perf.itl_seconds(batch, context) / k, limit

    def size_decode(self, rate: float, isl: float, osl: float, k: float = 1.0) -> DecodeSizing:
        """Decode replicas for `rate` requests/s of `isl` prompt and `osl` output tokens."""
        batch, itl, limit = self.decode_frontier(isl + osl / 2.0, k)
        in_flight = max(rate, 0.0) * osl * itl
        replicas = max(1, math.ceil(in_flight / batch - 1e-9))
        return DecodeSizing(replicas, batch, itl, batch / itl, in_flight, limit)

    def decode_shortfall(self, replicas: int, sizing: DecodeSizing) -> float:
        """Share of the decode demand `replicas` cannot carry at the TPOT target (0 when they can)."""
        if sizing.in_flight <= 0:
            return 0.0
        return max(0.0, 1.0 - replicas * sizing.batch / sizing.in_flight)
