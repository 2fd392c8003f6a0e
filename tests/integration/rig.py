"""The proxy in front of stub engines (`xpyd.testing.stubengine`), all in this process on loopback,
with a client session: the rig of the proxy integration tests; and its Kubernetes discovery of the
pools' Pods on a mock API server (`pod`, `pod_discovery`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kubernetes
from aiohttp import web

from tests.eventually import eventually
from xpyd.api.naming import KV_COMPAT_LABEL, Role
from xpyd.common.netguard import require_loopback
from xpyd.common.timefmt import rfc3339
from xpyd.kube import Kube
from xpyd.proxy.config import ProxyConfig
from xpyd.proxy.discovery import PodWatcher, static_endpoints
from xpyd.proxy.pool import Endpoint
from xpyd.proxy.server import Proxy
from xpyd.testing.stubengine import StubEngine

HOST = require_loopback("127.0.0.1")
#: Fast probes and short timeouts, so failure tests run in seconds.
TEST_CONFIG: dict[str, Any] = {"health_interval": 0.1, "health_timeout": 0.5, "connect_timeout": 0.5,
                               "prefill_timeout": 5.0, "breaker_cooldown": 0.2, "seed": 7}
#: The completion request the proxy tests send (the stub engines answer it with max_tokens tokens).
COMPLETION = {"model": "m", "prompt": "the quick brown fox", "max_tokens": 8, "min_tokens": 2, "temperature": 0}
#: The namespace and the role selectors of the pools' Pods in the discovery tests.
NAMESPACE = "inference"
SELECTORS: dict[Role, str] = {"prefill": "xpyd.io/serving=llama,xpyd.io/role=prefill",
                              "decode": "xpyd.io/serving=llama,xpyd.io/role=decode"}


@dataclass
class Rig:
    """A proxy in front of stub engines, and a client session."""

    proxy: Proxy
    url: str
    prefill: list[StubEngine]
    decode: list[StubEngine]
    session: aiohttp.ClientSession
    extra: list[Any] = field(default_factory=list)

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
        """POST JSON; (status, parsed JSON or raw text, response headers)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.session.post(self.url + path, data=data, headers=headers or {}) as response:
            text = await response.text()
            try:
                parsed: Any = json.loads(text)
            except ValueError:
                parsed = text
            return response.status, parsed, response.headers

    def set(self, role: Any, engines: list[StubEngine]) -> None:
        """Point discovery at these engines."""
        self.proxy.set_endpoints(role, static_endpoints([e.url for e in engines]))

    async def ready(self, prefill: int | None = None, decode: int | None = None) -> None:
        """Wait until the proxy has probed its instances healthy."""
        want: dict[Role, int] = {"prefill": len(self.prefill) if prefill is None else prefill,
                                 "decode": len(self.decode) if decode is None else decode}
        await eventually(lambda: all(self.proxy.pools[r].counts()["eligible"] == n for r, n in want.items()),
                         what=f"eligible instances {want}")


@contextlib.asynccontextmanager
async def rig(prefill: int = 1, decode: int = 1, engines: tuple[list[StubEngine], list[StubEngine]] | None = None,
              **config: Any) -> AsyncIterator[Rig]:
    """Start stub engines and a proxy in front of them (all on loopback), torn down after."""
    prefills, decodes = engines or ([StubEngine(name=f"p{i}") for i in range(prefill)],
                                    [StubEngine(name=f"d{i}") for i in range(decode)])
    for engine in (*prefills, *decodes):
        if not engine.port:
            await engine.start(HOST)
    proxy = Proxy(ProxyConfig(**{**TEST_CONFIG, **config}))
    runner = web.AppRunner(proxy.app(), access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    the_rig = Rig(proxy, f"http://{HOST}:{port}", prefills, decodes, session)
    the_rig.set("prefill", prefills)
    the_rig.set("decode", decodes)
    try:
        await the_rig.ready(prefill=sum(e.health_status == 200 for e in prefills),
                            decode=sum(e.health_status == 200 for e in decodes))
        yield the_rig
    finally:
        await session.close()
        await runner.cleanup()
        for engine in (*prefills, *decodes):
            await engine.stop()


def common_port(hosts: list[str]) -> int:
    """A port free on every one of these loopback addresses."""
    for _ in range(50):
        probe = socket.socket()
        probe.bind((hosts[0], 0))
        port: int = probe.getsockname()[1]
        probe.close()
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
            return port
        except OSError:
            continue
    raise AssertionError("no common free port")


def pod(name: str, role: str, ip: str, ready: bool = True, deleting: bool = False,
        compat: str | None = None) -> dict[str, Any]:
    """An engine Pod of the `llama` serving in NAMESPACE; `deleting`: deleted just now, with the
    rendered engines' grace period (drain timeout 60 s, shutdown margin 30 s); `compat`: its KV
    compatibility hash label."""
    labels = {"xpyd.io/serving": "llama", "xpyd.io/role": role}
    if compat is not None:
        labels[KV_COMPAT_LABEL] = compat
    meta: dict[str, Any] = {"name": name, "namespace": NAMESPACE, "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = rfc3339(time.time() + 90)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


@contextlib.asynccontextmanager
async def pod_discovery(api_url: str, r: Rig, engine_port: int) -> AsyncIterator[None]:
    """The proxy's discovery of both pools' Pods (SELECTORS in NAMESPACE) on the API at `api_url`,
    as `xpyd proxy` runs it, for the life of the context."""
    kube = Kube(kubernetes.client.ApiClient(kubernetes.client.Configuration(host=api_url.rstrip("/"))))
    loop = asyncio.get_running_loop()
    watchers = []
    for role, selector in SELECTORS.items():
        def publish(endpoints: list[Endpoint], role: Role = role) -> None:
            loop.call_soon_threadsafe(r.proxy.set_endpoints, role, endpoints)
        watchers.append(PodWatcher(kube, NAMESPACE, selector, engine_port, publish))
    for watcher in watchers:
        watcher.start()
    try:
        yield
    finally:
        for watcher in watchers:
            watcher.stop()
