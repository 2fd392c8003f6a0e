"""Protocol conformance of the proxy over real HTTP on loopback: what each connector's legs carry,
streaming intact, request ids, auth, the 4xx answers that never reach an engine, and cancellation
reaching the engines. The engines are stub engines in this process (`xpyd.testing.stubengine`),
behind the proxy of `tests/integration/rig.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.eventually import eventually
from tests.integration.rig import COMPLETION, HOST, Rig, rig
from xpyd.api.models import Connector
from xpyd.proxy import protocol
from xpyd.proxy.metrics import LATENCY_BUCKETS
from xpyd.testing.stubengine import StubEngine

pytestmark = pytest.mark.integration

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_completion_tokens": 6,
        "stream": True, "stream_options": {"include_usage": True}}


def _events(text: str) -> list[Any]:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    return [event if event == "[DONE]" else json.loads(event) for event in events]


async def test_nixl_pull_legs_follow_toy_proxy_server() -> None:
    """NixlConnector, reference vllm-project/vllm tests/v1/kv_connector/nixl_integration/toy_proxy_server.py
    (`send_request_to_service`, `handle_completions`): prefill is a copy of the body with max_tokens=1
    (max_completion_tokens=1 when present), stream false, no stream_options/min_tokens/
    min_completion_tokens, kv_transfer_params {do_remote_decode: true, do_remote_prefill: false,
    remote_engine_id/remote_block_ids/remote_host/remote_port: null}; decode is the original body with
    prefill's kv_transfer_params unchanged; both legs carry the same fresh uuid4 X-Request-Id."""
    body = {**COMPLETION, "max_completion_tokens": 8, "min_completion_tokens": 2,
            "stream_options": {"include_usage": True}, "stream": True}
    async with rig(connector=Connector.NIXL) as r:
        status, _, headers = await r.post("/v1/completions", body,
                                          {"X-Request-Id": "client-1", "Authorization": "Bearer secret"})
        assert status == 200
        assert headers["X-Request-Id"] == "client-1"
        (prefill,), (decode,) = r.prefill[0].seen, r.decode[0].seen
        expected = {key: value for key, value in body.items()
                    if key not in ("stream_options", "min_tokens", "min_completion_tokens")}
        assert prefill.body == {**expected, "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
                                "kv_transfer_params": {
                                    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                    "remote_block_ids": None, "remote_host": None, "remote_port": None}}
        upstream_id = prefill.headers["X-Request-Id"]
        assert uuid.UUID(upstream_id).version == 4
        assert decode.body == {**body, "kv_transfer_params": r.prefill[0].kv_answer(upstream_id)}
        for leg in (prefill, decode):
            assert leg.headers["X-Request-Id"] == upstream_id
            assert leg.headers["Authorization"] == "Bearer secret"


async def test_streaming_passes_through_intact_with_usage() -> None:
    async with rig() as r:
        status, text, headers = await r.post("/v1/chat/completions", CHAT)
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        request_id = r.decode[0].seen[0].headers["X-Request-Id"]
        # What the decode engine sends for the same leg, asked directly.
        async with r.session.post(r.decode[0].url + "/v1/chat/completions", json=r.decode[0].seen[0].body,
                                  headers={"X-Request-Id": request_id}) as direct:
            expected = await direct.text()
    strip = [{k: v for k, v in e.items() if k != "created"} if isinstance(e, dict) else e for e in _events(text)]
    assert strip == [{k: v for k, v in e.items() if k != "created"} if isinstance(e, dict) else e
                     for e in _events(expected)]
    assert strip[-1] == "[DONE]" and strip[-2]["usage"]["completion_tokens"] == 6
    prefill = r.prefill[0].seen[0].body
    assert prefill["stream"] is False and "stream_options" not in prefill and prefill["max_completion_tokens"] == 1


async def test_a_stream_is_relayed_chunk_by_chunk_not_buffered() -> None:
    async with rig() as r:
        r.decode[0].token_delay = 0.2
        body = {**CHAT, "max_completion_tokens": 5}
        async with r.session.post(r.url + "/v1/chat/completions", json=body) as response:
            first = await response.content.readline()
            decode_started = r.decode[0].started
            assert first.startswith(b"data: ") and decode_started == 1
            assert r.decode[0].completed == 0      # the first token reached us while decode still ran
            await response.read()


