"""The operator's own series on its /metrics (beside the autoscaler's): what it asks of the API
server, what its caches hold and how much work waits."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from xpyd.controller.runtime import OperatorRuntime


class OperatorMetrics(Collector):
    """`xpyd_operator_*`, read at scrape time from the operator's runtime."""

    def __init__(self, runtime: OperatorRuntime) -> None:
        self.runtime = runtime

    def collect(self) -> Iterable[Metric]:
        requests = CounterMetricFamily(
            "xpyd_operator_api_requests", "Requests the operator sent to the Kubernetes API server, by verb "
            "(as apiserver_request_total counts them), resource and HTTP status (0: no answer).",
            labels=("verb", "resource", "code"))
        for (verb, resource, code), count in sorted(self.runtime.kube.request_counts().items()):
            requests.add_metric((verb, resource, str(code)), count)
        yield requests
        cached = GaugeMetricFamily("xpyd_operator_cached_objects", "Objects in the operator's watch-fed cache, "
                                   "by kind.", labels=("kind",))
        synced = GaugeMetricFamily("xpyd_operator_cache_synced", "1 when every reflector of the kind has listed "
                                   "(reads of it are served from memory), else 0.", labels=("kind",))
        if self.runtime.cache is not None:
            for (_, kind), reflectors in sorted(self.runtime.cache.reflectors.items()):
                cached.add_metric((kind,), sum(len(r) for r in reflectors))
                synced.add_metric((kind,), float(all(r.synced.is_set() for r in reflectors)))
        yield cached
        yield synced
        yield GaugeMetricFamily("xpyd_operator_leader", "1 while this replica reconciles and decides (it holds "
                                "the leader's Lease, or runs without leader election), 0 while it stands by.",
                                value=float(self.runtime.acting()))
        yield GaugeMetricFamily("xpyd_operator_workqueue_depth", "DisaggregatedServings waiting for a reconcile.",
                                value=len(self.runtime.queue))
