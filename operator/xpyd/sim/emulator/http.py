"""The emulator's aiohttp server: the OpenAI endpoints, probes, `/metrics` and the KV side channel."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from aiohttp import web

from xpyd.kvcache.events import block_hash_key
from xpyd.sim.core import EnginePerf
from xpyd.sim.emulator.config import EMULATED_VLLM_VERSION, KEEPALIVE_TIMEOUT_S, EmulatorConfig, env_flag
from xpyd.sim.emulator.engine import Engine, Stream
from xpyd.sim.emulator.exposition import CONTENT_TYPE
from xpyd.sim.emulator.wire import (
    ApiError,
    Chunks,
    Generation,
    error_body,
    error_response,
    full_response,
    parse_generation,
    parse_tokenize,
    prompt_tokens_details,
    random_uuid,
    sse_event,
    tokenize_response,
)

log = logging.getLogger(__name__)

ENGINE: web.AppKey[Engine] = web.AppKey("engine", Engine)
SESSION_ID_HEADER = "X-Session-ID"
"""vLLM's session header: a request's `session_id` when its body has none (BlockStored's `session_id`)."""


def _not_ready(engine: Engine) -> web.Response | None:
    if (reason := engine.not_ready_reason()) is not None:
        return error_response(503, f"The engine is not serving: {reason}.", "ServiceUnavailableError")
    if not engine.ready:
        return error_response(503, f"The model is loading (ready in {engine.loading_left_s:.1f} s).",
                              "ServiceUnavailableError")
    return None


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE]
    unavailable = _not_ready(engine)
    if unavailable is not None:
        return unavailable
    config = engine.config
    try:
        if request.content_type != "application/json":
            raise ApiError(400, "Unsupported Media Type: Only 'application/json' is allowed")
        try:
            body = json.loads(await request.read())
        except ValueError as error:
            raise ApiError(400, f"Invalid JSON body: {error}") from None
        generation = parse_generation(body, chat, config, request.headers.get(SESSION_ID_HEADER))
    except ApiError as error:
        return error_response(error.status, error.message, error.error_type, error.param)
    base = request.headers.get("X-Request-Id") or random_uuid()
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{base}"
    # The engine's request id: a completion's prompt i is `{response_id}-{i}` (one prompt here).
    internal_id = response_id if chat else f"{response_id}-0"
    if engine.draining:
        return await _rejected(request, engine, generation, response_id)
    engine.in_flight += 1
    stream: Stream | None = None
    try:
        if generation.stream:
            return await _stream(request, engine, generation, response_id, internal_id)
        stream = _submit(engine, internal_id, generation)
        while not stream.finished:
            await stream.wait()
        if stream.error is not None:
            return error_response(500, stream.error, "InternalServerError")
        params = engine.kv_transfer_params(stream) if stream.request.do_remote_decode else None
        return web.json_response(_full_response(engine, generation, response_id, stream.tokens, "length", params,
                                                _details(engine, generation, stream)))
    finally:
        engine.in_flight -= 1
        if stream is not None:
            engine.abort(stream)   # no-op once finished


async def _rejected(request: web.Request, engine: Engine, generation: Generation,
                    response_id: str) -> web.StreamResponse:
    """A request that arrives while the engine drains: vLLM's EngineCore rejects it at once with
    finish_reason "abort" (`_reject_add_in_shutdown`), which the OpenAI layer answers like any finished
    request -- 200, no text, no `kv_transfer_params` (the connector hands nothing off for an abort)."""
    engine.connector.aborted_total += 1
    if not generation.stream:
        return web.json_response(_full_response(engine, generation, response_id, 0, "abort", None))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    chunks = Chunks(response_id, engine.config.model_name, int(time.time()), generation, engine.system_fingerprint)
    events = [chunks.role()] if generation.chat else []
    events.append(chunks.aborted())
    if generation.include_usage:
        events.append(chunks.usage(0))
    events.append("data: [DONE]\n\n")
    try:
        await response.write("".join(events).encode())
        await response.write_eof()
    except ConnectionResetError:
        log.debug("client of %s went away", response_id)
    return response