async def test_request_id_generated_when_absent_or_unusable() -> None:
    async with rig() as r:
        _, _, headers = await r.post("/v1/completions", COMPLETION)
        _, _, bad = await r.post("/v1/completions", COMPLETION, {"X-Request-Id": "has space"})
        assert re.fullmatch(r"[0-9a-f-]{36}", headers["X-Request-Id"])
        assert bad["X-Request-Id"] != "has space"
        # The engines never see the client's id: each attempt goes upstream under a fresh uuid4.
        assert r.decode[0].seen[0].headers["X-Request-Id"] != headers["X-Request-Id"]
        assert uuid.UUID(r.decode[0].seen[0].headers["X-Request-Id"]).version == 4


async def push_rig() -> contextlib.AbstractAsyncContextManager[Rig]:
    """A NixlPushConnector rig whose decode stub checks what a push decode leg carries."""
    prefill = StubEngine(name="p0")
    return rig(engines=([prefill], [StubEngine(name="d0", push_prefill=prefill)]), connector=Connector.NIXL_PUSH)


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_nixl_push_legs_follow_toy_push_proxy_server(path: str, body: dict[str, Any]) -> None:
    """NixlPushConnector (vLLM 0.24+), reference vllm-project/vllm
    tests/v1/kv_connector/nixl_integration/toy_push_proxy_server.py: prefill first (the NIXL prefill
    body), then decode with {do_remote_prefill: true, do_remote_decode: false, remote_engine_id,
    remote_host, remote_port, tp_size, pp_size, remote_request_id} from prefill's answer and no
    block ids. remote_request_id is prefill's internal id (`cmpl-<id>-0-<8 hex>`): decode's lease
    heartbeats name it (nixl/base_scheduler.py `on_new_request`, base_worker.py `_handle_heartbeat`).
    Both legs carry one X-Request-Id: prefill matches decode's registration by it
    (nixl/push_worker.py `_pop_matching_registration`, utils.py `get_base_request_id`)."""
    async with await push_rig() as r:
        status, _, headers = await r.post(path, body, {"X-Request-Id": "client"})
        assert status == 200 and headers["X-Request-Id"] == "client"
        (prefill,), (decode,) = r.prefill[0].seen, r.decode[0].seen
        assert r.decode[0].errors == []
        upstream_id = prefill.headers["X-Request-Id"]
        assert decode.headers["X-Request-Id"] == upstream_id
        assert prefill.body == protocol.prefill_body(body, protocol.NIXL_PREFILL_PARAMS)
        internal = r.prefill[0].internal_ids[upstream_id]
        base = f"chatcmpl-{upstream_id}" if "chat" in path else f"cmpl-{upstream_id}-0"
        assert re.fullmatch(re.escape(base) + "-[0-9a-f]{8}", internal)
        assert decode.body == {**body, "kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p0-engine",
            "remote_host": HOST, "remote_port": r.prefill[0].side_channel_port, "tp_size": 1, "pp_size": 1,
            "remote_request_id": internal}}


async def test_nixl_push_sends_decode_only_after_prefill_answered() -> None:
    """toy_push_proxy_server.py: decode's kv_transfer_params come from prefill's answer, so decode
    waits for it, also once the prefill engine's identity is known."""
    async with await push_rig() as r:
        assert (await r.post("/v1/completions", COMPLETION))[0] == 200
        r.prefill[0].hang = True
        task = asyncio.ensure_future(r.post("/v1/completions", COMPLETION))
        await eventually(lambda: len(r.prefill[0].seen) == 2, what="the second prefill leg")
        await asyncio.sleep(0.2)
        assert len(r.decode[0].seen) == 1
        r.prefill[0].hang = False
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_nixl_push_decode_learns_a_restarted_prefill_engines_new_identity() -> None:
    async with await push_rig() as r:
        assert (await r.post("/v1/completions", COMPLETION))[0] == 200
        r.prefill[0].name = "p0-restarted"
        assert (await r.post("/v1/completions", COMPLETION))[0] == 200
        assert [leg.body["kv_transfer_params"]["remote_engine_id"] for leg in r.decode[0].seen] == \
            ["p0-engine", "p0-restarted-engine"]
        assert r.decode[0].errors == []


