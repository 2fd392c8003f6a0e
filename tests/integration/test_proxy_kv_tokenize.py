"""The proxy's KVAware routing and the emulator's `/tokenize` agree: a proxy process (the Events index)
in front of emulated engines (`xpyd engine-sim` processes on their own loopback addresses, publishing
their KV events) sends each text or chat conversation's next turn to the prefill engine that caches
its prefix, with the token ids the engines' own `/tokenize` gave it; and the hits the proxy predicted
are, token for token, the hits the prefill engines report (`vllm:prefix_cache_hits_total`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp
import pytest

from tests.integration.processes import kill, start_proxy, wait_eligible, wait_for
from tests.integration.test_proxy_kv_routing import _free_port_on
from xpyd.cluster.controlplane import free_ports

pytestmark = pytest.mark.integration

MODEL = "llama-8b"
BLOCK = 16
PREFILLS = ("127.0.0.5", "127.0.0.6", "127.0.0.7")
DECODE_HOST = "127.0.0.8"


@dataclass
class Pool:
    proxy: str
    prefills: list[str]
    decode: str


def engine(role: str, host: str, port: int, side_port: int, events_port: int) -> subprocess.Popen[bytes]:
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}",
              "replay_endpoint": f"tcp://*:{events_port + 100}", "topic": "kv-events"}
    return subprocess.Popen(
        [sys.executable, "-m", "xpyd.sim.emulator", "--role", role, "--host", host, "--port", str(port),
         "--served-model-name", MODEL, "--time-scale", "20", "--kv-events-config", json.dumps(events)],
        env={**os.environ, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    events_port = _free_port_on([*PREFILLS, DECODE_HOST])
    http, side, proxy_port = free_ports(3)
    processes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for host in (*PREFILLS, DECODE_HOST):
            role = "decode" if host == DECODE_HOST else "prefill"
            processes[f"http://{host}:{http}"] = engine(role, host, http, side, events_port)
        prefills = [f"http://{host}:{http}" for host in PREFILLS]
        decode = f"http://{DECODE_HOST}:{http}"
        proxy = f"http://127.0.0.1:{proxy_port}"
        processes[proxy] = start_proxy(proxy_port, prefills, [decode], "--routing-policy", "KVAware",
                                       "--kv-index", "Events", "--kv-block-size", str(BLOCK),
                                       "--kv-events-port", str(events_port),
                                       "--kv-events-replay-port", str(events_port + 100))
        for url, process in processes.items():
            await wait_for(url + "/health", process)
        await wait_eligible(proxy, prefill=len(PREFILLS), decode=1)
        yield Pool(proxy, prefills, decode)
    finally:
        kill(processes.values())


async def samples(session: aiohttp.ClientSession, url: str, name: str) -> dict[str, float]:
    """`name`'s samples on `url`'s /metrics, by their label text."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name):
            key, value = line.rsplit(" ", 1)
            out[key[len(name):]] = float(value)
    return out


async def total(session: aiohttp.ClientSession, url: str, name: str) -> float:
    return sum((await samples(session, url, name)).values())


def completions(conversation: int, turns: int) -> Iterator[dict[str, object]]:
    """A text conversation: each turn's prompt is the one before, its answer, and a new question."""
    prompt = f"Conversation {conversation}. " + "You are a helpful assistant who answers briefly. " * 12
    for turn in range(turns):
        prompt += f" Question {turn} of {conversation}: " + "why is the sky blue today? " * (4 + turn)
        yield {"model": MODEL, "prompt": prompt, "max_tokens": 8}
        prompt += " tok" * 8


def chats(conversation: int, turns: int) -> Iterator[dict[str, object]]:
    messages: list[dict[str, str]] = [{"role": "system", "content": f"Assistant {conversation}. " + "Be kind. " * 40}]
    for turn in range(turns):
        messages = [*messages, {"role": "user", "content": f"Turn {turn}: " + "tell me more. " * (6 + turn)}]
        yield {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": turn % 2 == 1}
        messages = [*messages, {"role": "assistant", "content": " tok" * 8}]


async def test_text_and_chat_turns_go_where_their_prefix_is_and_the_hits_agree(pool: Pool) -> None:
    async with aiohttp.ClientSession() as session:
        for path, conversations in (("/v1/completions", completions), ("/v1/chat/completions", chats)):
            for conversation in range(4):
                homes = set()
                for body in conversations(conversation, 4):
                    before = [await total(session, url, "vllm:request_success_total") for url in pool.prefills]
                    async with session.post(pool.proxy + path, json=body) as response:
                        assert response.status == 200, await response.text()
                        await response.read()
                    after = [await total(session, url, "vllm:request_success_total") for url in pool.prefills]
                    homes |= {url for url, b, a in zip(pool.prefills, before, after, strict=True) if a > b}
                assert len(homes) == 1, f"{path} conversation {conversation}'s turns went to {homes}"
        hits = sum([await total(session, url, "vllm:prefix_cache_hits_total") for url in pool.prefills])
        predicted = await samples(session, pool.proxy, "xpyd_proxy_kv_predicted_hit_tokens_total")
        tokenized = await samples(session, pool.proxy, "xpyd_proxy_kv_tokenize_seconds_count")
        failures = await total(session, pool.proxy, "xpyd_proxy_kv_tokenize_failures_total")
    assert sum(tokenized.values()) == 32 and failures == 0, (tokenized, failures)   # one /tokenize per request
    # 8 conversations of 4 turns: the 24 later turns hit; the proxy expected exactly what the engines found.
    assert hits > 24 * 10 * BLOCK
    assert predicted['{role="prefill"}'] == hits
