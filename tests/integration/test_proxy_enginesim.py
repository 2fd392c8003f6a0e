"""The proxy process in front of `xpyd engine-sim` processes (real processes, real HTTP, loopback):
the NIXL hand-off really happens (decode counts the prompt as `external_kv_transfer`), streams come
through intact with usage, a client's disconnect aborts the decode request in the engine, and a
decode engine killed mid-load costs no client an error."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest

from tests.integration.processes import HOST, kill, start_engine, start_proxy, wait_eligible, wait_for
from xpyd.cluster.controlplane import free_ports

pytestmark = pytest.mark.integration

#: Modelled time runs this many times faster than the wall clock.
TIME_SCALE = "5"
PROMPT = "hello " * 50



@dataclass
class Cluster:
    proxy: str
    prefill: list[str]
    decode: list[str]
    processes: dict[str, subprocess.Popen[bytes]]


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    ports = free_ports(9)
    side_ports = iter(ports[5:])
    processes: dict[str, subprocess.Popen[bytes]] = {}
    roles = {"prefill": ports[:2], "decode": ports[2:4]}
    try:
        for role, role_ports in roles.items():
            for port in role_ports:
                processes[f"http://{HOST}:{port}"] = start_engine(role, port, next(side_ports), TIME_SCALE)
        urls = {role: [f"http://{HOST}:{port}" for port in role_ports] for role, role_ports in roles.items()}
        proxy = f"http://{HOST}:{ports[4]}"
        processes[proxy] = start_proxy(ports[4], urls["prefill"], urls["decode"])
        for url, process in processes.items():
            await wait_for(url + "/health", process)
        await wait_eligible(proxy, prefill=2, decode=2)
        yield Cluster(proxy, urls["prefill"], urls["decode"], processes)
    finally:
        kill(processes.values())


async def _metric(session: aiohttp.ClientSession, urls: list[str], name: str, labels: str = "") -> float:
    total = 0.0
    for url in urls:
        try:
            async with session.get(url + "/metrics") as response:
                text = await response.text()
        except aiohttp.ClientError:
            continue
        for line in text.splitlines():
            if line.startswith(name + "{") and labels in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


async def test_the_kv_hand_off_happens_and_streams_arrive_intact(cluster: Cluster) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": PROMPT, "max_tokens": 12}
        async with session.post(cluster.proxy + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
        assert answer["choices"][0]["text"] == " tok" * 12 and answer["usage"]["completion_tokens"] == 12
        chat = {"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
        async with session.post(cluster.proxy + "/v1/chat/completions", json=chat) as response:
            assert response.status == 200
            text = await response.text()
        events = [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert content == " tok" * 8 and chunks[-1]["usage"]["completion_tokens"] == 8
        # Decode received the KV: its prompts came over the (emulated) NIXL transfer, none computed locally.
        transferred = await _metric(session, cluster.decode, "vllm:prompt_tokens_by_source_total",
                                    'source="external_kv_transfer"')
        local = await _metric(session, cluster.decode, "vllm:prompt_tokens_by_source_total", 'source="local_compute"')
        assert transferred > 0 and local == 0
        assert await _metric(session, cluster.prefill, "vllm:request_success_total") == 2


async def test_a_client_disconnect_aborts_the_decode_request(cluster: Cluster) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": PROMPT, "max_tokens": 4000, "stream": True}
        response = await session.post(cluster.proxy + "/v1/completions", json=body)
        assert response.status == 200
        await response.content.readline()
        response.close()
        for _ in range(100):
            if await _metric(session, cluster.decode, "vllm:request_success_total", 'finished_reason="abort"') == 1:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the decode engine never saw the abort")


async def test_a_decode_engine_killed_mid_load_costs_no_client_an_error(cluster: Cluster) -> None:
    statuses: list[int] = []
    failures: list[str] = []
    body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": PROMPT, "max_tokens": 4}

    async def client(session: aiohttp.ClientSession, count: int) -> None:
        for _ in range(count):
            async with session.post(cluster.proxy + "/v1/completions", json=body) as response:
                text = await response.text()
                statuses.append(response.status)
                if response.status != 200:
                    failures.append(text)

    async with aiohttp.ClientSession() as session:
        clients = asyncio.gather(*(client(session, 15) for _ in range(8)))
        while len(statuses) < 30:
            await asyncio.sleep(0.01)
        cluster.processes[cluster.decode[0]].send_signal(signal.SIGKILL)
        await asyncio.wait_for(clients, 60)
    assert statuses == [200] * 120, failures



async def test_failed_kv_transfers_a_recomputing_decode_counts_are_reported_by_the_proxy() -> None:
    """Under kv_load_failure_policy recompute a broken link fails no request (decode recomputes the
    prompt): the only sign is the engine's vllm:nixl_num_failed_transfers_total, which the proxy
    reads and reports in /health (and so on its pod's condition)."""
    ports = free_ports(5)
    prefill, decode, proxy = (f"http://{HOST}:{port}" for port in ports[:3])
    recompute = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
                            "kv_load_failure_policy": "recompute"})
    processes = {prefill: start_engine("prefill", ports[0], ports[3], TIME_SCALE),
                 decode: start_engine("decode", ports[1], ports[4], TIME_SCALE, "--kv-transfer-config", recompute)}
    try:
        processes[proxy] = start_proxy(ports[2], [prefill], [decode], "--kv-metrics-interval", "1")
        for url, process in processes.items():
            await wait_for(url + "/health", process)
        await wait_eligible(proxy, prefill=1, decode=1)
        async with aiohttp.ClientSession() as session:
            async with session.put(decode + "/xpyd/faults", json={"unreadable_from": [HOST]}) as response:
                assert response.status == 200
            body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": PROMPT, "max_tokens": 4}
            for n in range(6):
                if n == 3:  # the proxy's first read (a baseline) has happened by the second half
                    await asyncio.sleep(2.5)
                async with session.post(proxy + "/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
            assert await _metric(session, [decode], "vllm:nixl_num_failed_transfers_total") == 6

            async def reported() -> list[dict[str, object]]:
                async with session.get(proxy + "/health") as response:
                    report = (await response.json())["kvTransfer"]
                assert report["failingPairs"] == []   # every hand-off "worked": decode recomputed
                return list(report["failingEngines"])

            deadline = asyncio.get_running_loop().time() + 10
            while not (engines := await reported()):
                assert asyncio.get_running_loop().time() < deadline, "the proxy never reported the engine"
                await asyncio.sleep(0.2)
            (engine,) = engines
            assert (engine["engine"], engine["role"], engine["windowSeconds"]) == (decode, "decode", 60.0)
            assert 3 <= float(engine["failedTransfers"]) <= 6   # the first read may come after some of them
    finally:
        kill(processes.values())