async def test_nixl_push_prefill_answer_without_its_request_id_is_a_prefill_failure() -> None:
    async with await push_rig() as r:
        original = r.prefill[0].kv_answer

        def without_id(request_id: str, rank: int = 0, chat: bool = False) -> dict[str, Any]:
            return {k: v for k, v in original(request_id, rank, chat).items() if k != "remote_request_id"}

        r.prefill[0].kv_answer = without_id  # type: ignore[method-assign]
        status, answer, _ = await r.post("/v1/completions", COMPLETION)
        assert status == 503 and "Prefill failed" in answer["error"]["message"] and r.decode[0].seen == []


async def mooncake_rig() -> contextlib.AbstractAsyncContextManager[Rig]:
    """A Mooncake rig whose prefill engine is also its own bootstrap server."""
    prefill = StubEngine(name="p0")
    await prefill.start(HOST)
    return rig(engines=([prefill], [StubEngine(name="d0")]), connector=Connector.MOONCAKE,
               mooncake_bootstrap_port=prefill.port)


async def test_mooncake_legs_follow_mooncake_connector_proxy() -> None:
    """MooncakeConnector (vLLM 0.16+), reference vllm-project/vllm
    examples/online_serving/disaggregated_serving/mooncake_connector/mooncake_connector_proxy.py and
    vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py: prefill
    {do_remote_decode: true, do_remote_prefill: false, transfer_id}, max_tokens 1, stream false,
    header X-data-parallel-rank; decode {do_remote_decode: false, do_remote_prefill: true,
    remote_bootstrap_addr: http://<prefill host>:<bootstrap port>, remote_engine_id (from GET /query),
    transfer_id}; both legs at once, one fresh X-Request-Id and transfer_id per attempt."""
    async with await mooncake_rig() as r:
        status, _, headers = await r.post("/v1/completions", COMPLETION, {"X-Request-Id": "mc"})
        assert status == 200 and headers["X-Request-Id"] == "mc"
        (prefill,), (decode,) = r.prefill[0].seen, r.decode[0].seen
        upstream_id = prefill.headers["X-Request-Id"]
        assert uuid.UUID(upstream_id).version == 4 and decode.headers["X-Request-Id"] == upstream_id
        transfer_id = f"xfer-{upstream_id}"
        without_min = {key: value for key, value in COMPLETION.items() if key != "min_tokens"}
        assert prefill.body == {**without_min, "max_tokens": 1, "stream": False, "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}}
        assert prefill.headers["X-data-parallel-rank"] == "0"
        assert decode.body == {**COMPLETION, "kv_transfer_params": {
            "do_remote_decode": False, "do_remote_prefill": True,
            "remote_bootstrap_addr": f"http://{HOST}:{r.prefill[0].port}", "remote_engine_id": "p0-engine",
            "transfer_id": transfer_id}}


async def test_p2p_nccl_encodes_the_peers_in_the_request_id() -> None:
    async with rig(connector=Connector.P2P_NCCL) as r:
        status, _, headers = await r.post("/v1/completions", COMPLETION, {"X-Request-Id": "client"})
        assert status == 200 and headers["X-Request-Id"] == "client"
        (prefill,), (decode,) = r.prefill[0].seen, r.decode[0].seen
        upstream_id = prefill.headers["X-Request-Id"]
        assert decode.headers["X-Request-Id"] == upstream_id
        assert re.fullmatch(rf"___prefill_addr_{HOST}:14579___decode_addr_{HOST}:14579_[0-9a-f]{{32}}", upstream_id)
        assert "kv_transfer_params" not in prefill.body and decode.body == COMPLETION


async def lmcache_rig(tp: int = 1, **config: Any) -> contextlib.AbstractAsyncContextManager[Rig]:
    """An LMCache P/D rig: the prefill stub fails as LMCache's producer would, decode on another host."""
    decode = StubEngine(name="d0")
    await decode.start("127.0.0.2")
    return rig(engines=([StubEngine(name="p0", lmcache_producer=True, tensor_parallel_size=tp)], [decode]),
               connector=Connector.LMCACHE, **config)


def _lmcache_params(upstream_id: str) -> dict[str, Any]:
    return {"ret_first_tok": True,
            "disagg_spec": {"req_id": upstream_id, "receiver_host": "127.0.0.2",
                            "receiver_init_port": [8300, 8301], "receiver_alloc_port": [8400, 8401]}}


LMCACHE_CONFIG: dict[str, Any] = {"lmcache_init_port": 8300, "lmcache_alloc_port": 8400,
                                  "decode_tensor_parallel_size": 2}


async def test_lmcache_legs_follow_the_lmcache_first_token_proxy() -> None:
    """LMCacheConnectorV1 with enable_pd, references: LMCache examples/disagg_prefill/xpyd/
    disagg_proxy_server_first_token_from_prefiller_xpyd.py (/tokenize, prefill with token ids and
    {ret_first_tok, disagg_spec}, decode with the prompt plus first_tok and max_tokens - 1, prefill's
    token first to the client); vLLM lmcache_integration/vllm_v1_adapter.py (a kv_producer asserts
    `request.disagg_spec is not None`; reads req_id, receiver_host, receiver_init_port,
    receiver_alloc_port; `ret_first_tok` makes `request_finished` answer {first_tok}); LMCache's
    pd_backend indexes the port lists by TP rank."""
    async with await lmcache_rig(tp=2, **LMCACHE_CONFIG) as r:
        status, answer, headers = await r.post("/v1/completions", COMPLETION, {"X-Request-Id": "client"})
        assert status == 200 and headers["X-Request-Id"] == "client"
        (prefill,), (decode,) = r.prefill[0].seen, r.decode[0].seen
        assert r.prefill[0].errors == []
        upstream_id = prefill.headers["X-Request-Id"]
        assert uuid.UUID(upstream_id).version == 4 and decode.headers["X-Request-Id"] == upstream_id
        assert r.prefill[0].tokenized == [{"model": "m", "prompt": COMPLETION["prompt"], "add_special_tokens": True}]
        prompt_ids = list(range(1000, 1000 + 5))
        assert prefill.body == protocol.prefill_body({**COMPLETION, "prompt": prompt_ids}, None) | {
            "kv_transfer_params": _lmcache_params(upstream_id)}
        assert prefill.body["max_tokens"] == 1 and prefill.body["stream"] is False
        assert decode.body == {**COMPLETION, "prompt": [*prompt_ids, r.prefill[0].first_token], "max_tokens": 7,
                               "min_tokens": 1}
        # The client sees prefill's token, then decode's seven, counted as its own request.
        assert answer["choices"][0]["text"] == " tok0" + "".join(f" tok{i}" for i in range(7))
        assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}


