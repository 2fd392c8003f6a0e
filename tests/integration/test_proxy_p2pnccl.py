"""P2pNcclConnector registration over real ZMQ (loopback): engines that register with the proxy
join its pools, and the request id tells each leg its peer's registered ZMQ address."""

from __future__ import annotations

import asyncio
import re
import socket
from typing import Any

import msgpack
import pytest
import zmq

from tests.eventually import eventually
from tests.integration.rig import COMPLETION, HOST, rig
from xpyd.api.models import Connector
from xpyd.proxy.p2pnccl import Registrations
from xpyd.testing.stubengine import StubEngine

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


async def test_registered_engines_serve_with_their_zmq_addresses() -> None:
    prefill, decode = StubEngine(name="p0"), StubEngine(name="d0")
    for engine in (prefill, decode):
        await engine.start(HOST)
    port = _free_port()
    loop = asyncio.get_running_loop()
    async with rig(engines=([], []), connector=Connector.P2P_NCCL) as r:
        def publish(role: Any, endpoints: Any) -> None:
            loop.call_soon_threadsafe(r.proxy.set_endpoints, role, endpoints, "registration")

        registrations = Registrations(HOST, port, publish)
        registrations.start()
        context = zmq.Context.instance()
        dealer = context.socket(zmq.DEALER)
        dealer.connect(f"tcp://{HOST}:{port}")
        try:
            for kind, engine, zmq_port in (("P", prefill, 21001), ("D", decode, 21002)):
                dealer.send(msgpack.dumps({"type": kind, "http_address": f"{HOST}:{engine.port}",
                                           "zmq_address": f"{HOST}:{zmq_port}"}))
            await eventually(lambda: all(p.counts()["eligible"] == 1 for p in r.proxy.pools.values()),
                             what="registered engines eligible")
            status, _, _ = await r.post("/v1/completions", COMPLETION)
            assert status == 200
            upstream_id = prefill.seen[0].headers["X-Request-Id"]
            assert decode.seen[0].headers["X-Request-Id"] == upstream_id
            assert re.fullmatch(rf"___prefill_addr_{HOST}:21001___decode_addr_{HOST}:21002_[0-9a-f]{{32}}", upstream_id)
        finally:
            registrations.stop()
            dealer.close(linger=0)
            for engine in (prefill, decode):
                await engine.stop()
