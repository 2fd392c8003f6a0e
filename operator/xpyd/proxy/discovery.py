"""Where the engines are: fixed URLs, or the pool's Pods in Kubernetes.

Kubernetes: one thread per role LISTs the Pods matching the role's label selector in the proxy's
namespace, then WATCHes them from the list's resourceVersion through the same ApiClient as
`xpyd.kube` (streaming `?watch=1`, one JSON event per line), and hands every change to the event
loop. A watch sees a pod turn Ready or NotReady, or get its deletionTimestamp, within milliseconds,
where polling every second or two would leave a new pod unused and keep sending new requests to a
terminating pod for that long, and cost the API server a LIST per proxy replica each time. A watch
that ends normally (its timeoutSeconds) is resumed from the last resourceVersion; one that fails
(410 Gone, a dropped connection, a refused verb) is followed by a fresh LIST after a short pause, so
the thread degrades to polling at that pace when watching is impossible.

Pods, not EndpointSlices: a pod shows readiness and termination directly, and EndpointSlices
refuse the loopback addresses of the local e2e cluster.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

from xpyd.api.models import ENGINE_SHUTDOWN_MARGIN_SECONDS
from xpyd.common.jsontypes import JSON
from xpyd.common.timefmt import parse_rfc3339
from xpyd.kube import Kube, KubeError, resource_path
from xpyd.proxy.pool import Endpoint
from xpyd.proxy.protocol import host_port

log = logging.getLogger(__name__)

#: Server-side end of one watch request; the thread then re-watches from the last resourceVersion.
WATCH_SECONDS: Final = 240
#: Pause before a LIST after a failed or expired watch.
RELIST_PAUSE_SECONDS: Final = 1.0
CONNECT_TIMEOUT_SECONDS: Final = 10.0


def pod_ready(pod: JSON) -> bool:
    """The Pod's condition Ready=True (a terminating pod keeps it while its probes pass)."""
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_endpoints(pods: Iterable[JSON], engine_port: int) -> list[Endpoint]:
    """The engine URL of every pod that has an IP, ready or not (a pod that is not ready keeps its
    outstanding requests and gets no new ones), with its readiness and, for a terminating pod, when
    its drain reaches its timeout: the engines' shutdown margin before its deletionTimestamp."""
    endpoints = []
    for pod in pods:
        ip = pod.get("status", {}).get("podIP")
        if ip:
            deletion = pod.get("metadata", {}).get("deletionTimestamp")
            deadline = parse_rfc3339(deletion)
            endpoints.append(Endpoint(
                url=f"http://{host_port(ip, engine_port)}", ready=pod_ready(pod), checked=True,
                terminating=bool(deletion),
                drain_timeout_at=None if deadline is None else deadline - ENGINE_SHUTDOWN_MARGIN_SECONDS))
    return endpoints


def static_endpoints(urls: Iterable[str]) -> list[Endpoint]:
    """Fixed engine URLs (without a trailing slash), always listed and ready."""
    return [Endpoint(url=url.rstrip("/")) for url in urls]


