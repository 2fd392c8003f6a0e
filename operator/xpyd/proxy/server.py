"""The proxy's HTTP server (aiohttp): the OpenAI-compatible front, the retry loop around each
request's attempts, and metrics. The legs of an attempt are `xpyd.proxy.legs`'s (per connector), the
health of the upstream instances `xpyd.proxy.health`'s.

One request, in order:

1. Checks that cost no engine anything: the API key, the concurrency bound (429), the body's size
   (413), JSON and types (400), the model name (404). With the waiting room on (`--wait-timeout`), a
   request that finds a role without instances is held until both have one (`xpyd.proxy.waiting`).
2. An attempt: a prefill instance and a decode instance are picked (the decode instance's count
   includes requests still in their prefill phase, so concurrent picks spread). The legs go out as
   the connector needs (`protocol`): one after the other, or both at once with decode's answer held
   back until prefill has answered.
3. Prefill fails (connection error, timeout, 5xx, an engine's abort of a request it never ran, an
   answer without hand-off parameters): the attempt is retried on another prefill instance, at most
   `prefill_retries` times; then 503, or, only with `decode_only_fallback`, decode alone (counted
   and logged). A 4xx from prefill is the client's and is returned as is.
4. Decode fails before its first byte (an abort included): retried once on another decode instance. When the failed
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
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Iterable
from typing import Final

import aiohttp
from aiohttp import web

from xpyd.api.models import RoutingPolicy
from xpyd.api.naming import ROLES, Role
from xpyd.common import exposition
from xpyd.common.jsontypes import JSON
from xpyd.proxy import protocol
from xpyd.proxy.config import ProxyConfig, client_timeouts
from xpyd.proxy.health import HealthProber
from xpyd.proxy.kvaware import KVAware
from xpyd.proxy.kvhealth import EngineTransferFailures, PairHealth
from xpyd.proxy.legs import Context, DecodeFailed, Legs, PrefillFailed, UpstreamAnswer
from xpyd.proxy.metrics import ProxyMetrics, proxy_gauges
from xpyd.proxy.pairing import NoCompatiblePair, Pairing
from xpyd.proxy.pool import Endpoint, Instance, Pool
from xpyd.proxy.validation import ClientApi, RequestError, error_body, parse
from xpyd.proxy.waiting import WaitingError, WaitingRoom

log = logging.getLogger(__name__)

#: Longest client X-Request-Id passed on (longer or non-printable ones are replaced).
MAX_REQUEST_ID: Final = 256
API_KEY_ENV: Final = "XPYD_PROXY_API_KEY"


def _printable_id(value: str | None) -> str | None:
    if value and len(value) <= MAX_REQUEST_ID and value.isascii() and value.isprintable() and " " not in value:
        return value
    return None


def _error_response(status: int, message: str, request_id: str | None = None, param: str | None = None,
                    headers: dict[str, str] | None = None) -> web.Response:
    response = web.json_response(error_body(status, message, param), status=status, headers=headers)
    if request_id:
        response.headers["X-Request-Id"] = request_id
    return response


class Proxy:
    """The proxy: pools, upstream session, handlers. `start()` / `close()` around `app`'s life."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.pools: dict[Role, Pool] = {
            role: Pool(role, config.routing_policy, self.rng, breaker_threshold=config.breaker_threshold,
                       breaker_cooldown=config.breaker_cooldown) for role in ROLES}
        self.metrics = ProxyMetrics()
        self.pair_health = PairHealth()
        self.engine_failures = EngineTransferFailures()
        self.pairing = Pairing(self.pools, self.pair_health)
        self.waiting = WaitingRoom(config.wait_max_requests, config.wait_max_bytes, config.wait_timeout)
        self.kv = KVAware(config.kv, self.rng) if config.routing_policy == RoutingPolicy.KV_AWARE else None
        for pool in self.pools.values():
            pool.on_forget = self._forget_departed
        self._timeouts = client_timeouts(config)
        self._sources: dict[Role, dict[str, list[Endpoint]]] = {role: {} for role in ROLES}
        self.in_flight = 0
        self.draining = False
        self.session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._prober: asyncio.Task[None] | None = None
        self.health_prober = HealthProber(config, self.pools, self.metrics, lambda: self._session, self._timeouts,
                                          self._spawn, self.engine_failures)
        self.legs = Legs(config, self.pools, self.metrics, lambda: self._session, self._timeouts,
                         self.health_prober)
        m = self.metrics
        gauges = proxy_gauges(self.pools, lambda: self.in_flight, lambda: self.draining, self.pair_health,
                              self.engine_failures)
        self.registry = exposition.registry([m.requests, m.rejected, m.ttft, m.stream_ttft, m.duration, m.legs,
                                             m.retries, m.fallbacks, m.breaker_trips, m.kv_handoff_failures,
                                             m.arrival_tokens, m.prompt_tokens, *gauges, *self.waiting.collectors(),
                                             *(self.kv.collectors(self.pools) if self.kv else ())])

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
        self._prober = asyncio.create_task(self.health_prober.run())
        self._spawn(self.health_prober.run_kv_metrics())

    async def close(self) -> None:
        """Stop probing and close upstream connections."""
        tasks = [t for t in (self._prober, *self._tasks) if t is not None]
        if self.kv is not None:
            await self.kv.close()
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
        union of the sources. New instances, and those whose pod turned Ready, are probed at once."""
        self._sources[role][source] = list(endpoints)
        merged: dict[str, Endpoint] = {}
        for listed in self._sources[role].values():
            for endpoint in listed:
                known = merged.get(endpoint.url)
                merged[endpoint.url] = endpoint if known is None else Endpoint(
                    url=endpoint.url, ready=known.ready and endpoint.ready, checked=known.checked or endpoint.checked,
                    terminating=known.terminating or endpoint.terminating,
                    drain_timeout_at=endpoint.drain_timeout_at or known.drain_timeout_at,
                    zmq_address=endpoint.zmq_address or known.zmq_address,
                    compat=known.compat if endpoint.compat is None else endpoint.compat,
                    name=endpoint.name or known.name)
        for instance in self.pools[role].update(merged.values(), time.monotonic(), time.time()):
            self._spawn(self.health_prober.probe(instance))
        self._forget_departed()
        self.waiting.poke()

    def _forget_departed(self) -> None:
        """Drop what is kept per instance (transfer health, KV-aware indexes and event subscribers) for
        instances no pool holds any more: at each discovery change, and when an unlisted instance's
        last leg ends (`Pool.on_forget`)."""
        instances = {url for pool in self.pools.values() for url in pool.instances}
        self.pair_health.forget({url for pair in self.pair_health.pairs for url in pair} - instances)
        self.engine_failures.forget(set(self.engine_failures.last) - instances)
        if self.kv is not None:
            self.kv.update(self.pools)

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("the proxy is not started")
        return self.session

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

    async def _generate(self, request: web.Request, api: ClientApi, path: str) -> web.StreamResponse:
        request_id = _printable_id(request.headers.get("X-Request-Id")) or str(uuid.uuid4())
        connector = self.config.connector.value
        if not self._authorized(request):
            self.metrics.requests.inc(connector, api, "unauthorized")
            return self._reject(401, "Missing or invalid API key.", request_id)
        if self.in_flight >= self.config.max_concurrency:  # still demand: the autoscaler counts it
            self.metrics.requests.inc(connector, api, "overloaded")
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
                parsed = parse(raw, api, self.config.served_model_name)
            except RequestError as error:
                outcome = "invalid"
                return self._reject(error.status, error.message, request_id, error.param)
            self.metrics.arrival(parsed.prompt_tokens)  # offered to the pool, whether held or refused later
            context = Context(request=request, parsed=parsed, path=path, request_id=request_id,
                              authorization=request.headers.get("Authorization"), started=started)
            try:
                if self.waiting.enabled and self.missing_roles():  # held until a pair is ready
                    await self.waiting.hold(len(raw), parsed.prompt_tokens, lambda: not self.missing_roles())
                response = await self._serve(context)
            except WaitingError as error:  # the waiting room is full (429), or the wait ran out (503)
                outcome = error.outcome
                if error.status == 429:
                    self.metrics.rejected.inc("429")
                return _error_response(error.status, error.message, request_id, headers=error.headers)
            except NoCompatiblePair as error:
                outcome = "incompatible"
                return _error_response(error.status, error.message, request_id)
            except RequestError as error:
                outcome = "unavailable" if error.status >= 500 else "invalid"
                return _error_response(error.status, error.message, request_id)
            except UpstreamAnswer as answer:
                outcome = "upstream_client_error"
                return web.Response(status=answer.status, body=answer.body, content_type=answer.content_type,
                                    headers={"X-Request-Id": request_id})
            outcome = context.outcome
            if context.first_byte_at is not None:
                self.metrics.ttft.observe(context.first_byte_at - started, connector, api)
                if parsed.stream:
                    self.metrics.stream_ttft.observe(context.first_byte_at - started, connector, api)
            return response
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self.in_flight -= 1
            self.metrics.requests.inc(connector, api, outcome)
            self.metrics.duration.observe(time.monotonic() - started, connector, api)

    # -- attempts ------------------------------------------------------------------------------

    async def _serve(self, context: Context) -> web.StreamResponse:
        traits = protocol.TRAITS[self.config.connector]
        tried_prefill: set[str] = set()
        tried_decode: set[str] = set()
        prefill_failures = decode_failures = 0
        reusable: JSON | None = None
        retrying: str | None = None  # the role whose failed leg the next attempt sends again
        kv_source: Instance | None = None  # the prefill whose KV the next decode leg reads
        if self.kv is not None:  # KVAware: the prompt's block keys (its token ids from /tokenize if need be)
            context.kv = await self.kv.prepare(context, self.pairing.candidates(time.monotonic())[0], self._session)
        while True:
            prefills, decodes = self.pairing.candidates(time.monotonic(), tried_prefill, tried_decode)
            if reusable is not None and not self.pairing.partners(kv_source, decodes, time.monotonic()):
                if not decodes:
                    raise RequestError(503, "No decode instance is available.")
                reusable = None  # no decode left that can read that KV: a whole new attempt
            prefill = None
            if reusable is None:
                if not prefills:
                    reason = "prefill_failed" if prefill_failures else "no_prefill_instance"
                    return await self._without_prefill(context, reason, tried_decode)
                if not decodes:
                    raise RequestError(503, "No decode instance is available.")
                prefill = self.pools["prefill"].choose(self.pairing.prefills(prefills, decodes, time.monotonic()),
                                                       self.kv.chooser("prefill", context.kv) if self.kv else None)
                if prefill is None and decode_failures:  # pairs there were; the request's failed
                    raise RequestError(503, f"Decode failed on {decode_failures} instance(s); no other decode "
                                            "instance pairs with a prefill instance.")
                if prefill is None:
                    reason = "prefill_failed" if prefill_failures else "no_compatible_pair"
                    return await self._without_prefill(context, reason, tried_decode)
                kv_source = prefill
            decode = self.pools["decode"].choose(self.pairing.partners(kv_source, decodes, time.monotonic()),
                                                 self.kv.chooser("decode", context.kv) if self.kv else None)
            assert decode is not None  # a prefill is only chosen with partners, a reuse only kept with some
            if retrying is not None:  # counted once there is an instance to retry on
                self.metrics.retries.inc(retrying)
                retrying = None
            decode.acquire()
            try:
                if reusable is not None:
                    answer = await self.legs.decode_with(context, decode, reusable)
                else:
                    assert prefill is not None
                    context.new_attempt()
                    answer = await self.legs.attempt(context, prefill, decode)
                if kv_source is not None:
                    self.pair_health.succeeded(kv_source.url, decode.url)
                return answer
            except PrefillFailed as failure:
                assert prefill is not None
                self.health_prober.failed(prefill, str(failure))
                tried_prefill.add(prefill.url)
                prefill_failures += 1
                if prefill_failures > self.config.prefill_retries:
                    return await self._without_prefill(context, "prefill_failed", tried_decode)
                retrying = "prefill"
            except DecodeFailed as failure:
                if failure.handoff and kv_source is not None:
                    self._handoff_failed(kv_source, decode, str(failure))
                self.health_prober.failed(decode, str(failure))
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

    def _handoff_failed(self, prefill: Instance, decode: Instance, reason: str) -> None:
        self.metrics.kv_handoff_failures.inc(prefill.url, decode.url)
        if self.pair_health.failed(prefill.url, decode.url, time.monotonic()):
            log.warning("KV hand-off from %s to %s keeps failing (%s): the pair is avoided for %.0f s",
                        prefill.name or prefill.url, decode.name or decode.url, reason,
                        self.pair_health.pairs[(prefill.url, decode.url)].cooldown)

    def failing_pairs(self) -> list[JSON]:
        """The pairs whose hand-offs keep failing, by pod name where known (for /health and the pod's
        condition)."""
        names = {i.url: i.name or i.url for pool in self.pools.values() for i in pool.instances.values()}
        return [{"prefill": names.get(pair.prefill, pair.prefill), "decode": names.get(pair.decode, pair.decode),
                 "failures": pair.failures, "total": pair.total, "avoidedForSeconds": pair.avoided_for}
                for pair in self.pair_health.failing(time.monotonic())]

    def failing_engines(self) -> list[JSON]:
        """The engines whose own count of failed KV transfers rose within the window, by pod name
        where known (for /health and the pod's condition)."""
        known = {i.url: i for pool in self.pools.values() for i in pool.instances.values()}
        return [{"engine": (known[url].name or url) if url in known else url,
                 "role": known[url].role if url in known else None,
                 "failedTransfers": count, "windowSeconds": self.engine_failures.window}
                for url, count in self.engine_failures.failing(time.monotonic())]

    def kv_transfer_report(self) -> JSON:
        """The KV-transfer health this proxy sees: failing pairs and failing engines."""
        return {"failingPairs": self.failing_pairs(), "failingEngines": self.failing_engines()}

    async def _without_prefill(self, context: Context, reason: str, tried_decode: set[str]) -> web.StreamResponse:
        """No prefill instance could serve: 503, or decode alone when configured to (never silently)."""
        if not self.config.decode_only_fallback:
            if reason == "no_compatible_pair":
                raise NoCompatiblePair()
            message = ("No prefill instance is available." if reason == "no_prefill_instance"
                       else "Prefill failed on every instance tried.")
            raise RequestError(503, message)
        decode = self.pools["decode"].pick(time.monotonic(), tried_decode)
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
                opened = await self.legs.open_decode(context, decode, body, context.new_attempt())
            except DecodeFailed as failure:
                self.health_prober.failed(decode, str(failure))
                raise RequestError(503, f"Decode-only fallback failed: {failure}") from None
            return await self.legs.relay(context, decode, opened)
        finally:
            decode.release()
            self.pools["decode"].forget_if_done(decode)

    # -- the other paths ------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/models, answered by a decode instance."""
        request_id = _printable_id(request.headers.get("X-Request-Id")) or str(uuid.uuid4())
        if not self._authorized(request):
            return self._reject(401, "Missing or invalid API key.", request_id)
        tried: set[str] = set()
        headers = {"Authorization": request.headers["Authorization"]} if "Authorization" in request.headers else {}
        while (decode := self.pools["decode"].pick(time.monotonic(), tried)) is not None:
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
                                  **{role: pool.counts() for role, pool in self.pools.items()},
                                  "kvTransfer": self.kv_transfer_report()})

    def missing_roles(self) -> list[Role]:
        """The roles a request needs that have no instance to take it now. Every connector sends a
        prefill and a decode leg; with the decode-only fallback decode alone can answer."""
        needed: tuple[Role, ...] = ("decode",) if self.config.decode_only_fallback else ROLES
        now = time.monotonic()
        return [role for role in needed if not self.pools[role].candidates(now)]

    async def ready(self, request: web.Request) -> web.Response:
        """GET /ready (readiness): 200 while requests can be served; 503 once draining, so the pod
        leaves the Service's endpoints while it still serves what reaches it, and 503 while a role
        has no instance to take a request, or (without the decode-only fallback) no prefill has a
        decode of its KV compatibility hash, so clients reach a replica that can serve. With the
        waiting room on, a role without instances is not a reason: requests are held (a pool at
        zero keeps its proxies in the Service)."""
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        missing = self.missing_roles()
        if missing and self.waiting.enabled:  # ready by design: requests are held until a pair is
            return web.json_response({"status": "ready", "missing": missing, "waiting": self.waiting.requests})
        if missing:
            return web.json_response({"status": "unavailable", "missing": missing}, status=503)
        if not self.config.decode_only_fallback and not self.pairing.compatible_pair():
            now = time.monotonic()
            compat = {role: sorted({i.compat or "" for i in pool.candidates(now)}) for role, pool in self.pools.items()}
            return web.json_response({"status": "unavailable", "missing": [], "reason": "no_compatible_pair",
                                      "compat": compat}, status=503)
        return web.json_response({"status": "ready"})

    async def metrics_page(self, request: web.Request) -> web.Response:
        """GET /metrics in the Prometheus text format (arrival slots that ended since the last
        arrival are observed first)."""
        self.metrics.flush_arrivals()
        return exposition.response(self.registry)
