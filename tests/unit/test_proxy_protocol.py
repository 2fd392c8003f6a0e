"""What each connector's legs carry (pure builders), the flags the operator passes, and the
request checks."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from xpyd.api.models import Connector, DisaggregatedServingSpec
from xpyd.proxy import protocol
from xpyd.proxy.main import _check, add_arguments, config_from_args
from xpyd.proxy.validation import RequestError, parse, text_tokens
from xpyd.render.proxy import proxy_args

pytestmark = pytest.mark.unit

BODY = {"model": "m", "prompt": "hi", "max_tokens": 50, "max_completion_tokens": 50, "stream": True,
        "stream_options": {"include_usage": True}, "min_tokens": 5, "min_completion_tokens": 5, "temperature": 0.5,
        "kv_transfer_params": {"client": "junk"}}


def test_nixl_prefill_leg_follows_toy_proxy_server() -> None:
    """Reference: vllm-project/vllm tests/v1/kv_connector/nixl_integration/toy_proxy_server.py
    (`send_request_to_service`): a copy of the body with max_tokens=1 (max_completion_tokens=1 when
    present), stream false, stream_options, min_tokens and min_completion_tokens removed, and
    kv_transfer_params {do_remote_decode: true, do_remote_prefill: false, remote_engine_id,
    remote_block_ids, remote_host, remote_port: null}."""
    leg = protocol.prefill_body(BODY, protocol.NIXL_PREFILL_PARAMS)
    assert leg == {"model": "m", "prompt": "hi", "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
                   "temperature": 0.5,
                   "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                          "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                                          "remote_port": None}}
    assert BODY["max_tokens"] == 50 and "stream_options" in BODY  # the client's body is untouched


def test_max_completion_tokens_only_when_present() -> None:
    leg = protocol.prefill_body({"model": "m", "prompt": "x"}, None)
    assert leg == {"model": "m", "prompt": "x", "max_tokens": 1, "stream": False}


def test_decode_leg_follows_toy_proxy_server() -> None:
    """Reference: toy_proxy_server.py (`handle_completions`): decode is the original body with the
    prefill answer's kv_transfer_params, unchanged."""
    answered = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h",
                "remote_port": 5600, "tp_size": 1, "remote_request_id": "r"}
    leg = protocol.decode_body(BODY, answered)
    assert leg == {**BODY, "kv_transfer_params": answered}
    assert protocol.decode_body(BODY, None) == {k: v for k, v in BODY.items() if k != "kv_transfer_params"}


PUSH_ANSWER = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
               "remote_engine_id": "pe", "remote_request_id": "cmpl-x-0", "remote_host": "10.0.0.1",
               "remote_port": 5600, "tp_size": 2, "pp_size": 1, "remote_num_tokens": 64, "transfer_mode": "push"}


@pytest.mark.parametrize(("answer", "identity"), [
    (PUSH_ANSWER, {"remote_engine_id": "pe", "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 2,
                   "pp_size": 1}),
    ({**PUSH_ANSWER, "pp_size": None}, {"remote_engine_id": "pe", "remote_host": "10.0.0.1", "remote_port": 5600,
                                        "tp_size": 2}),
    ({**PUSH_ANSWER, "remote_engine_id": None}, None),
    ({k: v for k, v in PUSH_ANSWER.items() if k != "tp_size"}, None),
    ({**PUSH_ANSWER, "remote_port": [5600]}, None),
    (None, None),
    ("x", None),
])
def test_push_identity(answer: Any, identity: Any) -> None:
    assert protocol.push_identity(answer) == identity


def test_push_decode_params_follow_toy_push_proxy_server() -> None:
    """Reference: vllm-project/vllm tests/v1/kv_connector/nixl_integration/toy_push_proxy_server.py;
    vLLM 0.33 nixl/push_scheduler.py `update_state_after_alloc` (reads remote_engine_id,
    remote_host, remote_port, tp_size, pp_size; no block ids) and metadata.py
    `add_new_req_to_recv` (remote_request_id required)."""
    identity = protocol.push_identity(PUSH_ANSWER)
    assert identity is not None
    params = protocol.push_decode_params(identity, "rid")
    assert params == {**identity, "do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": "rid"}
    assert "remote_block_ids" not in params


