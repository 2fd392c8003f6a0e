"""Kubernetes discovery on a mock API server (real HTTP, loopback): the proxy watches the pool's
Pods and routes only to those with an IP and Ready=True, stops sending new requests to a pod that
turns NotReady or is being deleted (while its role has another), and picks up new pods while
requests flow."""

from __future__ import annotations

import asyncio
import copy

import pytest

from tests.eventually import eventually
from tests.integration.fakekube import FakeKube
from tests.integration.rig import COMPLETION, NAMESPACE, Rig, common_port, pod, pod_discovery, rig
from xpyd.common.netguard import require_loopback
from xpyd.testing.stubengine import StubEngine

pytestmark = pytest.mark.integration


async def test_routing_follows_the_pools_pods(fake: FakeKube) -> None:
    hosts = [require_loopback(f"127.0.0.{n}") for n in (2, 3, 4, 5)]
    port = common_port(hosts)
    engines = [StubEngine(name=f"e{n}") for n in range(4)]
    for engine, host in zip(engines, hosts, strict=True):
        await engine.start(host, port)
    prefill, decode_a, decode_b, decode_new = engines
    async with rig(engines=([], [])) as r:
        pods = {"p0": pod("p0", "prefill", prefill.host), "d0": pod("d0", "decode", decode_a.host),
                "d1": pod("d1", "decode", decode_b.host, ready=False),
                "other": {**pod("other", "decode", "127.0.0.9"),
                          "metadata": {"name": "other", "namespace": NAMESPACE, "labels": {"xpyd.io/serving": "x"}}}}
        for item in pods.values():
            await fake.put_object("v1/pods", copy.deepcopy(item))
        try:
            async with pod_discovery(str(fake.url), r, port):
                await r.ready(prefill=1, decode=1)
                assert set(r.proxy.pools["decode"].instances) == {decode_a.url, decode_b.url}   # "other" not selected
                await _send(r, 10)
                assert (decode_a.started, decode_b.started) == (10, 0)          # d1 is not ready

                await fake.put_object("v1/pods", pod("d1", "decode", decode_b.host, ready=True))
                await r.ready(prefill=1, decode=2)
                await _send(r, 20)
                assert decode_b.started > 0

                # d0 is being deleted while d1 serves: it gets nothing new.
                await fake.put_object("v1/pods", pod("d0", "decode", decode_a.host, deleting=True))
                await r.ready(prefill=1, decode=1)
                before = decode_a.started
                await _send(r, 10)
                assert decode_a.started == before

                # A new pod joins while requests flow; the terminating one goes away.
                flowing = asyncio.ensure_future(_send(r, 60, concurrency=4))
                await fake.put_object("v1/pods", pod("d2", "decode", decode_new.host))
                async with r.session.delete(f"{str(fake.url).rstrip('/')}/api/v1/namespaces/{NAMESPACE}/pods/d0") \
                        as deleted:
                    assert deleted.status == 200
                await flowing
                await eventually(lambda: decode_a.url not in r.proxy.pools["decode"].instances, what="d0 forgotten")
                await _send(r, 20)
                assert decode_new.started > 0
        finally:
            for engine in engines:
                await engine.stop()


async def _send(r: Rig, count: int, concurrency: int = 1) -> None:
    async def client(n: int) -> None:
        for _ in range(n):
            status, answer, _ = await r.post("/v1/completions", COMPLETION)
            assert status == 200, answer

    await asyncio.wait_for(asyncio.gather(*(client(count // concurrency) for _ in range(concurrency))), 30)