async def test_lmcache_first_token_leads_a_stream_and_usage_counts_it() -> None:
    """disagg_proxy_server_first_token_from_prefiller_xpyd.py streams prefill's token first."""
    body = {**COMPLETION, "prompt": [5, 6, 7], "stream": True, "stream_options": {"include_usage": True}}
    async with await lmcache_rig(tp=2, **LMCACHE_CONFIG) as r:
        status, text, _ = await r.post("/v1/completions", body)
        assert status == 200 and r.prefill[0].tokenized == []
        events = _events(text)
        assert "".join(e["choices"][0]["text"] for e in events[:-2]) == " tok0" + "".join(f" tok{i}" for i in range(7))
        assert events[0]["id"] == events[1]["id"] and events[0]["object"] == "text_completion"
        assert events[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}
        assert events[-1] == "[DONE]"
        assert r.decode[0].seen[0].body["prompt"] == [5, 6, 7, r.prefill[0].first_token]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {**COMPLETION, "n": 2}),
    ("/v1/completions", {**COMPLETION, "logprobs": 1}),
    ("/v1/completions", {**COMPLETION, "echo": True}),
    ("/v1/completions", {**COMPLETION, "prompt": ["a", "b"]}),
    ("/v1/completions", {**COMPLETION, "max_tokens": 1}),
])
async def test_lmcache_without_the_first_token_hand_off_decode_gets_the_clients_body(
        path: str, body: dict[str, Any]) -> None:
    """Requests the first token cannot be spliced into: prefill still carries ret_first_tok and
    disagg_spec (the producer needs them), decode gets the client's body as sent."""
    async with await lmcache_rig(tp=2, **LMCACHE_CONFIG) as r:
        assert (await r.post(path, body))[0] == 200
        (prefill,), (decode,) = r.prefill[0].seen, r.decode[0].seen
        assert r.prefill[0].errors == [] and r.prefill[0].tokenized == []
        assert prefill.body == protocol.prefill_body(body, None) | {
            "kv_transfer_params": _lmcache_params(prefill.headers["X-Request-Id"])}
        assert decode.body == body