def test_mooncake_params() -> None:
    """Reference: vllm-project/vllm examples/online_serving/disaggregated_serving/mooncake_connector/
    mooncake_connector_proxy.py; vLLM 0.16+ mooncake/mooncake_connector.py reads transfer_id,
    remote_engine_id and remote_bootstrap_addr."""
    transfer = protocol.mooncake_transfer_id("rid")
    assert transfer == "xfer-rid"
    assert protocol.mooncake_prefill_params(transfer) == {"do_remote_decode": True, "do_remote_prefill": False,
                                                          "transfer_id": "xfer-rid"}
    assert protocol.mooncake_decode_params(transfer, "http://10.0.0.1:8998", "eng") == {
        "do_remote_decode": False, "do_remote_prefill": True, "remote_bootstrap_addr": "http://10.0.0.1:8998",
        "remote_engine_id": "eng", "transfer_id": "xfer-rid"}


@pytest.mark.parametrize(("answer", "engine_id"), [
    ({"0": {"engine_id": "a"}, "1": {"engine_id": "b"}}, "a"),
    ({"1": {"engine_id": "b"}}, None),
    ({"0": {}}, None),
    ([], None),
])
def test_mooncake_engine_id(answer: Any, engine_id: str | None) -> None:
    assert protocol.mooncake_engine_id(answer) == engine_id


@pytest.mark.parametrize(("prefill", "decode"), [("10.0.0.1:14579", "10.0.0.2:14580"),
                                                 ("127.64.0.3:14579", "127.64.1.9:14579")])
def test_p2p_nccl_request_id_parses_as_vllm_parses_it(prefill: str, decode: str) -> None:
    """Reference: vllm-project/vllm examples/online_serving/disaggregated_serving_p2p_nccl_xpyd/
    disagg_proxy_p2p_nccl_xpyd.py; vLLM <= 0.23 p2p/p2p_nccl_connector.py `parse_request_id`."""
    request_id = protocol.p2p_nccl_request_id(prefill, decode)
    # vLLM 0.23 P2pNcclConnector.parse_request_id, prefill and decode side.
    on_prefill = re.search(r"___decode_addr_(.*):(\d+)", request_id)
    on_decode = re.search(r"___prefill_addr_(.*):(\d+)___", request_id)
    assert on_prefill and f"{on_prefill.group(1)}:{on_prefill.group(2)}" == decode
    assert on_decode and f"{on_decode.group(1)}:{on_decode.group(2)}" == prefill
    assert protocol.p2p_nccl_request_id(prefill, decode) != request_id


def test_host_port_brackets_ipv6() -> None:
    assert protocol.host_port("fd00::1", 80) == "[fd00::1]:80"
    assert protocol.host_port("10.0.0.1", 80) == "10.0.0.1:80"


def test_every_connector_has_traits() -> None:
    assert set(protocol.TRAITS) == set(Connector)
    assert [c for c, t in protocol.TRAITS.items() if t.concurrent] == [Connector.MOONCAKE]


# -- the command line the operator renders -------------------------------------------------------


@pytest.mark.parametrize("connector", ["NixlConnector", "NixlPushConnector", "MooncakeConnector"])
def test_the_operators_proxy_args_parse(connector: str) -> None:
    import argparse

    spec = DisaggregatedServingSpec.model_validate({
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "kvTransfer": {"connector": connector},
        "proxy": {"routingPolicy": "PowerOfTwo"}})
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(proxy_args("llama", "inference", spec))
    assert _check(args) is None
    config = config_from_args(args)
    assert config.connector.value == connector
    assert config.routing_policy.value == "PowerOfTwo"
    assert args.prefill_selector == "xpyd.io/serving=llama,xpyd.io/role=prefill"
    assert args.namespace == "inference" and args.engine_port == 8000


