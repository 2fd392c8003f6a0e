"""Failure injection: engines that answer 500, hang, answer without hand-off parameters, report
503 on /health, break mid-stream, are killed (real processes) mid-load, or come and go while
requests flow. No client may see an error that a healthy instance could have served. Every load
here is bounded in requests and time."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.eventually import eventually
from tests.integration.rig import COMPLETION, HOST, Rig, common_port, rig
from xpyd.api.models import Connector, RoutingPolicy
from xpyd.cluster.controlplane import free_port, free_ports
from xpyd.proxy.discovery import static_endpoints
from xpyd.testing.stubengine import StubEngine

pytestmark = pytest.mark.integration


async def load(r: Rig, requests: int, concurrency: int, body: dict[str, Any] | None = None,
               during: Any = None) -> Counter[int]:
    """`requests` requests from `concurrency` clients (statuses counted); `during()` runs once a
    third of them are done."""
    statuses: Counter[int] = Counter()
    remaining = list(range(requests))
    done = asyncio.Event()

    async def client() -> None:
        while remaining:
            remaining.pop()
            status, _, _ = await r.post("/v1/completions", body or COMPLETION)
            statuses[status] += 1
            if sum(statuses.values()) >= requests // 3:
                done.set()

    clients = [asyncio.ensure_future(client()) for _ in range(concurrency)]
    if during is not None:
        await asyncio.wait_for(done.wait(), 30)
        await during()
    await asyncio.wait_for(asyncio.gather(*clients), 60)
    return statuses


async def test_a_prefill_answering_500_is_retried_on_another_and_its_breaker_opens() -> None:
    async with rig(prefill=2, decode=1, breaker_cooldown=30.0) as r:
        r.prefill[0].fail_status = 500
        assert await load(r, 40, 4) == {200: 40}
        bad = r.proxy.pools["prefill"].instances[r.prefill[0].url]
        assert not bad.breaker.allows()
        assert r.prefill[0].started == 3               # three failures opened it; then no more traffic
        assert r.proxy.metrics.retries.value("prefill") == 3
        assert r.proxy.metrics.breaker_trips.value("prefill") == 1


async def test_a_decode_failing_before_its_first_byte_is_a_failed_leg_and_no_retry_without_another() -> None:
    async with rig(prefill=1, decode=1) as r:
        r.decode[0].fail_status = 500
        status, answer, _ = await r.post("/v1/completions", COMPLETION)
        assert status == 503 and "decode" in answer["error"]["message"].lower()
        assert r.proxy.metrics.legs.count("decode", "error") == 1
        assert r.proxy.metrics.retries.value("decode") == 0       # no other decode instance: nothing resent


async def test_every_prefill_failing_is_a_clear_503() -> None:
    async with rig(prefill=2, decode=1) as r:
        for engine in r.prefill:
            engine.fail_status = 500
        status, answer, _ = await r.post("/v1/completions", COMPLETION)
        assert status == 503 and answer["error"]["type"] == "ServiceUnavailableError"
        assert "Prefill failed" in answer["error"]["message"]
        assert r.decode[0].seen == []                  # never a silent decode-only answer
        assert r.proxy.metrics.requests.value("NixlConnector", "completions", "unavailable") == 1


async def test_decode_only_fallback_only_when_configured_and_counted() -> None:
    async with rig(prefill=1, decode=1, decode_only_fallback=True) as r:
        r.prefill[0].fail_status = 503
        status, _, _ = await r.post("/v1/completions", COMPLETION)
        assert status == 200
        assert r.decode[0].seen[0].body == COMPLETION  # no kv_transfer_params: decode computes the prompt
        assert r.proxy.metrics.fallbacks.value("prefill_failed") == 1
        assert r.proxy.metrics.requests.value("NixlConnector", "completions", "fallback") == 1


async def test_a_prefill_answer_without_kv_transfer_params_is_a_prefill_failure() -> None:
    async with rig(prefill=2, decode=1) as r:
        r.prefill[0].omit_kv_params = True              # an engine not configured as kv_producer
        assert await load(r, 10, 2) == {200: 10}
        assert all(leg.body["kv_transfer_params"]["remote_engine_id"] == "p1-engine" for leg in r.decode[0].seen)


async def test_a_hanging_prefill_times_out_and_is_retried() -> None:
    async with rig(prefill=2, decode=1, prefill_timeout=0.3, health_timeout=0.2) as r:
        r.prefill[0].hang = r.prefill[0].hang_health = True
        assert await load(r, 12, 3) == {200: 12}
        await eventually(lambda: r.proxy.pools["prefill"].instances[r.prefill[0].url].healthy is False,
                         what="the hanging prefill marked unhealthy by its probe")


async def test_a_decode_failing_before_its_first_byte_is_retried_once_elsewhere() -> None:
    async with rig(prefill=1, decode=2) as r:
        r.decode[0].fail_status = 500
        assert await load(r, 20, 4, {**COMPLETION, "stream": True}) == {200: 20}
        retries = r.proxy.metrics.retries.value("decode")
        assert retries >= 1
        # The failed decode got the request (it may have read the KV): the retry prefills again.
        assert r.prefill[0].started == 20 + retries


async def decode_retries_reuse_the_kv(unreachable: str) -> None:
    """Beside a working decode, a decode at `unreachable` that the first probe finds down but that is
    taken as healthy (as if it died just after a good probe): the one decode retry it causes reuses
    prefill's answer (NIXL pull: one prefill per request)."""
    async with rig(prefill=1, decode=1, routing_policy=RoutingPolicy.ROUND_ROBIN, health_interval=60.0) as r:
        r.proxy.set_endpoints("decode", static_endpoints([r.decode[0].url, unreachable]))
        instance = r.proxy.pools["decode"].instances[unreachable]
        await eventually(lambda: instance.healthy is False, what="the first probe of the unreachable instance")
        instance.healthy = True
        sent = 0
        while r.proxy.metrics.retries.value("decode") == 0 and sent < 10:
            assert (await r.post("/v1/completions", COMPLETION))[0] == 200
            sent += 1
        assert r.proxy.metrics.retries.value("decode") == 1
        assert r.prefill[0].started == sent


