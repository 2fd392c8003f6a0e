"""The legs of one request, per connector: which leg goes first, what each carries, how decode's
answer is relayed, and the failures that decide a retry (`PrefillFailed`, `DecodeFailed`) or go to
the client as they are (`UpstreamAnswer`). `xpyd.proxy.server` picks the instances and retries;
`xpyd.proxy.protocol` builds the bodies.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import aiohttp
from aiohttp import web

from xpyd.api.models import Connector
from xpyd.api.naming import Role
from xpyd.common.jsontypes import JSON
from xpyd.proxy import protocol
from xpyd.proxy.config import ProxyConfig
from xpyd.proxy.health import HealthProber
from xpyd.proxy.kvaware import KVAwareRequest
from xpyd.proxy.metrics import ProxyMetrics
from xpyd.proxy.pool import Instance, Pool
from xpyd.proxy.validation import ClientRequest, error_body

log = logging.getLogger(__name__)

#: Upper bound on an upstream error body read into memory.
MAX_ERROR_BODY: Final = 64 * 1024
#: A leg the engine aborted without running it: it is shutting down (see `protocol.aborted`).
ABORTED: Final = "the engine aborted the request unrun (it is shutting down)"


class PrefillFailed(Exception):
    """The prefill leg failed in a way another prefill instance may not."""


class DecodeFailed(Exception):
    """The decode leg failed before anything reached the client. `prefill` is the prefill answer
    when decode may be retried with it: NIXL pull, and the failed decode never got the request.
    `handoff`: the decode engine took the request and failed it (an HTTP 5xx, or no first byte in
    time), which after a successful prefill is a failed KV hand-off (`xpyd.proxy.kvhealth`)."""

    def __init__(self, message: str, prefill: JSON | None = None, handoff: bool = False) -> None:
        super().__init__(message)
        self.prefill = prefill
        self.handoff = handoff


class UpstreamAnswer(Exception):
    """An engine's 4xx for the client's request: returned to the client as is."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body
        self.content_type = content_type


@dataclass
class Context:
    """One client request on its way through the proxy."""

    request: web.Request
    parsed: ClientRequest
    path: str
    request_id: str
    authorization: str | None
    started: float
    outcome: str = "success"
    first_byte_at: float | None = None
    attempts: int = 0
    #: The X-Request-Id of the current attempt's legs: a fresh uuid4 per attempt, never the client's
    #: (`request_id`, kept for logs and the answer's header). vLLM derives its internal request id
    #: from it, and a prefill engine matches a decode's KV by it (NixlPushConnector) or by the
    #: transfer id made from it (Mooncake): two clients sending the same id must never share one.
    #: Every reference proxy does the same (`toy_proxy_server.py`, `toy_push_proxy_server.py`,
    #: `mooncake_connector_proxy.py`: a new uuid4 per request, the same on both legs).
    upstream_id: str = ""
    #: KVAware routing's view of the prompt (None under the other policies).
    kv: KVAwareRequest | None = None

    def new_attempt(self) -> str:
        """Start an attempt: count it and mint its upstream id (returned)."""
        self.attempts += 1
        self.upstream_id = str(uuid.uuid4())
        log.debug("request %s: attempt %d goes upstream as %s", self.request_id, self.attempts, self.upstream_id)
        return self.upstream_id


@dataclass
class Opened:
    """A decode leg whose answer has started: the open response and what was read of it (the first
    chunk of a stream, or the whole of an unstreamed answer)."""

    response: aiohttp.ClientResponse
    head: bytes
    #: When the leg was sent (monotonic seconds): its duration runs to the end of the relay.
    started: float

    def close(self) -> None:
        """Drop the upstream connection (vLLM aborts the request)."""
        self.response.close()


def json_bytes(body: JSON) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def sse_error(message: str) -> bytes:
    """The event vLLM ends a broken stream with (an error object, then [DONE])."""
    return b"data: " + json.dumps(error_body(502, message)).encode() + b"\n\ndata: [DONE]\n\n"


