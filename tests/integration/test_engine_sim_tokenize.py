"""`xpyd engine-sim`'s `POST /tokenize`: vLLM's request and answer shapes, and token ids that are the
ones the generation endpoints hash into prefix-cache blocks (a prompt sent again as the ids
`/tokenize` gave hits every block the text cached), for a text prompt and for a chat with vLLM's chat
fields; errors in vLLM's envelope."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.integration.enginesim import HOST, KV_BYTES, PERF, client_session, post
from xpyd.sim.emulator import tokens
from xpyd.sim.emulator.config import EmulatorConfig
from xpyd.sim.emulator.http import EmulatorServer, start_server

pytestmark = pytest.mark.integration

NAME = "llama-8b"
MAX_MODEL_LEN = 4096
BLOCK = 16


@contextlib.asynccontextmanager
async def engine(**overrides: Any) -> AsyncIterator[EmulatorServer]:
    settings: dict[str, Any] = {"served_model_names": (NAME,), "host": HOST, "port": 0, "side_channel_port": 0,
                                "time_scale": 100.0, "kv_bytes_per_token": KV_BYTES, "seed": 1,
                                "enable_prompt_tokens_details": True, "max_model_len": MAX_MODEL_LEN}
    settings.update(overrides)
    server = await start_server(EmulatorConfig(**settings), PERF)
    try:
        yield server
    finally:
        await server.close()


async def tokenize(session: aiohttp.ClientSession, server: EmulatorServer, body: Any) -> tuple[int, Any]:
    return await post(session, f"{server.url}/tokenize", body)


async def generate(session: aiohttp.ClientSession, server: EmulatorServer, path: str, body: dict[str, Any]) -> Any:
    status, answer = await post(session, f"{server.url}{path}", {"model": NAME, "max_tokens": 1, **body})
    assert status == 200, answer
    return answer


TEXT = "".join(f" w{i:02d}" for i in range(100))   # 400 characters: 100 tokens, 6 full blocks
MESSAGES = [{"role": "system", "content": "You are terse. " * 10},
            {"role": "user", "content": [{"type": "text", "text": "Say something "},
                                         {"type": "text", "text": "x" * 99}]}]


async def test_a_prompts_ids_are_the_ones_its_completion_caches() -> None:
    async with engine() as server, client_session() as session:
        status, answer = await tokenize(session, server, {"model": NAME, "prompt": TEXT})
        assert status == 200, answer
        assert answer == {"count": 100, "max_model_len": MAX_MODEL_LEN, "tokens": tokens.prompt_ids(TEXT),
                          "token_strs": None}
        first = await generate(session, server, "/v1/completions", {"prompt": TEXT})
        assert first["usage"]["prompt_tokens"] == answer["count"]
        again = await generate(session, server, "/v1/completions", {"prompt": answer["tokens"]})
        # every full block but the one holding the last token: the ids hash to the blocks the text cached
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (100 - 1) // BLOCK * BLOCK

        status, answer = await tokenize(session, server, {"prompt": TEXT, "return_token_strs": True,
                                                          "add_special_tokens": False})
        assert status == 200, answer
        assert answer["token_strs"] == [TEXT[i:i + 4] for i in range(0, 400, 4)]
        assert [tokens.token_id(text) for text in answer["token_strs"]] == answer["tokens"]


@pytest.mark.parametrize("fields", [
    {},
    {"add_generation_prompt": False},
    {"add_generation_prompt": False, "continue_final_message": True},
    {"add_special_tokens": True},
], ids=["defaults", "no-generation-prompt", "continue-final-message", "add-special-tokens"])
async def test_a_chats_ids_are_the_ones_its_chat_completion_caches(fields: dict[str, Any]) -> None:
    async with engine() as server, client_session() as session:
        status, answer = await tokenize(session, server, {"model": NAME, "messages": MESSAGES,
                                                          "return_token_strs": True, **fields})
        assert status == 200, answer
        ids = answer["tokens"]
        assert answer["count"] == len(ids) and answer["max_model_len"] == MAX_MODEL_LEN
        assert [tokens.token_id(text) for text in answer["token_strs"]] == ids
        chat = await generate(session, server, "/v1/chat/completions", {"messages": MESSAGES, **fields})
        assert chat["usage"]["prompt_tokens"] == len(ids)
        again = await generate(session, server, "/v1/completions", {"prompt": ids})
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // BLOCK * BLOCK

    strs = answer["token_strs"]
    assert strs.count("<|begin_of_text|>") == (2 if fields.get("add_special_tokens") else 1)
    if fields.get("continue_final_message"):   # the last message left open
        assert strs.count("<|eot_id|>") == len(MESSAGES) - 1 and strs[-1] == "x"
    elif fields.get("add_generation_prompt") is False:
        assert strs.count("<|eot_id|>") == len(MESSAGES) and strs[-1] == "<|eot_id|>"
    else:
        assert strs[-4:] == ["<|start_header_id|>", "assistant", "<|end_header_id|>", "\n\n"]


def test_the_framing_of_a_chat() -> None:
    chat = [("system", "abcdefgh"), ("user", "ij")]
    assert tokens.chat_strs(chat) == [
        "<|begin_of_text|>", "<|start_header_id|>", "system", "<|end_header_id|>", "\n\n", "abcd", "efgh",
        "<|eot_id|>", "<|start_header_id|>", "user", "<|end_header_id|>", "\n\n", "ij", "<|eot_id|>",
        "<|start_header_id|>", "assistant", "<|end_header_id|>", "\n\n"]
    open_ended = tokens.ChatFlags(add_generation_prompt=False, continue_final_message=True)
    assert tokens.chat_strs(chat, open_ended)[-2:] == ["\n\n", "ij"]
    for flags in (tokens.ChatFlags(), open_ended, tokens.ChatFlags(add_special_tokens=True)):
        assert [tokens.token_id(t) for t in tokens.chat_strs(chat, flags)] == tokens.chat_ids(chat, flags)
    assert len(tokens.chat_ids(chat)) == 1 + (5 + 2) + (5 + 1) + 4   # as the emulator has always counted
    assert tokens.prompt_strs("") == ["<|begin_of_text|>"] and tokens.prompt_ids("") == [tokens.BOS]


async def test_a_prompt_over_the_context_is_tokenized_all_the_same() -> None:
    async with engine() as server, client_session() as session:
        status, answer = await tokenize(session, server, {"prompt": "abcd" * (MAX_MODEL_LEN + 10)})
        assert status == 200 and answer["count"] == MAX_MODEL_LEN + 10, answer


@pytest.mark.parametrize(("body", "status", "error_type", "param"), [
    ({"model": "other", "prompt": "hi"}, 404, "NotFoundError", "model"),
    ({"model": "other", "messages": MESSAGES}, 404, "NotFoundError", "model"),
    ({"model": NAME}, 400, "Bad Request", "body"),
    ({"prompt": [1, 2, 3]}, 400, "Bad Request", "body.prompt"),
    ({"prompt": "hi", "return_token_strs": "yes"}, 400, "Bad Request", "body.return_token_strs"),
    ({"messages": "hi"}, 400, "Bad Request", "body.messages"),
    ({"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True}, 400, "Bad Request",
     "body"),
    ({"messages": MESSAGES, "tools": {"type": "function"}}, 400, "Bad Request", "body.tools"),
    ([1, 2], 400, "Bad Request", "body"),
], ids=["model", "chat-model", "no-prompt", "token-ids", "return-token-strs", "messages", "both-flags", "tools",
        "not-an-object"])
async def test_errors_are_in_vllms_envelope(body: Any, status: int, error_type: str, param: str) -> None:
    async with engine() as server, client_session() as session:
        got, answer = await tokenize(session, server, body)
    assert got == status, answer
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    assert (answer["error"]["type"], answer["error"]["param"], answer["error"]["code"]) == (error_type, param, status)
    if status == 404:
        assert answer["error"]["message"] == f"The model `other` does not exist. Valid aliases: {NAME}."


async def test_the_chat_endpoint_refuses_both_flags_as_vllm_does() -> None:
    async with engine() as server, client_session() as session:
        status, answer = await post(session, f"{server.url}/v1/chat/completions", {
            "messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True})
    assert status == 400 and "Cannot set both `continue_final_message`" in answer["error"]["message"], answer


async def test_not_json_and_loading() -> None:
    async with engine() as server, client_session() as session, session.post(
            f"{server.url}/tokenize", data="prompt=hi",
            headers={"Content-Type": "application/x-www-form-urlencoded"}) as response:
        assert response.status == 400
        assert (await response.json())["error"]["code"] == 400
    async with engine(startup_delay_s=1000.0) as server, client_session() as session:
        status, answer = await tokenize(session, server, {"prompt": "hi"})
        assert status == 503 and answer["error"]["type"] == "ServiceUnavailableError", answer
