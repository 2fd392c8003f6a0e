"""Stopping the proxy process as Kubernetes does (SIGTERM), in front of `xpyd engine-sim` processes
(real processes, real HTTP, loopback): readiness fails at once while liveness stays up, requests
keep being served through the drain period, streams in flight finish intact, the process exits 0;
a stream longer than the finish timeout is cut and the exit stays bounded; SIGINT skips the drain."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest

from tests.integration.processes import HOST, kill, start_engine, start_proxy, wait_eligible, wait_for
from xpyd.cluster.controlplane import free_ports

pytestmark = pytest.mark.integration

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROMPT = "hello " * 50
#: Modelled time runs at wall-clock speed: a decode step of the bundled profile takes milliseconds.
TIME_SCALE = "1"
DRAIN_SECONDS = 2.0


@dataclass
class Engines:
    """One prefill and one decode `engine-sim` process."""

    prefill: str
    decode: str
    processes: list[subprocess.Popen[bytes]]


@pytest.fixture
async def engines() -> AsyncIterator[Engines]:
    ports = free_ports(4)
    processes = [start_engine(role, port, side_port, TIME_SCALE)
                 for role, port, side_port in zip(("prefill", "decode"), ports[:2], ports[2:], strict=True)]
    try:
        urls = [f"http://{HOST}:{port}" for port in ports[:2]]
        for url, process in zip(urls, processes, strict=True):
            await wait_for(url + "/health", process)
        yield Engines(urls[0], urls[1], processes)
    finally:
        kill(processes)


async def _start_proxy(engines: Engines, *extra: str) -> tuple[str, subprocess.Popen[bytes]]:
    (port,) = free_ports(1)
    process = start_proxy(port, [engines.prefill], [engines.decode], *extra)
    url = f"http://{HOST}:{port}"
    try:
        await wait_for(url + "/ready", process)
        await wait_eligible(url, prefill=1, decode=1)
    except BaseException:
        kill([process])
        raise
    engines.processes.append(process)
    return url, process


async def _exit_code(process: subprocess.Popen[bytes], timeout: float) -> int:
    """The process's exit code, waiting at most `timeout` seconds (without blocking the loop)."""
    deadline = time.monotonic() + timeout
    while process.poll() is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"the proxy did not exit within {timeout} s")
        await asyncio.sleep(0.05)
    return process.returncode


def _stream_body(tokens: int) -> dict[str, object]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}}


def _events(text: str) -> list[str]:
    return [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]


async def test_sigterm_fails_readiness_serves_through_the_drain_and_finishes_streams(engines: Engines) -> None:
    url, process = await _start_proxy(engines, "--drain-seconds", str(DRAIN_SECONDS), "--finish-timeout", "30")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        # A stream that outlasts the drain period (about 6 s of decode): it is in flight when the listener closes.
        streamed = await session.post(url + "/v1/completions", json=_stream_body(1500))
        assert streamed.status == 200
        first = await streamed.content.readline()
        assert first.startswith(b"data: ")
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        # Readiness fails at once; liveness does not.
        async with session.get(url + "/ready") as response:
            assert response.status == 503
        assert time.monotonic() - signalled < 1.0
        async with session.get(url + "/health") as response:
            assert response.status == 200 and (await response.json())["draining"] is True
        # A request arriving during the drain period is served, and its connection is not kept.
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
        async with session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            assert response.headers.get("Connection", "").lower() == "close"
            assert (await response.json())["usage"]["completion_tokens"] == 4
        # So do the proxy's own answers (here a 400).
        async with session.post(url + "/v1/completions", data=b"{not json",
                                headers={"Content-Type": "application/json"}) as response:
            assert response.status == 400 and response.headers.get("Connection", "").lower() == "close"
        assert time.monotonic() - signalled < DRAIN_SECONDS
        # After the drain period the listener is closed: new connections are refused.
        await asyncio.sleep(DRAIN_SECONDS + 0.5 - (time.monotonic() - signalled))
        assert process.poll() is None, "the proxy exited while a stream was in flight"
        with pytest.raises(aiohttp.ClientConnectionError):
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)):
                pass
        # The stream in flight comes through intact, then the process exits 0.
        rest = (await streamed.read()).decode()
        streamed.release()
    events = _events(first.decode() + rest)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " tok" * 1500
    assert chunks[-1]["usage"]["completion_tokens"] == 1500
    assert await _exit_code(process, 10) == 0


async def test_a_stream_longer_than_the_finish_timeout_is_cut_and_the_exit_is_bounded(engines: Engines) -> None:
    url, process = await _start_proxy(engines, "--drain-seconds", "0.5", "--finish-timeout", "1")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        streamed = await session.post(url + "/v1/completions", json=_stream_body(4000))
        assert streamed.status == 200
        await streamed.content.readline()
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert await _exit_code(process, 10) == 0
        took = time.monotonic() - signalled
        with pytest.raises(aiohttp.ClientPayloadError):
            await streamed.read()
        streamed.release()
    assert 1.5 <= took < 5.0, took


async def test_sigint_skips_the_drain_period(engines: Engines) -> None:
    _, process = await _start_proxy(engines, "--drain-seconds", "30")
    signalled = time.monotonic()
    process.send_signal(signal.SIGINT)
    assert await _exit_code(process, 10) == 0
    assert time.monotonic() - signalled < 5.0


async def test_a_second_sigterm_ends_the_drain_period(engines: Engines) -> None:
    url, process = await _start_proxy(engines, "--drain-seconds", "30")
    process.send_signal(signal.SIGTERM)
    async with aiohttp.ClientSession() as session:
        for _ in range(50):
            async with session.get(url + "/ready") as response:
                if response.status == 503:
                    break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("readiness never failed")
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert await _exit_code(process, 10) == 0
    assert time.monotonic() - signalled < 5.0