async def test_lmcache_port_lists_shorter_than_the_tp_size_fail_prefill() -> None:
    """The stub fails like LMCache's PD backend indexing `receiver_init_port[tp_rank]`."""
    async with await lmcache_rig(tp=2) as r:
        status, answer, _ = await r.post("/v1/completions", COMPLETION)
        assert status == 503 and "Prefill failed" in answer["error"]["message"]
        assert r.prefill[0].errors and r.decode[0].seen == []


async def test_lmcache_prefill_answer_without_first_tok_is_a_prefill_failure() -> None:
    """An engine that is no LMCache P/D producer answers without kv_transfer_params.first_tok."""
    async with rig(connector=Connector.LMCACHE) as r:
        status, answer, _ = await r.post("/v1/completions", COMPLETION)
        assert status == 503 and "Prefill failed" in answer["error"]["message"]
        assert r.decode[0].seen == []


async def test_models_come_from_the_decode_pool() -> None:
    async with rig() as r, r.session.get(r.url + "/v1/models") as response:
        assert response.status == 200
        assert (await response.json())["data"][0]["id"] == "d0"


async def test_api_key_protects_the_proxy() -> None:
    async with rig(api_key="k3y") as r:
        assert (await r.post("/v1/completions", COMPLETION))[0] == 401
        assert (await r.post("/v1/completions", COMPLETION, {"Authorization": "Bearer nope"}))[0] == 401
        assert r.proxy.metrics.requests.value("NixlConnector", "completions", "unauthorized") == 2
        async with r.session.get(r.url + "/v1/models") as response:
            assert response.status == 401
        assert r.prefill[0].seen == [] and r.decode[0].seen == []
        assert (await r.post("/v1/completions", COMPLETION, {"Authorization": "Bearer k3y"}))[0] == 200
        async with r.session.get(r.url + "/health") as response:
            assert response.status == 200               # probes need no key


@pytest.mark.parametrize(("body", "status"), [
    (b"{not json", 400), (b'{"prompt": "x"}', 400), (b'{"model": "m", "prompt": 5}', 400),
    (b'{"model": "other", "prompt": "x"}', 404), (b'{"model": "m", "prompt": "' + b"x" * 5000 + b'"}', 413),
])
async def test_malformed_requests_get_json_errors_before_any_upstream_call(body: bytes, status: int) -> None:
    async with rig(served_model_name="m", max_body_bytes=4096) as r:
        got, answer, headers = await r.post("/v1/completions", body, {"Content-Type": "application/json"})
        assert got == status
        assert answer["error"]["code"] == status and answer["error"]["message"]
        assert headers["X-Request-Id"]
        assert r.prefill[0].seen == [] and r.decode[0].seen == []
        assert r.proxy.metrics.rejected.value(str(status)) == 1
        assert r.proxy.metrics.requests.value("NixlConnector", "completions", "invalid") == 1


async def test_saturation_answers_429() -> None:
    async with rig(max_concurrency=2) as r:
        r.prefill[0].hang = True
        waiting = [asyncio.ensure_future(r.post("/v1/completions", COMPLETION)) for _ in range(2)]
        await eventually(lambda: r.prefill[0].started == 2, what="two requests in flight")
        status, answer, headers = await r.post("/v1/completions", COMPLETION)
        assert (status, answer["error"]["type"], headers["Retry-After"]) == (429, "RateLimitError", "1")
        # Refused, but demand all the same: the autoscaler reads its arrival rate from this counter.
        assert r.proxy.metrics.requests.value("NixlConnector", "completions", "overloaded") == 1
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)


async def _disconnect_while(r: Rig, body: Any, started: Callable[[], bool]) -> None:
    """Send a request, wait until `started()`, then drop the client connection."""
    session = aiohttp.ClientSession()
    task = asyncio.ensure_future(session.post(r.url + "/v1/completions", json=body))
    try:
        await eventually(started, what="the legs to start")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await session.close()


