"""A Service's traffic on the local cluster, and steady load through it.

`ServiceForwarder` does for one Service what kube-proxy does: every new TCP connection to its
loopback listener goes to one of the Service's endpoints, the pods its selector matches that are
Ready and not terminating, taken in turn; the list is re-read every `REFRESH_SECONDS`. A pod that
leaves the list keeps its open connections (as with kube-proxy) until it closes them; with no
endpoint a connection is closed at once, which a client sees as a failed request. Only pod IPs on
loopback are dialled, never the Service's ClusterIP.

`SteadyLoad` runs `xpyd bench`'s open-loop Poisson load through a forwarder, in a thread of its
own, until told to stop (or its request cap, or its time cap), and keeps every request's record
with the monotonic time it arrived."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from xpyd.bench import BenchConfig, RequestRecord, run_bench
from xpyd.common.netguard import require_loopback
from xpyd.kube import Kube, KubeError
from xpyd.kube.pods import pod_ready

log = logging.getLogger(__name__)

HOST = require_loopback("127.0.0.1")
REFRESH_SECONDS = 0.25
CHUNK = 64 * 1024


def ready_endpoints(kube: Kube, namespace: str, selector: str, target_port: int | str) -> list[tuple[str, int]]:
    """(IP, port) of the pods matching `selector` that are Ready and not terminating, by pod name; a
    named `target_port` is the pod's container port of that name."""
    result = []
    for pod in sorted(kube.list_objects("v1", "Pod", namespace, selector), key=lambda p: p["metadata"]["name"]):
        status = pod.get("status", {})
        if pod["metadata"].get("deletionTimestamp") or not status.get("podIP") or not pod_ready(pod):
            continue
        ports = {p.get("name"): p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        port = target_port if isinstance(target_port, int) else ports.get(target_port)
        if port is not None:
            result.append((require_loopback(status["podIP"], "endpoint pod IP"), int(port)))
    return result


class ServiceForwarder:
    """kube-proxy for one Service, on a loopback port of this machine (see the module docstring)."""

    def __init__(self, kube: Kube, namespace: str, service: str) -> None:
        obj = kube.get("v1", "Service", namespace, service)
        assert obj is not None, f"no Service {namespace}/{service}"
        self.kube, self.namespace = kube, namespace
        self.selector = ",".join(f"{k}={v}" for k, v in sorted(obj["spec"]["selector"].items()))
        self.target_port: int | str = obj["spec"]["ports"][0]["targetPort"]
        self.endpoints: list[tuple[str, int]] = []
        self.connections: dict[str, int] = {}  # by endpoint, for the test's record
        self.refused = 0
        self._turn = 0
        self._open: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.endpoints = ready_endpoints(self.kube, self.namespace, self.selector, self.target_port)
        self._server = await asyncio.start_server(self._accept, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        asyncio.get_running_loop().create_task(self._refresh())

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def close(self) -> None:
        """Stop listening and close the connections still open (both ends), waiting for their pipes."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._open):
            writer.close()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _refresh(self) -> None:
        while self._server is not None and self._server.is_serving():
            try:
                self.endpoints = await asyncio.to_thread(ready_endpoints, self.kube, self.namespace, self.selector,
                                                         self.target_port)
            except KubeError as error:  # keep the last list, as kube-proxy does
                log.warning("endpoints of %s not refreshed: %s", self.selector, error)
            await asyncio.sleep(REFRESH_SECONDS)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        endpoints = self.endpoints
        if not endpoints:
            self.refused += 1
            writer.close()
            return
        self._turn += 1
        ip, port = endpoints[self._turn % len(endpoints)]
        self.connections[ip] = self.connections.get(ip, 0) + 1
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        try:
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(require_loopback(ip), port)
            except OSError:
                self.refused += 1
                writer.close()
                return
            self._open.update((writer, upstream_writer))
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
            self._open.difference_update((writer, upstream_writer))
        finally:
            self._handlers.discard(handler)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError):
            writer.close()


@dataclass
class Arrived:
    """A finished request, with the monotonic times it was sent and it finished."""

    at: float
    finished: float
    record: RequestRecord


@dataclass
class SteadyLoad:
    """Open-loop load through a ServiceForwarder for the Service `service`, in its own thread."""

    kube: Kube
    namespace: str
    service: str
    model: str
    rate: float = 8.0
    max_seconds: float = 240.0
    isl: int = 512
    osl: int = 32
    finished: list[tuple[float, RequestRecord]] = field(default_factory=list)
    forwarder: ServiceForwarder | None = None
    _stop: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _started: threading.Event = field(default_factory=threading.Event)
    _error: BaseException | None = None

    def __enter__(self) -> SteadyLoad:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="steady-load", daemon=True)
        self._thread.start()
        assert self._started.wait(30), "the load did not start"
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    async def _run(self) -> None:
        try:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self.forwarder = ServiceForwarder(self.kube, self.namespace, self.service)
            await self.forwarder.start()
            config = BenchConfig(url=self.forwarder.url, model=self.model, rate_rps=self.rate, isl=self.isl,
                                 osl=self.osl, duration_s=self.max_seconds,
                                 max_requests=int(self.rate * self.max_seconds), timeout_s=30.0, loopback_only=True)
        except BaseException as error:
            self._error = error
            self._started.set()
            raise
        self._started.set()
        try:
            await run_bench(config, on_result=self._record, stop=self._stop)
        finally:
            await self.forwarder.close()

    def _record(self, record: RequestRecord) -> None:
        self.finished.append((time.monotonic(), record))

    @property
    def results(self) -> list[Arrived]:
        """Every finished request. A record's send time counts from the run's start, so the start's
        monotonic time is taken from the successful ones (finished less their duration less their
        send time: the same up to the callback's delay, the least of them is the closest)."""
        origins = [finished - r.e2e_s - r.sent_s for finished, r in self.finished if r.e2e_s is not None]
        origin = min(origins) if origins else 0.0
        return [Arrived(origin + r.sent_s, finished, r) for finished, r in self.finished]

    def stop(self) -> list[Arrived]:
        """End the arrivals, wait for the requests in flight, return every record (once stopped,
        again the same records)."""
        if self._loop is not None and self._stop is not None and self._thread is not None \
                and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=60)
            assert not self._thread.is_alive(), "the load did not stop"
        return self.results


@contextlib.contextmanager
def forwarded(kube: Kube, namespace: str, service: str) -> Iterator[str]:
    """A ServiceForwarder for `service` on its own event loop thread, for synchronous clients: yields
    the loopback URL that reaches the Service's ready pods, and closes it on exit."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=f"forward-{service}", daemon=True)
    thread.start()
    forwarder = ServiceForwarder(kube, namespace, service)
    try:
        asyncio.run_coroutine_threadsafe(forwarder.start(), loop).result(timeout=30)
        yield forwarder.url
    finally:
        asyncio.run_coroutine_threadsafe(forwarder.close(), loop).result(timeout=30)
        asyncio.run_coroutine_threadsafe(_cancel_others(), loop).result(timeout=30)  # its endpoint refresh
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


async def _cancel_others() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