@pytest.mark.parametrize(("argv", "problem"), [
    ([], "either"),
    (["--prefill", "http://a", "--prefill-selector", "x=y"], "either"),
    (["--prefill-selector", "x=y"], "go together"),
    (["--prefill", "http://a"], "--decode"),
    (["--decode", "http://a"], "--prefill"),
    (["--decode", "http://a", "--decode-only-fallback"], None),
    (["--prefill", "http://a", "--decode", "http://b", "--upstream-idle-timeout", "5"], "5 s"),
])
def test_contradictory_flags(argv: list[str], problem: str | None) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    message = _check(parser.parse_args(argv))
    assert (message is None) if problem is None else (message is not None and problem in message)


# -- request checks --------------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "endpoint", "status", "param"), [
    (b"{", "completions", 400, None),
    (b"\xff\xfe", "completions", 400, None),
    (b"[1]", "completions", 400, None),
    (b'{"prompt": "x"}', "completions", 400, "model"),
    (b'{"model": 3, "prompt": "x"}', "completions", 400, "model"),
    (b'{"model": "other", "prompt": "x"}', "completions", 404, "model"),
    (b'{"model": "m"}', "completions", 400, "prompt"),
    (b'{"model": "m", "prompt": []}', "completions", 400, "prompt"),
    (b'{"model": "m", "prompt": [1, "a"]}', "completions", 400, "prompt"),
    (b'{"model": "m", "prompt": "x", "max_tokens": "5"}', "completions", 400, "max_tokens"),
    (b'{"model": "m", "prompt": "x", "max_tokens": true}', "completions", 400, "max_tokens"),
    (b'{"model": "m", "prompt": "x", "max_tokens": 0}', "completions", 400, "max_tokens"),
    (b'{"model": "m", "prompt": "x", "temperature": NaN}', "completions", 400, None),
    (b'{"model": "m", "prompt": "x", "temperature": "hot"}', "completions", 400, "temperature"),
    (b'{"model": "m", "prompt": "x", "stream": "yes"}', "completions", 400, "stream"),
    (b'{"model": "m", "prompt": "x", "stream_options": {"include_usage": true}}', "completions", 400,
     "stream_options"),
    (b'{"model": "m", "prompt": "x", "kv_transfer_params": [1]}', "completions", 400, "kv_transfer_params"),
    (b'{"model": "m", "messages": []}', "chat", 400, "messages"),
    (b'{"model": "m", "messages": [{"content": "x"}]}', "chat", 400, "messages"),
    (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "chat", 400, "messages"),
    (b"[" * 100000 + b"]" * 100000, "completions", 400, None),
])
def test_malformed_requests_are_refused(raw: bytes, endpoint: Any, status: int, param: str | None) -> None:
    with pytest.raises(RequestError) as caught:
        parse(raw, endpoint, served_model="m")
    assert caught.value.status == status
    assert caught.value.param == param
    assert caught.value.body()["error"]["code"] == status


@pytest.mark.parametrize(("raw", "endpoint", "tokens", "stream"), [
    (b'{"model": "m", "prompt": "abcdefgh"}', "completions", 2, False),
    (b'{"model": "m", "prompt": "abcdefghi"}', "completions", 3, False),
    (b'{"model": "m", "prompt": [1, 2, 3, 4, 5]}', "completions", 5, False),
    (b'{"model": "m", "prompt": [[1, 2], [3]]}', "completions", 3, False),
    (b'{"model": "m", "prompt": ["abcd", "ab"], "stream": true}', "completions", 2, True),
    # 5 for the template, 5 per message, characters / 4: as `xpyd engine-sim` counts.
    (b'{"model": "m", "messages": [{"role": "user", "content": "abcdefgh"}]}', "chat", 12, False),
    (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "abcd"}]},'
     b' {"role": "assistant", "content": null}]}', "chat", 16, False),
])
def test_accepted_requests_and_prompt_token_estimates(raw: bytes, endpoint: Any, tokens: int, stream: bool) -> None:
    parsed = parse(raw, endpoint)
    assert (parsed.prompt_tokens, parsed.stream) == (tokens, stream)


def test_text_tokens_like_the_engine() -> None:
    assert [text_tokens("x" * n) for n in (0, 1, 4, 5, 400)] == [1, 1, 1, 2, 100]


