"""Kubernetes discovery on a mock API server (real HTTP, loopback): the proxy watches the pool's
Pods and routes only to those with an IP and Ready=True, stops sending new requests to a pod that
turns NotReady or is being deleted, and picks up new pods while requests flow."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import kubernetes
import pytest

from tests.integration.fakekube import FakeKube
from tests.integration.rig import COMPLETION, Rig, common_port, eventually, rig
from xpyd.common.netguard import require_loopback
from xpyd.kube import Kube
from xpyd.proxy.discovery import PodWatcher
from xpyd.proxy.pool import Endpoint
from xpyd.testing.stubengine import StubEngine

pytestmark = pytest.mark.integration

NS = "inference"
SELECTORS = {"prefill": "xpyd.io/serving=llama,xpyd.io/role=prefill",
             "decode": "xpyd.io/serving=llama,xpyd.io/role=decode"}


def _pod(name: str, role: str, ip: str, ready: bool = True) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {"xpyd.io/serving": "llama", "xpyd.io/role": role}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


async def test_routing_follows_the_pools_pods(fake: FakeKube) -> None:
    hosts = [require_loopback(f"127.0.0.{n}") for n in (2, 3, 4, 5)]
    port = common_port(hosts)
    engines = [StubEngine(name=f"e{n}") for n in range(4)]
    for engine, host in zip(engines, hosts, strict=True):
        await engine.start(host, port)
    prefill, decode_a, decode_b, decode_new = engines
    kube = Kube(kubernetes.client.ApiClient(kubernetes.client.Configuration(host=str(fake.url).rstrip("/"))))
    loop = asyncio.get_running_loop()
    async with rig(engines=([], [])) as r:
        watchers = []
        for role, selector in SELECTORS.items():
            def publish(endpoints: list[Endpoint], role: Any = role) -> None:
                loop.call_soon_threadsafe(r.proxy.set_endpoints, role, endpoints)
            watchers.append(PodWatcher(kube, NS, selector, port, publish))
        pods = {"p0": _pod("p0", "prefill", prefill.host), "d0": _pod("d0", "decode", decode_a.host),
                "d1": _pod("d1", "decode", decode_b.host, ready=False),
                "other": {**_pod("other", "decode", "127.0.0.9"),
                          "metadata": {"name": "other", "namespace": NS, "labels": {"xpyd.io/serving": "x"}}}}
        for pod in pods.values():
            await fake.put_object("v1/pods", copy.deepcopy(pod))
        for watcher in watchers:
            watcher.start()
        try:
            await r.ready(prefill=1, decode=1)
            assert set(r.proxy.pools["decode"].instances) == {decode_a.url, decode_b.url}   # "other" not selected
            await _send(r, 10)
            assert (decode_a.started, decode_b.started) == (10, 0)          # d1 is not ready

            await fake.put_object("v1/pods", _pod("d1", "decode", decode_b.host, ready=True))
            await r.ready(prefill=1, decode=2)
            await _send(r, 20)
            assert decode_b.started > 0

            # d0 is being deleted: it keeps nothing new.
            terminating = _pod("d0", "decode", decode_a.host)
            terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
            await fake.put_object("v1/pods", terminating)
            await r.ready(prefill=1, decode=1)
            before = decode_a.started
            await _send(r, 10)
            assert decode_a.started == before

            # A new pod joins while requests flow; the terminating one goes away.
            flowing = asyncio.ensure_future(_send(r, 60, concurrency=4))
            await fake.put_object("v1/pods", _pod("d2", "decode", decode_new.host))
            async with r.session.delete(f"{str(fake.url).rstrip('/')}/api/v1/namespaces/{NS}/pods/d0") as deleted:
                assert deleted.status == 200
            await flowing
            await eventually(lambda: decode_a.url not in r.proxy.pools["decode"].instances, what="d0 forgotten")
            await _send(r, 20)
            assert decode_new.started > 0
        finally:
            for watcher in watchers:
                watcher.stop()
            for engine in engines:
                await engine.stop()


async def _send(r: Rig, count: int, concurrency: int = 1) -> None:
    async def client(n: int) -> None:
        for _ in range(n):
            status, answer, _ = await r.post("/v1/completions", COMPLETION)
            assert status == 200, answer

    await asyncio.wait_for(asyncio.gather(*(client(count // concurrency) for _ in range(concurrency))), 30)
