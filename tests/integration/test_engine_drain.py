"""The engines' preStop drain, the command the operator renders into every engine pod
(`xpyd.render.drain`), run against an `xpyd engine-sim` process: while requests keep coming (the
proxy still sends a terminating pod new requests when its role has no other instance) it does not
end, so the kubelet does not yet SIGTERM an engine that is serving; once they stop it ends after its
quiet period, well before its timeout. (The quiet period is shortened here to keep the test short.)"""

from __future__ import annotations

import asyncio
import http.server
import subprocess
import sys
import threading
import time

import aiohttp
import pytest

from tests.integration.processes import HOST, kill, start_engine, wait_for
from xpyd.api.models import DisaggregatedServingSpec
from xpyd.cluster.controlplane import free_ports
from xpyd.render import drain
from xpyd.render.engine import drain_command
from xpyd.sim.emulator.config import DEFAULT_MODEL

pytestmark = pytest.mark.integration

QUIET_SECONDS = 1.5
TIMEOUT_SECONDS = 30
#: How long the requests keep coming: twice the quiet period.
LOAD_SECONDS = 2 * QUIET_SECONDS


async def test_the_drain_waits_while_requests_come_and_ends_once_the_engine_is_idle() -> None:
    port, side_port = free_ports(2)
    engine = start_engine("decode", port, side_port, "1")
    drain: subprocess.Popen[bytes] | None = None
    try:
        url = f"http://{HOST}:{port}"
        await wait_for(url + "/health", engine)
        spec = DisaggregatedServingSpec.model_validate(
            {"model": {"name": "m"}, "engine": {"port": port}, "decode": {"drainTimeoutSeconds": TIMEOUT_SECONDS}})
        command = drain_command(spec, "decode")
        assert command[0] == "python3" and command[3:5] == [str(port), str(TIMEOUT_SECONDS)]
        drain = subprocess.Popen([sys.executable, *command[1:-2], str(QUIET_SECONDS), command[-1]])
        loop = asyncio.get_running_loop()
        body = {"model": DEFAULT_MODEL, "prompt": "hello", "max_tokens": 2}
        served = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            until = loop.time() + LOAD_SECONDS
            while loop.time() < until:          # a short request every 0.2 s: never running at a poll
                async with session.post(url + "/v1/completions", json=body) as response:
                    assert response.status == 200
                    served += 1
                await asyncio.sleep(0.2)
        assert served >= 10
        assert drain.poll() is None, "the drain ended while the engine was still getting requests"
        idle_since = loop.time()
        while drain.poll() is None and loop.time() < idle_since + TIMEOUT_SECONDS / 2:
            await asyncio.sleep(0.1)
        assert drain.returncode == 0, "the drain did not end on an idle engine well before its timeout"
    finally:
        kill([engine, *([drain] if drain else [])])


def test_a_worker_waits_while_its_leader_answers_and_stops_once_it_is_gone() -> None:
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    leader = http.server.ThreadingHTTPServer((HOST, 0), Health)
    serving = threading.Thread(target=leader.serve_forever, daemon=True)
    serving.start()
    follower = threading.Thread(target=drain.follow_leader, args=(HOST, leader.server_address[1], 30.0), daemon=True)
    follower.start()
    try:
        time.sleep(2.5)
        assert follower.is_alive(), "the worker stopped while its leader still served"
    finally:
        leader.shutdown()
        leader.server_close()
    follower.join(timeout=5)
    assert not follower.is_alive(), "the worker still waits for a leader that is gone"
