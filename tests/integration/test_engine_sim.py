"""`xpyd engine-sim`: the vLLM engine emulator on real HTTP (loopback only).

Most tests run engines in this event loop (`start_server`, real sockets on 127.0.0.1); the process
tests start `python -m xpyd.sim.emulator` (the module `xpyd engine-sim` runs) with a pod's rendered
`vllm serve` arguments, a 200-stream burst and SIGTERM draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.integration.enginesim import (
    HOST,
    KV_BYTES,
    PERF,
    PREFILL_KV,
    EngineProcess,
    client_session,
    engine_process,
    post,
    prefill_leg,
    token_prompt,
)
from xpyd.cluster.controlplane import free_port
from xpyd.common.netguard import NonLoopbackAddress
from xpyd.perf.model import DEFAULT_PROFILE, PerfModel
from xpyd.sim.core import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, build_1_2_5_buckets
from xpyd.sim.emulator.config import EmulatorConfig
from xpyd.sim.emulator.exposition import NIXL_BYTES_BUCKETS, NIXL_XFER_TIME_BUCKETS
from xpyd.sim.emulator.http import EmulatorServer, start_server
from xpyd.sim.emulator.main import config_from_args

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
NAME = "llama-8b"


@contextlib.asynccontextmanager
async def engine(**overrides: Any) -> AsyncIterator[EmulatorServer]:
    """One engine in this event loop on free loopback ports."""
    settings: dict[str, Any] = {"served_model_names": (NAME,), "host": HOST, "port": 0, "side_channel_port": 0,
                                "time_scale": 10.0, "kv_bytes_per_token": KV_BYTES, "seed": 1}
    perf = overrides.pop("perf", PERF)
    settings.update(overrides)
    server = await start_server(EmulatorConfig(**settings), perf)
    try:
        yield server
    finally:
        await server.close()


@dataclass
class StreamResult:
    """A streamed response: events, token arrival times and whether `[DONE]` came."""

    status: int
    events: list[dict[str, Any]] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    done: bool = False

    @property
    def text(self) -> str:
        out = []
        for event in self.events:
            for choice in event.get("choices") or []:
                out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        return "".join(out)

    @property
    def usage(self) -> dict[str, Any] | None:
        return next((e["usage"] for e in reversed(self.events) if e.get("usage")), None)


async def stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                 headers: dict[str, str] | None = None) -> StreamResult:
    """POST with stream=true and read the SSE events; a token is an event whose choice carries text."""
    async with session.post(url, json={**body, "stream": True}, headers=headers) as response:
        result = StreamResult(response.status)
        if response.status != 200:
            result.events.append(await response.json())
            return result
        assert response.headers["Content-Type"].startswith("text/event-stream")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            if data == "[DONE]":
                result.done = True
                continue
            event = json.loads(data)
            result.events.append(event)
            choices = event.get("choices") or []
            if choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
                result.token_times.append(time.perf_counter())
        return result


# --- Prometheus text ------------------------------------------------------------------------------

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class Exposition:
    """A parsed text exposition (format 0.0.4)."""

    types: dict[str, str]
    samples: list[tuple[str, dict[str, str], float]]

    def value(self, name: str, **labels: str) -> float:
        matches = [v for n, lab, v in self.samples if n == name and all(lab.get(k) == x for k, x in labels.items())]
        assert len(matches) == 1, (name, labels, matches)
        return matches[0]

    def buckets(self, name: str) -> list[tuple[float, float]]:
        return [(float(lab["le"]), v) for n, lab, v in self.samples if n == f"{name}_bucket"]


def parse_exposition(text: str) -> Exposition:
    """Parse Prometheus text format, checking every line is well formed and every sample typed."""
    types: dict[str, str] = {}
    samples: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line.startswith("# HELP ") or not line:
            continue
        else:
            match = _SAMPLE.match(line)
            assert match, f"malformed sample line: {line!r}"
            labels = dict(_LABEL.findall(match.group(3) or ""))
            samples.append((match.group(1), labels, float(match.group(4))))
    for name, _, _ in samples:
        family = re.sub(r"_(bucket|count|sum)$", "", name)
        assert name in types or family in types, f"sample {name} has no # TYPE"
    return Exposition(types, samples)


async def scrape(session: aiohttp.ClientSession, server: EmulatorServer | str) -> Exposition:
    """GET /metrics and parse it."""
    url = server if isinstance(server, str) else server.url
    async with session.get(f"{url}/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        return parse_exposition(await response.text())


# --- the OpenAI surface ---------------------------------------------------------------------------

async def test_completions_non_stream_counts_exactly() -> None:
    async with engine() as server, client_session() as session:
        status, body = await post(session, f"{server.url}/v1/completions",
                                  {"model": NAME, "prompt": token_prompt(37), "max_tokens": 9},
                                  headers={"X-Request-Id": "abc"})
        assert status == 200
        assert body["id"] == "cmpl-abc" and body["object"] == "text_completion" and body["model"] == NAME
        assert body["usage"] == {"prompt_tokens": 37, "completion_tokens": 9, "total_tokens": 46,
                                 "prompt_tokens_details": None, "completion_tokens_details": None}
        choice = body["choices"][0]
        assert choice["text"] == " tok" * 9 and choice["finish_reason"] == "length"
        assert body["kv_transfer_params"] is None
        # Text prompts: about four characters per token; no model field means the served model.
        status, body = await post(session, f"{server.url}/v1/completions", {"prompt": "x" * 41, "max_tokens": 1})
        assert status == 200 and body["usage"]["prompt_tokens"] == 11
        # The OpenAI default for completions: 16 tokens.
        status, body = await post(session, f"{server.url}/v1/completions", {"prompt": [[5, 6, 7]]})
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 16, "total_tokens": 19,
                                 "prompt_tokens_details": None, "completion_tokens_details": None}


async def test_completions_stream_with_and_without_usage() -> None:
    async with engine() as server, client_session() as session:
        url = f"{server.url}/v1/completions"
        result = await stream(session, url, {"model": NAME, "prompt": token_prompt(20), "max_tokens": 12,
                                             "stream_options": {"include_usage": True}})
        assert result.status == 200 and result.done
        assert len(result.token_times) == 12 and result.text == " tok" * 12
        finishes = [e["choices"][0]["finish_reason"] for e in result.events if e["choices"]]
        assert finishes == [None] * 11 + ["length"]
        assert result.events[-1]["choices"] == [] and result.usage == {
            "prompt_tokens": 20, "completion_tokens": 12, "total_tokens": 32}
        assert result.events[-1]["system_fingerprint"].startswith("vllm-0.33.0-")
        result = await stream(session, url, {"prompt": token_prompt(20), "max_tokens": 3})
        assert result.done and len(result.token_times) == 3 and result.usage is None
        result = await stream(session, url, {"prompt": token_prompt(5), "max_tokens": 3,
                                             "stream_options": {"include_usage": True,
                                                                "continuous_usage_stats": True}})
        assert [e["usage"]["completion_tokens"] for e in result.events] == [1, 2, 3, 3]


async def test_chat_completions_stream_and_non_stream() -> None:
    async with engine() as server, client_session() as session:
        url = f"{server.url}/v1/chat/completions"
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
            {"type": "text", "text": "hello there"}]}]
        # 1 BOS + (5 + 2) + (5 + 3) + 4 assistant header = 20.
        status, body = await post(session, url, {"model": NAME, "messages": messages, "max_tokens": 50,
                                                 "max_completion_tokens": 4})
        assert status == 200 and body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["choices"][0]["message"]["content"] == " tok" * 4
        assert body["usage"]["prompt_tokens"] == 20 and body["usage"]["completion_tokens"] == 4
        result = await stream(session, url, {"messages": messages, "max_tokens": 5,
                                             "stream_options": {"include_usage": True}})
        assert result.done and result.events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(e["object"] == "chat.completion.chunk" for e in result.events)
        assert len(result.token_times) == 5 and result.text == " tok" * 5
        assert result.usage is not None and result.usage["total_tokens"] == 25


async def test_models_version_ping() -> None:
    async with engine(model="/models/llama-8b") as server, client_session() as session:
        async with session.get(f"{server.url}/v1/models") as response:
            body = await response.json()
        assert [card["id"] for card in body["data"]] == [NAME]
        assert body["data"][0]["root"] == "/models/llama-8b" and body["data"][0]["max_model_len"] == 131072
        async with session.get(f"{server.url}/version") as response:
            assert (await response.json())["version"] == "0.33.0"
        for method in ("GET", "POST"):
            async with session.request(method, f"{server.url}/ping") as response:
                assert response.status == 200


async def test_health_is_503_while_loading_then_200() -> None:
    # 10 modelled seconds of loading at 20x: 0.5 s.
    async with engine(startup_delay_s=10.0, time_scale=20.0) as server, client_session() as session:
        async with session.get(f"{server.url}/health") as response:
            assert response.status == 503
            assert "loading" in (await response.json())["error"]["message"]
        status, body = await post(session, f"{server.url}/v1/completions", {"prompt": "hi"})
        assert status == 503 and body["error"]["type"] == "ServiceUnavailableError"
        async with session.get(f"{server.url}/metrics") as response:
            assert response.status == 200
        started = time.monotonic()
        while True:
            async with session.get(f"{server.url}/health") as response:
                if response.status == 200:
                    assert await response.read() == b""
                    break
            assert time.monotonic() - started < 5
            await asyncio.sleep(0.02)
        assert 0.3 < time.monotonic() - started + 0.05 < 1.5


# --- errors -----------------------------------------------------------------------------------------

#: (what, endpoint, body, status, part of the message, `param`): vLLM's protocol errors, then its
#: model, max_tokens and prompt-length checks with their messages and parameters (vLLM 0.33).
BAD_REQUESTS: list[tuple[str, str, Any, int, str, str | None]] = [
    ("not JSON", "completions", b"{nope", 400, "Invalid JSON", None),
    ("not an object", "completions", [1, 2], 400, "JSON object", None),
    ("unknown model", "completions", {"model": "gpt-4", "prompt": "x"}, 404,
     "The model `gpt-4` does not exist. Valid aliases: llama-8b.", "model"),
    ("max_tokens 0", "completions", {"prompt": "x", "max_tokens": 0}, 400, "at least 1", None),
    ("max_tokens text", "completions", {"prompt": "x", "max_tokens": "5"}, 400, "must be an integer", None),
    ("max_tokens bool", "chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": True},
     400, "must be an integer", None),
    ("no prompt", "completions", {"max_tokens": 3}, 400, "prompt", None),
    ("empty token list", "completions", {"prompt": []}, 400, "prompt", None),
    ("batched prompts", "completions", {"prompt": ["a", "b"]}, 400, "batched", None),
    ("no messages", "chat/completions", {"messages": []}, 400, "messages", None),
    ("image content", "chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "text", None),
    ("stream_options without stream", "completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     400, "Stream options can only be defined when `stream=True`.", None),
    ("stream not bool", "completions", {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("n=2", "completions", {"prompt": "x", "n": 2}, 400, "n ", None),
    ("prompt over max-model-len", "completions", {"prompt": token_prompt(1001)}, 400,
     "This model's maximum context length is 1000 tokens. However, your prompt contains 1001 input tokens, which "
     "exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
     "(parameter=input_tokens, value=1001)", "input_tokens"),
    ("prompt at max-model-len", "completions", {"prompt": token_prompt(1000)}, 400,
     "The decoder prompt (length 1000) plus the number of requested output tokens (at least 1) is longer than the "
     "maximum model length of 1000.", None),
    ("max_tokens over max-model-len", "completions", {"prompt": token_prompt(9), "max_tokens": 1001}, 400,
     "max_tokens=1001 cannot be greater than max_model_len=1000. Please request fewer output tokens. "
     "(parameter=max_tokens, value=1001)", "max_tokens"),
    ("max_completion_tokens over max-model-len", "chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 1001}, 400,
     "max_completion_tokens=1001 cannot be greater than max_model_len=1000.", "max_completion_tokens"),
    ("kv_transfer_params not an object", "completions", {"prompt": "x", "kv_transfer_params": "yes"}, 400,
     "kv_transfer_params", None),
]


async def test_bad_requests_get_vllm_error_envelopes() -> None:
    async with engine(max_model_len=1000, max_kv_tokens=10_000) as server, client_session() as session:
        for what, path, body, status, message, param in BAD_REQUESTS:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with session.post(f"{server.url}/v1/{path}", data=data,
                                    headers={"Content-Type": "application/json"}) as response:
                assert response.status == status, what
                error = (await response.json())["error"]
            assert set(error) == {"message", "type", "param", "code"}, what
            assert error["code"] == status and error["param"] == param, (what, error["param"])
            assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError"), what
            assert message in error["message"], (what, error["message"])
        async with session.post(f"{server.url}/v1/completions", data=b'{"prompt": "x"}',
                                headers={"Content-Type": "text/plain"}) as response:
            assert response.status == 400
            assert "application/json" in (await response.json())["error"]["message"]
        # The engine is unharmed.
        status, _ = await post(session, f"{server.url}/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 200
        # A max_tokens within the context but not beside the prompt is lowered to what is left, as vLLM's
        # get_max_tokens does; so is a chat's default (no max_tokens).
        status, body = await post(session, f"{server.url}/v1/completions",
                                  {"prompt": token_prompt(900), "max_tokens": 101})
        assert status == 200 and body["usage"]["completion_tokens"] == 100
        status, body = await post(session, f"{server.url}/v1/chat/completions",   # 1 + (5 + 980) + 4 tokens
                                  {"messages": [{"role": "user", "content": "x" * 3920}]})
        assert status == 200 and body["usage"] == {"prompt_tokens": 990, "total_tokens": 1000, "completion_tokens": 10,
                                                   "prompt_tokens_details": None, "completion_tokens_details": None}


# --- metrics ----------------------------------------------------------------------------------------

# What an engine with a KV connector (kv_both) exposes; tests/conformance/test_emulator_vs_real.py holds
# them against real vLLM's.
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:num_requests_waiting_by_reason", "vllm:num_requests_kv_fetch_by_stage", "vllm:engine_sleep_state")
COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
            "vllm:prompt_tokens_by_source_total", "vllm:prompt_tokens_cached_total", "vllm:num_preemptions_total",
            "vllm:prompt_tokens_cached_by_source_total", "vllm:external_prefix_cache_queries_total",
            "vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_kv_expired_reqs_total",
            "vllm:nixl_num_failed_notifications_total", "vllm:nixl_num_notifications_after_expiry_total")
HISTOGRAMS: dict[str, Sequence[float]] = {
    "vllm:time_to_first_token_seconds": TTFT_BUCKETS,
    "vllm:inter_token_latency_seconds": ITL_BUCKETS,
    "vllm:request_time_per_output_token_seconds": ITL_BUCKETS,
    "vllm:e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_inference_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_prefill_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_decode_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_prompt_tokens": build_1_2_5_buckets(131072),
    "vllm:request_generation_tokens": build_1_2_5_buckets(131072),
    # vLLM 0.33's defaults (vllm/v1/metrics/buckets.py), written out.
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "vllm:request_max_num_generation_tokens": build_1_2_5_buckets(131072),
    "vllm:request_params_max_tokens": build_1_2_5_buckets(131072),
    "vllm:request_prefill_kv_computed_tokens": build_1_2_5_buckets(131072),
    "vllm:request_params_n": [1, 2, 5, 10, 20],
    "vllm:request_num_preemptions": [1, 2, 3, 4, 5, 10, 20],
    "vllm:nixl_xfer_time_seconds": NIXL_XFER_TIME_BUCKETS,
    "vllm:nixl_bytes_transferred": NIXL_BYTES_BUCKETS,
}


async def test_metrics_names_types_labels_and_buckets() -> None:
    started = time.time()
    async with engine(kv_role="kv_both") as server, engine() as plain, client_session() as session:
        for request in range(3):   # prompts of their own: nothing in the prefix cache to find
            await post(session, f"{server.url}/v1/completions",
                       {"prompt": [1000 * request + token for token in token_prompt(100)], "max_tokens": 10})
        metrics = await scrape(session, server)
        without_connector = await scrape(session, plain)
    for name in GAUGES:
        assert metrics.types[name] == "gauge"
    for name in COUNTERS:
        assert metrics.types[name] == "counter"
        # prometheus_client's `_created` gauge beside every counter and histogram: when its series began.
        created = name.removesuffix("_total") + "_created"
        assert metrics.types[created] == "gauge"
        times = [value for n, _, value in metrics.samples if n == created]
        assert times and all(started - 1 < value < time.time() for value in times), (created, times)
    for name, buckets in HISTOGRAMS.items():
        assert metrics.types[name] == "histogram" and metrics.types[f"{name}_created"] == "gauge"
        series = metrics.buckets(name)
        assert [le for le, _ in series] == [*buckets, math.inf], name
        counts = [count for _, count in series]
        assert counts == sorted(counts), f"{name} buckets are not cumulative"
        assert counts[-1] == metrics.value(f"{name}_count")
    assert "vllm:gpu_cache_usage_perc" not in metrics.types
    assert "vllm:time_per_output_token_seconds" not in metrics.types
    for name, labels, _ in metrics.samples:
        assert labels["model_name"] == NAME and labels["engine"] == "0", name
    assert metrics.value("vllm:prompt_tokens_total") == 300
    assert metrics.value("vllm:generation_tokens_total") == 30
    assert metrics.value("vllm:request_success_total", finished_reason="length") == 3
    assert {lab["finished_reason"] for n, lab, _ in metrics.samples if n == "vllm:request_success_total"} == {
        "stop", "length", "abort", "error", "repetition"}
    assert metrics.value("vllm:prompt_tokens_by_source_total", source="local_compute") == 300
    assert metrics.value("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert metrics.value("vllm:request_generation_tokens_sum") == 30
    assert metrics.value("vllm:request_max_num_generation_tokens_sum") == 30
    assert metrics.value("vllm:request_params_max_tokens_sum") == 30
    assert metrics.value("vllm:request_params_n_sum") == metrics.value("vllm:request_params_n_count") == 3
    assert metrics.value("vllm:request_num_preemptions_sum") == 0
    assert metrics.value("vllm:request_num_preemptions_count") == 3
    assert metrics.value("vllm:request_prefill_kv_computed_tokens_sum") == 300
    # Every pass's computed prompt tokens plus generated tokens: all 300 + 30 of them.
    assert metrics.value("vllm:iteration_tokens_total_sum") == 330
    assert metrics.value("vllm:prompt_tokens_cached_total") == 0
    assert metrics.value("vllm:num_requests_waiting_by_reason", reason="capacity") == 0
    assert metrics.value("vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    assert metrics.value("vllm:inter_token_latency_seconds_count") == 27
    # Wall seconds at time scale 10: a 100-token prefill of ~19.5 ms modelled shows ~2 ms.
    ttft = metrics.value("vllm:time_to_first_token_seconds_sum") / 3
    assert PERF.prefill_seconds(100) / 10 - 1e-9 <= ttft < PERF.prefill_seconds(100) / 10 + 0.01
    assert metrics.value("vllm:num_requests_running") == 0 and metrics.value("vllm:kv_cache_usage_perc") == 0
    # The connector is asked about every prompt; nothing came from another engine; the engine is awake.
    assert metrics.value("vllm:external_prefix_cache_queries_total") == 300
    assert metrics.value("vllm:external_prefix_cache_hits_total") == 0
    assert metrics.value("vllm:prefix_cache_queries_total") == 300
    assert metrics.value("vllm:prefix_cache_hits_total") == 0
    assert sum(v for n, _, v in metrics.samples if n == "vllm:prompt_tokens_cached_by_source_total") == 0
    assert sum(v for n, _, v in metrics.samples if n == "vllm:num_requests_kv_fetch_by_stage") == 0
    assert {lab["sleep_state"]: v for n, lab, v in metrics.samples if n == "vllm:engine_sleep_state"} == {
        "awake": 1, "weights_offloaded": 0, "discard_all": 0}
    # As vLLM, an engine without a KV connector has no NIXL families, and no KV fetches to count.
    assert not [name for name in without_connector.types if name.startswith("vllm:nixl_")]
    assert "vllm:num_requests_kv_fetch_by_stage" not in without_connector.types
    assert without_connector.value("vllm:external_prefix_cache_queries_total") == 0


async def test_kv_capacity_makes_requests_wait() -> None:
    # Room for one 600 + 100 token request at a time.
    async with engine(max_kv_tokens=1000, max_model_len=1000, time_scale=1.0) as server, \
            client_session() as session:
        url = f"{server.url}/v1/completions"
        first = asyncio.create_task(stream(session, url, {"prompt": token_prompt(600), "max_tokens": 100}))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(stream(session, url, {"prompt": token_prompt(600), "max_tokens": 100}))
        await asyncio.sleep(0.05)
        metrics = await scrape(session, server)
        assert metrics.value("vllm:num_requests_waiting") == 1 and metrics.value("vllm:num_requests_running") == 1
        assert metrics.value("vllm:kv_cache_usage_perc") == pytest.approx(0.7)
        done_first, done_second = await asyncio.gather(first, second)
        assert done_second.token_times[0] >= done_first.token_times[-1]


async def test_client_disconnect_aborts() -> None:
    async with engine(time_scale=1.0) as server, client_session() as session:
        async with session.post(f"{server.url}/v1/completions", json={
                "prompt": token_prompt(50), "max_tokens": 5000, "stream": True}) as response:
            await response.content.readline()
        for _ in range(100):
            metrics = await scrape(session, server)
            if metrics.value("vllm:num_requests_running") == 0:
                break
            await asyncio.sleep(0.02)
        assert metrics.value("vllm:request_success_total", finished_reason="abort") == 1
        assert metrics.value("vllm:num_requests_running") == 0 and metrics.value("vllm:kv_cache_usage_perc") == 0


# --- P/D: the NIXL pull flow ------------------------------------------------------------------------

async def test_prefill_leg_returns_kv_transfer_params_and_holds_kv() -> None:
    async with engine(kv_role="kv_producer", tensor_parallel_size=2) as prefill, client_session() as session:
        status, body = await post(session, f"{prefill.url}/v1/completions", {
            "prompt": token_prompt(100), "max_tokens": 1, "kv_transfer_params": PREFILL_KV},
            headers={"X-Request-Id": "r1"})
        assert status == 200 and body["usage"]["completion_tokens"] == 1
        params = body["kv_transfer_params"]
        side_host, side_port = prefill.engine.side_channel
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_engine_id"] == prefill.engine.engine_id
        assert params["remote_host"] == side_host == HOST and params["remote_port"] == side_port != prefill.http_port
        # NixlConnector's (pull) answer in 0.33, with the scheduler's remote_prefill_cached_tokens: exactly
        # these fields (tests/conformance/test_emulator_vs_real.py holds them against real vLLM's).
        assert set(params) == {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                               "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
                               "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode",
                               "remote_registration_generation", "remote_prefill_cached_tokens"}
        assert params["remote_prefill_cached_tokens"] == 0   # no prefix cache on the prefill engine
        assert params["tp_size"] == 2 and params["dcp_size"] == params["pp_size"] == 1
        # vLLM's internal id: cmpl-{X-Request-Id}-{prompt index}-{8 random hex digits}.
        assert re.fullmatch(r"cmpl-r1-0-[0-9a-f]{8}", params["remote_request_id"]), params["remote_request_id"]
        assert [len(group) for group in params["remote_block_ids"]] == [7]   # one KV-cache group, ceil(100 / 16)
        assert params["remote_num_tokens"] == 100 and params["remote_blocks_expiry_time"] is None
        assert params["transfer_mode"] == "pull" and params["remote_registration_generation"] == 2
        # A do_remote_decode request stops after one token even if it asked for more.
        status, body = await post(session, f"{prefill.url}/v1/completions", {
            "prompt": token_prompt(100), "max_tokens": 50, "kv_transfer_params": PREFILL_KV})
        assert body["usage"]["completion_tokens"] == 1
        metrics = await scrape(session, prefill)
        assert metrics.value("vllm:kv_cache_usage_perc") == pytest.approx(202 / prefill.engine.core.capacity)
        # The side channel (on its own port) tells a consumer about the lease, and frees it.
        kv_url = f"http://{side_host}:{side_port}/xpyd/kv/{params['remote_request_id']}"
        async with session.get(kv_url) as response:
            held = await response.json()
        assert held["engine_id"] == prefill.engine.engine_id and held["prompt_tokens"] == 100
        assert 0 < held["lease_remaining_s"] <= 30 / 10
        async with session.post(f"{kv_url}/release") as response:
            assert response.status == 200
        async with session.post(f"{kv_url}/release") as response:
            assert response.status == 404
        assert (await scrape(session, prefill)).value("vllm:nixl_num_notifications_after_expiry_total") == 1
        metrics = await scrape(session, prefill)
        assert metrics.value("vllm:kv_cache_usage_perc") == pytest.approx(101 / prefill.engine.core.capacity)


async def test_decode_leg_waits_for_the_transfer_and_decodes_only() -> None:
    # A slow link makes the transfer stand out: 400 tokens x 128 KiB at 10 Gb/s = 41.9 ms, at 1x.
    slow = PerfModel.from_profile(DEFAULT_PROFILE).with_kv_transfer(KV_BYTES, 10.0)
    transfer_s = slow.kv_transfer_seconds(400)
    async with engine(kv_role="kv_producer", perf=slow, time_scale=1.0) as prefill, \
            engine(kv_role="kv_consumer", perf=slow, time_scale=1.0) as decode, client_session() as session:
        body = {"model": NAME, "prompt": token_prompt(400), "max_tokens": 20}
        params = await prefill_leg(session, prefill.url, body, "pd-1")
        sent = time.perf_counter()
        result = await stream(session, f"{decode.url}/v1/completions",
                              {**body, "kv_transfer_params": params, "stream_options": {"include_usage": True}},
                              headers={"X-Request-Id": "pd-1"})
        ttft = result.token_times[0] - sent
        assert result.done and len(result.token_times) == 20
        assert result.usage is not None and result.usage["prompt_tokens"] == 400
        # Transfer, then one decode step before the first token (a lower bound: wall time can only
        # add); no prefill on decode, which the token sources below show (an upper bound on wall
        # time would only measure how busy this machine is).
        first_step = slow.decode_step_seconds(1, 400)
        assert transfer_s + first_step <= ttft
        decode_metrics = await scrape(session, decode)
        assert decode_metrics.value("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 400
        assert decode_metrics.value("vllm:prompt_tokens_by_source_total", source="local_compute") == 0
        assert decode_metrics.value("vllm:prompt_tokens_cached_total") == 400
        assert decode_metrics.value("vllm:prompt_tokens_cached_by_source_total", source="p2p") == 400
        assert decode_metrics.value("vllm:external_prefix_cache_queries_total") == 400
        assert decode_metrics.value("vllm:external_prefix_cache_hits_total") == 400
        assert decode_metrics.value("vllm:request_prefill_kv_computed_tokens_sum") == 0
        assert decode_metrics.value("vllm:nixl_xfer_time_seconds_sum") == pytest.approx(transfer_s)
        assert decode_metrics.value("vllm:nixl_bytes_transferred_sum") == 400 * KV_BYTES
        assert decode_metrics.value("vllm:nixl_num_failed_transfers_total") == 0
        # The decode engine released the producer's blocks once it had them.
        for _ in range(50):
            if prefill.engine.num_held == 0:
                break
            await asyncio.sleep(0.01)
        prefill_metrics = await scrape(session, prefill)
        assert prefill_metrics.value("vllm:kv_cache_usage_perc") == 0
        assert prefill_metrics.value("vllm:nixl_num_kv_expired_reqs_total") == 0


async def test_decode_legs_waiting_for_their_kv_are_counted_by_stage() -> None:
    # 400 tokens x 128 KiB at 1 Gb/s: a 419 ms pull at 1x, long enough to be seen.
    slow = PerfModel.from_profile(DEFAULT_PROFILE).with_kv_transfer(KV_BYTES, 1.0)
    async with engine(kv_role="kv_producer", perf=slow, time_scale=1.0) as prefill, \
            engine(kv_role="kv_consumer", perf=slow, time_scale=1.0) as decode, client_session() as session:
        body = {"model": NAME, "prompt": token_prompt(400), "max_tokens": 2}
        params = await prefill_leg(session, prefill.url, body, "stages")
        leg = asyncio.create_task(post(session, f"{decode.url}/v1/completions", {**body, "kv_transfer_params": params}))
        seen: dict[str, float] = {}
        while not leg.done() and not seen.get("in_progress"):
            metrics = await scrape(session, decode)
            seen = {lab["stage"]: v for n, lab, v in metrics.samples if n == "vllm:num_requests_kv_fetch_by_stage"}
            await asyncio.sleep(0.005)
        assert seen == {"waiting_to_start": 0, "in_progress": 1, "completed_waiting": 0}
        # A pulling request waits for a transfer: vLLM's "deferred" reason.
        assert metrics.value("vllm:num_requests_waiting_by_reason", reason="deferred") == 1
        status, _ = await leg
        assert status == 200
        metrics = await scrape(session, decode)
        assert sum(v for n, _, v in metrics.samples if n == "vllm:num_requests_kv_fetch_by_stage") == 0


async def test_a_streamed_prefill_leg_hands_off_on_its_final_event() -> None:
    async with engine(kv_role="kv_producer") as prefill, engine(kv_role="kv_consumer") as decode, \
            client_session() as session:
        body = {"model": NAME, "prompt": token_prompt(40), "max_tokens": 1}
        result = await stream(session, f"{prefill.url}/v1/completions", {**body, "kv_transfer_params": PREFILL_KV})
        assert result.done and [e["kv_transfer_params"] is None for e in result.events] == [False]
        params = result.events[-1]["kv_transfer_params"]
        assert result.events[-1]["choices"][0]["finish_reason"] == "length" and params["do_remote_prefill"] is True
        answer = await stream(session, f"{decode.url}/v1/completions", {**body, "max_tokens": 3,
                                                                        "kv_transfer_params": params})
        assert answer.done and len(answer.token_times) == 3
        assert all(event["kv_transfer_params"] is None for event in answer.events)


async def test_decode_leg_takes_block_ids_per_group_or_flat_and_rejects_other_shapes() -> None:
    async with engine(kv_role="kv_producer") as prefill, engine(kv_role="kv_consumer") as decode, \
            client_session() as session:
        body = {"prompt": token_prompt(40), "max_tokens": 3}
        params = await prefill_leg(session, prefill.url, body, "groups")
        status, answer = await post(session, f"{decode.url}/v1/completions", {**body, "kv_transfer_params": params})
        assert status == 200 and answer["usage"]["completion_tokens"] == 3
        params = await prefill_leg(session, prefill.url, body, "flat")   # as vLLM before 0.18 sent them
        flat = {**params, "remote_block_ids": params["remote_block_ids"][0]}
        status, answer = await post(session, f"{decode.url}/v1/completions", {**body, "kv_transfer_params": flat})
        assert status == 200 and answer["usage"]["completion_tokens"] == 3
        params = await prefill_leg(session, prefill.url, body, "bad")
        bad = {**params, "remote_block_ids": [["x"]]}
        status, answer = await post(session, f"{decode.url}/v1/completions", {**body, "kv_transfer_params": bad})
        assert status == 500 and "remote_block_ids" in answer["error"]["message"]


async def test_chat_prefill_leg_names_the_request_as_vllm_does() -> None:
    async with engine(kv_role="kv_producer") as prefill, client_session() as session:
        status, body = await post(session, f"{prefill.url}/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "kv_transfer_params": PREFILL_KV},
            headers={"X-Request-Id": "c1"})
        assert status == 200 and body["id"] == "chatcmpl-c1"
        assert re.fullmatch(r"chatcmpl-c1-[0-9a-f]{8}", body["kv_transfer_params"]["remote_request_id"])


async def test_transfer_faster_than_the_producers_answer_waits_for_it() -> None:
    # At 500x a 400-token transfer takes ~8 us of wall time, far less than the side-channel round trip:
    # the decode engine waits for the producer's answer, then loads the KV (once, in its metrics).
    async with engine(kv_role="kv_producer", time_scale=500.0) as prefill, \
            engine(kv_role="kv_consumer", time_scale=500.0) as decode, client_session() as session:
        body = {"prompt": token_prompt(400), "max_tokens": 30}
        params = await prefill_leg(session, prefill.url, body, "fast")
        status, answer = await post(session, f"{decode.url}/v1/completions", {**body, "kv_transfer_params": params})
        assert status == 200 and answer["usage"]["completion_tokens"] == 30
        metrics = await scrape(session, decode)
        assert metrics.value("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 400
        assert metrics.value("vllm:nixl_xfer_time_seconds_count") == 1
        assert metrics.value("vllm:generation_tokens_total") == 30
        assert metrics.value("vllm:request_success_total", finished_reason="length") == 1
        # The same race with a producer that holds nothing: no token, no work counted.
        status, answer = await post(session, f"{decode.url}/v1/completions",
                                    {**body, "kv_transfer_params": unknown_params(prefill)})
        assert status == 500
        metrics = await scrape(session, decode)
        assert metrics.value("vllm:generation_tokens_total") == 30
        assert metrics.value("vllm:kv_cache_usage_perc") == 0


async def test_decode_without_params_computes_the_prompt_locally() -> None:
    async with engine(kv_role="kv_consumer") as decode, client_session() as session:
        status, body = await post(session, f"{decode.url}/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 4})
        assert status == 200 and body["kv_transfer_params"] is None
        metrics = await scrape(session, decode)
        prompt = body["usage"]["prompt_tokens"]
        assert metrics.value("vllm:prompt_tokens_by_source_total", source="local_compute") == prompt == 110
        assert metrics.value("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0


def unknown_params(prefill: EmulatorServer) -> dict[str, Any]:
    host, port = prefill.engine.side_channel
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": prefill.engine.engine_id,
            "remote_block_ids": [1, 2], "remote_host": host, "remote_port": port,
            "remote_request_id": "cmpl-never-prefilled-0", "tp_size": 1}


async def test_load_failure_policy_fail() -> None:
    async with engine(kv_role="kv_producer") as prefill, engine(kv_role="kv_consumer") as decode, \
            client_session() as session:
        body = {"prompt": token_prompt(30), "max_tokens": 5, "kv_transfer_params": unknown_params(prefill)}
        status, answer = await post(session, f"{decode.url}/v1/completions", body)
        assert status == 500
        assert answer["error"]["type"] == "InternalServerError" and answer["error"]["code"] == 500
        assert "holds no KV" in answer["error"]["message"]
        result = await stream(session, f"{decode.url}/v1/completions", body)
        assert result.status == 200 and result.done and not result.token_times
        assert result.events[-1]["error"]["code"] == 500
        # A producer that is gone (nothing listens there) fails the same way.
        gone = {**unknown_params(prefill), "remote_port": free_port()}
        status, answer = await post(session, f"{decode.url}/v1/completions", {**body, "kv_transfer_params": gone})
        assert status == 500 and "cannot reach" in answer["error"]["message"]
        # Parameters that point outside loopback are never dialled.
        outside = {**unknown_params(prefill), "remote_host": "10.0.0.1"}
        status, answer = await post(session, f"{decode.url}/v1/completions", {**body, "kv_transfer_params": outside})
        assert status == 500 and "outside 127.0.0.0/8" in answer["error"]["message"]
        metrics = await scrape(session, decode)
        assert metrics.value("vllm:request_success_total", finished_reason="error") == 4
        assert metrics.value("vllm:nixl_num_failed_transfers_total") == 4
        assert metrics.value("vllm:prompt_tokens_total") == 0
        assert metrics.value("vllm:num_requests_running") == 0 and metrics.value("vllm:num_requests_waiting") == 0


async def test_an_injected_broken_link_fails_kv_loads_from_that_host_until_repaired() -> None:
    async with engine(kv_role="kv_producer") as prefill, engine(kv_role="kv_consumer") as decode, \
            client_session() as session:
        faults = f"{decode.url}/xpyd/faults"
        for bad in (b"not json", b'{"unreadable_from": "127.0.0.1"}', b'{"unreadable_from": [""]}', b"[]"):
            async with session.put(faults, data=bad) as response:
                assert response.status == 400 and (await response.json())["error"]["type"] == "BadRequestError"
        host = prefill.engine.side_channel[0]
        async with session.put(faults, json={"unreadable_from": [host]}) as response:
            assert response.status == 200 and await response.json() == {"unreadable_from": [host]}
        status, first = await post(session, f"{prefill.url}/v1/completions", {
            "prompt": token_prompt(30), "max_tokens": 1, "kv_transfer_params": PREFILL_KV})
        assert status == 200
        body = {"prompt": token_prompt(30), "max_tokens": 5, "kv_transfer_params": first["kv_transfer_params"]}
        status, answer = await post(session, f"{decode.url}/v1/completions", body)
        assert status == 500 and "the link is down" in answer["error"]["message"]
        assert (await scrape(session, decode)).value("vllm:nixl_num_failed_transfers_total") == 1
        # Repaired: the same KV (still held under its lease) is read.
        async with session.put(faults, json={"unreadable_from": []}) as response:
            assert await response.json() == {"unreadable_from": []}
        status, answer = await post(session, f"{decode.url}/v1/completions", body)
        assert status == 200 and answer["usage"]["completion_tokens"] == 5
        async with session.get(faults) as response:
            assert await response.json() == {"unreadable_from": []}


async def test_load_failure_policy_recompute() -> None:
    async with engine(kv_role="kv_producer") as prefill, \
            engine(kv_role="kv_consumer", kv_load_failure_policy="recompute") as decode, client_session() as session:
        body = {"prompt": token_prompt(30), "max_tokens": 5, "kv_transfer_params": unknown_params(prefill)}
        status, answer = await post(session, f"{decode.url}/v1/completions", body)
        assert status == 200 and answer["usage"]["completion_tokens"] == 5
        metrics = await scrape(session, decode)
        assert metrics.value("vllm:prompt_tokens_by_source_total", source="local_compute") == 30
        assert metrics.value("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
        assert metrics.value("vllm:nixl_num_failed_transfers_total") == 1
        assert metrics.value("vllm:request_success_total", finished_reason="length") == 1


async def test_expired_lease_fails_the_decode_leg() -> None:
    # A 0.2 s (modelled) lease at 1x: the decode leg comes too late.
    async with engine(kv_role="kv_producer", kv_lease_s=0.2, time_scale=1.0) as prefill, \
            engine(kv_role="kv_consumer") as decode, client_session() as session:
        body = {"prompt": token_prompt(64), "max_tokens": 3}
        params = await prefill_leg(session, prefill.url, body, "late")
        await asyncio.sleep(0.3)
        status, answer = await post(session, f"{decode.url}/v1/completions", {**body, "kv_transfer_params": params})
        assert status == 500 and "lease expired" in answer["error"]["message"]
        prefill_metrics = await scrape(session, prefill)
        assert prefill_metrics.value("vllm:nixl_num_kv_expired_reqs_total") == 1
        assert prefill_metrics.value("vllm:kv_cache_usage_perc") == 0


# --- command line and processes ---------------------------------------------------------------------

def rendered_args(role: str) -> list[str]:
    """The `vllm serve` arguments the operator renders for the sample NIXL serving."""
    from xpyd.api.load import load_servings
    from xpyd.render import render

    sample = REPO / "manifests" / "samples" / "nixl.yaml"
    serving = load_servings(sample.read_text(), source=str(sample))[0]
    for obj in render(serving.metadata.name, serving.metadata.namespace, serving.spec):
        if obj["kind"] == "Deployment" and obj["metadata"]["name"].endswith(f"-{role}"):
            container = obj["spec"]["template"]["spec"]["containers"][0]
            assert container["command"][-2:] == ["vllm", "serve"]
            return list(container["args"])
    raise AssertionError(f"no {role} Deployment")


def test_rendered_vllm_args_configure_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_IP", raising=False)
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "5611")
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        args = rendered_args(role)
        config, perf, ignored = config_from_args([*args, "--gpu-memory-utilization", "0.9", "--enable-prefix-caching",
                                                  "--swap-space", "4"])
        assert config.role == role and config.kv_role == kv_role and config.kv_load_failure_policy == "fail"
        assert config.model == "meta-llama/Llama-3.1-8B-Instruct" and config.model_name == NAME
        assert config.port == 8000 and config.host == HOST and config.side_channel_port == 5611
        assert config.kv_lease_s == 30 and config.shutdown_timeout_s == 60
        assert ignored == ["--gpu-memory-utilization", "0.9", "--swap-space", "4"]
        assert config.enable_prefix_caching and config.block_size == 16 and config.prefix_caching_hash_algo == "sha256"
        assert perf.kv_transfer_seconds(1000) == pytest.approx(PERF.kv_transfer_seconds(1000))
    config, _, _ = config_from_args(["m", "--role", "decode", "--kv-transfer-config.kv_load_failure_policy",
                                     "recompute", "--kv-transfer-config.kv_role=kv_consumer", "--max-model-len", "32k",
                                     "--kv-cache-dtype", "fp8"])
    assert config.kv_load_failure_policy == "recompute" and config.max_model_len == 32000
    assert config.kv_bytes_per_token == KV_BYTES // 2
    with pytest.raises(ValueError, match="contradicts"):
        config_from_args(["--role", "decode", '--kv-transfer-config={"kv_role": "kv_producer"}'])
    with pytest.raises(NonLoopbackAddress, match=r"outside 127\.0\.0\.0/8"):
        config_from_args(["--host", "0.0.0.0"])
    config, _, _ = config_from_args([])
    assert config.kv_role is None and config.role == "none"


async def test_process_with_rendered_args_serves_the_pd_flow() -> None:
    extra = ["--time-scale=10", "--gpu-memory-utilization=0.9", "--enable-chunked-prefill"]
    async with client_session() as session, \
            engine_process([*rendered_args("prefill"), *extra], session) as prefill, \
            engine_process([*rendered_args("decode"), *extra], session) as decode:
        async with session.get(f"{decode.url}/v1/models") as response:
            assert [card["id"] for card in (await response.json())["data"]] == [NAME]
        body = {"model": NAME, "prompt": token_prompt(300), "max_tokens": 8}
        params = await prefill_leg(session, prefill.url, body, "proc-1")
        assert params["remote_port"] == prefill.side_channel_port and params["remote_host"] == HOST
        result = await stream(session, f"{decode.url}/v1/completions", {**body, "kv_transfer_params": params})
        assert result.done and len(result.token_times) == 8
        metrics = await scrape(session, decode.url)
        assert metrics.value("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 300
        log = prefill.output()
        assert "ignoring vLLM arguments the emulator does not model: --gpu-memory-utilization=0.9" in log
    assert prefill.process.returncode == 0 and decode.process.returncode == 0


async def test_burst_of_200_concurrent_streams() -> None:
    async with client_session() as session, \
            engine_process(["--time-scale=5", "--served-model-name", NAME], session) as server:
        url = f"{server.url}/v1/completions"
        started = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*(
            stream(session, url, {"prompt": token_prompt(200 + i), "max_tokens": 64,
                                  "stream_options": {"include_usage": True}}) for i in range(200))), timeout=60)
        elapsed = time.monotonic() - started
        assert all(r.done and r.usage is not None and r.usage["completion_tokens"] == 64 for r in results)
        assert sum(r.usage["prompt_tokens"] for r in results if r.usage) == sum(200 + i for i in range(200))
        metrics = await scrape(session, server.url)
        assert metrics.value("vllm:request_success_total", finished_reason="length") == 200
        assert metrics.value("vllm:generation_tokens_total") == 200 * 64
        assert metrics.value("vllm:num_requests_running") == 0
    assert elapsed < 30


async def test_sigterm_drains_in_flight_requests() -> None:
    with tempfile.TemporaryFile(mode="w+") as log:
        process = EngineProcess(["--shutdown-timeout=20", "--served-model-name", NAME], log)
        try:
            async with client_session() as session:
                await process.wait_ready(session)
                url = f"{process.url}/v1/completions"
                # ~250 tokens at batch 1: about 1.1 s at 1x.
                task = asyncio.create_task(stream(session, url, {"prompt": token_prompt(100), "max_tokens": 250}))
                await asyncio.sleep(0.3)
                process.process.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
                # vLLM keeps serving HTTP while it drains: healthy, new requests aborted.
                async with aiohttp.ClientSession() as fresh, fresh.get(f"{process.url}/health") as response:
                    assert response.status == 200
                status, body = await post(session, url, {"prompt": token_prompt(10), "max_tokens": 5})
                assert status == 200 and body["choices"][0]["finish_reason"] == "abort"
                result = await asyncio.wait_for(task, timeout=10)
                assert result.done and len(result.token_times) == 250
                exit_code = await asyncio.get_running_loop().run_in_executor(None, process.process.wait, 10)
                assert exit_code == 0
        finally:
            process.stop()
        assert "draining" in process.output()


async def test_a_draining_engine_stays_healthy_and_aborts_new_requests() -> None:
    async with engine(kv_role="kv_producer", shutdown_timeout_s=20.0) as server, client_session() as session:
        url = f"{server.url}/v1/completions"
        task = asyncio.create_task(stream(session, url, {"prompt": token_prompt(100), "max_tokens": 250}))
        while server.engine.in_flight == 0:
            await asyncio.sleep(0.005)
        drain = asyncio.create_task(server.drain())
        await asyncio.sleep(0.02)
        assert server.engine.draining and not drain.done()
        for path in ("/health", "/ping", "/v1/models"):
            async with session.get(f"{server.url}{path}") as response:
                assert response.status == 200, path
        # What vLLM's client gets for a request EngineCore rejects in shutdown: a finished, empty answer.
        status, body = await post(session, url, {"prompt": token_prompt(10), "max_tokens": 5,
                                                 "kv_transfer_params": PREFILL_KV})
        assert status == 200 and body["choices"][0]["finish_reason"] == "abort" and body["choices"][0]["text"] == ""
        assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == 10
        assert body["kv_transfer_params"] is None and server.engine.num_held == 0
        chat = await stream(session, f"{server.url}/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "stream_options": {"include_usage": True}})
        assert chat.status == 200 and chat.done and chat.text == "" and chat.usage is not None
        assert [e["choices"][0]["finish_reason"] for e in chat.events if e["choices"]] == [None, "abort"]
        assert chat.usage["completion_tokens"] == 0
        status, body = await post(session, url, {"prompt": "x", "max_tokens": 0})
        assert status == 400   # validation still comes first
        metrics = await scrape(session, server)
        assert metrics.value("vllm:request_success_total", finished_reason="abort") == 2
        result = await asyncio.wait_for(task, timeout=20)   # the request in flight finishes intact
        assert result.done and len(result.token_times) == 250
        await asyncio.wait_for(drain, timeout=5)


def test_cli_registers_engine_sim() -> None:
    from xpyd.cli import build_parser

    args = build_parser().parse_args(["engine-sim", "--role", "prefill", "--port", "0", "--foo=1"])
    assert args.argv == ["--role", "prefill", "--port", "0", "--foo=1"]
    help_text = subprocess.run([sys.executable, "-m", "xpyd.cli", "engine-sim", "--help"], capture_output=True,
                               text=True, timeout=30, check=True).stdout
    assert "--time-scale" in help_text and "--kv-transfer-config" in help_text


# --- a multi-node engine (vLLM's --nnodes launch) ----------------------------------------------------------

async def health_status(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.get(f"{url}/health") as response:
        return response.status, await response.text()


async def wait_exit(process: subprocess.Popen[str], timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert process.poll() is not None, "did not exit"
    return process.returncode


def group_args(master_port: int, rank: int) -> list[str]:
    args = ["--nnodes=2", f"--node-rank={rank}", f"--master-addr={HOST}", f"--master-port={master_port}"]
    return [*args, "--headless"] if rank else args


async def test_a_multi_node_leader_serves_once_its_worker_joined_and_dies_with_it() -> None:
    master = free_port()
    with tempfile.TemporaryFile(mode="w+") as leader_log, tempfile.TemporaryFile(mode="w+") as worker_log:
        leader = EngineProcess(group_args(master, 0), leader_log)
        worker: EngineProcess | None = None
        try:
            async with client_session() as session:
                deadline = time.monotonic() + 20
                while True:  # serving HTTP, but not ready: the engine waits for its other node
                    with contextlib.suppress(aiohttp.ClientError):
                        status, body = await health_status(session, leader.url)
                        break
                    assert time.monotonic() < deadline, leader.output()
                    await asyncio.sleep(0.05)
                assert status == 503 and "waiting for 1 of 1 worker node(s) to join" in body
                worker = EngineProcess(group_args(master, 1), worker_log)
                await leader.wait_ready(session)
                # The worker goes (kill -9): the leader's engine cannot go on, and says so in its exit code.
                worker.process.kill()
                assert await wait_exit(leader.process) == 1
                assert "worker node 1 left the group" in leader.output()
        finally:
            leader.stop()
            if worker is not None:
                worker.stop()


async def test_a_worker_exits_with_an_error_when_its_leader_goes_and_rejects_bad_launches() -> None:
    master = free_port()
    with tempfile.TemporaryFile(mode="w+") as leader_log, tempfile.TemporaryFile(mode="w+") as worker_log:
        worker = EngineProcess(group_args(master, 1), worker_log)  # before its leader: it keeps dialling
        leader = EngineProcess(group_args(master, 0), leader_log)
        try:
            async with client_session() as session:
                await leader.wait_ready(session)
            assert worker.process.poll() is None
            leader.process.kill()
            assert await wait_exit(worker.process) == 1
            assert "left the group" in worker.output()
        finally:
            leader.stop()
            worker.stop()
    for bad, message in ((["--nnodes=2", "--node-rank=1"], "needs --headless"),
                         (["--nnodes=2", "--node-rank=2", "--headless"], "--node-rank must be between 0 and 1"),
                         (["--nnodes=2", "--headless"], "--headless on node rank 0"),
                         (["--nnodes=2", "--node-rank=1", "--headless", "--master-addr=10.0.0.1"], "refusing")):
        result = subprocess.run([sys.executable, "-m", "xpyd.sim.emulator", *bad], capture_output=True, text=True,
                                timeout=30)
        assert result.returncode == 2 and message in result.stderr, (bad, result.stderr)