def test_add_parser_registers_the_proxy_command() -> None:
    import argparse

    from xpyd.proxy.main import add_parser, run

    parser = argparse.ArgumentParser(prog="xpyd")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                              "--routing-policy", "RoundRobin", "--decode-only-fallback"])
    assert args.func is run
    config = config_from_args(args)
    assert config.routing_policy.value == "RoundRobin" and config.decode_only_fallback


def test_the_api_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--prefill", "http://a", "--decode", "http://b"])
    assert config_from_args(args).api_key is None
    monkeypatch.setenv("XPYD_PROXY_API_KEY", "s3cret")
    assert config_from_args(args).api_key == "s3cret"


def test_lmcache_prefill_params_follow_the_lmcache_pd_proxy() -> None:
    """LMCache P/D, references: LMCache examples/disagg_prefill/xpyd/
    disagg_proxy_server_first_token_from_prefiller_xpyd.py (ports as per-TP-rank lists, init 7300+i,
    alloc 7400+i), vLLM vllm/distributed/kv_transfer/kv_connector/v1/lmcache_integration/
    vllm_v1_adapter.py (reads disagg_spec's req_id, receiver_host, receiver_init_port,
    receiver_alloc_port; `ret_first_tok` in the params makes `request_finished` answer first_tok)."""
    assert protocol.lmcache_prefill_params("rid", "10.0.0.7", decode_tp_size=2) == {
        "ret_first_tok": True,
        "disagg_spec": {"req_id": "rid", "receiver_host": "10.0.0.7",
                        "receiver_init_port": [7300, 7301], "receiver_alloc_port": [7400, 7401]}}
    assert protocol.lmcache_prefill_params("r", "h", 9000, 9100)["disagg_spec"]["receiver_init_port"] == [9000]


@pytest.mark.parametrize(("params", "token"), [
    ({"first_tok": 7}, 7), ({"first_tok": 0}, 0), ({"first_tok": True}, None), ({"first_tok": -1}, None),
    ({"first_tok": "7"}, None), ({}, None), (None, None),
])
def test_lmcache_first_token(params: Any, token: int | None) -> None:
    assert protocol.lmcache_first_token(params) == token


@pytest.mark.parametrize(("body", "eligible"), [
    ({"prompt": "hi", "max_tokens": 2}, True),
    ({"prompt": [1, 2], "max_tokens": 9, "n": 1, "echo": False, "logprobs": None}, True),
    ({"prompt": "hi", "max_tokens": 1}, False),
    ({"prompt": "hi"}, False),
    ({"prompt": "", "max_tokens": 4}, False),
    ({"prompt": ["a", "b"], "max_tokens": 4}, False),
    ({"prompt": [[1], [2]], "max_tokens": 4}, False),
    ({"prompt": "hi", "max_tokens": 4, "n": 2}, False),
    ({"prompt": "hi", "max_tokens": 4, "best_of": 2}, False),
    ({"prompt": "hi", "max_tokens": 4, "logprobs": 0}, False),
    ({"prompt": "hi", "max_tokens": 4, "echo": True}, False),
    ({"prompt": "hi", "max_tokens": 4, "suffix": "x"}, False),
])
def test_lmcache_first_token_eligible(body: dict[str, Any], eligible: bool) -> None:
    assert protocol.lmcache_first_token_eligible(True, body) is eligible
    assert protocol.lmcache_first_token_eligible(False, body) is False


def test_lmcache_decode_body_continues_after_the_first_token() -> None:
    """disagg_proxy_server_first_token_from_prefiller_xpyd.py: prompt ids + first_tok, max_tokens - 1."""
    body = {"model": "m", "prompt": "hi", "max_tokens": 5, "min_tokens": 2, "kv_transfer_params": {"x": 1}}
    assert protocol.lmcache_decode_body(body, [1, 2], 9) == {"model": "m", "prompt": [1, 2, 9], "max_tokens": 4,
                                                            "min_tokens": 1}
    assert protocol.lmcache_decode_body({"prompt": [1], "max_tokens": 2, "min_tokens": 0}, [1], 9)["min_tokens"] == 0