async def test_a_decode_retry_reuses_the_kv_when_the_failed_decode_never_got_the_request() -> None:
    await decode_retries_reuse_the_kv(f"http://{HOST}:{free_port()}")  # nothing listens: refused


async def test_a_decode_that_never_accepts_the_connection_is_retried_with_the_same_kv() -> None:
    """A connect timeout (a listener whose backlog is full) is a TimeoutError in aiohttp, but nothing
    reached decode: the retry reuses prefill's answer, as for a refused connection."""
    with socket.socket() as listener:
        listener.bind((HOST, 0))
        listener.listen(0)
        with socket.create_connection(listener.getsockname()):  # fills the backlog: later connects hang
            await decode_retries_reuse_the_kv(f"http://{HOST}:{listener.getsockname()[1]}")


@pytest.mark.parametrize("stream", [False, True])
async def test_an_engine_shutting_down_aborts_and_its_legs_go_elsewhere(stream: bool) -> None:
    # vLLM after SIGTERM: /health 200, every new request answered 200 with finish_reason "abort".
    # P2pNccl: a prefill answer needs no kv_transfer_params, so only the abort tells it from a success.
    async with rig(prefill=2, decode=2, breaker_cooldown=30.0, connector=Connector.P2P_NCCL) as r:
        r.prefill[0].shutting_down = r.decode[0].shutting_down = True
        body = {**COMPLETION, "stream": stream}
        for _ in range(20):
            status, answer, _ = await r.post("/v1/completions", body)
            assert status == 200 and "tok1" in str(answer)            # a real answer, never an empty abort
        for engine in (r.prefill[0], r.decode[0]):
            assert engine.started == 3                                # three aborts opened its breaker
        assert r.proxy.metrics.retries.value("prefill") >= 3 and r.proxy.metrics.retries.value("decode") >= 1
        r.decode[1].shutting_down = True                              # no decode left that runs requests
        before = r.decode[1].started
        status, _, _ = await r.post("/v1/completions", body)
        assert (status, r.decode[1].started) == (503, before + 1)     # a clear 503, not an empty 200


async def test_every_decode_failing_is_a_503() -> None:
    async with rig(prefill=1, decode=2) as r:
        for engine in r.decode:
            engine.fail_status = 500
        status, answer, _ = await r.post("/v1/completions", COMPLETION)
        assert status == 503 and "Decode failed on 2 instance(s)" in answer["error"]["message"]


async def test_a_stream_broken_after_its_first_bytes_ends_with_an_error_event() -> None:
    async with rig() as r:
        r.decode[0].break_after_chunks = 2
        status, text, _ = await r.post("/v1/completions", {**COMPLETION, "stream": True})
        assert status == 200
        events = [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]
        assert len(events) == 4 and events[-1] == "[DONE]"
        assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == [" tok0", " tok1"]
        assert json.loads(events[2])["error"]["code"] == 502
        assert r.proxy.metrics.requests.value("NixlConnector", "completions", "broken_stream") == 1


