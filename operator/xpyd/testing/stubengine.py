"""A stub vLLM engine that answers at once: vLLM's OpenAI API (completions, chat, streaming with
usage, /v1/models, /health) and the `kv_transfer_params` answers of a NIXL prefill engine and a
Mooncake bootstrap server (`GET /query`). It models no timing at all (`xpyd engine-sim` does): it is
the engine of the proxy benchmark, where only the proxy's own cost should show, and of the proxy's
failure-injection tests, which switch its faults on and off (`fail_status`, `hang`, `health_status`,
`break_after_chunks`, `omit_kv_params`, `token_delay`, `shutting_down`: answer every generation
request as vLLM does once its engine got SIGTERM, 200 with `finish_reason` `abort` and no output) and
read what it received (`seen`) and how
requests ended (`cancelled`). With `data_parallel_size` > 1 it has one engine id per rank
(`<name>-engine_dp<rank>`, the `_dp` suffix vLLM gives each rank's engine id), which its bootstrap
server reports; a NIXL prefill answer carries the identity of the rank that served it (the one the
`X-data-parallel-rank` header names, else the next in turn, as vLLM's internal balancing would),
with that rank's side-channel port (`side_channel_port` + rank), and a `remote_request_id` shaped
like vLLM's internal id: `cmpl-<X-Request-Id>-0-<8 hex>` (`chatcmpl-<X-Request-Id>-<8 hex>` for
chat), the random suffix vLLM 0.16+ appends (`InputProcessor.assign_request_id`).

A decode stub given `push_prefill` (the prefill stub of a NixlPushConnector pair) checks a push
decode leg as vLLM's push connector would need it: the identity fields and `remote_request_id`
present and no `remote_block_ids`; `remote_request_id` one its prefill issued, for the same
X-Request-Id (prefill matches decode's registration by that base id, nixl/push_worker.py
`_pop_matching_registration`); anything else is answered 400 and recorded in `errors`.

With `lmcache_producer` the stub is an LMCacheConnectorV1 P/D prefill engine (`kv_role`
kv_producer, `enable_pd`): a generation request without a well-formed `disagg_spec` fails with 500
(vLLM's adapter asserts `request.disagg_spec is not None` for every request a producer saves, and
LMCache's PD backend indexes the port lists by its tensor-parallel rank), and one with
`ret_first_tok` is answered `kv_transfer_params: {"first_tok": <token id>}`. `POST /tokenize`
answers vLLM's shape (`count`, `max_model_len`, `tokens`: ids from 1000 up, one per estimated
token) and records what it was asked in `tokenized`.

    python -m xpyd.testing.stubengine --host 127.0.0.1 --port 8100 [--port 8101 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from xpyd.common.jsontypes import JSON
from xpyd.proxy.validation import text_tokens

#: Longest answer the stub generates (vLLM refuses more than the context allows with a 400 too).
MAX_TOKENS = 4096


@dataclass(frozen=True)
class Seen:
    """A generation request as the stub received it."""

    path: str
    headers: CIMultiDict[str]
    body: JSON


def _prompt_tokens(body: JSON) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(4 + text_tokens(str(m.get("content") or "")) for m in messages if isinstance(m, dict))
    return 1


@dataclass
class StubEngine:
    """One stub engine; `start()` serves it on loopback (or `app()` for an existing runner)."""

    name: str = "stub"
    default_max_tokens: int = 16
    record: bool = True
    side_channel_port: int = 5600
    fail_status: int | None = None
    #: Engine ids of the prefill engines whose KV this decode engine cannot load: their decode legs get
    #: the 500 vLLM answers under `kv_load_failure_policy: fail` (a broken pair, not a broken engine).
    unreadable_from: frozenset[str] = frozenset()
    hang: bool = False
    health_status: int = 200
    hang_health: bool = False
    break_after_chunks: int | None = None
    omit_kv_params: bool = False
    token_delay: float = 0.0
    shutting_down: bool = False
    data_parallel_size: int = 1
    push_prefill: StubEngine | None = None
    lmcache_producer: bool = False
    tensor_parallel_size: int = 1
    #: The token id an LMCache P/D prefill answers as `first_tok`.
    first_token: int = 42
    seen: list[Seen] = field(default_factory=list)
    #: The internal request id answered per X-Request-Id (NIXL prefill answers' `remote_request_id`).
    internal_ids: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    tokenized: list[JSON] = field(default_factory=list)
    started: int = 0
    completed: int = 0
    cancelled: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    _runner: web.AppRunner | None = None
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def url(self) -> str:
        """Base URL once started."""
        return f"http://{self.host}:{self.port}"

    @property
    def engine_id(self) -> str:
        """The NIXL/Mooncake engine id the stub reports (of data-parallel rank 0)."""
        return self.rank_engine_id(0)

    def rank_engine_id(self, rank: int) -> str:
        """The engine id of data-parallel `rank`."""
        return f"{self.name}-engine" if self.data_parallel_size == 1 else f"{self.name}-engine_dp{rank}"

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/query", self._query)
        app.router.add_post("/tokenize", self._tokenize)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on `host:port` (0: any free port); returns the base URL."""
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        self.host, self.port = host, server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return self.url

    async def stop(self) -> None:
        """Stop serving (open connections are closed)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        if self.hang_health:
            await asyncio.sleep(3600)
        return web.Response(status=self.health_status)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.name, "object": "model", "created": 0, "owned_by": "vllm", "root": self.name,
             "parent": None, "max_model_len": 131072}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        self.tokenized.append(body)
        count = _prompt_tokens(body)
        return web.json_response({"count": count, "max_model_len": 131072, "tokens": list(range(1000, 1000 + count)),
                                  "token_strs": None})

    async def _query(self, request: web.Request) -> web.Response:
        return web.json_response({str(rank): {"engine_id": self.rank_engine_id(rank),
                                              "worker_addr": {"0": {"0": f"{self.host}:{17000 + rank}"}}}
                                  for rank in range(self.data_parallel_size)})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError:
            return web.json_response({"error": {"message": "invalid JSON", "type": "BadRequestError",
                                                "param": None, "code": 400}}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "not an object", "type": "BadRequestError",
                                                "param": None, "code": 400}}, status=400)
        if self.record:
            self.seen.append(Seen(request.path, CIMultiDict(request.headers), body))
        self.started += 1
        try:
            if self.hang:
                await asyncio.sleep(3600)
            if self.fail_status is not None:
                return web.json_response({"error": {"message": "injected failure", "type": "InternalServerError",
                                                    "param": None, "code": self.fail_status}}, status=self.fail_status)
            if self.shutting_down:
                return self._aborted(request, body)
            if (body.get("kv_transfer_params") or {}).get("remote_engine_id") in self.unreadable_from:
                error = {"error": {"message": "KV load failed", "type": "InternalServerError", "param": None,
                                   "code": 500}}
                if body.get("stream"):  # vLLM's stream generators: 200, the error event, then [DONE]
                    return web.Response(body=b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n",
                                        content_type="text/event-stream")
                return web.json_response(error, status=500)
            broken = self._check_lmcache_prefill(body.get("kv_transfer_params"))
            if broken is not None:
                self.errors.append(broken)
                return web.json_response({"error": {"message": broken, "type": "InternalServerError",
                                                    "param": None, "code": 500}}, status=500)
            refused = self._check_push_decode(request, body.get("kv_transfer_params"))
            if refused is not None:
                self.errors.append(refused)
                return web.json_response({"error": {"message": refused, "type": "BadRequestError",
                                                    "param": "kv_transfer_params", "code": 400}}, status=400)
            response = await self._answer(request, body)
            self.completed += 1
            return response
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    def _aborted(self, request: web.Request, body: JSON) -> web.Response:
        """vLLM's answer to a request that reaches an engine shutting down (`EngineCore.
        _reject_add_in_shutdown`): 200, `finish_reason` `abort`, no output, no `kv_transfer_params`."""
        chat = request.path.endswith("/chat/completions")
        stream = bool(body.get("stream"))
        output: JSON = ({"delta" if stream else "message": {"role": "assistant", "content": ""}} if chat
                        else {"text": ""})
        answer = {"id": f"cmpl-{next(self._ids)}", "model": str(body.get("model", self.name)),
                  "choices": [{"index": 0, **output, "logprobs": None, "finish_reason": "abort"}]}
        if not stream:
            prompt_tokens = _prompt_tokens(body)
            return web.json_response({**answer, "usage": {"prompt_tokens": prompt_tokens,
                                                          "total_tokens": prompt_tokens, "completion_tokens": 0}})
        return web.Response(body=b"data: " + json.dumps(answer).encode() + b"\n\ndata: [DONE]\n\n",
                            content_type="text/event-stream")

    def _kv_answer(self, request: web.Request, params: Any) -> JSON | None:
        if self.lmcache_producer:
            return {"first_tok": self.first_token} if isinstance(params, dict) and "ret_first_tok" in params else None
        if not isinstance(params, dict) or not params.get("do_remote_decode") or self.omit_kv_params:
            return None
        if "transfer_id" in params:  # Mooncake: decode learns everything from the proxy
            return None
        return self.kv_answer(request.headers.get("X-Request-Id", ""), self._rank(request),
                              chat=request.path.endswith("/chat/completions"))

    def _check_lmcache_prefill(self, params: Any) -> str | None:
        """What an LMCache P/D producer would fail on in this request's `kv_transfer_params`."""
        if not self.lmcache_producer:
            return None
        spec = params.get("disagg_spec") if isinstance(params, dict) else None
        if not isinstance(spec, dict):
            return "AssertionError: request.disagg_spec is not None"
        for key, kind in (("req_id", str), ("receiver_host", str)):
            if not isinstance(spec.get(key), kind) or not spec[key]:
                return f"disagg_spec[{key!r}] is not a non-empty string"
        for key in ("receiver_init_port", "receiver_alloc_port"):
            ports = spec.get(key)
            if not isinstance(ports, list) or len(ports) < self.tensor_parallel_size or \
                    not all(isinstance(port, int) and 0 < port < 65536 for port in ports):
                return f"disagg_spec[{key!r}] has no port for each of {self.tensor_parallel_size} TP rank(s)"
        return None

    def _check_push_decode(self, request: web.Request, params: Any) -> str | None:
        """What is wrong with a NixlPushConnector decode leg (None: nothing, or not one)."""
        if self.push_prefill is None or not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        missing = [key for key in ("remote_engine_id", "remote_host", "remote_port", "tp_size", "remote_request_id")
                   if params.get(key) is None]
        if missing:
            return f"push decode without {missing}"
        if "remote_block_ids" in params:
            return "push decode with remote_block_ids"
        remote_id = params["remote_request_id"]
        if remote_id not in self.push_prefill.internal_ids.values():
            return f"remote_request_id {remote_id!r} is no request id the prefill engine issued"
        own = request.headers.get("X-Request-Id", "")
        mine = f"chatcmpl-{own}" if request.path.endswith("/chat/completions") else f"cmpl-{own}-0"
        if re.sub(r"-[0-9a-f]{8}$", "", str(remote_id)) != mine:
            return f"remote_request_id {remote_id!r} belongs to another X-Request-Id than {own!r}"
        return None

    def _rank(self, request: web.Request) -> int:
        """The data-parallel rank that serves a request: the pinned one, else the next in turn."""
        pinned = request.headers.get("X-data-parallel-rank", "")
        if pinned.isdigit() and int(pinned) < self.data_parallel_size:
            return int(pinned)
        return next(self._turn) % max(self.data_parallel_size, 1)

    def internal_id(self, request_id: str, chat: bool = False) -> str:
        """The internal request id vLLM gives a request with this X-Request-Id (the same one each
        time it is asked here; vLLM's random suffix makes it unknowable before the answer)."""
        base = f"chatcmpl-{request_id}" if chat else f"cmpl-{request_id}-0"
        return self.internal_ids.setdefault(request_id, f"{base}-{secrets.token_hex(4)}")

    def kv_answer(self, request_id: str, rank: int = 0, chat: bool = False) -> JSON:
        """The `kv_transfer_params` a NIXL prefill leg with this X-Request-Id is answered with by
        data-parallel `rank`."""
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
                "remote_engine_id": self.rank_engine_id(rank),
                "remote_request_id": self.internal_id(request_id, chat),
                "remote_host": self.host, "remote_port": self.side_channel_port + rank, "tp_size": 1, "pp_size": 1}

    async def _answer(self, request: web.Request, body: JSON) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        model = str(body.get("model", self.name))
        limit = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") else None
        tokens = int(limit or body.get("max_tokens") or self.default_max_tokens)
        if not 0 < tokens <= MAX_TOKENS:
            return web.json_response({"error": {"message": f"max_tokens must be within 1..{MAX_TOKENS}",
                                                "type": "BadRequestError", "param": "max_tokens", "code": 400}},
                                     status=400)
        prompt_tokens = _prompt_tokens(body)
        kv = self._kv_answer(request, body.get("kv_transfer_params"))
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{request.headers.get('X-Request-Id', next(self._ids))}"
        created = int(time.time())
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + tokens, "completion_tokens": tokens}
        words = [f" tok{i}" for i in range(tokens)]
        if not body.get("stream"):
            if chat:
                choice: JSON = {"index": 0, "message": {"role": "assistant", "content": "".join(words)},
                                "logprobs": None, "finish_reason": "length"}
            else:
                choice = {"index": 0, "text": "".join(words), "logprobs": None, "finish_reason": "length"}
            return web.json_response({
                "id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model, "choices": [choice], "usage": usage, "kv_transfer_params": kv})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"
        for index, word in enumerate(words):
            if self.break_after_chunks is not None and index >= self.break_after_chunks:
                assert request.transport is not None
                request.transport.abort()
                return response
            last = index == len(words) - 1
            if chat:
                delta: JSON = {"role": "assistant", "content": word} if index == 0 else {"content": word}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": "length" if last else None}
            else:
                choice = {"index": 0, "text": word, "logprobs": None, "finish_reason": "length" if last else None}
            chunk = {"id": ident, "object": kind, "created": created, "model": model, "choices": [choice]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            chunk = {"id": ident, "object": kind, "created": created, "model": model, "choices": [], "usage": usage}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _serve(host: str, ports: list[int]) -> None:
    engines = [StubEngine(name=f"stub-{port}", record=False) for port in ports]
    for engine, port in zip(engines, ports, strict=True):
        await engine.start(host, port)
    await asyncio.Event().wait()


def main() -> int:
    """Serve stub engines until killed."""
    parser = argparse.ArgumentParser(prog="python -m xpyd.testing.stubengine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, action="append", required=True, help="a port to serve (repeatable)")
    args = parser.parse_args()
    from xpyd.common.netguard import require_loopback

    asyncio.run(_serve(require_loopback(args.host, "stub engine address"), args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
