"""Data-parallel prefill engines (one vLLM server, several DP ranks behind its own load balancer),
over real HTTP on loopback (stub engines in this process: `xpyd engine-sim` emulates one rank).

- MooncakeConnector: a prefill pod serves one bootstrap server for all its DP ranks; the proxy pins
  each prefill leg to a rank with `X-data-parallel-rank` and gives decode that rank's engine id, as
  vLLM's `examples/disaggregated/mooncake_connector/mooncake_connector_proxy.py` does.
- NixlPushConnector: each rank has its own engine id and side-channel port, so the identity decode
  registers with is learnt per rank and the prefill leg is pinned to the rank decode was told.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.eventually import eventually
from tests.integration.rig import COMPLETION, HOST, rig
from xpyd.api.models import Connector
from xpyd.proxy import protocol
from xpyd.testing.stubengine import StubEngine

pytestmark = pytest.mark.integration


async def _prefill(dp: int) -> StubEngine:
    engine = StubEngine(name="p0", data_parallel_size=dp)
    await engine.start(HOST)
    return engine


def _pairs(prefill: StubEngine, decode: StubEngine) -> list[tuple[str, str, str]]:
    """(X-Request-Id, prefill's DP rank header, decode's remote_engine_id) per request."""
    ranks = {leg.headers["X-Request-Id"]: leg.headers[protocol.DP_RANK_HEADER] for leg in prefill.seen}
    return sorted((leg.headers["X-Request-Id"], ranks[leg.headers["X-Request-Id"]],
                   leg.body["kv_transfer_params"]["remote_engine_id"]) for leg in decode.seen)


async def test_each_prefill_leg_is_pinned_to_a_rank_and_decode_gets_that_ranks_engine() -> None:
    prefill = await _prefill(dp=4)
    async with rig(engines=([prefill], [StubEngine(name="d0")]), connector=Connector.MOONCAKE,
                   mooncake_bootstrap_port=prefill.port) as r:
        for n in range(8):
            assert (await r.post("/v1/completions", COMPLETION, {"X-Request-Id": f"r{n}"}))[0] == 200
        pairs = _pairs(prefill, r.decode[0])
        assert len(pairs) == 8
        assert all(engine == f"p0-engine_dp{rank}" for _, rank, engine in pairs)
        # An idle instance spreads its legs over every rank.
        assert sorted(rank for _, rank, _ in pairs) == ["0", "0", "1", "1", "2", "2", "3", "3"]
        for leg in r.decode[0].seen:
            params = leg.body["kv_transfer_params"]
            assert params["remote_bootstrap_addr"] == f"http://{HOST}:{prefill.port}"
            assert params["transfer_id"] == f"xfer-{leg.headers['X-Request-Id']}"
            assert protocol.DP_RANK_HEADER not in leg.headers   # decode's own load balancer picks its rank
        assert r.proxy.pools["prefill"].instances[prefill.url].rank_outstanding == {}


async def test_concurrent_legs_go_to_the_least_busy_rank() -> None:
    prefill = await _prefill(dp=2)
    async with rig(engines=([prefill], [StubEngine(name="d0")]), connector=Connector.MOONCAKE,
                   mooncake_bootstrap_port=prefill.port) as r:
        prefill.hang = True
        held = [asyncio.ensure_future(r.post("/v1/completions", COMPLETION, {"X-Request-Id": f"h{n}"}))
                for n in range(4)]
        await eventually(lambda: prefill.started == 4, what="four prefill legs in flight")
        ranks = sorted(leg.headers[protocol.DP_RANK_HEADER] for leg in prefill.seen)
        assert ranks == ["0", "0", "1", "1"]
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)


async def test_a_restarted_prefill_engine_is_asked_for_its_ranks_again() -> None:
    prefill = await _prefill(dp=1)
    async with rig(engines=([prefill], [StubEngine(name="d0")]), connector=Connector.MOONCAKE,
                   mooncake_bootstrap_port=prefill.port) as r:
        assert (await r.post("/v1/completions", COMPLETION, {"X-Request-Id": "before"}))[0] == 200
        instance = r.proxy.pools["prefill"].instances[prefill.url]
        assert instance.mooncake_engines == {0: "p0-engine"}
        # The engine restarts (loading: 503 on /health) and comes back with two ranks and new ids.
        prefill.health_status = 503
        await eventually(lambda: instance.healthy is False, what="the restart seen")
        prefill.name, prefill.data_parallel_size = "p0-restarted", 2
        prefill.health_status = 200
        await eventually(lambda: instance.serving(), what="the engine back")
        for n in range(2):
            assert (await r.post("/v1/completions", COMPLETION, {"X-Request-Id": f"after{n}"}))[0] == 200
        engines = {leg.body["kv_transfer_params"]["remote_engine_id"] for leg in r.decode[0].seen[1:]}
        assert engines == {"p0-restarted-engine_dp0", "p0-restarted-engine_dp1"}


async def test_a_bootstrap_server_reporting_no_engine_is_a_prefill_failure() -> None:
    broken = StubEngine(name="p0", data_parallel_size=0)           # /query answers {}
    await broken.start(HOST)
    async with rig(engines=([broken], [StubEngine(name="d0")]), connector=Connector.MOONCAKE,
                   mooncake_bootstrap_port=broken.port) as r:
        status, answer, _ = await r.post("/v1/completions", COMPLETION)
        assert status == 503 and "Prefill failed" in answer["error"]["message"]
        assert broken.seen == [] and r.decode[0].seen == []


async def _push_rig_requests(dp: int, count: int) -> tuple[StubEngine, StubEngine, Any]:
    """`count` requests, one after another, through a NixlPushConnector proxy in front of one
    prefill engine with `dp` ranks (the proxy told so, as the operator renders it)."""
    prefill, decode = await _prefill(dp), StubEngine(name="d0")
    async with rig(engines=([prefill], [decode]), connector=Connector.NIXL_PUSH,
                   prefill_data_parallel_size=dp) as r:
        for n in range(count):
            assert (await r.post("/v1/completions", COMPLETION, {"X-Request-Id": f"r{n}"}))[0] == 200
        learnt = dict(r.proxy.pools["prefill"].instances[prefill.url].push_identities)
    return prefill, decode, learnt


async def test_nixl_push_learns_each_ranks_identity_and_pins_prefill_to_the_rank_decode_was_told() -> None:
    prefill, decode, learnt = await _push_rig_requests(dp=2, count=6)
    assert sorted(learnt) == [0, 1]
    for rank, identity in learnt.items():
        assert identity["remote_engine_id"] == f"p0-engine_dp{rank}"
        assert identity["remote_port"] == prefill.side_channel_port + rank
    pinned = {leg.headers["X-Request-Id"]: int(leg.headers[protocol.DP_RANK_HEADER]) for leg in prefill.seen}
    assert len(pinned) == 6 and sorted(pinned.values()) == [0, 0, 0, 1, 1, 1]
    # One decode leg per request, each told the identity of the rank its prefill leg was pinned to
    # and the internal request id that prefill answered with.
    assert len(decode.seen) == 6
    for leg in decode.seen:
        request_id = leg.headers["X-Request-Id"]
        assert leg.body["kv_transfer_params"] == protocol.push_decode_params(learnt[pinned[request_id]],
                                                                             prefill.internal_ids[request_id])


async def test_nixl_push_without_data_parallelism_pins_nothing() -> None:
    prefill, decode, learnt = await _push_rig_requests(dp=1, count=3)
    assert list(learnt) == [0] and learnt[0]["remote_engine_id"] == "p0-engine"
    assert all(protocol.DP_RANK_HEADER not in leg.headers for leg in prefill.seen)
    assert len(decode.seen) == 3