async def test_an_instance_answering_503_on_health_gets_no_traffic_until_it_recovers() -> None:
    loading = StubEngine(name="d-loading", health_status=503)
    async with rig(engines=([StubEngine(name="p0")], [StubEngine(name="d0"), loading])) as r:
        assert await load(r, 20, 4) == {200: 20}
        assert loading.started == 0
        loading.health_status = 200
        await r.ready(decode=2)
        assert await load(r, 20, 4) == {200: 20}
        assert loading.started > 0


async def test_decode_endpoints_scaled_up_and_down_while_requests_flow() -> None:
    extra = StubEngine(name="d-new")
    await extra.start(HOST)
    async with rig(prefill=1, decode=2) as r:
        r.decode[0].token_delay = r.decode[1].token_delay = 0.01
        body = {**COMPLETION, "stream": True}

        async def scale() -> None:
            # Scale up by one and down by one at once: d0 leaves discovery with streams in flight.
            r.proxy.set_endpoints("decode", static_endpoints([r.decode[1].url, extra.url]))
            await r.ready(decode=2)

        statuses = await load(r, 150, 8, body, during=scale)
        before = r.decode[0].started
        assert statuses == {200: 150}
        assert await load(r, 30, 4, body) == {200: 30}
        assert r.decode[0].started == before           # gone from discovery: nothing new
        assert extra.started > 0
        assert r.decode[0].cancelled == 0              # its streams in flight finished
        await eventually(lambda: r.decode[0].url not in r.proxy.pools["decode"].instances,
                         what="the removed instance forgotten once idle")
    await extra.stop()


# -- real processes killed mid-load -----------------------------------------------------------------



async def _engine_process(port: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-m", "xpyd.testing.stubengine", "--host", HOST, "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    async with aiohttp.ClientSession() as session:
        for _ in range(200):
            try:
                async with session.get(f"http://{HOST}:{port}/health") as response:
                    if response.status == 200:
                        return process
            except aiohttp.ClientError:
                await asyncio.sleep(0.05)
    process.kill()
    raise AssertionError("stub engine process did not start")


@pytest.fixture
async def engine_processes() -> AsyncIterator[list[tuple[subprocess.Popen[bytes], StubEngine]]]:
    ports = free_ports(4)
    processes = [await _engine_process(port) for port in ports]
    handles = []
    for port, process in zip(ports, processes, strict=True):
        handle = StubEngine(name=f"proc-{port}")
        handle.host, handle.port = HOST, port          # a handle for its URL; the engine runs in the process
        handles.append((process, handle))
    yield handles
    for process, _ in handles:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)


@pytest.mark.parametrize("stream", [False, True])
async def test_killing_a_prefill_and_a_decode_process_mid_load(
        engine_processes: list[tuple[subprocess.Popen[bytes], StubEngine]], stream: bool) -> None:
    (p0, p0h), (_, p1h), (d0, d0h), (_, d1h) = engine_processes
    async with rig(engines=([p0h, p1h], [d0h, d1h])) as r:
        async def kill() -> None:
            p0.send_signal(signal.SIGKILL)
            d0.send_signal(signal.SIGKILL)

        statuses = await load(r, 300, 16, {**COMPLETION, "stream": stream}, during=kill)
        assert statuses == {200: 300}
        pools = r.proxy.pools
        await eventually(lambda: not pools["prefill"].instances[p0h.url].serving()
                         and not pools["decode"].instances[d0h.url].serving(), what="the dead instances excluded")


async def test_connector_with_concurrent_legs_survives_a_failing_prefill() -> None:
    prefill = StubEngine(name="p0")
    spare = StubEngine(name="p1")
    for engine in (prefill, spare):
        await engine.start(HOST)
    async with rig(engines=([prefill, spare], [StubEngine(name="d0")]), connector=Connector.NIXL_PUSH) as r:
        assert await load(r, 10, 2) == {200: 10}         # both identities learnt
        prefill.fail_status = 500
        assert await load(r, 20, 4) == {200: 20}
        assert r.proxy.metrics.retries.value("prefill") >= 1


