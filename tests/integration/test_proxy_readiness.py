"""No lost requests around pod readiness and termination (issue 16), with Kubernetes discovery on a
mock API server and stub engines on loopback, under a bounded open-loop load (a request every
INTERVAL seconds, whatever the answers, as independent clients send them); each test counts the
client requests that failed:

- engines that start listening after the proxy's first probe: once discovery sees their pods Ready
  no request fails, although the next periodic probe is far off, and `/ready` is 503 until the
  proxy has a usable prefill and decode instance;
- the only prefill pod is being deleted while it still serves and its replacement is not Ready:
  no request fails, and once the replacement is Ready new requests go only to it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.eventually import eventually
from tests.integration.fakekube import FakeKube
from tests.integration.rig import COMPLETION, Rig, common_port, pod, pod_discovery, rig
from xpyd.common.netguard import require_loopback
from xpyd.testing.stubengine import StubEngine

pytestmark = pytest.mark.integration

#: Seconds between two requests of the load.
INTERVAL = 0.02


@dataclass
class Load:
    """`count` requests, one every INTERVAL seconds from `run()` on; `sent` holds each request's
    loop time and task, `results` each answered one's loop time and HTTP status (0: no answer)."""

    r: Rig
    count: int
    sent: list[tuple[float, asyncio.Task[None]]] = field(default_factory=list)
    results: list[tuple[float, int]] = field(default_factory=list)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        for n in range(self.count):
            await asyncio.sleep(max(0.0, start + n * INTERVAL - loop.time()))
            now = loop.time()
            self.sent.append((now, asyncio.ensure_future(self._one(now))))
        await asyncio.wait_for(asyncio.gather(*(task for _, task in self.sent)), 30)

    async def _one(self, sent: float) -> None:
        try:
            status, _, _ = await self.r.post("/v1/completions", COMPLETION)
        except Exception:  # a request without an answer is a failure, counted
            status = 0
        self.results.append((sent, status))

    def failures(self, since: float = float("-inf")) -> int:
        """Answered requests sent at or after `since` that did not get 200."""
        return sum(status != 200 for sent, status in self.results if sent >= since)

    def sent_since(self, since: float) -> int:
        return sum(sent >= since for sent, _ in self.sent)

    async def answered_before(self, moment: float) -> None:
        """Wait until every request sent before `moment` is answered."""
        await asyncio.wait_for(asyncio.gather(*(task for sent, task in self.sent if sent < moment)), 30)


async def _ready(r: Rig) -> tuple[int, Any]:
    async with r.session.get(r.url + "/ready") as response:
        return response.status, await response.json()


async def test_engines_listening_after_the_first_probe_serve_once_their_pods_are_ready(fake: FakeKube) -> None:
    hosts = [require_loopback("127.0.0.2"), require_loopback("127.0.0.3")]
    port = common_port(hosts)
    prefill, decode = StubEngine(name="p0"), StubEngine(name="d0")     # not listening yet
    # Periodic probes far apart: only the pods' readiness can bring the instances in during the test.
    async with rig(engines=([], []), health_interval=60.0) as r, pod_discovery(str(fake.url), r, port):
        await fake.put_object("v1/pods", pod("p0", "prefill", hosts[0], ready=False))
        await fake.put_object("v1/pods", pod("d0", "decode", hosts[1], ready=False))
        pools = r.proxy.pools
        await eventually(lambda: all(len(p.instances) == 1 and next(iter(p.instances.values())).healthy is False
                                     for p in pools.values()), what="both instances probed, refused")
        readiness = [await _ready(r)]

        load = Load(r, count=150)                         # 3 s of load from now on
        running = asyncio.ensure_future(load.run())
        await eventually(lambda: len(load.results) >= 10, what="the first requests answered")
        for engine, host in ((prefill, hosts[0]), (decode, hosts[1])):
            await engine.start(host, port)
        await fake.put_object("v1/pods", pod("p0", "prefill", hosts[0]))
        await eventually(lambda: pools["prefill"].instances[prefill.url].ready, what="p0 seen Ready")
        readiness.append(await _ready(r))
        await fake.put_object("v1/pods", pod("d0", "decode", hosts[1]))
        await eventually(lambda: pools["decode"].instances[decode.url].ready, what="d0 seen Ready")
        seen_ready = asyncio.get_running_loop().time()
        readiness.append(await _ready(r))
        await running
        try:
            assert load.failures() >= 10                  # before the pods were Ready: 503
            assert load.sent_since(seen_ready) >= 20
            assert load.failures(since=seen_ready) == 0
            assert readiness == [(503, {"status": "unavailable", "missing": ["prefill", "decode"]}),
                                 (503, {"status": "unavailable", "missing": ["decode"]}),
                                 (200, {"status": "ready"})]
            # The probe sent when the pods turned Ready confirmed them.
            await eventually(lambda: all(i.healthy is True and not i.probing
                                         for p in pools.values() for i in p.instances.values()),
                             what="the readiness probes answered")
        finally:
            for engine in (prefill, decode):
                await engine.stop()


async def test_the_only_prefill_pod_serves_while_it_terminates_until_a_replacement_is_ready(fake: FakeKube) -> None:
    hosts = [require_loopback(f"127.0.0.{n}") for n in (2, 3, 4)]
    port = common_port(hosts)
    old, new, decode = StubEngine(name="p0"), StubEngine(name="p1"), StubEngine(name="d0")
    for engine, host in zip((old, new, decode), hosts, strict=True):
        await engine.start(host, port)
    try:
        async with rig(engines=([], [])) as r, pod_discovery(str(fake.url), r, port):
            await fake.put_object("v1/pods", pod("p0", "prefill", old.host))
            await fake.put_object("v1/pods", pod("d0", "decode", decode.host))
            await r.ready(prefill=1, decode=1)
            load = Load(r, count=150)                     # 3 s of load
            running = asyncio.ensure_future(load.run())
            await eventually(lambda: len(load.results) >= 20, what="requests served")

            # The only prefill pod is being deleted (its preStop drain keeps the engine serving); the
            # replacement's pod exists but is not Ready yet.
            await fake.put_object("v1/pods", pod("p0", "prefill", old.host, deleting=True))
            await fake.put_object("v1/pods", pod("p1", "prefill", new.host, ready=False))
            prefills = r.proxy.pools["prefill"].instances
            await eventually(lambda: new.url in prefills, what="p0 seen terminating")   # (the events keep their order)
            terminating = asyncio.get_running_loop().time()
            readiness = await _ready(r)                   # the terminating pod still takes requests
            await eventually(lambda: load.sent_since(terminating) >= 40, what="requests during the termination")

            await fake.put_object("v1/pods", pod("p1", "prefill", new.host))
            await eventually(lambda: r.proxy.pools["prefill"].counts()["eligible"] == 1, what="p1 seen Ready")
            replaced = asyncio.get_running_loop().time()
            await load.answered_before(replaced)
            served_by_old = old.started
            await running

            assert len(load.results) == 150
            assert load.failures() == 0
            assert readiness == (200, {"status": "ready"})
            assert load.sent_since(terminating) - load.sent_since(replaced) >= 40
            assert old.started == served_by_old           # nothing new once the replacement was Ready
            assert load.sent_since(replaced) >= 20
            assert new.started >= load.sent_since(replaced)
    finally:
        for engine in (old, new, decode):
            await engine.stop()