def test_first_token_splice_answer_and_stream() -> None:
    splice = protocol.FirstTokenSplice(" A")
    answer = json.loads(splice.answer(json.dumps({"choices": [{"text": " B"}], "usage": {
        "prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}).encode()))
    assert answer["choices"][0]["text"] == " A B" and answer["usage"]["prompt_tokens"] == 3
    assert answer["usage"]["completion_tokens"] == 3 and answer["usage"]["total_tokens"] == 6
    assert splice.answer(b"not json") == b"not json"
    head = b'data: {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m", "choices": []}\n\n'
    lead = json.loads(splice.lead(head)[len(b"data: "):])
    assert (lead["id"], lead["created"], lead["choices"][0]["text"]) == ("cmpl-1", 5, " A")
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}\n\n'
    stream = head + usage + b"data: [DONE]\n\n"
    out = b"".join(splice.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)) + splice.flush()
    events = [e for e in out.split(b"\n\n") if e]
    assert events[0] == head.strip() and events[-1] == b"data: [DONE]"
    assert json.loads(events[1][len(b"data: "):])["usage"] == {"prompt_tokens": 3, "completion_tokens": 3,
                                                                "total_tokens": 6}


def _event(choice: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps({"id": "cmpl-1", "choices": [choice]}).encode() + b"\n\n"


ABORT = {"index": 0, "text": "", "finish_reason": "abort"}
ROLE = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}


@pytest.mark.parametrize(("data", "stream", "aborted"), [
    # vLLM's answer to a request that reached an engine shutting down (EngineCore._reject_add_in_shutdown).
    (json.dumps({"choices": [ABORT], "usage": {"completion_tokens": 0}}).encode(), False, True),
    (json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                              "finish_reason": "abort"}]}).encode(), False, True),
    (_event(ABORT) + b"data: [DONE]\n\n", True, True),
    (_event(ROLE) + _event({"index": 0, "delta": {"content": ""}, "finish_reason": "abort"}), True, True),
    # Anything else is an answer.
    (json.dumps({"choices": [{"index": 0, "text": "abort", "finish_reason": "length"}]}).encode(), False, False),
    (json.dumps({"choices": [{**ABORT, "text": " partial"}]}).encode(), False, False),   # aborted after output
    (json.dumps({"choices": [ABORT, {**ABORT, "index": 1, "finish_reason": "stop"}]}).encode(), False, False),
    (json.dumps({"choices": []}).encode(), False, False),
    (b'{"choices": [{"finish_reason": "abort"', False, False),                             # not JSON
    (_event({"index": 0, "text": " tok", "finish_reason": None}) + _event(ABORT), True, False),
    (_event(ROLE), True, False),                                                         # not known yet
    (_event(ABORT)[:30], True, False),                                                   # cut short
    (_event({"index": 0, "text": " tok", "finish_reason": None}), True, False),
])
def test_an_engine_shutting_down_aborts_unrun_requests(data: bytes, stream: bool, aborted: bool) -> None:
    assert protocol.answer_aborted(data, stream) == aborted


KV_ERROR = {"message": "KV transfer failed", "type": "InternalServerError", "param": None, "code": 500}


@pytest.mark.parametrize(("data", "error"), [
    # vLLM's stream generators: a request that failed before any output (GenerationError).
    (b"data: " + json.dumps({"error": KV_ERROR}).encode() + b"\n\ndata: [DONE]\n\n", KV_ERROR),
    # Not an error event first: output came (an error later is the stream's, relayed as it is).
    (_event({"index": 0, "text": " tok", "finish_reason": None}) + b"data: " + json.dumps({"error": KV_ERROR}).encode(),
     None),
    (_event({"index": 0, "text": ' "error"', "finish_reason": None}), None),
    (b'data: {"error": {"message": "cut', None),                                            # cut short
    (b'data: {"error": "not an object"}\n\n', None),
    (b"", None),
])
def test_a_stream_whose_first_event_is_an_error(data: bytes, error: dict[str, Any] | None) -> None:
    assert protocol.stream_error(data) == error