@pytest.mark.parametrize("where", ["prefill", "decode", "mid-stream"])
async def test_a_client_disconnect_cancels_the_upstream_leg(where: str) -> None:
    async with rig() as r:
        prefill, decode = r.prefill[0], r.decode[0]
        if where == "prefill":
            prefill.hang = True
        elif where == "decode":
            decode.hang = True
        else:
            decode.token_delay = 0.5
        body = {**COMPLETION, "stream": where == "mid-stream"}
        engine = prefill if where == "prefill" else decode
        await _disconnect_while(r, body, lambda: engine.started == 1)
        await eventually(lambda: engine.cancelled == 1, what=f"the {where} leg cancelled upstream")
        await eventually(lambda: r.proxy.in_flight == 0, what="the proxy to forget the request")
        assert r.proxy.metrics.requests.value("NixlConnector", "completions", "cancelled") == 1


async def test_a_client_disconnect_cancels_both_concurrent_legs() -> None:
    async with await mooncake_rig() as r:
        r.prefill[0].hang = r.decode[0].hang = True
        await _disconnect_while(r, COMPLETION, lambda: r.prefill[0].started == r.decode[0].started == 1)
        await eventually(lambda: r.prefill[0].cancelled == r.decode[0].cancelled == 1, what="both legs cancelled")


#: Every series family the proxy exports: the name Prometheus stores (counters' with `_total`), its
#: type and its label names (`le` besides, on a histogram's buckets).
PROXY_FAMILIES: dict[str, tuple[str, set[str]]] = {
    "xpyd_proxy_requests_total": ("counter", {"connector", "endpoint", "outcome"}),
    "xpyd_proxy_rejected_total": ("counter", {"status"}),
    "xpyd_proxy_arrival_prompt_tokens": ("histogram", {"window"}),
    "xpyd_proxy_prompt_tokens_total": ("counter", set()),
    "xpyd_proxy_time_to_first_byte_seconds": ("histogram", {"connector", "endpoint"}),
    "xpyd_proxy_time_to_first_token_seconds": ("histogram", {"connector", "endpoint"}),
    "xpyd_proxy_request_duration_seconds": ("histogram", {"connector", "endpoint"}),
    "xpyd_proxy_leg_duration_seconds": ("histogram", {"role", "result"}),
    "xpyd_proxy_retries_total": ("counter", {"role"}),
    "xpyd_proxy_decode_only_fallbacks_total": ("counter", {"reason"}),
    "xpyd_proxy_breaker_trips_total": ("counter", {"role"}),
    "xpyd_proxy_in_flight_requests": ("gauge", set()),
    "xpyd_proxy_upstream_in_flight": ("gauge", {"role", "upstream"}),
    "xpyd_proxy_upstream_prompt_tokens": ("gauge", {"upstream"}),
    "xpyd_proxy_breaker_state": ("gauge", {"role", "upstream"}),
    "xpyd_proxy_upstream_healthy": ("gauge", {"role", "upstream"}),
    "xpyd_proxy_upstreams": ("gauge", {"role", "state"}),
    "xpyd_proxy_draining": ("gauge", set()),
    "xpyd_proxy_kv_handoff_failures_total": ("counter", {"prefill", "decode"}),
    "xpyd_proxy_kv_pairs_failing": ("gauge", set()),
    "xpyd_proxy_kv_engines_failing": ("gauge", set()),
    "xpyd_proxy_waiting_requests": ("gauge", set()),
    "xpyd_proxy_waiting_bytes": ("gauge", set()),
    "xpyd_proxy_waiting_total": ("counter", {"result"}),
    "xpyd_proxy_wait_duration_seconds": ("histogram", {"result"}),
}


