"""The proxy's Prometheus metrics, through `prometheus_client` (see `xpyd.common.exposition`).

`Counter` and `Histogram` are prometheus_client's, not registered anywhere by themselves: each
proxy registers its own in a `CollectorRegistry` of its own. They cache the child of each label
tuple, so recording costs a dict lookup and prometheus_client's own `inc` / `observe` (instead of
`labels(...)`, which converts and checks the values and takes a lock, on every call). `Gauge` is
the scrape-time gauge: the proxy's gauges (`proxy_gauges`) are computed from the live instance set
at scrape time, so an instance that left leaves no series behind.

What this costs over the hand-written exposition it replaced (docs/proxy.md has the runs):
recording one streamed request's metrics takes about 9-11 us instead of 2-2.5 us
(`benchmarks/metrics_bench.py`: prometheus_client takes a lock per value and finds a bucket by a
linear scan), under 1% of the 0.9-1.7 ms of CPU the proxy spends on a request, and
`benchmarks/proxy_bench.py` could not tell the two proxies apart. A scrape of a few hundred lines
takes about 5 ms instead of 1 ms of the event loop, once per scrape interval.

How prompt work bunches on arrival (`xpyd.common.bunching`; prefill is sized by it) is
`xpyd_proxy_arrival_prompt_tokens{window}`: the proxy adds each request's prompt to the aligned
slots of its arrival time (`ProxyMetrics.arrival`), and a slot's total is observed once per request
in it when the slot closes: at the first arrival past its end, or at the first scrape after it
(`ProxyMetrics.flush_arrivals`, which `/metrics` calls before rendering). The prompt tokens counted
are added as the 0.25 s slots close, so the counter and the histogram's `_count` cover the same
requests (the autoscaler divides one by the other). Slots are aligned to the wall clock as it was
when the proxy started, advanced by the monotonic clock (`wall_clock`): a wall clock stepped back
would otherwise pile later arrivals into a slot still open.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

import prometheus_client
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from xpyd.api.naming import Role
from xpyd.common import bunching
from xpyd.common.exposition import GaugeSample, Labels, without_created
from xpyd.common.exposition import ScrapeGauge as Gauge
from xpyd.proxy.kvhealth import EngineTransferFailures, PairHealth
from xpyd.proxy.pool import Instance, Pool

__all__ = ["LATENCY_BUCKETS", "Counter", "Gauge", "GaugeSample", "Histogram", "ProxyMetrics", "proxy_gauges"]

#: Seconds; vLLM's TTFT buckets with sub-millisecond ones in front (the proxy's own overhead).
LATENCY_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                          1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)

_WALL_AT_START = time.time() - time.monotonic()


def wall_clock() -> float:
    """Seconds since the epoch as the wall clock read when the proxy started, advanced by the
    monotonic clock: never steps back."""
    return _WALL_AT_START + time.monotonic()


M = TypeVar("M", prometheus_client.Counter, prometheus_client.Histogram)


class _Children(Collector, Generic[M]):
    """A labelled prometheus_client metric and its children by label tuple."""

    def __init__(self, metric: M) -> None:
        self.metric: M = metric
        self._children: dict[Labels, M] = {}

    def _child(self, labels: Labels) -> M:
        """The child of `labels`, made on first use (a hit is one dict lookup); an unlabelled
        metric is its own child."""
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self.metric.labels(*labels) if labels else self.metric
        return child

    def _sample(self, labels: Labels, suffix: str) -> float:
        child = self._children.get(labels)
        if child is None:
            return 0.0
        (family,) = child.collect()
        return next(sample.value for sample in family.samples if sample.name == family.name + suffix)

    def describe(self) -> Iterable[Metric]:
        """The metric's families without samples (the registry checks names with them)."""
        return self.metric.describe()

    def collect(self) -> Iterable[Metric]:
        """The metric's families, without `_created` series."""
        return without_created(self.metric.collect())


