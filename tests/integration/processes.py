"""Real `xpyd engine-sim` and `xpyd proxy` processes on loopback for the integration tests: start
them, wait until they serve, kill what is left."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable

import aiohttp

from xpyd.common.netguard import require_loopback

HOST = require_loopback("127.0.0.1")


def start_engine(role: str, port: int, side_port: int, time_scale: str, *extra: str) -> subprocess.Popen[bytes]:
    """An `engine-sim` process of `role` serving HTTP on `port` and its NIXL side channel on
    `side_port` (`extra`: more of its arguments). Take both ports from the same `free_ports` call as
    every other port of the test: a side channel on "any free port" (0) could take a port chosen
    for a process not started yet."""
    env = {**os.environ, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port)}
    return subprocess.Popen(
        [sys.executable, "-m", "xpyd.sim.emulator", "--role", role, "--host", HOST, "--port", str(port),
         "--time-scale", time_scale, *extra], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_proxy(port: int, prefill: Iterable[str], decode: Iterable[str], *extra: str) -> subprocess.Popen[bytes]:
    """A proxy process in front of fixed engine URLs, probing their health every 0.2 s."""
    return subprocess.Popen(
        [sys.executable, "-m", "xpyd.proxy", "--host", HOST, "--port", str(port),
         *[a for url in prefill for a in ("--prefill", url)], *[a for url in decode for a in ("--decode", url)],
         "--health-interval", "0.2", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def wait_for(url: str, process: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Wait until `url` answers 200 (the process must stay alive)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            assert process.poll() is None, f"the process behind {url} exited"
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError(f"{url} never answered 200")


async def wait_eligible(proxy: str, prefill: int, decode: int, timeout: float = 10.0) -> None:
    """Wait until the proxy's /health counts this many eligible instances per role."""
    deadline = time.monotonic() + timeout
    state = None
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            async with session.get(proxy + "/health") as response:
                state = await response.json()
            if state["prefill"]["eligible"] == prefill and state["decode"]["eligible"] == decode:
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"the proxy never saw {prefill} prefill and {decode} decode instances: {state}")


def kill(processes: Iterable[subprocess.Popen[bytes]]) -> None:
    """SIGKILL whatever still runs and reap it."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
