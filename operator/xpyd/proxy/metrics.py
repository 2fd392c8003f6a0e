"""The proxy's Prometheus metrics, in the text exposition format (version 0.0.4).

A small self-contained implementation: prometheus_client is not a dependency of the project, and
the proxy needs only counters, histograms and gauges read at scrape time. Children are cached per
label tuple, so recording costs a dict lookup and an addition. Per-upstream gauges are computed
from the live instance set at scrape time, so an instance that left leaves no series behind.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

#: Seconds; vLLM's TTFT buckets with sub-millisecond ones in front (the proxy's own overhead).
LATENCY_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                          1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)

Labels = tuple[str, ...]
GaugeSample = tuple[Labels, float]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{name}="{_escape(value)}"' for name, value in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Counter:
    """A monotonically increasing value per label tuple."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.values: dict[Labels, float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        """Add `amount` to the series of `labels`."""
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        """The current value of a series (0 when never incremented)."""
        return self.values.get(labels, 0.0)

    def render(self) -> Iterable[str]:
        """Exposition lines."""
        yield f"# HELP {self.name} {self.documentation}"
        yield f"# TYPE {self.name} counter"
        for labels, value in self.values.items():
            yield f"{self.name}{_labels(self.labelnames, labels)} {_number(value)}"


class Histogram:
    """Observations counted into cumulative buckets per label tuple."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.buckets = tuple(buckets)
        self.series: dict[Labels, tuple[list[int], list[float]]] = {}

    def observe(self, value: float, *labels: str) -> None:
        """Record one observation."""
        series = self.series.get(labels)
        if series is None:
            series = self.series[labels] = ([0] * (len(self.buckets) + 1), [0.0])
        series[0][bisect.bisect_left(self.buckets, value)] += 1
        series[1][0] += value

    def count(self, *labels: str) -> int:
        """Observations recorded for `labels`."""
        series = self.series.get(labels)
        return sum(series[0]) if series else 0

    def render(self) -> Iterable[str]:
        """Exposition lines."""
        yield f"# HELP {self.name} {self.documentation}"
        yield f"# TYPE {self.name} histogram"
        for labels, (counts, total) in self.series.items():
            cumulative = 0
            for bound, count in zip((*self.buckets, math.inf), counts, strict=True):
                cumulative += count
                le = 'le="' + _number(bound) + '"'
                yield f"{self.name}_bucket{_labels(self.labelnames, labels, le)} {cumulative}"
            yield f"{self.name}_sum{_labels(self.labelnames, labels)} {_number(total[0])}"
            yield f"{self.name}_count{_labels(self.labelnames, labels)} {cumulative}"


class Gauge:
    """A value read at scrape time from a callback returning (labels, value) samples."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 collect: Callable[[], Iterable[GaugeSample]]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.collect = collect

    def render(self) -> Iterable[str]:
        """Exposition lines."""
        yield f"# HELP {self.name} {self.documentation}"
        yield f"# TYPE {self.name} gauge"
        for labels, value in self.collect():
            yield f"{self.name}{_labels(self.labelnames, labels)} {_number(value)}"


Metric = Counter | Histogram | Gauge


def exposition(metrics: Iterable[Metric]) -> str:
    """The text format of every metric."""
    return "\n".join(line for metric in metrics for line in metric.render()) + "\n"


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