def _full_response(engine: Engine, generation: Generation, response_id: str, tokens: int, finish_reason: str,
                   params: dict[str, Any] | None, details: dict[str, Any] | None = None) -> dict[str, Any]:
    return full_response(generation, response_id, engine.config.model_name, int(time.time()), tokens, finish_reason,
                         params, engine.system_fingerprint, details)


def _submit(engine: Engine, internal_id: str, generation: Generation) -> Stream:
    return engine.submit(internal_id, generation.token_ids, generation.max_tokens, generation.kv_transfer_params,
                         generation.cache_salt, generation.session_id)


def _details(engine: Engine, generation: Generation, stream: Stream) -> dict[str, Any] | None:
    """`usage.prompt_tokens_details`: with `--enable-prompt-tokens-details` only, as in vLLM."""
    if not engine.config.enable_prompt_tokens_details:
        return None
    return prompt_tokens_details(generation.chat, stream.cached_tokens, stream.created_cache_tokens)


async def _stream(request: web.Request, engine: Engine, generation: Generation,
                  response_id: str, internal_id: str) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    chunks = Chunks(response_id, engine.config.model_name, int(time.time()), generation, engine.system_fingerprint)
    if generation.chat:
        await response.write(chunks.role().encode())
    stream = _submit(engine, internal_id, generation)
    try:
        sent = 0
        total = stream.total
        while True:
            while stream.tokens == sent and not stream.finished:
                await stream.wait()
            if stream.error is not None:
                await response.write(sse_event(error_body(stream.error, "InternalServerError", 500)).encode())
                break
            count = stream.tokens - sent
            if count and sent + count == total and stream.request.do_remote_decode:
                chunks.kv_transfer_params = engine.kv_transfer_params(stream)   # on the final event
            if count:
                await response.write(chunks.tokens(sent, count, total).encode())
                sent += count
            if stream.finished:
                if generation.include_usage:
                    await response.write(chunks.usage(sent, _details(engine, generation, stream)).encode())
                break
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        log.debug("client of %s went away", response_id)
    finally:
        engine.abort(stream)   # no-op once finished
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/completions`."""
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/chat/completions`."""
    return await _generate(request, chat=True)


async def tokenize(request: web.Request) -> web.Response:
    """`POST /tokenize`: a prompt's or a chat's token ids as the generation endpoints count them (vLLM's
    `TokenizeResponse`: `count`, `max_model_len`, `tokens`, `token_strs` with `return_token_strs`).
    Served while draining too: vLLM tokenizes in its API server, without the engine."""
    engine = request.app[ENGINE]
    unavailable = _not_ready(engine)
    if unavailable is not None:
        return unavailable
    try:
        if request.content_type != "application/json":
            raise ApiError(400, "Unsupported Media Type: Only 'application/json' is allowed", "Bad Request")
        try:
            body = json.loads(await request.read())
        except ValueError as error:
            raise ApiError(400, f"Invalid JSON body: {error}") from None
        tokenized = parse_tokenize(body, engine.config)
    except ApiError as error:
        return error_response(error.status, error.message, error.error_type, error.param)
    return web.json_response(tokenize_response(tokenized, engine.config.max_model_len))


async def models(request: web.Request) -> web.Response:
    """`GET /v1/models`: the served model names."""
    engine = request.app[ENGINE]
    unavailable = _not_ready(engine)
    if unavailable is not None:
        return unavailable
    config = engine.config
    created = int(time.time())
    cards = [{"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": config.model,
              "parent": None, "max_model_len": config.max_model_len,
              "permission": [{"id": f"modelperm-{random_uuid()}", "object": "model_permission",
                              "created": created, "allow_create_engine": False, "allow_sampling": True,
                              "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                              "allow_fine_tuning": False, "organization": "*", "group": None,
                              "is_blocking": False}]}
             for name in (config.served_model_names or (config.model,))]
    return web.json_response({"object": "list", "data": cards})


async def health(request: web.Request) -> web.Response:
    """`GET /health` and `/ping`: 200 with an empty body when ready (draining too, as vLLM: its handler
    answers 503 only for a dead engine), 503 while loading."""
    unavailable = _not_ready(request.app[ENGINE])
    return unavailable if unavailable is not None else web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    """`GET /version`: the emulated vLLM release."""
    return web.json_response({"version": EMULATED_VLLM_VERSION})


async def metrics(request: web.Request) -> web.Response:
    """`GET /metrics`: Prometheus text format 0.0.4."""
    return web.Response(body=request.app[ENGINE].metrics_text().encode(), headers={"Content-Type": CONTENT_TYPE})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """`POST /reset_prefix_cache` (vLLM serves it only with VLLM_SERVER_DEV_MODE=1): `{"success": bool}`,
    false while requests hold KV. An `AllBlocksCleared` KV event goes out with the next step's batch."""
    engine = request.app[ENGINE]
    running = request.query.get("reset_running_requests", "false").lower() in ("1", "true", "yes", "on")
    log.info("Resetting prefix cache...")
    return web.json_response({"success": engine.reset_prefix_cache(running)})