class Legs:
    """Sends the legs of an attempt for the configured connector."""

    def __init__(self, config: ProxyConfig, pools: dict[Role, Pool], metrics: ProxyMetrics,
                 session: Callable[[], aiohttp.ClientSession], timeouts: dict[str, aiohttp.ClientTimeout],
                 prober: HealthProber) -> None:
        self.config = config
        self.pools = pools
        self.metrics = metrics
        self.session = session
        self.timeouts = timeouts
        self.prober = prober

    async def attempt(self, context: Context, prefill: Instance, decode: Instance) -> web.StreamResponse:
        connector = self.config.connector
        body = context.parsed.body
        request_id = context.upstream_id
        if connector == Connector.MOONCAKE:
            return await self.mooncake(context, prefill, decode, request_id)
        if connector == Connector.NIXL_PUSH:
            return await self.push(context, prefill, decode, request_id)
        if connector == Connector.LMCACHE:
            return await self.lmcache(context, prefill, decode, request_id)
        # Sequential: prefill, then decode with what prefill answered.
        if connector == Connector.P2P_NCCL:
            request_id = protocol.p2p_nccl_request_id(self.zmq_address(prefill), self.zmq_address(decode))
        kv = protocol.NIXL_PREFILL_PARAMS if connector.is_nixl else None
        answer = await self.prefill_leg(context, prefill, protocol.prefill_body(body, kv), request_id)
        decode_params: JSON | None = answer["kv_transfer_params"] if connector == Connector.NIXL else None
        opened = await self.open_decode(context, decode, protocol.decode_body(body, decode_params), request_id,
                                         prefill_answer=answer)
        return await self.relay(context, decode, opened)

    async def push(self, context: Context, prefill: Instance, decode: Instance,
                    request_id: str) -> web.StreamResponse:
        """NixlPushConnector: prefill first, then decode told the identity of the engine (rank) that
        ran the prefill and prefill's own internal request id, as `toy_push_proxy_server.py` does.

        Decode sends that id back to prefill in its lease heartbeats (`HB:<id>`; vLLM
        nixl/base_scheduler.py `on_new_request`, base_worker.py `_handle_heartbeat`), and prefill
        extends the lease on its finished blocks only for ids it owns: its internal id carries a
        random suffix (`InputProcessor.assign_request_id`, 0.16+), so only its answer knows it.
        Sent at once, decode would hold an id prefill never heard of, and a decode backlog longer
        than `kv_lease_duration` would find the blocks freed. With several data-parallel ranks the
        prefill leg is pinned to one, which spreads legs over the ranks."""
        dp = self.config.prefill_data_parallel_size
        rank = prefill.pick_rank(range(dp))
        headers = {protocol.DP_RANK_HEADER: str(rank)} if dp > 1 else None
        body = context.parsed.body
        prefill.acquire_rank(rank)
        try:
            answer = await self.prefill_leg(context, prefill, protocol.prefill_body(body, protocol.NIXL_PREFILL_PARAMS),
                                            request_id, headers)
        finally:
            prefill.release_rank(rank)
        identity = self.learn_push_identity(prefill, rank, answer)
        params = answer["kv_transfer_params"]
        prefill_request_id = params.get("remote_request_id") if isinstance(params, dict) else None
        if not isinstance(prefill_request_id, str) or not prefill_request_id:
            raise PrefillFailed("the prefill answer carries no remote_request_id")
        opened = await self.open_decode(
            context, decode, protocol.decode_body(body, protocol.push_decode_params(identity, prefill_request_id)),
            request_id)
        return await self.relay(context, decode, opened)

    async def lmcache(self, context: Context, prefill: Instance, decode: Instance,
                      request_id: str) -> web.StreamResponse:
        """LMCacheConnectorV1 P/D (LMCache's `disagg_proxy_server_first_token_from_prefiller_xpyd.py`):
        prefill first, told where LMCache must push the KV (the decode instance's host and its LMCache
        ports, one per decode TP rank) and asked for its first token back; an answer without
        `first_tok` is not from an LMCache P/D producer. For a completion of one prompt, the prompt
        goes as token ids (`/tokenize` on the prefill engine for text) and decode continues after
        prefill's token: the prompt plus `first_tok`, `max_tokens - 1`, and the client's answer gets
        prefill's token back in front. Other requests (chat, several prompts or choices, logprobs,
        echo) and a prefill that already stopped: decode gets the client's body and computes its
        first token itself on top of the pushed KV."""
        config = self.config
        params = protocol.lmcache_prefill_params(request_id, decode.host, config.lmcache_init_port,
                                                 config.lmcache_alloc_port, config.decode_tensor_parallel_size)
        body = context.parsed.body
        prompt_ids: list[int] | None = None
        if protocol.lmcache_first_token_eligible(context.path.endswith("/v1/completions"), body):
            prompt = body["prompt"]
            prompt_ids = list(prompt) if isinstance(prompt, list) else await self.tokenize(context, prefill, body)
            body_for_prefill: JSON = {**body, "prompt": prompt_ids}
        else:
            body_for_prefill = body
        answer = await self.prefill_leg(context, prefill, protocol.prefill_body(body_for_prefill, params), request_id)
        first_token = protocol.lmcache_first_token(answer.get("kv_transfer_params"))
        if first_token is None:
            raise PrefillFailed("the answer's kv_transfer_params carry no first_tok (is LMCache's enable_pd on?)")
        splice = None
        decode_body = protocol.decode_body(body, None)
        choices = answer.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        if prompt_ids is not None and choice.get("finish_reason") == "length" and isinstance(choice.get("text"), str):
            decode_body = protocol.lmcache_decode_body(body, prompt_ids, first_token)
            splice = protocol.FirstTokenSplice(choice["text"])
        opened = await self.open_decode(context, decode, decode_body, request_id)
        return await self.relay(context, decode, opened, splice)

    async def tokenize(self, context: Context, prefill: Instance, body: JSON) -> list[int]:
        """A text prompt's token ids from the prefill engine (`POST /tokenize`), as the completion
        would tokenize it; a failure is a prefill failure."""
        ask = {"model": body.get("model"), "prompt": body["prompt"],
               "add_special_tokens": body.get("add_special_tokens", True)}
        try:
            async with self.session().post(prefill.url + "/tokenize", data=json_bytes(ask),
                                          timeout=self.timeouts["prefill"],
                                          headers=self.headers(context, context.upstream_id)) as response:
                answer = await response.json(content_type=None) if response.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as error:
            raise PrefillFailed(f"/tokenize: {error!r}") from None
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list) or not tokens or \
                not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise PrefillFailed("/tokenize gave no token ids")
        return tokens

    @staticmethod
    def learn_push_identity(prefill: Instance, rank: int, answer: JSON) -> JSON:
        """The NixlPushConnector identity a prefill answer reports, remembered for `rank`."""
        identity = protocol.push_identity(answer.get("kv_transfer_params"))
        if identity is None:
            prefill.push_identities.pop(rank, None)
            raise PrefillFailed("the prefill answer carries no NixlPushConnector identity")
        prefill.push_identities[rank] = identity
        return identity

    async def decode_with(self, context: Context, decode: Instance, answer: JSON) -> web.StreamResponse:
        """Decode again with an earlier prefill answer (NIXL pull: the KV is still on prefill)."""
        params = answer.get("kv_transfer_params")
        body = protocol.decode_body(context.parsed.body, params if isinstance(params, dict) else None)
        opened = await self.open_decode(context, decode, body, context.upstream_id, prefill_answer=answer)
        return await self.relay(context, decode, opened)

    async def concurrent(self, context: Context, prefill: Instance, decode: Instance, request_id: str,
                          prefill_body: JSON, decode_body: JSON,
                          prefill_headers: dict[str, str] | None = None) -> web.StreamResponse:
        """Both legs at once; decode's answer reaches the client only after prefill answered well."""
        prefill_task = asyncio.ensure_future(
            self.prefill_leg(context, prefill, prefill_body, request_id, prefill_headers))
        decode_task = asyncio.ensure_future(self.open_decode(context, decode, decode_body, request_id))
        relayed: Opened | None = None
        try:
            await asyncio.wait((prefill_task, decode_task), return_when=asyncio.FIRST_COMPLETED)
            if decode_task.done() and decode_task.exception() is not None:
                decode_task.result()  # raises DecodeFailed: prefill is cancelled below
            await prefill_task
            relayed = await decode_task
            return await self.relay(context, decode, relayed)
        finally:
            for task in (prefill_task, decode_task):
                task.cancel()
            results = await asyncio.gather(prefill_task, decode_task, return_exceptions=True)
            if isinstance(results[1], Opened) and results[1] is not relayed:
                results[1].close()

    # -- legs ----------------------------------------------------------------------------------

    def headers(self, context: Context, request_id: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        if context.authorization:
            headers["Authorization"] = context.authorization
        if extra:
            headers.update(extra)
        return headers

    async def prefill_leg(self, context: Context, instance: Instance, body: JSON, request_id: str,
                           extra_headers: dict[str, str] | None = None) -> JSON:
        """The prefill leg; its JSON answer, PrefillFailed, or UpstreamAnswer for a 4xx."""
        tokens = context.parsed.prompt_tokens
        computed = context.kv.computed(instance.url) if context.kv is not None else None
        instance.acquire(tokens, computed)
        started = time.monotonic()
        result = "error"
        status: int | None = None
        try:
            try:
                async with self.session().post(instance.url + context.path, data=json_bytes(body),
                                              timeout=self.timeouts["prefill"],
                                              headers=self.headers(context, request_id, extra_headers)) as response:
                    data = await response.read()
                    status = response.status
                    content_type = response.content_type
            except aiohttp.ConnectionTimeoutError:  # a TimeoutError too: the connect timeout, not the leg's
                raise PrefillFailed(f"no connection within {self.config.connect_timeout} s") from None
            except TimeoutError:
                raise PrefillFailed(f"no answer within {self.config.prefill_timeout} s") from None
            except (aiohttp.ClientError, OSError) as error:
                raise PrefillFailed(f"{type(error).__name__}: {error}") from None
            if 400 <= status < 500 and status not in (408, 429):
                result = "client_error"
                instance.breaker.success()
                raise UpstreamAnswer(status, data, content_type)
            if status != 200:
                raise PrefillFailed(f"HTTP {status}: {data[:200]!r}")
            try:
                answer = json.loads(data)
            except ValueError:
                raise PrefillFailed("the answer is not JSON") from None
            if not isinstance(answer, dict):
                raise PrefillFailed("the answer is not a JSON object")
            if protocol.aborted(answer):
                raise PrefillFailed(ABORTED)
            if protocol.TRAITS[self.config.connector].prefill_answer_has_params and \
                    not isinstance(answer.get("kv_transfer_params"), dict):
                # An engine not set up as a KV producer answers without them; decode would then
                # recompute the prompt: that silent decode-only path is refused.
                raise PrefillFailed("the answer carries no kv_transfer_params (is the engine a kv_producer?)")
            instance.breaker.success()
            result = "success"
            return answer
        except asyncio.CancelledError:
            result = "cancelled"
            raise
        finally:
            instance.release(tokens, computed)
            if status is not None:
                instance.answered(time.monotonic())
            self.pools["prefill"].forget_if_done(instance)
            self.metrics.legs.observe(time.monotonic() - started, "prefill", result)

    async def open_decode(self, context: Context, instance: Instance, body: JSON, request_id: str,
                           prefill_answer: JSON | None = None) -> Opened:
        """Send the decode leg and read up to its first chunk (or all of an unstreamed answer)."""
        stream = context.parsed.stream
        timeout = self.timeouts["stream" if stream else "decode"]
        reusable = prefill_answer if protocol.TRAITS[self.config.connector].decode_reuses_prefill else None
        response: aiohttp.ClientResponse | None = None
        started = time.monotonic()
        result = "error"  # how the leg ended, unless it opened (then `_relay` records it)
        try:
            response = await self.session().post(instance.url + context.path, data=json_bytes(body), timeout=timeout,
                                                headers=self.headers(context, request_id))
            if 400 <= response.status < 500 and response.status not in (408, 429):
                data = await response.content.read(MAX_ERROR_BODY)
                instance.breaker.success()
                result = "client_error"
                raise UpstreamAnswer(response.status, data, response.content_type)
            if response.status != 200:
                data = await response.content.read(MAX_ERROR_BODY)
                raise DecodeFailed(f"HTTP {response.status}: {data[:200]!r}", handoff=response.status >= 500)
            head = await response.content.readany() if stream else await response.read()
            if stream and not head:
                raise DecodeFailed("the stream ended before its first byte")
            if protocol.answer_aborted(head, stream):
                raise DecodeFailed(ABORTED)
            failed = protocol.stream_error(head) if stream else None
            if failed is not None and isinstance(failed.get("code"), int) and failed["code"] >= 500:
                # Nothing has reached the client yet: as an HTTP 5xx would be, retried on another pair.
                raise DecodeFailed(f"the stream's first event is an error (code {failed['code']}): "
                                   f"{str(failed.get('message'))[:200]!r}", handoff=True)
            opened = Opened(response, head, started)
            response = None
            result = ""
            return opened
        except aiohttp.ConnectionTimeoutError:  # a TimeoutError too, but never delivered, as below
            raise DecodeFailed(f"no connection within {self.config.connect_timeout} s", reusable) from None
        except TimeoutError:
            raise DecodeFailed("no first byte in time", handoff=True) from None
        except aiohttp.ClientConnectorError as error:  # never delivered: the KV is still on prefill
            raise DecodeFailed(f"{type(error).__name__}: {error}", reusable) from None
        except (aiohttp.ClientError, OSError) as error:
            raise DecodeFailed(f"{type(error).__name__}: {error}") from None
        except asyncio.CancelledError:
            result = "cancelled"
            raise
        finally:
            if response is not None:  # an answer that is not relayed: it ends here
                response.close()
                instance.answered(time.monotonic())
            if result:
                self.metrics.legs.observe(time.monotonic() - started, "decode", result)

    async def relay(self, context: Context, instance: Instance, opened: Opened,
                    splice: protocol.FirstTokenSplice | None = None) -> web.StreamResponse:
        """Send decode's answer to the client as it arrives (with prefill's first token put back in
        front, for LMCache's first-token hand-off)."""
        upstream = opened.response
        headers = {"X-Request-Id": context.request_id}
        result = "success"
        try:
            instance.breaker.success()
            if not context.parsed.stream:
                context.first_byte_at = time.monotonic()
                return web.Response(body=splice.answer(opened.head) if splice else opened.head, status=200,
                                    headers=headers, content_type=upstream.content_type)
            headers["Content-Type"] = upstream.headers.get("Content-Type", "text/event-stream; charset=utf-8")
            headers["Cache-Control"] = "no-cache"
            response = web.StreamResponse(status=200, headers=headers)
            try:
                await response.prepare(context.request)
                await response.write(splice.lead(opened.head) + splice.feed(opened.head) if splice else opened.head)
                context.first_byte_at = time.monotonic()
                while True:
                    try:
                        chunk = await upstream.content.readany()
                    except (TimeoutError, aiohttp.ClientError, OSError) as error:
                        result = context.outcome = "broken_stream"
                        self.prober.failed(instance, f"the stream broke: {error!r}")
                        await response.write((splice.flush() if splice else b"") +
                                             sse_error(f"The decode instance failed mid-stream: {error!r}"))
                        break
                    if not chunk:
                        if splice:
                            await response.write(splice.flush())
                        break
                    data = splice.feed(chunk) if splice else chunk
                    if data:
                        await response.write(data)
                await response.write_eof()
            except ConnectionResetError:  # the client went away while we wrote to it
                result = context.outcome = "cancelled"
            return response
        except asyncio.CancelledError:
            result = context.outcome = "cancelled"
            raise
        finally:
            opened.close()
            instance.answered(time.monotonic())
            self.metrics.legs.observe(time.monotonic() - opened.started, "decode", result)

    # -- connector specifics --------------------------------------------------------------------

    def zmq_address(self, instance: Instance) -> str:
        return instance.zmq_address or protocol.host_port(instance.host, self.config.p2p_nccl_kv_port)

    def mooncake_bootstrap(self, prefill: Instance) -> str:
        """The base URL of a prefill pod's Mooncake bootstrap server (what decode dials)."""
        return "http://" + protocol.host_port(prefill.host, self.config.mooncake_bootstrap_port)

    async def mooncake_engines(self, prefill: Instance) -> dict[int, str]:
        """Prefill's engine id per data-parallel rank from its bootstrap server (`GET /query`),
        cached per instance until a failure or a restart."""
        if prefill.mooncake_engines:
            return prefill.mooncake_engines
        url = self.mooncake_bootstrap(prefill) + "/query"
        try:
            async with self.session().get(url, timeout=self.timeouts["probe"]) as response:
                answer = await response.json(content_type=None) if response.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as error:
            raise PrefillFailed(f"bootstrap server {url}: {error!r}") from None
        engines = protocol.mooncake_engine_ids(answer)
        if not engines:
            raise PrefillFailed(f"bootstrap server {url} reports no engine")
        if len(engines) > 1:
            log.info("prefill %s: Mooncake data-parallel ranks %s", prefill.url, sorted(engines))
        prefill.mooncake_engines = engines
        return engines

    async def mooncake(self, context: Context, prefill: Instance, decode: Instance,
                        request_id: str) -> web.StreamResponse:
        """Both Mooncake legs at once: prefill pinned to one of its data-parallel ranks, decode told
        that rank's engine id and the pod's bootstrap server."""
        engines = await self.mooncake_engines(prefill)
        rank = prefill.pick_rank(engines)
        transfer_id = protocol.mooncake_transfer_id(request_id)
        body = context.parsed.body
        decode_params = protocol.mooncake_decode_params(transfer_id, self.mooncake_bootstrap(prefill), engines[rank])
        prefill.acquire_rank(rank)
        try:
            return await self.concurrent(
                context, prefill, decode, request_id,
                protocol.prefill_body(body, protocol.mooncake_prefill_params(transfer_id)),
                protocol.decode_body(body, decode_params),
                prefill_headers={protocol.DP_RANK_HEADER: str(rank)})
        finally:
            prefill.release_rank(rank)