class Counter(_Children[prometheus_client.Counter]):
    """A monotonically increasing value per label tuple."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        super().__init__(prometheus_client.Counter(name, documentation, labelnames, registry=None))

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        """Add `amount` to the series of `labels`."""
        self._child(labels).inc(amount)

    def value(self, *labels: str) -> float:
        """The current value of a series (0 when never incremented)."""
        return self._sample(labels, "_total")


class Histogram(_Children[prometheus_client.Histogram]):
    """Observations counted into cumulative buckets per label tuple."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        super().__init__(prometheus_client.Histogram(name, documentation, labelnames, registry=None,
                                                     buckets=buckets))

    def observe(self, value: float, *labels: str) -> None:
        """Record one observation."""
        self._child(labels).observe(value)

    def count(self, *labels: str) -> int:
        """Observations recorded for `labels`."""
        return int(self._sample(labels, "_count"))


@dataclass
class ProxyMetrics:
    """The metrics `/metrics` exports."""

    requests: Counter = field(default_factory=lambda: Counter(
        "xpyd_proxy_requests_total", "Client requests by connector, endpoint and outcome.",
        ("connector", "endpoint", "outcome")))
    ttft: Histogram = field(default_factory=lambda: Histogram(
        "xpyd_proxy_time_to_first_byte_seconds", "Client-seen time to the answer's first byte (TTFT when "
        "streamed).", ("connector", "endpoint")))
    stream_ttft: Histogram = field(default_factory=lambda: Histogram(
        "xpyd_proxy_time_to_first_token_seconds", "Client-seen time to the first streamed chunk of streamed "
        "requests: their TTFT (the autoscaler reads it).", ("connector", "endpoint")))
    duration: Histogram = field(default_factory=lambda: Histogram(
        "xpyd_proxy_request_duration_seconds", "Client-seen request duration.", ("connector", "endpoint")))
    legs: Histogram = field(default_factory=lambda: Histogram(
        "xpyd_proxy_leg_duration_seconds", "Duration of upstream legs by role and result.", ("role", "result")))
    retries: Counter = field(default_factory=lambda: Counter(
        "xpyd_proxy_retries_total", "Legs sent again to another instance, by role.", ("role",)))
    fallbacks: Counter = field(default_factory=lambda: Counter(
        "xpyd_proxy_decode_only_fallbacks_total", "Requests served by decode alone because no prefill "
        "instance could (only with --decode-only-fallback).", ("reason",)))
    breaker_trips: Counter = field(default_factory=lambda: Counter(
        "xpyd_proxy_breaker_trips_total", "Circuit breakers opened, by role.", ("role",)))
    rejected: Counter = field(default_factory=lambda: Counter(
        "xpyd_proxy_rejected_total", "Requests refused before any upstream call, by HTTP status.", ("status",)))
    kv_handoff_failures: Counter = field(default_factory=lambda: Counter(
        "xpyd_proxy_kv_handoff_failures_total", "Decode legs the decode engine failed (HTTP 5xx, or no first "
        "byte in time) after their prefill succeeded, by prefill and decode upstream.", ("prefill", "decode")))
    arrival_tokens: Histogram = field(default_factory=lambda: Histogram(
        "xpyd_proxy_arrival_prompt_tokens", "Prompt tokens arriving at this proxy in the same aligned slot of "
        "`window` seconds as each request (its own included), observed once per request when the slot closes.",
        ("window",), buckets=bunching.BUCKETS))
    prompt_tokens: Counter = field(default_factory=lambda: Counter(
        "xpyd_proxy_prompt_tokens_total", "Prompt tokens (the proxy's estimate) of the requests the arrival "
        "histogram counts.", ()))
    #: The clock the arrival slots are aligned to (seconds); tests pass their own.
    clock: Callable[[], float] = wall_clock
    arrival_slots: bunching.ArrivalSlots = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.arrival_slots = bunching.ArrivalSlots(self._slot_closed, bunching.WINDOWS_S)

    def arrival(self, prompt_tokens: int) -> None:
        """A client request of `prompt_tokens` (the proxy's estimate) offered to the pool now."""
        self.arrival_slots.add(self.clock(), prompt_tokens)

    def flush_arrivals(self) -> None:
        """Observe the slots that ended with no arrival since (before a scrape renders the histogram)."""
        self.arrival_slots.flush(self.clock())

    def _slot_closed(self, window_s: float, tokens: float, requests: int) -> None:
        if window_s == bunching.WINDOWS_S[0]:
            self.prompt_tokens.inc(amount=tokens)
        label = bunching.window_label(window_s)
        for _ in range(requests):  # once per request in the slot (observe takes no weight)
            self.arrival_tokens.observe(tokens, label)