async def kv_lookup(request: web.Request) -> web.Response:
    """`GET /xpyd/kv/{id}` (side channel): whether this engine holds a prefill leg's KV, and for how long."""
    engine = request.app[ENGINE]
    request_id = request.match_info["request_id"]
    held = engine.held_kv(request_id)
    if held is None:
        return error_response(404, f"no KV held for {request_id}", "NotFoundError")
    engine_request, remaining = held
    return web.json_response({"remote_request_id": request_id, "engine_id": engine.engine_id,
                              "prompt_tokens": engine_request.prompt_tokens, "lease_remaining_s": remaining})


async def kv_release(request: web.Request) -> web.Response:
    """`POST /xpyd/kv/{id}/release` (side channel): the consumer has pulled the KV; free the blocks."""
    engine = request.app[ENGINE]
    request_id = request.match_info["request_id"]
    if not engine.release_kv(request_id):
        return error_response(404, f"no KV held for {request_id}", "NotFoundError")
    return web.json_response({"released": request_id})


async def kv_blocks(request: web.Request) -> web.Response:
    """`GET /xpyd/kv/blocks` (not vLLM's): what the prefix cache holds now, to check a router's index
    against: `{"blocks": [hash, ...], "duplicated": n, "batches": n}`, each cached prompt block once as
    the KV events name it (an integer, or hex digits with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), how
    many of them are cached more than once, and the KV event batches published so far. The blocks
    include those cached or evicted in the step under way, whose events go out when it ends. With
    `?format=u64` the body is the blocks' low 64 bits (a router's keys), 8 bytes each, big-endian, and
    the counts are the headers `X-KV-Duplicated` and `X-KV-Batches` (cheap to read beside a busy loop)."""
    engine = request.app[ENGINE]
    cached = engine.cached_blocks()
    duplicated = sum(1 for _, copies in cached if copies > 1)
    batches = engine.kv_batches_published
    if request.query.get("format") == "u64":
        body = b"".join(block_hash_key(block).to_bytes(8, "big") for block, _ in cached)
        return web.Response(body=body, content_type="application/octet-stream",
                            headers={"X-KV-Duplicated": str(duplicated), "X-KV-Batches": str(batches)})
    blocks = [block if isinstance(block, int) else block.hex() for block, _ in cached]
    return web.json_response({"blocks": blocks, "duplicated": duplicated, "batches": batches})



