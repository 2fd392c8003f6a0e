"""Pairing by KV compatibility hash, through Kubernetes discovery on a mock API server (real HTTP,
loopback): with prefill and decode pods of two revisions ("old" and "new"), every request's decode
leg reads the KV of a prefill of its own revision; when the old decode goes, the new pair serves
everything; when no pair is left, requests get a 503 that says why and readiness fails."""

from __future__ import annotations

import asyncio
import copy

import pytest

from tests.eventually import eventually
from tests.integration.fakekube import FakeKube
from tests.integration.rig import COMPLETION, NAMESPACE, Rig, common_port, pod, pod_discovery, rig
from xpyd.api.naming import Role
from xpyd.common.netguard import require_loopback
from xpyd.proxy.pool import Endpoint
from xpyd.testing.stubengine import StubEngine

pytestmark = pytest.mark.integration


async def _load(r: Rig, count: int, concurrency: int) -> list[tuple[int, object]]:
    """`count` completions from `concurrency` clients at once (bounded in time); (status, answer) each."""
    async def client(n: int) -> list[tuple[int, object]]:
        results = []
        for _ in range(n):
            status, answer, _ = await r.post("/v1/completions", COMPLETION)
            results.append((status, answer))
        return results

    batches = await asyncio.wait_for(asyncio.gather(*(client(count // concurrency) for _ in range(concurrency))), 30)
    return [result for batch in batches for result in batch]


def _prefills_read(decode: StubEngine) -> set[str]:
    """The engine ids of the prefill engines whose KV the decode legs this engine got read."""
    return {seen.body["kv_transfer_params"]["remote_engine_id"] for seen in decode.seen}


async def _ready(r: Rig) -> tuple[int, object]:
    async with r.session.get(r.url + "/ready") as response:
        return response.status, await response.json()


async def test_prefill_and_decode_of_different_revisions_are_never_paired(fake: FakeKube) -> None:
    hosts = [require_loopback(f"127.0.0.{n}") for n in (2, 3, 4, 5)]
    port = common_port(hosts)
    engines = [StubEngine(name=name) for name in ("p-old", "p-new", "d-old", "d-new")]
    for engine, host in zip(engines, hosts, strict=True):
        await engine.start(host, port)
    p_old, p_new, d_old, d_new = engines
    async with rig(engines=([], [])) as r:
        pods = [pod("p-old", "prefill", p_old.host, compat="old"), pod("p-new", "prefill", p_new.host, compat="new"),
                pod("d-old", "decode", d_old.host, compat="old"), pod("d-new", "decode", d_new.host, compat="new")]
        for item in pods:
            await fake.put_object("v1/pods", copy.deepcopy(item))
        try:
            async with pod_discovery(str(fake.url), r, port):
                await r.ready(prefill=2, decode=2)
                results = await _load(r, 80, concurrency=8)
                assert [status for status, _ in results] == [200] * 80, results
                # Both pairs served, and never across.
                assert min(e.started for e in engines) > 0
                assert p_old.started + p_new.started == d_old.started + d_new.started == 80
                assert _prefills_read(d_old) == {p_old.engine_id}
                assert _prefills_read(d_new) == {p_new.engine_id}

                # The old decode goes: the old prefill has no partner and gets nothing new.
                async with r.session.delete(f"{str(fake.url).rstrip('/')}/api/v1/namespaces/{NAMESPACE}/pods/d-old") \
                        as deleted:
                    assert deleted.status == 200
                await eventually(lambda: d_old.url not in r.proxy.pools["decode"].instances, what="d-old forgotten")
                before = p_old.started
                results = await _load(r, 40, concurrency=4)
                assert [status for status, _ in results] == [200] * 40, results
                assert p_old.started == before
                assert _prefills_read(d_new) == {p_new.engine_id}
                assert (await _ready(r))[0] == 200

                # The new prefill goes too: an old prefill and a new decode remain, which cannot pair.
                async with r.session.delete(f"{str(fake.url).rstrip('/')}/api/v1/namespaces/{NAMESPACE}/pods/p-new") \
                        as deleted:
                    assert deleted.status == 200
                await eventually(lambda: p_new.url not in r.proxy.pools["prefill"].instances, what="p-new forgotten")
                before = p_old.started + d_new.started
                status, answer, _ = await r.post("/v1/completions", COMPLETION)
                assert status == 503
                assert "KV compatibility" in answer["error"]["message"] and answer["error"]["code"] == 503
                assert p_old.started + d_new.started == before
                connector = r.proxy.config.connector.value
                assert r.proxy.metrics.requests.value(connector, "completions", "incompatible") == 1
                assert await _ready(r) == (503, {"status": "unavailable", "missing": [],
                                                 "reason": "no_compatible_pair",
                                                 "compat": {"prefill": ["old"], "decode": ["new"]}})
        finally:
            for engine in engines:
                await engine.stop()


def _label(r: Rig, compat: dict[str, str]) -> None:
    """Give the rig's engines these KV compatibility hashes (by engine name), as discovery would."""
    roles: list[tuple[Role, list[StubEngine]]] = [("prefill", r.prefill), ("decode", r.decode)]
    for role, engines in roles:
        r.proxy.set_endpoints(role, [Endpoint(e.url, compat=compat[e.name]) for e in engines])


async def test_a_failed_decode_is_retried_on_the_other_revisions_pair() -> None:
    engines = ([StubEngine(name="p-a"), StubEngine(name="p-b")],
               [StubEngine(name="d-a", fail_status=500), StubEngine(name="d-b")])
    async with rig(engines=engines) as r:
        _label(r, {"p-a": "a", "p-b": "b", "d-a": "a", "d-b": "b"})
        results = await _load(r, 20, concurrency=2)
        assert [status for status, _ in results] == [200] * 20, results
        p_a, p_b = r.prefill
        d_a, d_b = r.decode
        assert d_a.started > 0 and p_a.started == d_a.started       # each failed decode was p-a's partner...
        assert d_b.completed == 20 and _prefills_read(d_b) == {p_b.engine_id}   # ...and its retry went to p-b


async def test_a_failed_decode_with_no_other_pair_is_a_decode_failure_not_a_skew() -> None:
    engines = ([StubEngine(name="p-a")], [StubEngine(name="d-a", fail_status=500), StubEngine(name="d-c")])
    async with rig(engines=engines) as r:
        _label(r, {"p-a": "a", "d-a": "a", "d-c": "c"})
        status, answer, _ = await r.post("/v1/completions", COMPLETION)
        assert status == 503 and "Decode failed on 1 instance(s)" in answer["error"]["message"], answer
        assert r.decode[1].started == 0
        connector = r.proxy.config.connector.value
        assert r.proxy.metrics.requests.value(connector, "completions", "unavailable") == 1
        assert r.proxy.metrics.requests.value(connector, "completions", "incompatible") == 0


async def test_with_the_decode_only_fallback_no_pair_means_decode_alone() -> None:
    engines = ([StubEngine(name="p-a")], [StubEngine(name="d-b")])
    async with rig(engines=engines, decode_only_fallback=True) as r:
        _label(r, {"p-a": "a", "d-b": "b"})
        status, answer, _ = await r.post("/v1/completions", COMPLETION)
        assert status == 200, answer
        assert (r.prefill[0].started, r.decode[0].started) == (0, 1)
        assert r.decode[0].seen[0].body.get("kv_transfer_params") is None       # it computed the prompt itself
        assert r.proxy.metrics.fallbacks.value("no_compatible_pair") == 1
        assert (await _ready(r))[0] == 200


async def test_mid_rollout_the_draining_old_pair_serves_until_the_new_revision_has_both_roles() -> None:
    """Both roles roll: the new prefill is ready, the old one drains, the decodes are all old. Per
    role the old prefill is only a fallback, yet it is the only prefill a decode can read: the old
    pair serves. Once a new decode is ready, the new pair serves and the old prefill gets nothing."""
    engines = ([StubEngine(name="p-old"), StubEngine(name="p-new")],
               [StubEngine(name="d-old"), StubEngine(name="d-new")])
    async with rig(engines=engines) as r:
        p_old, p_new = r.prefill
        d_old, d_new = r.decode
        r.proxy.set_endpoints("prefill", [Endpoint(p_old.url, compat="old", terminating=True),
                                          Endpoint(p_new.url, compat="new")])
        r.proxy.set_endpoints("decode", [Endpoint(d_old.url, compat="old")])
        assert (await _ready(r))[0] == 200
        results = await _load(r, 20, concurrency=4)
        assert [status for status, _ in results] == [200] * 20, results
        assert (p_old.started, p_new.started, d_old.completed) == (20, 0, 20)

        r.proxy.set_endpoints("decode", [Endpoint(d_old.url, compat="old"), Endpoint(d_new.url, compat="new")])
        await r.ready(prefill=1, decode=2)  # the new decode probed healthy (the old prefill is terminating)
        results = await _load(r, 20, concurrency=4)
        assert [status for status, _ in results] == [200] * 20, results
        assert (p_old.started, p_new.started, d_new.completed) == (20, 20, 20)
        assert _prefills_read(d_new) == {p_new.engine_id}