def proxy_gauges(pools: Mapping[Role, Pool], in_flight: Callable[[], int], draining: Callable[[], bool],
                 pair_health: PairHealth, engine_failures: EngineTransferFailures) -> list[Gauge]:
    """The proxy's scrape-time gauges: its client requests and draining, its upstream instances
    (per instance and per pool) and its KV-transfer health (`xpyd.proxy.kvhealth`)."""
    return [
        Gauge("xpyd_proxy_in_flight_requests", "Client requests in the proxy.", (),
              lambda: [((), float(in_flight()))]),
        Gauge("xpyd_proxy_upstream_in_flight", "Legs outstanding per upstream instance.", ("role", "upstream"),
              lambda: _upstream_in_flight(pools)),
        Gauge("xpyd_proxy_upstream_prompt_tokens", "Prompt tokens outstanding per prefill instance.",
              ("upstream",), lambda: _upstream_tokens(pools)),
        Gauge("xpyd_proxy_breaker_state", "Circuit breaker per upstream: 0 closed, 1 open, 2 half-open.",
              ("role", "upstream"), lambda: _breaker_states(pools)),
        Gauge("xpyd_proxy_upstream_healthy", "Last health probe per upstream: 1 answered 200, 0 otherwise.",
              ("role", "upstream"), lambda: _health_states(pools)),
        Gauge("xpyd_proxy_upstreams", "Upstream instances by role and state.", ("role", "state"),
              lambda: _pool_states(pools)),
        Gauge("xpyd_proxy_draining", "1 once the proxy was told to stop (readiness fails), else 0.", (),
              lambda: [((), 1.0 if draining() else 0.0)]),
        Gauge("xpyd_proxy_kv_pairs_failing", "Prefill/decode pairs whose KV hand-offs keep failing.", (),
              lambda: [((), float(len(pair_health.failing(time.monotonic()))))]),
        Gauge("xpyd_proxy_kv_engines_failing", "Engines whose own count of failed KV transfers "
              "(vllm:nixl_num_failed_transfers_total) rose within the last minute.", (),
              lambda: [((), float(len(engine_failures.failing(time.monotonic()))))]),
    ]


def _each(pools: Mapping[Role, Pool]) -> Iterable[Instance]:
    for pool in pools.values():
        yield from pool.instances.values()


def _upstream_in_flight(pools: Mapping[Role, Pool]) -> Iterable[GaugeSample]:
    for instance in _each(pools):
        yield (instance.role, instance.url), float(instance.outstanding_requests)


def _upstream_tokens(pools: Mapping[Role, Pool]) -> Iterable[GaugeSample]:
    for instance in pools["prefill"].instances.values():
        yield (instance.url,), float(instance.outstanding_tokens)


def _breaker_states(pools: Mapping[Role, Pool]) -> Iterable[GaugeSample]:
    now = time.monotonic()
    for instance in _each(pools):
        yield (instance.role, instance.url), float(instance.breaker.state(now))


def _health_states(pools: Mapping[Role, Pool]) -> Iterable[GaugeSample]:
    for instance in _each(pools):
        yield (instance.role, instance.url), 1.0 if instance.healthy else 0.0


def _pool_states(pools: Mapping[Role, Pool]) -> Iterable[GaugeSample]:
    for role, pool in pools.items():
        for state, count in pool.counts().items():
            yield (role, state), float(count)