async def faults(request: web.Request) -> web.Response:
    """`GET` / `PUT /xpyd/faults` (fault injection, not vLLM's): `{"unreadable_from": [host, ...]}`,
    the prefill side-channel hosts whose KV this engine cannot read ("*": all), as a broken link
    would make it. `PUT` replaces the list; `[]` repairs every link."""
    engine = request.app[ENGINE]
    if request.method == "PUT":
        try:
            body = json.loads(await request.read())
        except ValueError as error:
            return error_response(400, f"Invalid JSON body: {error}", "BadRequestError")
        hosts = body.get("unreadable_from") if isinstance(body, dict) else None
        if not isinstance(hosts, list) or not all(isinstance(h, str) and h for h in hosts):
            return error_response(400, 'the body must be {"unreadable_from": [host, ...]} (non-empty strings)',
                                  "BadRequestError")
        engine.unreadable_from = frozenset(hosts)
        log.warning("injected fault: KV unreadable from %s", ", ".join(sorted(hosts)) or "no host")
    return web.json_response({"unreadable_from": sorted(engine.unreadable_from)})


def build_app(engine: Engine) -> web.Application:
    """The aiohttp application of one engine (the engine is started and stopped with it)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[ENGINE] = engine

    async def lifecycle(app: web.Application) -> Any:
        await engine.start()
        yield
        await engine.stop()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/xpyd/kv/blocks", kv_blocks)
    app.router.add_get("/xpyd/kv/{request_id}", kv_lookup)
    app.router.add_post("/xpyd/kv/{request_id}/release", kv_release)
    app.router.add_get("/xpyd/faults", faults)
    app.router.add_put("/xpyd/faults", faults)
    if env_flag("VLLM_SERVER_DEV_MODE", False):   # vLLM's development endpoints
        app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    return app




class EmulatorServer:
    """A running engine: HTTP on (host, port), plus the NIXL side channel when a connector is set."""

    def __init__(self, engine: Engine, runner: web.AppRunner, http_site: web.TCPSite, http_port: int) -> None:
        self.engine = engine
        self.runner = runner
        self.http_site = http_site
        self.http_port = http_port
        self._closed = False

    @property
    def url(self) -> str:
        """Base URL of the HTTP API."""
        return f"http://{self.engine.config.host}:{self.http_port}"

    async def drain(self) -> None:
        """Graceful stop (SIGTERM), as vLLM's launcher does it: HTTP keeps serving (`/health` 200, new
        generation requests aborted at once) while in-flight requests and held KV finish, up to the
        shutdown timeout; then close everything."""
        engine = self.engine
        engine.draining = True
        deadline = time.monotonic() + engine.config.shutdown_timeout_s
        while (engine.in_flight or engine.num_held) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if engine.in_flight or engine.num_held:
            log.warning("shutdown timeout: aborting %d in-flight requests (%d KV leases held)", engine.in_flight,
                        engine.num_held)
        await self.close()

    async def close(self) -> None:
        """Stop at once (in-flight handlers are cancelled); a no-op when already closed."""
        if not self._closed:
            self._closed = True
            await self.runner.cleanup()


async def start_server(config: EmulatorConfig, perf: EnginePerf) -> EmulatorServer:
    """Bind and start one emulated engine (ports 0 pick free ports; see `EmulatorServer`)."""
    engine = Engine(config, perf)
    runner = web.AppRunner(build_app(engine), handler_cancellation=True, keepalive_timeout=KEEPALIVE_TIMEOUT_S,
                           access_log=None, shutdown_timeout=0.0)
    await runner.setup()
    try:
        http_site = web.TCPSite(runner, config.host, config.port)
        await http_site.start()
        http_port = int(runner.addresses[0][1])
        if config.kv_role is not None:
            side_host, side_port = engine.side_channel
            await web.TCPSite(runner, side_host, side_port).start()
            engine.side_channel = (side_host, int(runner.addresses[1][1]))
    except BaseException:
        await runner.cleanup()
        raise
    return EmulatorServer(engine, runner, http_site, http_port)


