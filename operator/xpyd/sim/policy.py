"""The seam between the cluster simulator and an autoscaling policy.

Every `interval` seconds of simulated time the simulator builds an `Observation` from what an
autoscaler would read from Prometheus (the engines' `vllm:*` series aggregated per role over a
window, plus the proxy's client-side view) and from the replica counts, calls
`policy.decide(observation)` and scales each role to the returned `Desired` sizes. `decide` should
be pure in the observation (keeping its own smoothing state is fine), so it can be table-tested and
run unchanged in the operator.

Quantities follow Prometheus' shapes: rates are per second over the window (`rate()`), latency
quantiles are `histogram_quantile()` over the window's bucket increments (NaN without samples, as
Prometheus returns), gauges are the latest value summed (counts) or averaged (KV usage) over the
role's scraped engines.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from xpyd.sim.core import EngineConfig, EnginePerf
from xpyd.sim.traces import TraceRequest


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
    kv_cache_usage_perc: float = 0.0      # mean of vllm:kv_cache_usage_perc (0-1)
    kv_cache_usage_perc_max: float = 0.0  # max of vllm:kv_cache_usage_perc
    time_to_first_token_seconds: Quantiles = field(default_factory=Quantiles)  # vllm:time_to_first_token_seconds
    inter_token_latency_seconds: Quantiles = field(default_factory=Quantiles)  # vllm:inter_token_latency_seconds
    request_queue_time_seconds: Quantiles = field(default_factory=Quantiles)   # vllm:request_queue_time_seconds
    prompt_tokens_per_s: float = 0.0      # rate(vllm:prompt_tokens_total)
    generation_tokens_per_s: float = 0.0  # rate(vllm:generation_tokens_total)
    requests_per_s: float = 0.0           # rate(vllm:request_success_total)


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


@dataclass(frozen=True)
class Desired:
    """Replica counts a policy wants (the simulator keeps at least one of each)."""

    prefill: int
    decode: int


@dataclass(frozen=True)
class Slo:
    """Latency targets: both must hold for a request to count as good."""

    ttft_s: float = 0.5
    tpot_s: float = 0.05


@dataclass(frozen=True)
class PolicyContext:
    """What a policy is built from: the starting sizes, the targets, the engines' performance model.

    `trace` (the requests to be replayed) and `engine` (the engines' arguments) are given by the
    simulator for the policies that are baselines by hindsight (`static-peak`, `static-mean`,
    `oracle`); an autoscaler proper must not read them.
    """

    initial: Desired
    slo: Slo
    perf: EnginePerf
    interval_s: float
    startup_delay_s: float
    trace: Sequence[TraceRequest] = ()
    engine: EngineConfig | None = None


class Policy(Protocol):
    """An autoscaling policy: desired pool sizes from an observation."""

    def decide(self, observation: Observation) -> Desired:
        """The replica counts wanted now."""
        ...


@dataclass(frozen=True)
class StaticPolicy:
    """Keeps the given sizes whatever happens: the baseline."""

    desired: Desired

    def decide(self, observation: Observation) -> Desired:
        """The fixed sizes."""
        return self.desired


PolicyFactory = Callable[[PolicyContext], Policy]


class _Registry(Mapping[str, PolicyFactory]):
    """The built-in policies plus the autoscaler's (`xpyd.autoscaler.policies.POLICIES`), merged on
    first use: the autoscaler imports this module, so importing it here at import time would be a cycle."""

    def __init__(self, builtin: Mapping[str, PolicyFactory]) -> None:
        self._builtin = builtin
        self._all: Mapping[str, PolicyFactory] | None = None

    def _load(self) -> Mapping[str, PolicyFactory]:
        if self._all is None:
            from xpyd.autoscaler.policies import POLICIES as autoscaler_policies

            self._all = MappingProxyType({**self._builtin, **autoscaler_policies})
        return self._all

    def __getitem__(self, name: str) -> PolicyFactory:
        return self._load()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


POLICIES: Mapping[str, PolicyFactory] = _Registry({
    "static": lambda context: StaticPolicy(context.initial),
})


def build_policy(name: str, context: PolicyContext) -> Policy:
    """The policy called `name` (a key of POLICIES). Raises ValueError for an unknown name."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})")
    return factory(context)