async def test_a_retried_mooncake_attempt_gets_a_fresh_transfer_id() -> None:
    hosts = [HOST, "127.0.0.2", "127.0.0.3"]
    port = common_port(hosts)
    failing, healthy, decode = StubEngine(name="p0", fail_status=500), StubEngine(name="p1"), StubEngine(name="d0")
    for engine, host in zip((failing, healthy, decode), hosts, strict=True):
        await engine.start(host, port)
    async with rig(engines=([failing, healthy], [decode]), connector=Connector.MOONCAKE, mooncake_bootstrap_port=port,
                   routing_policy=RoutingPolicy.ROUND_ROBIN) as r:
        ids = set()
        for n in range(4):
            assert (await r.post("/v1/completions", COMPLETION, {"X-Request-Id": f"r{n}"}))[0] == 200
        for engine in (failing, healthy):
            for leg in engine.seen:
                ids.add((leg.headers["X-Request-Id"], leg.body["kv_transfer_params"]["transfer_id"]))
        # Every attempt (the failed ones and their retries) went up under its own id and transfer id.
        assert failing.seen and all(t == f"xfer-{i}" for i, t in ids)
        assert len({i for i, _ in ids}) == len({t for _, t in ids}) == len(failing.seen) + len(healthy.seen)
        # Each client request had exactly one decode leg paired with a prefill that succeeded.
        succeeded = {leg.body["kv_transfer_params"]["transfer_id"] for leg in healthy.seen}
        assert len(succeeded) == 4
        assert sum(leg.body["kv_transfer_params"]["transfer_id"] in succeeded for leg in decode.seen) == 4


async def test_a_streamed_kv_load_failure_is_retried_on_another_pair_before_the_client_sees_it() -> None:
    """vLLM answers a streamed request whose KV cannot be loaded with 200, an error event and [DONE]
    (its stream generators). Nothing has reached the client then: the proxy treats it as a failed
    hand-off, retries on another decode, and the client gets the whole stream."""
    engines = ([StubEngine(name="p-a")], [StubEngine(name="d-a"), StubEngine(name="d-b")])
    async with rig(engines=engines, health_interval=0.2) as r:
        (p_a,), (d_a, d_b) = r.prefill, r.decode
        d_a.unreadable_from = frozenset({p_a.engine_id})
        for _ in range(12):
            status, text, _ = await r.post("/v1/completions", {**COMPLETION, "stream": True})
            assert status == 200 and '"error"' not in text and text.rstrip().endswith("data: [DONE]"), text
        assert r.proxy.metrics.kv_handoff_failures.value(p_a.url, d_a.url) >= 3
        health = await (await r.session.get(r.url + "/health")).json()
        assert [(p["prefill"], p["decode"]) for p in health["kvTransfer"]["failingPairs"]] == [(p_a.url, d_a.url)]
        assert d_b.completed == 12


async def test_a_pair_whose_kv_hand_offs_keep_failing_is_avoided_while_both_engines_serve_others() -> None:
    """d-a cannot load p-a's KV (500, as under kv_load_failure_policy fail) but reads p-b's. Each
    failed hand-off is retried elsewhere; after three the pair is avoided: p-a's requests go to d-b,
    d-a still takes p-b's, and /health, the metrics and the pod condition's source name the pair."""
    engines = ([StubEngine(name="p-a"), StubEngine(name="p-b")], [StubEngine(name="d-a"), StubEngine(name="d-b")])
    async with rig(engines=engines, health_interval=0.2) as r:  # LeastLoaded: ties broken at random
        (p_a, p_b), (d_a, d_b) = r.prefill, r.decode
        d_a.unreadable_from = frozenset({p_a.engine_id})
        assert await load(r, 40, 4, COMPLETION) == {200: 40}
        handoffs = r.proxy.metrics.kv_handoff_failures.value(p_a.url, d_a.url)
        assert handoffs >= 3
        health = await (await r.session.get(r.url + "/health")).json()
        (pair,) = health["kvTransfer"]["failingPairs"]
        assert (pair["prefill"], pair["decode"]) == (p_a.url, d_a.url) and pair["failures"] >= 3
        await r.ready()  # d-a's breaker (it failed legs) closed again on its healthy probes
        before = len(d_a.seen)
        assert await load(r, 40, 4, COMPLETION) == {200: 40}
        later = [seen.body["kv_transfer_params"]["remote_engine_id"] for seen in d_a.seen[before:]]
        assert later and set(later) == {p_b.engine_id}, later   # d-a serves, only the pair is avoided
        assert r.proxy.metrics.kv_handoff_failures.value(p_a.url, d_a.url) == handoffs
        assert p_a.completed > 0 and d_b.completed > 0
