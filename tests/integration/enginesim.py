"""Talking to `xpyd engine-sim` (the vLLM engine emulator) on loopback: the perf model its engines
run by default, a client session, token prompts, the proxy's prefill leg of the NIXL pull flow, and
`python -m xpyd.sim.emulator` processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from typing import IO, Any

import aiohttp

from xpyd.cluster.controlplane import free_ports
from xpyd.common.netguard import require_loopback
from xpyd.perf.model import DEFAULT_PROFILE, PerfModel
from xpyd.perf.shapes import lookup_model

HOST = "127.0.0.1"
KV_BYTES = lookup_model("llama-3.1-8b").kv_bytes_per_token("bf16")
PERF = PerfModel.from_profile(DEFAULT_PROFILE).with_kv_transfer(KV_BYTES, 100.0)
PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}


@contextlib.asynccontextmanager
async def client_session() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session whose idle connections close before the engine's 5 s keep-alive does."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


def token_prompt(tokens: int) -> list[int]:
    """A prompt of token ids: its length is exact."""
    return list(range(1, tokens + 1))


async def post(session: aiohttp.ClientSession, url: str, body: Any,
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """POST JSON, return (status, decoded JSON body)."""
    require_loopback(url.split("//")[1].split(":")[0], "test URL")
    async with session.post(url, json=body, headers=headers) as response:
        return response.status, await response.json()


async def prefill_leg(session: aiohttp.ClientSession, prefill: str, body: dict[str, Any],
                      request_id: str) -> dict[str, Any]:
    """The proxy's first leg (toy_proxy_server): max_tokens=1, no streaming, do_remote_decode."""
    leg = {key: value for key, value in body.items() if key not in ("stream", "stream_options", "min_tokens")}
    leg.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_KV))
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    status, answer = await post(session, f"{prefill}/v1/completions", leg, headers={"X-Request-Id": request_id})
    assert status == 200, answer
    params: dict[str, Any] = answer["kv_transfer_params"]
    return params


class EngineProcess:
    """`python -m xpyd.sim.emulator ARGS` on loopback, with its HTTP and side-channel ports; its log
    goes to a temporary file (a pipe nobody reads could block it)."""

    def __init__(self, args: Sequence[str], log: IO[str]) -> None:
        self.port, self.side_channel_port = free_ports(2)
        env = {**os.environ, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
               "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST, "POD_IP": HOST}
        self.log = log
        self.process = subprocess.Popen([sys.executable, "-m", "xpyd.sim.emulator", *args, f"--port={self.port}"],
                                        env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        self.url = f"http://{HOST}:{self.port}"

    async def wait_ready(self, session: aiohttp.ClientSession, timeout_s: float = 20.0) -> None:
        """Until /health answers 200."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.output()
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{self.url}/health") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.05)
        raise AssertionError(f"engine-sim not ready after {timeout_s} s: {self.output()}")

    def output(self) -> str:
        """Its log so far."""
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        """SIGTERM, wait (bounded), return the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


@contextlib.asynccontextmanager
async def engine_process(args: Sequence[str], session: aiohttp.ClientSession) -> AsyncIterator[EngineProcess]:
    """A ready engine process, stopped (SIGTERM) at the end."""
    with tempfile.TemporaryFile(mode="w+") as log:
        process = EngineProcess(args, log)
        try:
            await process.wait_ready(session)
            yield process
        finally:
            process.stop()
