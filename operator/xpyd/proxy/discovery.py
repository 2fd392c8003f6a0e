"""Where the engines are: fixed URLs, or the pool's Pods in Kubernetes.

Kubernetes: one thread per role (an `xpyd.kube.cache.Reflector`, the operator's own) LISTs the
Pods matching the role's label selector in the proxy's namespace, then WATCHes them from the list's
resourceVersion (streaming `?watch=1`, one JSON event per line), and hands every change to the
event loop. A watch sees a pod turn Ready or NotReady, or get its deletionTimestamp, within milliseconds,
where polling every second or two would leave a new pod unused and keep sending new requests to a
terminating pod for that long, and cost the API server a LIST per proxy replica each time. A watch
that ends normally (its timeoutSeconds) is resumed from the last resourceVersion; one that fails
(410 Gone, a dropped connection, a refused verb) is followed by a fresh LIST after a short pause, so
the thread degrades to polling at that pace when watching is impossible.

Pods, not EndpointSlices: a pod shows readiness and termination directly, and EndpointSlices
refuse the loopback addresses of the local e2e cluster.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Final

from xpyd.api.models import ENGINE_SHUTDOWN_MARGIN_SECONDS
from xpyd.api.naming import KV_COMPAT_LABEL
from xpyd.common.jsontypes import JSON
from xpyd.common.timefmt import parse_rfc3339
from xpyd.kube import Kube
from xpyd.kube.cache import Reflector, without_managed_fields
from xpyd.kube.pods import pod_ready
from xpyd.proxy.pool import Endpoint
from xpyd.proxy.protocol import host_port

#: Server-side end of one watch request; the thread then re-watches from the last resourceVersion.
WATCH_SECONDS: Final = 240


def pod_endpoints(pods: Iterable[JSON], engine_port: int) -> list[Endpoint]:
    """The engine URL of every pod that has an IP, ready or not (a pod that is not ready keeps its
    outstanding requests and gets no new ones), with its readiness, its KV compatibility hash (the
    `xpyd.io/kv-compat` label) and, for a terminating pod, when its drain reaches its timeout: the
    engines' shutdown margin before its deletionTimestamp."""
    endpoints = []
    for pod in pods:
        ip = pod.get("status", {}).get("podIP")
        if ip:
            metadata = pod.get("metadata", {})
            deletion = metadata.get("deletionTimestamp")
            deadline = parse_rfc3339(deletion)
            endpoints.append(Endpoint(
                url=f"http://{host_port(ip, engine_port)}", ready=pod_ready(pod), checked=True,
                terminating=bool(deletion), compat=(metadata.get("labels") or {}).get(KV_COMPAT_LABEL),
                name=metadata.get("name"),
                drain_timeout_at=None if deadline is None else deadline - ENGINE_SHUTDOWN_MARGIN_SECONDS))
    return endpoints


def static_endpoints(urls: Iterable[str]) -> list[Endpoint]:
    """Fixed engine URLs (without a trailing slash), always listed and ready."""
    return [Endpoint(url=url.rstrip("/")) for url in urls]


class PodWatcher:
    """Follows the Pods of one role (a `Reflector` of its own) and calls `publish` with the
    endpoints after each change (from the reflector's thread: `publish` must be thread-safe)."""

    def __init__(self, kube: Kube, namespace: str, selector: str, engine_port: int,
                 publish: Callable[[list[Endpoint]], None]) -> None:
        self.namespace = namespace
        self.engine_port = engine_port
        self.publish = publish
        self.reflector = Reflector(kube, "v1", "Pod", namespace, selector, transform=without_managed_fields,
                                   on_change=self._changed, watch_seconds=WATCH_SECONDS)

    def start(self) -> threading.Thread:
        """Run in a daemon thread (a blocked watch read never delays the process's exit)."""
        return self.reflector.start()

    def stop(self) -> None:
        """End the thread soon: interrupts a watch blocked in a read."""
        self.reflector.stop()

    def _changed(self, old: JSON | None, new: JSON | None) -> None:
        self.publish(pod_endpoints(self.reflector.select(None), self.engine_port))  # its one namespace