async def test_metrics_page() -> None:
    async with rig() as r:
        await r.post("/v1/completions", COMPLETION)
        await r.post("/v1/completions", {**COMPLETION, "stream": True})
        await r.post("/v1/completions", {"prompt": "no model"})                  # 400: invalid, rejected
        async with r.session.get(r.url + "/metrics") as response:
            content_type = response.headers["Content-Type"]
            text = await response.text()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    # Parsed by prometheus_client's own parser: names, types and label names as Prometheus stores them.
    families = {f"{family.name}_total" if family.type == "counter" else family.name: family
                for family in text_string_to_metric_families(text)}
    assert {name: family.type for name, family in families.items()} == \
        {name: kind for name, (kind, _) in PROXY_FAMILIES.items()}
    for name, family in families.items():
        for sample in family.samples:
            assert set(sample.labels) - ({"le"} if sample.name.endswith("_bucket") else set()) == \
                PROXY_FAMILIES[name][1], sample
            assert not sample.name.endswith("_created"), sample
    values = {(sample.name, frozenset(sample.labels.items())): sample.value
              for family in families.values() for sample in family.samples}
    nixl = {"connector": "NixlConnector", "endpoint": "completions"}
    for name, labels, value in (
            ("xpyd_proxy_requests_total", {**nixl, "outcome": "success"}, 2),
            ("xpyd_proxy_requests_total", {**nixl, "outcome": "invalid"}, 1),
            ("xpyd_proxy_rejected_total", {"status": "400"}, 1),
            ("xpyd_proxy_time_to_first_byte_seconds_count", nixl, 2),
            ("xpyd_proxy_time_to_first_token_seconds_count", nixl, 1),         # TTFT proper: the streamed one
            ("xpyd_proxy_request_duration_seconds_count", nixl, 3),
            ("xpyd_proxy_leg_duration_seconds_count", {"role": "prefill", "result": "success"}, 2),
            ("xpyd_proxy_leg_duration_seconds_count", {"role": "decode", "result": "success"}, 2),
            ("xpyd_proxy_breaker_state", {"role": "decode", "upstream": r.decode[0].url}, 0),
            ("xpyd_proxy_upstream_in_flight", {"role": "prefill", "upstream": r.prefill[0].url}, 0),
            ("xpyd_proxy_upstream_healthy", {"role": "prefill", "upstream": r.prefill[0].url}, 1),
            ("xpyd_proxy_upstream_prompt_tokens", {"upstream": r.prefill[0].url}, 0),
            ("xpyd_proxy_upstreams", {"role": "decode", "state": "eligible"}, 1),
            ("xpyd_proxy_in_flight_requests", {}, 0), ("xpyd_proxy_draining", {}, 0)):
        assert values[(name, frozenset(labels.items()))] == value, (name, labels)
    # A histogram: every bound of LATENCY_BUCKETS and +Inf, cumulative, the last one the count.
    legs = [sample for sample in families["xpyd_proxy_leg_duration_seconds"].samples
            if sample.name.endswith("_bucket") and sample.labels["role"] == "prefill"]
    assert [float(sample.labels["le"]) for sample in legs] == [*LATENCY_BUCKETS, math.inf]
    counts = [sample.value for sample in legs]
    assert counts == sorted(counts) and counts[-1] == 2


async def test_idle_upstream_connections_close_before_the_engines_keep_alive() -> None:
    """vLLM (uvicorn) closes idle connections after 5 s; reusing one it is closing costs a reset."""
    async with rig() as r:
        assert r.proxy.session is not None
        connector = r.proxy.session.connector
        assert connector is not None
        assert connector._keepalive_timeout == r.proxy.config.upstream_idle_timeout < 5.0  # type: ignore[attr-defined]


async def test_concurrent_requests_with_one_client_id_never_share_an_upstream_id() -> None:
    """Reference: every vLLM proxy mints a fresh uuid4 per request and sends it on both legs
    (toy_proxy_server.py, toy_push_proxy_server.py, mooncake_connector_proxy.py); vLLM makes its
    internal id `cmpl-<X-Request-Id>-<i>[-<8 hex>]` from it (vllm/entrypoints/openai/, and
    `InputProcessor.assign_request_id` in vllm/v1/engine/input_processor.py from 0.16). Two client
    requests with the same X-Request-Id must not meet on one prefill engine under one id or one
    Mooncake transfer_id (one could get the other's KV); each client still gets its own id back."""
    async with await mooncake_rig() as r:
        r.decode[0].token_delay = 0.05
        answers = await asyncio.gather(*(r.post("/v1/completions", COMPLETION, {"X-Request-Id": "same"})
                                         for _ in range(2)))
        assert [(status, headers["X-Request-Id"]) for status, _, headers in answers] == [(200, "same")] * 2
        prefills, decodes = r.prefill[0].seen, r.decode[0].seen
        upstream = {leg.headers["X-Request-Id"] for leg in prefills}
        assert len(upstream) == 2 and "same" not in upstream
        assert {leg.headers["X-Request-Id"] for leg in decodes} == upstream
        transfers = {leg.body["kv_transfer_params"]["transfer_id"] for leg in prefills}
        assert transfers == {leg.body["kv_transfer_params"]["transfer_id"] for leg in decodes}
        assert transfers == {f"xfer-{i}" for i in upstream}
