"""The proxy's waiting room (issue 31) in front of stub engines on loopback, and with Kubernetes
discovery and its Pod condition on a mock API server:

- a pool with no engines: the proxy is Ready, holds every request, and sends each on once a
  prefill and decode pair exists (none lost, none answered before);
- a full room answers 429 at once with a JSON error and Retry-After; a request the room kept past
  its timeout gets 503 with Retry-After; both are counted in /metrics beside what is held;
- engine pods that turn Ready release the held requests, and the proxy's Pod carries what it holds
  (`xpyd.io/RequestsWaiting`) while it holds it, and nothing once released;
- without the room (the flag's default) nothing changes: 503 at once and /ready 503.
"""

from __future__ import annotations

import asyncio
from typing import Any

import kubernetes
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.eventually import eventually
from tests.integration.fakekube import FakeKube
from tests.integration.rig import COMPLETION, NAMESPACE, Rig, common_port, pod, pod_discovery, rig
from xpyd.api.conditions import REQUESTS_WAITING_POD_CONDITION
from xpyd.api.waiting import Held, held_by_pod
from xpyd.common.netguard import require_loopback
from xpyd.kube import Kube
from xpyd.proxy.podreport import WaitingReporter
from xpyd.testing.stubengine import StubEngine

pytestmark = pytest.mark.integration

#: The waiting room on: requests held up to 10 s, at most 8 of them.
ROOM: dict[str, Any] = {"wait_timeout": 10.0, "wait_max_requests": 8}


async def _get(r: Rig, path: str) -> tuple[int, Any]:
    async with r.session.get(r.url + path) as response:
        return response.status, (await response.json() if path != "/metrics" else await response.text())


async def metrics(r: Rig) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    _, text = await _get(r, "/metrics")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(values: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_held_requests_go_on_once_a_pair_exists() -> None:
    async with rig(engines=([], []), **ROOM) as r:
        assert await _get(r, "/ready") == (200, {"status": "ready", "missing": ["prefill", "decode"], "waiting": 0})
        sent = [asyncio.ensure_future(r.post("/v1/completions", {**COMPLETION, "prompt": f"request {n}"}))
                for n in range(6)]
        await eventually(lambda: r.proxy.waiting.requests == 6, what="six requests held")
        held = await metrics(r)
        assert sample(held, "xpyd_proxy_waiting_requests") == 6 and sample(held, "xpyd_proxy_waiting_bytes") > 0
        assert await _get(r, "/ready") == (200, {"status": "ready", "missing": ["prefill", "decode"], "waiting": 6})
        await asyncio.sleep(0.3)
        assert not any(task.done() for task in sent)  # nothing is answered while no pair exists

        prefill, decode = StubEngine(name="p0"), StubEngine(name="d0")
        await prefill.start("127.0.0.1")
        r.set("prefill", [prefill])  # one role is not a pair: still held
        await asyncio.sleep(0.3)
        assert not any(task.done() for task in sent)
        await decode.start("127.0.0.1")
        r.set("decode", [decode])
        answers = await asyncio.wait_for(asyncio.gather(*sent), 10)
        try:
            assert [status for status, _, _ in answers] == [200] * 6
            assert prefill.started == decode.started == 6
            after = await metrics(r)
            assert [sample(after, "xpyd_proxy_waiting_total", result=x) for x in ("held", "released")] == [6, 6]
            assert sample(after, "xpyd_proxy_waiting_requests") == 0
            assert sample(after, "xpyd_proxy_wait_duration_seconds_count", result="released") == 6
            assert sample(after, "xpyd_proxy_requests_total", connector="NixlConnector", endpoint="completions",
                          outcome="success") == 6
            assert await _get(r, "/ready") == (200, {"status": "ready"})
        finally:
            await prefill.stop()
            await decode.stop()


async def test_a_full_room_answers_429_at_once_and_a_held_request_times_out_with_503() -> None:
    async with rig(engines=([], []), wait_timeout=1.0, wait_max_requests=2, wait_max_bytes=4096) as r:
        held = [asyncio.ensure_future(r.post("/v1/completions", COMPLETION)) for _ in range(2)]
        await eventually(lambda: r.proxy.waiting.requests == 2, what="the room full")
        status, body, headers = await r.post("/v1/completions", COMPLETION)
        assert status == 429 and headers["Retry-After"] == "5" and body["error"]["code"] == 429
        assert "waiting room is full (2 of 2 requests held)" in body["error"]["message"]
        assert r.proxy.waiting.requests == 2  # the refused one was never held
        answers = await asyncio.wait_for(asyncio.gather(*held), 5)
        for status, body, headers in answers:
            assert status == 503 and headers["Retry-After"] == "30" and body["error"]["code"] == 503
            assert "No prefill and decode pair became ready within 1 s" in body["error"]["message"]
        big = {**COMPLETION, "prompt": "x" * 5000}  # more bytes than the room holds
        status, body, _ = await r.post("/v1/completions", big)
        assert status == 429 and "bytes would exceed 4096" in body["error"]["message"]
        values = await metrics(r)
        labels = {"connector": "NixlConnector", "endpoint": "completions"}
        assert sample(values, "xpyd_proxy_requests_total", **labels, outcome="waiting_room_full") == 2
        assert sample(values, "xpyd_proxy_requests_total", **labels, outcome="wait_expired") == 2
        assert sample(values, "xpyd_proxy_rejected_total", status="429") == 2
        assert [sample(values, "xpyd_proxy_waiting_total", result=x)
                for x in ("held", "released", "overflow", "expired")] == [2, 0, 2, 2]
        assert sample(values, "xpyd_proxy_waiting_requests") == 0


async def test_without_the_room_nothing_is_held() -> None:
    async with rig(engines=([], [])) as r:
        status, body, _ = await r.post("/v1/completions", COMPLETION)
        assert status == 503 and body["error"]["message"] == "No prefill instance is available."
        assert sample(await metrics(r), "xpyd_proxy_waiting_total", result="held") == 0
        assert await _get(r, "/ready") == (503, {"status": "unavailable", "missing": ["prefill", "decode"]})


def _proxy_pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE,
                         "labels": {"xpyd.io/serving": "llama", "xpyd.io/role": "proxy"}},
            "spec": {"containers": [{"name": "proxy", "image": "xpyd"}]},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}


