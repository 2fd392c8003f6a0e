"""The proxy's HTTP server (aiohttp): the OpenAI-compatible front, the two legs of each request,
retries, health probes and metrics.

One request, in order:

1. Checks that cost no engine anything: the API key, the concurrency bound (429), the body's size
   (413), JSON and types (400), the model name (404).
2. An attempt: a prefill instance and a decode instance are picked (the decode instance's count
   includes requests still in their prefill phase, so concurrent picks spread). The legs go out as
   the connector needs (`protocol`): one after the other, or both at once with decode's answer held
   back until prefill has answered.
3. Prefill fails (connection error, timeout, 5xx, an answer without hand-off parameters): the
   attempt is retried on another prefill instance, at most `prefill_retries` times; then 503, or,
   only with `decode_only_fallback`, decode alone (counted and logged). A 4xx from prefill is the
   client's and is returned as is.
4. Decode fails before its first byte: retried once on another decode instance. When the failed
   decode never got the request (no connection) and the connector lets decode read the KV later
   (NIXL pull: prefill holds the blocks for their lease; LMCache: the KV sits in LMCache's store),
   the retry reuses the prefill's KV; otherwise (the failed decode may have consumed
   it, or the connector pairs the legs) the retry is a whole new attempt, prefill included. Nothing
   reaches the client before decode's first byte, so such a retry is invisible. After that, a
   broken stream ends with an error event.
5. Streamed answers are relayed chunk by chunk as they arrive; unstreamed ones in one piece. A client
   that goes away cancels the handler, which closes both upstream connections (vLLM aborts a
   request whose connection closes).

Draining (`start_draining`, on SIGTERM: see `xpyd.proxy.main`): `/ready` answers 503 at once so
Kubernetes takes the pod out of its Service, while requests still arriving are served as usual;
their answers carry `Connection: close`, so clients holding a kept-alive connection to this pod
reconnect through the Service to another one. `/health` (liveness) stays 200 throughout.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
from aiohttp import web

from xpyd import exposition
from xpyd.api.models import Connector, RoutingPolicy
from xpyd.proxy import protocol
from xpyd.proxy.metrics import Counter, Gauge, GaugeSample, Histogram
from xpyd.proxy.pool import ROLES, Endpoint, Instance, Pool, Role
from xpyd.proxy.validation import ClientRequest, RequestError, error_body, parse
from xpyd.proxy.validation import Endpoint as ApiEndpoint

log = logging.getLogger(__name__)

JSON = dict[str, Any]
#: Longest client X-Request-Id passed on (longer or non-printable ones are replaced).
MAX_REQUEST_ID: Final = 256
#: Upper bound on an upstream error body read into memory.
MAX_ERROR_BODY: Final = 64 * 1024
API_KEY_ENV: Final = "XPYD_PROXY_API_KEY"


@dataclass(frozen=True)
class ProxyConfig:
    """Everything `xpyd proxy` is told on its command line."""

    connector: Connector = Connector.NIXL
    routing_policy: RoutingPolicy = RoutingPolicy.LEAST_LOADED
    served_model_name: str | None = None
    api_key: str | None = None
    prefill_retries: int = 2
    decode_retries: int = 1
    prefill_timeout: float = 300.0
    decode_timeout: float = 3600.0
    stream_idle_timeout: float = 300.0
    connect_timeout: float = 2.0
    health_interval: float = 2.0
    health_timeout: float = 2.0
    breaker_threshold: int = 3
    breaker_cooldown: float = 2.0
    #: Idle upstream connections close after this many seconds: below uvicorn's 5 s keep-alive,
    #: so the proxy never reuses a connection the engine is closing (resets, 502s).
    upstream_idle_timeout: float = 4.0
    max_concurrency: int = 2048
    max_body_bytes: int = 32 * 1024 * 1024
    decode_only_fallback: bool = False
    mooncake_bootstrap_port: int = protocol.MOONCAKE_BOOTSTRAP_PORT
    p2p_nccl_kv_port: int = protocol.P2P_NCCL_KV_PORT
    #: Data-parallel ranks per prefill server (NixlPushConnector learns and pins each rank's identity;
    #: Mooncake asks the bootstrap server instead).
    prefill_data_parallel_size: int = 1
    seed: int | None = None


class PrefillFailed(Exception):
    """The prefill leg failed in a way another prefill instance may not."""


class DecodeFailed(Exception):
    """The decode leg failed before anything reached the client. `prefill` is the prefill answer
    when decode may be retried with it: NIXL pull, and the failed decode never got the request."""

    def __init__(self, message: str, prefill: JSON | None = None) -> None:
        super().__init__(message)
        self.prefill = prefill


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

    @property
    def upstream_id(self) -> str:
        """The X-Request-Id of the current attempt's legs: the client's for the first attempt, made
        unique for later ones (a Mooncake transfer id or a push registration is single-use)."""
        return self.request_id if self.attempts <= 1 else f"{self.request_id}-attempt{self.attempts}"


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


@dataclass
class ProxyMetrics:
    """The metrics `/metrics` exports."""

    requests: Counter = field(default_factory=lambda: Counter(
        "xpyd_proxy_requests_total", "Client requests by connector, endpoint and outcome.",
        ("connector", "endpoint", "outcome")))
    ttft: Histogram = field(default_factory=lambda: Histogram(
        "xpyd_proxy_time_to_first_byte_seconds", "Client-seen time to the answer's first byte (TTFT when "
        "streamed).", ("connector", "endpoint")))
    stream_ttft: Histogram = field(default_factory=lambda: Histogram(
        "xpyd_proxy_time_to_first_token_seconds", "Client-seen time to the first streamed chunk of streamed "
        "requests: their TTFT (the autoscaler reads it).", ("connector", "endpoint")))
    duration: Histogram = field(default_factory=lambda: Histogram(
        "xpyd_proxy_request_duration_seconds", "Client-seen request duration.", ("connector", "endpoint")))
    legs: Histogram = field(default_factory=lambda: Histogram(
        "xpyd_proxy_leg_duration_seconds", "Duration of upstream legs by role and result.", ("role", "result")))
    retries: Counter = field(default_factory=lambda: Counter(
        "xpyd_proxy_retries_total", "Legs sent again to another instance, by role.", ("role",)))
    fallbacks: Counter = field(default_factory=lambda: Counter(
        "xpyd_proxy_decode_only_fallbacks_total", "Requests served by decode alone because no prefill "
        "instance could (only with --decode-only-fallback).", ("reason",)))
    breaker_trips: Counter = field(default_factory=lambda: Counter(
        "xpyd_proxy_breaker_trips_total", "Circuit breakers opened, by role.", ("role",)))
    rejected: Counter = field(default_factory=lambda: Counter(
        "xpyd_proxy_rejected_total", "Requests refused before any upstream call, by HTTP status.", ("status",)))


def _printable_id(value: str | None) -> str | None:
    if value and len(value) <= MAX_REQUEST_ID and value.isascii() and value.isprintable() and " " not in value:
        return value
    return None


def _json_bytes(body: JSON) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _error_response(status: int, message: str, request_id: str | None = None, param: str | None = None,
                    headers: dict[str, str] | None = None) -> web.Response:
    response = web.json_response(error_body(status, message, param), status=status, headers=headers)
    if request_id:
        response.headers["X-Request-Id"] = request_id
    return response


def _sse_error(message: str) -> bytes:
    """The event vLLM ends a broken stream with (an error object, then [DONE])."""
    return b"data: " + json.dumps(error_body(502, message)).encode() + b"\n\ndata: [DONE]\n\n"


class Proxy:
    """The proxy: pools, upstream session, handlers. `start()` / `close()` around `app`'s life."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.pools: dict[Role, Pool] = {
            role: Pool(role, config.routing_policy, self.rng, breaker_threshold=config.breaker_threshold,
                       breaker_cooldown=config.breaker_cooldown) for role in ROLES}
        self.metrics = ProxyMetrics()
        self._timeouts = {
            "probe": aiohttp.ClientTimeout(total=config.health_timeout),
            "models": aiohttp.ClientTimeout(total=config.health_timeout * 5),
            "prefill": aiohttp.ClientTimeout(total=config.prefill_timeout, sock_connect=config.connect_timeout),
            "decode": aiohttp.ClientTimeout(total=config.decode_timeout, sock_connect=config.connect_timeout),
            "stream": aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout,
                                            sock_read=config.stream_idle_timeout),
        }
        self._sources: dict[Role, dict[str, list[Endpoint]]] = {role: {} for role in ROLES}
        self.in_flight = 0
        self.draining = False
        self.session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._prober: asyncio.Task[None] | None = None
        self._gauges = [
            Gauge("xpyd_proxy_in_flight_requests", "Client requests in the proxy.", (), self._in_flight_sample),
            Gauge("xpyd_proxy_upstream_in_flight", "Legs outstanding per upstream instance.", ("role", "upstream"),
                  self._upstream_in_flight),
            Gauge("xpyd_proxy_upstream_prompt_tokens", "Prompt tokens outstanding per prefill instance.",
                  ("upstream",), self._upstream_tokens),
            Gauge("xpyd_proxy_breaker_state", "Circuit breaker per upstream: 0 closed, 1 open, 2 half-open.",
                  ("role", "upstream"), self._breaker_states),
            Gauge("xpyd_proxy_upstream_healthy", "Last health probe per upstream: 1 answered 200, 0 otherwise.",
                  ("role", "upstream"), self._health_states),
            Gauge("xpyd_proxy_upstreams", "Upstream instances by role and state.", ("role", "state"),
                  self._pool_states),
            Gauge("xpyd_proxy_draining", "1 once the proxy was told to stop (readiness fails), else 0.", (),
                  self._draining_sample),
        ]
        m = self.metrics
        self.registry = exposition.registry([m.requests, m.rejected, m.ttft, m.stream_ttft, m.duration, m.legs,
                                             m.retries, m.fallbacks, m.breaker_trips, *self._gauges])

    # -- life ----------------------------------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application (the session and prober start with it)."""
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_page)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        app.on_response_prepare.append(self._close_when_draining)
        return app

    async def _close_when_draining(self, request: web.Request, response: web.StreamResponse) -> None:
        """While draining, every answer (errors and probes included) closes its connection. (The
        hook runs after aiohttp wrote the Connection header, so it is set here too.)"""
        if self.draining:
            response.force_close()
            response.headers["Connection"] = "close"

    async def _on_startup(self, app: web.Application) -> None:
        await self.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.close()

    async def start(self) -> None:
        """Open the upstream connection pool and start probing."""
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.config.upstream_idle_timeout,
                                         ttl_dns_cache=10)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                             skip_auto_headers=("User-Agent",))
        self._prober = asyncio.create_task(self._probe_forever())

    async def close(self) -> None:
        """Stop probing and close upstream connections."""
        tasks = [t for t in (self._prober, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    def start_draining(self) -> None:
        """Fail readiness from now on, and close client connections after each answer; requests are
        still served (the listener is closed later, by whoever runs the app)."""
        if not self.draining:
            self.draining = True
            log.info("draining: /ready answers 503; %d request(s) in flight", self.in_flight)

    def set_endpoints(self, role: Role, endpoints: Iterable[Endpoint], source: str = "discovery") -> None:
        """A source's current view of a role (discovery, or P2pNccl registration); the pool is the
        union of the sources. New instances are probed at once."""
        self._sources[role][source] = list(endpoints)
        merged: dict[str, Endpoint] = {}
        for listed in self._sources[role].values():
            for endpoint in listed:
                known = merged.get(endpoint.url)
                merged[endpoint.url] = endpoint if known is None else Endpoint(
                    url=endpoint.url, ready=known.ready and endpoint.ready,
                    zmq_address=endpoint.zmq_address or known.zmq_address)
        for instance in self.pools[role].update(merged.values()):
            self._spawn(self._probe(instance))

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("the proxy is not started")
        return self.session

    # -- health --------------------------------------------------------------------------------

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            for pool in self.pools.values():
                for instance in list(pool.instances.values()):
                    if instance.listed and not instance.probing:
                        self._spawn(self._probe(instance))

    async def _probe(self, instance: Instance) -> None:
        """GET /health: 200 is healthy; 503 (loading, dead), anything else or no answer is not."""
        instance.probing = True
        try:
            async with self._session.get(instance.url + "/health", timeout=self._timeouts["probe"]) as response:
                await response.read()
                healthy = response.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            healthy = False
        finally:
            instance.probing = False
        if healthy != instance.healthy:
            log.info("%s %s is %s", instance.role, instance.url, "healthy" if healthy else "unhealthy")
            if healthy:  # back from a restart or a failure: its engine ids may have changed
                instance.forget_identity()
        instance.healthy = healthy
        instance.breaker.probe(healthy, time.monotonic())

    def _failed(self, instance: Instance, reason: str) -> None:
        log.warning("%s leg to %s failed: %s", instance.role, instance.url, reason)
        instance.forget_identity()  # a restarted engine has new ids: ask its bootstrap server again
        if instance.breaker.failure(time.monotonic()):
            self.metrics.breaker_trips.inc(instance.role)
            log.warning("circuit breaker of %s %s opened", instance.role, instance.url)
        if not instance.probing:
            self._spawn(self._probe(instance))

    # -- front ---------------------------------------------------------------------------------

    def _authorized(self, request: web.Request) -> bool:
        key = self.config.api_key
        if not key:
            return True
        return hmac.compare_digest(request.headers.get("Authorization", "").encode(), f"Bearer {key}".encode())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        return await self._generate(request, "completions", "/v1/completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        return await self._generate(request, "chat", "/v1/chat/completions")

    def _reject(self, status: int, message: str, request_id: str, param: str | None = None,
                headers: dict[str, str] | None = None) -> web.Response:
        self.metrics.rejected.inc(str(status))
        return _error_response(status, message, request_id, param, headers)

    async def _generate(self, request: web.Request, endpoint: ApiEndpoint, path: str) -> web.StreamResponse:
        request_id = _printable_id(request.headers.get("X-Request-Id")) or str(uuid.uuid4())
        connector = self.config.connector.value
        if not self._authorized(request):
            self.metrics.requests.inc(connector, endpoint, "unauthorized")
            return self._reject(401, "Missing or invalid API key.", request_id)
        if self.in_flight >= self.config.max_concurrency:  # still demand: the autoscaler counts it
            self.metrics.requests.inc(connector, endpoint, "overloaded")
            return self._reject(429, "The proxy is at its concurrency limit; retry later.", request_id,
                                headers={"Retry-After": "1"})
        started = time.monotonic()
        self.in_flight += 1
        outcome = "error"
        try:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                outcome = "invalid"
                return self._reject(413, f"The request body exceeds {self.config.max_body_bytes} bytes.", request_id)
            try:
                parsed = parse(raw, endpoint, self.config.served_model_name)
            except RequestError as error:
                outcome = "invalid"
                return self._reject(error.status, error.message, request_id, error.param)
            context = Context(request=request, parsed=parsed, path=path, request_id=request_id,
                              authorization=request.headers.get("Authorization"), started=started)
            try:
                response = await self._serve(context)
            except RequestError as error:
                outcome = "unavailable" if error.status >= 500 else "invalid"
                return _error_response(error.status, error.message, request_id)
            except UpstreamAnswer as answer:
                outcome = "upstream_client_error"
                return web.Response(status=answer.status, body=answer.body, content_type=answer.content_type,
                                    headers={"X-Request-Id": request_id})
            outcome = context.outcome
            if context.first_byte_at is not None:
                self.metrics.ttft.observe(context.first_byte_at - started, connector, endpoint)
                if parsed.stream:
                    self.metrics.stream_ttft.observe(context.first_byte_at - started, connector, endpoint)
            return response
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self.in_flight -= 1
            self.metrics.requests.inc(connector, endpoint, outcome)
            self.metrics.duration.observe(time.monotonic() - started, connector, endpoint)

    # -- attempts ------------------------------------------------------------------------------

    async def _serve(self, context: Context) -> web.StreamResponse:
        traits = protocol.TRAITS[self.config.connector]
        tried_prefill: set[str] = set()
        tried_decode: set[str] = set()
        prefill_failures = decode_failures = 0
        reusable: JSON | None = None
        retrying: str | None = None  # the role whose failed leg the next attempt sends again
        while True:
            prefill = None
            if reusable is None:
                prefill = self.pools["prefill"].pick(tried_prefill)
                if prefill is None:
                    reason = "prefill_failed" if prefill_failures else "no_prefill_instance"
                    return await self._without_prefill(context, reason, tried_decode)
            decode = self.pools["decode"].pick(tried_decode)
            if decode is None:
                raise RequestError(503, "No decode instance is available.")
            if retrying is not None:  # counted once there is an instance to retry on
                self.metrics.retries.inc(retrying)
                retrying = None
            decode.acquire()
            try:
                if reusable is not None:
                    return await self._decode_with(context, decode, reusable)
                assert prefill is not None
                context.attempts += 1
                return await self._attempt(context, prefill, decode)
            except PrefillFailed as failure:
                assert prefill is not None
                self._failed(prefill, str(failure))
                tried_prefill.add(prefill.url)
                prefill_failures += 1
                if prefill_failures > self.config.prefill_retries:
                    return await self._without_prefill(context, "prefill_failed", tried_decode)
                retrying = "prefill"
            except DecodeFailed as failure:
                self._failed(decode, str(failure))
                if prefill is not None:
                    prefill.forget_identity()
                tried_decode.add(decode.url)
                decode_failures += 1
                if decode_failures > self.config.decode_retries:
                    raise RequestError(503, f"Decode failed on {decode_failures} instance(s): {failure}") from None
                retrying = "decode"
                reusable = failure.prefill if traits.decode_reuses_prefill else None
            finally:
                decode.release()
                self.pools["decode"].forget_if_done(decode)

    async def _without_prefill(self, context: Context, reason: str, tried_decode: set[str]) -> web.StreamResponse:
        """No prefill instance could serve: 503, or decode alone when configured to (never silently)."""
        if not self.config.decode_only_fallback:
            message = ("No prefill instance is available." if reason == "no_prefill_instance"
                       else "Prefill failed on every instance tried.")
            raise RequestError(503, message)
        decode = self.pools["decode"].pick(tried_decode)
        if decode is None:
            raise RequestError(503, "No decode instance is available.")
        self.metrics.fallbacks.inc(reason)
        log.warning("request %s: %s; decode %s computes the prompt itself (decode-only fallback)",
                    context.request_id, reason, decode.url)
        context.outcome = "fallback"
        decode.acquire()
        try:
            body = protocol.decode_body(context.parsed.body, None)
            try:
                opened = await self._open_decode(context, decode, body, context.request_id)
            except DecodeFailed as failure:
                self._failed(decode, str(failure))
                raise RequestError(503, f"Decode-only fallback failed: {failure}") from None
            return await self._relay(context, decode, opened)
        finally:
            decode.release()
            self.pools["decode"].forget_if_done(decode)

    async def _attempt(self, context: Context, prefill: Instance, decode: Instance) -> web.StreamResponse:
        connector = self.config.connector
        body = context.parsed.body
        request_id = context.upstream_id
        if connector == Connector.MOONCAKE:
            return await self._mooncake(context, prefill, decode, request_id)
        if connector == Connector.NIXL_PUSH:
            return await self._push(context, prefill, decode, request_id)
        # Sequential: prefill, then decode with what prefill answered.
        if connector == Connector.P2P_NCCL:
            request_id = protocol.p2p_nccl_request_id(self._zmq_address(prefill), self._zmq_address(decode))
        kv = protocol.NIXL_PREFILL_PARAMS if connector.is_nixl else None
        answer = await self._prefill_leg(context, prefill, protocol.prefill_body(body, kv), request_id)
        decode_params: JSON | None = answer["kv_transfer_params"] if connector == Connector.NIXL else None
        opened = await self._open_decode(context, decode, protocol.decode_body(body, decode_params), request_id,
                                         prefill_answer=answer)
        return await self._relay(context, decode, opened)

    async def _push(self, context: Context, prefill: Instance, decode: Instance,
                    request_id: str) -> web.StreamResponse:
        """NixlPushConnector: decode needs the identity of the prefill engine (of the data-parallel
        rank) that will run the prefill. Known: both legs at once; not yet: prefill first, and its
        answer teaches the identity. With several ranks, the prefill leg is pinned to one."""
        dp = self.config.prefill_data_parallel_size
        rank = prefill.pick_rank(range(dp))
        headers = {protocol.DP_RANK_HEADER: str(rank)} if dp > 1 else None
        body = context.parsed.body
        prefill_body = protocol.prefill_body(body, protocol.NIXL_PREFILL_PARAMS)
        prefill.acquire_rank(rank)
        try:
            identity = prefill.push_identities.get(rank)
            if identity is not None:
                return await self._concurrent(
                    context, prefill, decode, request_id, prefill_body,
                    protocol.decode_body(body, protocol.push_decode_params(identity, request_id)),
                    prefill_headers=headers, push_told=(rank, identity))
            answer = await self._prefill_leg(context, prefill, prefill_body, request_id, headers)
            identity = self._learn_push_identity(prefill, rank, answer)
            opened = await self._open_decode(
                context, decode, protocol.decode_body(body, protocol.push_decode_params(identity, request_id)),
                request_id)
            return await self._relay(context, decode, opened)
        finally:
            prefill.release_rank(rank)

    @staticmethod
    def _learn_push_identity(prefill: Instance, rank: int, answer: JSON) -> JSON:
        """The NixlPushConnector identity a prefill answer reports, remembered for `rank`."""
        identity = protocol.push_identity(answer.get("kv_transfer_params"))
        if identity is None:
            prefill.push_identities.pop(rank, None)
            raise PrefillFailed("the prefill answer carries no NixlPushConnector identity")
        prefill.push_identities[rank] = identity
        return identity

    async def _decode_with(self, context: Context, decode: Instance, answer: JSON) -> web.StreamResponse:
        """Decode again with an earlier prefill answer (NIXL pull: the KV is still on prefill)."""
        params = answer.get("kv_transfer_params")
        body = protocol.decode_body(context.parsed.body, params if isinstance(params, dict) else None)
        opened = await self._open_decode(context, decode, body, context.upstream_id, prefill_answer=answer)
        return await self._relay(context, decode, opened)

    async def _concurrent(self, context: Context, prefill: Instance, decode: Instance, request_id: str,
                          prefill_body: JSON, decode_body: JSON, prefill_headers: dict[str, str] | None = None,
                          push_told: tuple[int, JSON] | None = None) -> web.StreamResponse:
        """Both legs at once; decode's answer reaches the client only after prefill answered well."""
        prefill_task = asyncio.ensure_future(
            self._prefill_leg(context, prefill, prefill_body, request_id, prefill_headers))
        decode_task = asyncio.ensure_future(self._open_decode(context, decode, decode_body, request_id))
        relayed: Opened | None = None
        try:
            await asyncio.wait((prefill_task, decode_task), return_when=asyncio.FIRST_COMPLETED)
            if decode_task.done() and decode_task.exception() is not None:
                decode_task.result()  # raises DecodeFailed: prefill is cancelled below
            answer = await prefill_task
            if push_told is not None:
                rank, told = push_told
                answered = self._learn_push_identity(prefill, rank, answer)
                if answered != told:
                    # Decode registered with an engine that did not run this prefill (it restarted):
                    # drop that decode leg and send decode again with the identity just learnt.
                    log.info("prefill %s has a new NIXL identity; sending decode again", prefill.url)
                    decode_task.cancel()
                    body = protocol.decode_body(context.parsed.body, protocol.push_decode_params(answered, request_id))
                    relayed = await self._open_decode(context, decode, body, request_id)
                    return await self._relay(context, decode, relayed)
            relayed = await decode_task
            return await self._relay(context, decode, relayed)
        finally:
            for task in (prefill_task, decode_task):
                task.cancel()
            results = await asyncio.gather(prefill_task, decode_task, return_exceptions=True)
            if isinstance(results[1], Opened) and results[1] is not relayed:
                results[1].close()

    # -- legs ----------------------------------------------------------------------------------

    def _headers(self, context: Context, request_id: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        if context.authorization:
            headers["Authorization"] = context.authorization
        if extra:
            headers.update(extra)
        return headers

    async def _prefill_leg(self, context: Context, instance: Instance, body: JSON, request_id: str,
                           extra_headers: dict[str, str] | None = None) -> JSON:
        """The prefill leg; its JSON answer, PrefillFailed, or UpstreamAnswer for a 4xx."""
        tokens = context.parsed.prompt_tokens
        instance.acquire(tokens)
        started = time.monotonic()
        result = "error"
        try:
            try:
                async with self._session.post(instance.url + context.path, data=_json_bytes(body),
                                              timeout=self._timeouts["prefill"],
                                              headers=self._headers(context, request_id, extra_headers)) as response:
                    data = await response.read()
                    status = response.status
                    content_type = response.content_type
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
            instance.release(tokens)
            self.pools["prefill"].forget_if_done(instance)
            self.metrics.legs.observe(time.monotonic() - started, "prefill", result)

    async def _open_decode(self, context: Context, instance: Instance, body: JSON, request_id: str,
                           prefill_answer: JSON | None = None) -> Opened:
        """Send the decode leg and read up to its first chunk (or all of an unstreamed answer)."""
        stream = context.parsed.stream
        timeout = self._timeouts["stream" if stream else "decode"]
        reusable = prefill_answer if protocol.TRAITS[self.config.connector].decode_reuses_prefill else None
        response: aiohttp.ClientResponse | None = None
        started = time.monotonic()
        result = "error"  # how the leg ended, unless it opened (then `_relay` records it)
        try:
            response = await self._session.post(instance.url + context.path, data=_json_bytes(body), timeout=timeout,
                                                headers=self._headers(context, request_id))
            if 400 <= response.status < 500 and response.status not in (408, 429):
                data = await response.content.read(MAX_ERROR_BODY)
                instance.breaker.success()
                result = "client_error"
                raise UpstreamAnswer(response.status, data, response.content_type)
            if response.status != 200:
                data = await response.content.read(MAX_ERROR_BODY)
                raise DecodeFailed(f"HTTP {response.status}: {data[:200]!r}")
            head = await response.content.readany() if stream else await response.read()
            if stream and not head:
                raise DecodeFailed("the stream ended before its first byte")
            opened = Opened(response, head, started)
            response = None
            result = ""
            return opened
        except TimeoutError:
            raise DecodeFailed("no first byte in time") from None
        except aiohttp.ClientConnectorError as error:  # never delivered: the KV is still on prefill
            raise DecodeFailed(f"{type(error).__name__}: {error}", reusable) from None
        except (aiohttp.ClientError, OSError) as error:
            raise DecodeFailed(f"{type(error).__name__}: {error}") from None
        except asyncio.CancelledError:
            result = "cancelled"
            raise
        finally:
            if response is not None:
                response.close()
            if result:
                self.metrics.legs.observe(time.monotonic() - started, "decode", result)

    async def _relay(self, context: Context, instance: Instance, opened: Opened) -> web.StreamResponse:
        """Send decode's answer to the client as it arrives."""
        upstream = opened.response
        headers = {"X-Request-Id": context.request_id}
        result = "success"
        try:
            instance.breaker.success()
            if not context.parsed.stream:
                context.first_byte_at = time.monotonic()
                return web.Response(body=opened.head, status=200, headers=headers,
                                    content_type=upstream.content_type)
            headers["Content-Type"] = upstream.headers.get("Content-Type", "text/event-stream; charset=utf-8")
            headers["Cache-Control"] = "no-cache"
            response = web.StreamResponse(status=200, headers=headers)
            try:
                await response.prepare(context.request)
                await response.write(opened.head)
                context.first_byte_at = time.monotonic()
                while True:
                    try:
                        chunk = await upstream.content.readany()
                    except (TimeoutError, aiohttp.ClientError, OSError) as error:
                        result = context.outcome = "broken_stream"
                        self._failed(instance, f"the stream broke: {error!r}")
                        await response.write(_sse_error(f"The decode instance failed mid-stream: {error!r}"))
                        break
                    if not chunk:
                        break
                    await response.write(chunk)
                await response.write_eof()
            except ConnectionResetError:  # the client went away while we wrote to it
                result = context.outcome = "cancelled"
            return response
        except asyncio.CancelledError:
            result = context.outcome = "cancelled"
            raise
        finally:
            opened.close()
            self.metrics.legs.observe(time.monotonic() - opened.started, "decode", result)

    # -- connector specifics --------------------------------------------------------------------

    def _zmq_address(self, instance: Instance) -> str:
        return instance.zmq_address or protocol.host_port(instance.host, self.config.p2p_nccl_kv_port)

    def _mooncake_bootstrap(self, prefill: Instance) -> str:
        """The base URL of a prefill pod's Mooncake bootstrap server (what decode dials)."""
        return "http://" + protocol.host_port(prefill.host, self.config.mooncake_bootstrap_port)

    async def _mooncake_engines(self, prefill: Instance) -> dict[int, str]:
        """Prefill's engine id per data-parallel rank from its bootstrap server (`GET /query`),
        cached per instance until a failure or a restart."""
        if prefill.mooncake_engines:
            return prefill.mooncake_engines
        url = self._mooncake_bootstrap(prefill) + "/query"
        try:
            async with self._session.get(url, timeout=self._timeouts["probe"]) as response:
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

    async def _mooncake(self, context: Context, prefill: Instance, decode: Instance,
                        request_id: str) -> web.StreamResponse:
        """Both Mooncake legs at once: prefill pinned to one of its data-parallel ranks, decode told
        that rank's engine id and the pod's bootstrap server."""
        engines = await self._mooncake_engines(prefill)
        rank = prefill.pick_rank(engines)
        transfer_id = protocol.mooncake_transfer_id(request_id)
        body = context.parsed.body
        decode_params = protocol.mooncake_decode_params(transfer_id, self._mooncake_bootstrap(prefill), engines[rank])
        prefill.acquire_rank(rank)
        try:
            return await self._concurrent(
                context, prefill, decode, request_id,
                protocol.prefill_body(body, protocol.mooncake_prefill_params(transfer_id)),
                protocol.decode_body(body, decode_params),
                prefill_headers={protocol.DP_RANK_HEADER: str(rank)})
        finally:
            prefill.release_rank(rank)

    # -- other endpoints -----------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/models, answered by a decode instance."""
        request_id = _printable_id(request.headers.get("X-Request-Id")) or str(uuid.uuid4())
        if not self._authorized(request):
            return self._reject(401, "Missing or invalid API key.", request_id)
        tried: set[str] = set()
        headers = {"Authorization": request.headers["Authorization"]} if "Authorization" in request.headers else {}
        while (decode := self.pools["decode"].pick(tried)) is not None:
            tried.add(decode.url)
            try:
                async with self._session.get(decode.url + "/v1/models", headers=headers,
                                             timeout=self._timeouts["models"]) as upstream:
                    data = await upstream.read()
                    if upstream.status < 500:
                        return web.Response(status=upstream.status, body=data, content_type=upstream.content_type,
                                            headers={"X-Request-Id": request_id})
            except (TimeoutError, aiohttp.ClientError, OSError):
                continue
        return _error_response(503, "No decode instance is available.", request_id)

    async def health(self, request: web.Request) -> web.Response:
        """GET /health (liveness): 200 while the proxy serves, draining included (the pools' state is
        in the body; an empty pool must not make Kubernetes restart the proxy)."""
        return web.json_response({"status": "ok", "connector": self.config.connector.value,
                                  "draining": self.draining,
                                  **{role: pool.counts() for role, pool in self.pools.items()}})

    async def ready(self, request: web.Request) -> web.Response:
        """GET /ready (readiness): 200, or 503 once draining, so the pod leaves the Service's
        endpoints while it still serves what reaches it."""
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ready"})

    async def metrics_page(self, request: web.Request) -> web.Response:
        """GET /metrics in the Prometheus text format."""
        return exposition.response(self.registry)

    def _in_flight_sample(self) -> Iterable[GaugeSample]:
        yield (), float(self.in_flight)

    def _draining_sample(self) -> Iterable[GaugeSample]:
        yield (), 1.0 if self.draining else 0.0

    def _each(self) -> Iterable[Instance]:
        for pool in self.pools.values():
            yield from pool.instances.values()

    def _upstream_in_flight(self) -> Iterable[GaugeSample]:
        for instance in self._each():
            yield (instance.role, instance.url), float(instance.outstanding_requests)

    def _upstream_tokens(self) -> Iterable[GaugeSample]:
        for instance in self.pools["prefill"].instances.values():
            yield (instance.url,), float(instance.outstanding_tokens)

    def _breaker_states(self) -> Iterable[GaugeSample]:
        now = time.monotonic()
        for instance in self._each():
            yield (instance.role, instance.url), float(instance.breaker.state(now))

    def _health_states(self) -> Iterable[GaugeSample]:
        for instance in self._each():
            yield (instance.role, instance.url), 1.0 if instance.healthy else 0.0

    def _pool_states(self) -> Iterable[GaugeSample]:
        for role, pool in self.pools.items():
            for state, count in pool.counts().items():
                yield (role, state), float(count)
