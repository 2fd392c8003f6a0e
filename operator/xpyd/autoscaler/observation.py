"""What the autoscaler decides from: an `Observation` of a pool (the engines' `vllm:*` series
aggregated per role over a window, the proxy's client-side view, the replica counts from the
Kubernetes API), the SLO, and the sizes it returns (`Desired`).

The operator builds observations from Prometheus (`collect`), the simulator from its own engines
(`xpyd.sim.simulator`); `decide()` cannot tell them apart, which is what makes the simulator's
figures those of the operator.

Quantities follow Prometheus' shapes: rates are per second over the window (`rate()`), latency
quantiles are `histogram_quantile()` over the window's bucket increments (NaN without samples, as
Prometheus returns), gauges are the latest value summed (counts) or averaged (KV usage) over the
role's scraped engines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Quantiles:
    """p50/p90/p99 and mean of a histogram over the window: a latency in seconds, or a token count
    (NaN when the window has no samples). The mean is `rate(_sum) / rate(_count)`."""

    p50: float = math.nan
    p90: float = math.nan
    p99: float = math.nan
    mean: float = math.nan


@dataclass(frozen=True)
class RoleObservation:
    """One role's pool (prefill or decode) as Prometheus and the Kubernetes API show it."""

    replicas: int = 0                 # desired size in force: ready + starting (not draining)
    ready: int = 0                    # serving and in the proxy's routing
    starting: int = 0                 # started, loading the model: costs GPUs, serves nothing yet
    pending: int = 0                  # wanted but not placed (no free GPU); the simulator has no GPU limit: 0
    draining: int = 0                 # scaled away, finishing their requests
    num_requests_running: float = 0.0     # sum of vllm:num_requests_running over the role's engines
    num_requests_waiting: float = 0.0     # sum of vllm:num_requests_waiting
    num_requests_waiting_max: float = 0.0  # max of vllm:num_requests_waiting (the fullest engine's queue)
    kv_cache_usage_perc: float = 0.0      # mean of vllm:kv_cache_usage_perc (0-1)
    kv_cache_usage_perc_max: float = 0.0  # max of vllm:kv_cache_usage_perc
    time_to_first_token_seconds: Quantiles = field(default_factory=Quantiles)  # vllm:time_to_first_token_seconds
    inter_token_latency_seconds: Quantiles = field(default_factory=Quantiles)  # vllm:inter_token_latency_seconds
    request_queue_time_seconds: Quantiles = field(default_factory=Quantiles)   # vllm:request_queue_time_seconds
    prompt_tokens_per_s: float = 0.0      # rate(vllm:prompt_tokens_total)
    generation_tokens_per_s: float = 0.0  # rate(vllm:generation_tokens_total)
    requests_per_s: float = 0.0           # rate(vllm:request_success_total{finished_reason=~"stop|length|repetition"})
    # rate(vllm:prefix_cache_hits_total) / rate(vllm:prefix_cache_queries_total): the share of prompt
    # tokens the engines found in their own prefix caches (0 when nothing was looked up)
    prefix_cache_hit_rate: float = 0.0


def hit_rate(hits: float, queries: float) -> float:
    """Prefix-cache hits over queries (counts or rates of vLLM's counters), within [0, 1]; 0 without
    queries or with either unknown."""
    if not (queries > 0 and math.isfinite(hits) and math.isfinite(queries)):
        return 0.0
    return min(max(hits / queries, 0.0), 1.0)


@dataclass(frozen=True)
class Observation:
    """What a policy sees at `time_s`: the cluster-wide load and latencies, and each role's pool."""

    time_s: float
    window_s: float
    request_rate: float = 0.0         # requests/s arriving at the proxy
    isl_mean: float = math.nan        # mean prompt tokens: vllm:request_prompt_tokens sum/count on prefill
    osl_mean: float = math.nan        # mean output tokens: vllm:request_generation_tokens sum/count on decode
    isl_quantiles: Quantiles = field(default_factory=Quantiles)  # vllm:request_prompt_tokens on prefill (tokens)
    ttft_seconds: Quantiles = field(default_factory=Quantiles)   # client-side TTFT at the proxy
    tpot_seconds: Quantiles = field(default_factory=Quantiles)   # client-side TPOT at the proxy
    prefill: RoleObservation = field(default_factory=RoleObservation)
    decode: RoleObservation = field(default_factory=RoleObservation)
    # Held in the proxies' waiting rooms for a ready prefill and decode pair (a pool at zero, starting):
    # from the proxies' pods at once (their xpyd.io/RequestsWaiting condition), not from Prometheus.
    held_requests: float = 0.0
    held_prompt_tokens: float = 0.0     # their prompt tokens, as the proxies estimate them
    # The client TTFT and TPOT histograms over the window, as (le, cumulative rate or count) pairs with
    # the last le +Inf (empty when unknown): the share of requests within each SLO (`attainment`).
    ttft_buckets: tuple[tuple[float, float], ...] = ()
    tpot_buckets: tuple[tuple[float, float], ...] = ()
    # How prompt work bunched on arrival (`autoscaler.arrivals`): per slot length (seconds), the prompt
    # tokens arriving in each request's slot, over the window's requests, in the engines' tokens
    # across all proxies (empty when unknown).
    arrival_prompt_tokens: tuple[tuple[float, Quantiles], ...] = ()


@dataclass(frozen=True)
class Desired:
    """Replica counts a policy wants (the simulator keeps at least its `min_replicas` of each)."""

    prefill: int
    decode: int


@dataclass(frozen=True)
class Slo:
    """Latency targets: both must hold for a request to count as good."""

    ttft_s: float = 0.5
    tpot_s: float = 0.05