def _equality_selector(selector: str) -> dict[str, str] | None:
    """`a=b,c=d` as a dict; None for set-based selectors (then only the server filters)."""
    result = {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, sep, value = term.partition("=")
        if not sep or any(c in key for c in "!<> ") or value.startswith("="):
            if term.count("==") == 1:
                key, value = term.split("==")
            else:
                return None
        result[key.strip()] = value.strip()
    return result


class PodWatcher:
    """Follows the Pods of one role and calls `publish` with the endpoints after each change
    (from its own thread: `publish` must be thread-safe)."""

    def __init__(self, kube: Kube, namespace: str, selector: str, engine_port: int,
                 publish: Callable[[list[Endpoint]], None]) -> None:
        self.kube = kube
        self.namespace = namespace
        self.selector = selector
        self.engine_port = engine_port
        self.publish = publish
        self.stopping = threading.Event()
        self._labels = _equality_selector(selector)
        self._pods: dict[str, JSON] = {}
        self._response: Any = None

    def start(self) -> threading.Thread:
        """Run in a daemon thread (a blocked watch read never delays the process's exit)."""
        thread = threading.Thread(target=self.run, name=f"pod-watch[{self.selector}]", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """End the thread soon: interrupts a watch blocked in a read."""
        self.stopping.set()
        response = self._response
        if response is not None:
            with contextlib.suppress(Exception):
                response.shutdown()

    def run(self) -> None:
        """LIST, WATCH, repeat until `stopping` is set."""
        while not self.stopping.is_set():
            try:
                version = self._list()
                while version and not self.stopping.is_set():
                    started = time.monotonic()
                    version = self._watch(version)
                    if time.monotonic() - started < RELIST_PAUSE_SECONDS:  # never spin on a watch that ends at once
                        self.stopping.wait(RELIST_PAUSE_SECONDS)
            except (KubeError, OSError, ValueError) as error:
                if self.stopping.is_set():
                    return
                log.warning("pods %s in %s: %s", self.selector, self.namespace, error)
            except Exception:  # the thread must outlive any surprise from the client library
                if self.stopping.is_set():
                    return
                log.exception("pods %s in %s: unexpected error", self.selector, self.namespace)
            self.stopping.wait(RELIST_PAUSE_SECONDS)

    def _matches(self, pod: JSON) -> bool:
        labels = pod.get("metadata", {}).get("labels") or {}
        return self._labels is None or all(labels.get(k) == v for k, v in self._labels.items())

    def _changed(self) -> None:
        self.publish(pod_endpoints(self._pods.values(), self.engine_port))

    def _list(self) -> str:
        result = self._get([("labelSelector", self.selector)] if self.selector else [])
        items = result.get("items") or []
        self._pods = {pod["metadata"]["name"]: pod for pod in items if self._matches(pod)}
        self._changed()
        return str(result.get("metadata", {}).get("resourceVersion") or "")

    def _watch(self, version: str) -> str:
        """One watch request; the resourceVersion to continue from, or "" to LIST again."""
        query = [("watch", "true"), ("resourceVersion", version), ("allowWatchBookmarks", "true"),
                 ("timeoutSeconds", str(WATCH_SECONDS))]
        if self.selector:
            query.append(("labelSelector", self.selector))
        for event in self._stream(query):
            kind = event.get("type")
            obj = event.get("object") or {}
            if kind == "ERROR":  # 410 Gone: the version is too old
                log.info("pods %s: watch error %s; listing again", self.selector, obj.get("message"))
                return ""
            meta = obj.get("metadata") or {}
            version = str(meta.get("resourceVersion") or version)
            if kind == "BOOKMARK" or "name" not in meta:
                continue
            if kind == "DELETED" or not self._matches(obj):
                if self._pods.pop(meta["name"], None) is None:
                    continue
            else:
                if self._pods.get(meta["name"]) == obj:
                    continue
                self._pods[meta["name"]] = obj
            self._changed()
        return version

    def _send(self, query: list[tuple[str, str]], timeout: tuple[float, float]) -> Any:
        api = self.kube.api
        path = resource_path("v1", "Pod", self.namespace)
        method, url, headers, body, _ = api.param_serialize(
            method="GET", resource_path=path, query_params=query, header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"])
        try:
            response = api.call_api(method, url, header_params=headers, body=body, _request_timeout=timeout)
        except Exception as error:
            raise KubeError(0, f"GET {path}: {error}") from None
        if response.status != 200:
            raise KubeError(response.status, f"GET {path}: {response.read()[:300]!r}")  # type: ignore[no-untyped-call]
        return response

    def _get(self, query: list[tuple[str, str]]) -> JSON:
        response = self._send(query, (CONNECT_TIMEOUT_SECONDS, 30.0))
        result: JSON = json.loads(response.read())
        return result

    def _stream(self, query: list[tuple[str, str]]) -> Iterator[JSON]:
        """The events of one watch request, as they arrive."""
        response = self._send(query, (CONNECT_TIMEOUT_SECONDS, WATCH_SECONDS + 30.0))
        raw = self._response = response.response
        buffer = b""
        try:
            for chunk in raw.stream(amt=None, decode_content=False):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
                if self.stopping.is_set():
                    return
        finally:
            self._response = None
            raw.release_conn()