async def test_pods_turning_ready_release_the_held_requests_and_the_pod_says_what_is_held(fake: FakeKube) -> None:
    hosts = [require_loopback("127.0.0.2"), require_loopback("127.0.0.3")]
    port = common_port(hosts)
    prefill, decode = StubEngine(name="p0"), StubEngine(name="d0")
    kube = Kube(kubernetes.client.ApiClient(kubernetes.client.Configuration(host=str(fake.url).rstrip("/"))))
    await fake.put_object("v1/pods", _proxy_pod("llama-proxy-0"))
    async with rig(engines=([], []), **ROOM) as r, pod_discovery(str(fake.url), r, port):
        reporter = WaitingReporter(kube, NAMESPACE, "llama-proxy-0", r.proxy.waiting, interval=0.1)
        reporting = asyncio.ensure_future(reporter.run())

        def reported() -> Held:
            return held_by_pod(fake.get_object("v1/pods", NAMESPACE, "llama-proxy-0") or {})

        try:
            await eventually(lambda: reporter.written is not None, what="the state at start written")
            assert reported() == Held()
            sent = [asyncio.ensure_future(r.post("/v1/completions", COMPLETION)) for _ in range(3)]
            await eventually(lambda: reported().requests == 3, what="three held requests on the proxy's pod")
            assert reported().prompt_tokens == r.proxy.waiting.prompt_tokens > 0
            condition = next(c for c in fake.get_object("v1/pods", NAMESPACE, "llama-proxy-0")["status"]["conditions"]
                             if c["type"] == REQUESTS_WAITING_POD_CONDITION)
            assert condition["status"] == "True" and condition["reason"] == "RequestsWaiting"

            for engine, host in ((prefill, hosts[0]), (decode, hosts[1])):
                await engine.start(host, port)
            await fake.put_object("v1/pods", pod("p0", "prefill", hosts[0]))
            await fake.put_object("v1/pods", pod("d0", "decode", hosts[1]))
            answers = await asyncio.wait_for(asyncio.gather(*sent), 10)
            assert [status for status, _, _ in answers] == [200] * 3
            await eventually(lambda: reporter.written is not None and reporter.written[0] == "False",
                             what="nothing held written back")
            assert reported() == Held()
        finally:
            reporting.cancel()
            for engine in (prefill, decode):
                await engine.stop()
