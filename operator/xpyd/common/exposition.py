"""What the proxy's and the operator's `/metrics` serve, through `prometheus_client`.

Each proxy and each operator owns a `CollectorRegistry` (prometheus_client's global default
registry is never used, so tests run several proxies in one process). A scrape is the registry in
the Prometheus text format 0.0.4 (`generate_latest`), served with prometheus_client's
`CONTENT_TYPE_PLAIN_0_0_4`: its `CONTENT_TYPE_LATEST` names the text format 1.0.0 (UTF-8 names),
which prometheus_client itself only claims when a scraper asks for it (`choose_encoder`).

Two things prometheus_client does differently from what these endpoints always served are undone
here rather than by its process-wide switches:

- counters and histograms get a `<name>_created` series each; `without_created` drops them
  (`disable_created_metrics()` would change every registry in the process);
- gauges computed at scrape time from live state are `ScrapeGauge` collectors yielding a fresh
  `GaugeMetricFamily`, so a series whose subject left (an upstream instance, a deleted
  DisaggregatedServing) is gone from the next scrape instead of lingering as a stale child.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Final

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: The content type of what `generate_latest` writes (text format 0.0.4).
CONTENT_TYPE: Final = CONTENT_TYPE_PLAIN_0_0_4

Labels = tuple[str, ...]
GaugeSample = tuple[Labels, float]


def without_created(families: Iterable[Metric]) -> Iterator[Metric]:
    """`families` (fresh from a metric's `collect()`) without their `_created` samples."""
    for family in families:
        family.samples = [sample for sample in family.samples if sample.name != family.name + "_created"]
        yield family


class ScrapeGauge(Collector):
    """A gauge read at scrape time from a callback returning (label values, value) samples."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 samples: Callable[[], Iterable[GaugeSample]]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.samples = samples

    def describe(self) -> Iterable[Metric]:
        """The family without samples (the registry checks names with it, without a callback)."""
        return [GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterable[Metric]:
        """The family with the callback's samples."""
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in self.samples():
            family.add_metric(labels, value)
        return [family]


def registry(collectors: Iterable[Collector]) -> CollectorRegistry:
    """A registry of its own holding `collectors`, exposed in this order (a clash of names raises)."""
    owned = CollectorRegistry()
    for collector in collectors:
        owned.register(collector)
    return owned


def response(metrics: CollectorRegistry) -> web.Response:
    """A `/metrics` answer: the registry in the text format."""
    return web.Response(body=generate_latest(metrics),
                        headers={"Content-Type": CONTENT_TYPE, "X-Content-Type-Options": "nosniff"})
