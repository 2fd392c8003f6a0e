"""The real-time engine: an `EngineCore` driven by the wall clock, with the NIXL-style KV hand-off between engines."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import os
import random
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from xpyd.common.netguard import NonLoopbackAddress, require_loopback
from xpyd.kvcache.events import external_block_hash
from xpyd.kvcache.hashing import BlockHasher, none_hash_seed
from xpyd.kvcache.pool import BlockKeys
from xpyd.sim.core import EngineConfig, EngineCore, EnginePerf, EngineRequest, EngineStep, Event, EventKind, Phase
from xpyd.sim.emulator.config import (
    KEEPALIVE_TIMEOUT_S,
    LAG_WARNING_INTERVAL_S,
    MAX_LAG_S,
    SIDE_CHANNEL_TIMEOUT_S,
    TIMER_SLACK_S,
    EmulatorConfig,
    ScaledPerf,
)
from xpyd.sim.emulator.exposition import KV_FETCH_STAGES, ConnectorMetrics, render_metrics
from xpyd.sim.emulator.kvevents import KVEventRecorder, RequestTokens, ZmqPublisher
from xpyd.sim.emulator.wire import system_fingerprint

log = logging.getLogger(__name__)

_KV_FETCH_STAGE_OF_PHASE = {Phase.WAITING: "waiting_to_start", Phase.TRANSFERRING: "in_progress",
                            Phase.READY: "completed_waiting"}
"""A decode leg's `vllm:num_requests_kv_fetch_by_stage` stage by its phase in the core."""


@dataclass(frozen=True)
class RemoteKV:
    """Where a decode leg's KV is held: the producer's side channel and its request id."""

    host: str
    port: int
    request_id: str
    engine_id: str | None

    def url(self, suffix: str = "") -> str:
        """A side-channel URL on the producer."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/xpyd/kv/{quote(self.request_id, safe='')}{suffix}"


class Stream:
    """One request's progress as its HTTP handler sees it: tokens so far, finished, or an error; and,
    from its first token, the prompt tokens it found cached (`cached_tokens`, as vLLM reports them in
    `prompt_tokens_details`) and those its prefill wrote to the prefix cache (`created_cache_tokens`)."""

    __slots__ = ("cached_tokens", "cancelled", "created_cache_tokens", "error", "finished", "parked", "remote",
                 "remote_cached_tokens", "request", "tokens", "total", "verified", "waiter")

    def __init__(self, request: EngineRequest, remote: RemoteKV | None = None) -> None:
        self.request = request
        self.remote = remote
        self.cached_tokens = 0
        self.created_cache_tokens = 0
        #: A decode leg's `remote_prefill_cached_tokens`: what it reports as cached, as vLLM 0.32+ does.
        self.remote_cached_tokens: int | None = None
        self.total = 1 if request.do_remote_decode else request.max_tokens   # tokens this engine generates
        self.tokens = 0
        self.finished = False
        self.error: str | None = None
        self.cancelled = False
        self.verified = True    # a decode leg: its producer has confirmed the KV
        self.parked = False     # a decode leg whose transfer ended before that confirmation
        self.waiter: asyncio.Future[None] | None = None

    def notify(self) -> None:
        """Wake the handler waiting on this stream."""
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until the engine has news for this request."""
        self.waiter = asyncio.get_running_loop().create_future()
        await self.waiter


class KVLoadError(Exception):
    """A decode leg's remote KV cannot be loaded (the message says why)."""


class Engine:
    """An `EngineCore` driven in real time, with the KV hand-off of vLLM's NixlConnector."""

    def __init__(self, config: EmulatorConfig, perf: EnginePerf) -> None:
        self.config = config
        self.core = EngineCore(ScaledPerf(perf, config.time_scale), EngineConfig(
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
            max_kv_tokens=config.max_kv_tokens, kv_lease_seconds=config.kv_lease_s / config.time_scale,
            max_model_len=config.max_model_len, enable_prefix_caching=config.enable_prefix_caching,
            block_size=config.block_size))
        #: vLLM's block hashes of each request's token ids (None without prefix caching).
        self.hasher: BlockHasher | None = None
        if config.enable_prefix_caching:
            seed = config.none_hash_seed
            if seed is None:
                seed = none_hash_seed(config.prefix_caching_hash_algo, os.environ.get("PYTHONHASHSEED"))
            self.hasher = BlockHasher(config.block_size, config.prefix_caching_hash_algo, seed)
        #: The block pool's KV events (with `--kv-events-config` and prefix caching), and their publisher.
        self.kv_events: KVEventRecorder | None = None
        self.publisher: ZmqPublisher | None = None
        if config.kv_events.enable_kv_cache_events and self.core.pool is not None:
            self.kv_events = KVEventRecorder(config.block_size, config.kv_events_int_hashes)
            self.core.pool.listener = self.kv_events
        if self.core.capacity < config.max_model_len:
            raise ValueError(f"the model's max seq len ({config.max_model_len}) is larger than the maximum number "
                             f"of tokens that can be stored in KV cache ({self.core.capacity}): lower "
                             "--max-model-len or raise --max-kv-tokens")
        self.connector = ConnectorMetrics(kv_connector=config.kv_role is not None)
        self.system_fingerprint = system_fingerprint(config)
        self._rng = random.Random(config.seed)
        self.engine_id = config.engine_id or str(uuid.UUID(int=self._rng.getrandbits(128), version=4))
        self.side_channel: tuple[str, int] = (config.side_channel_host or config.host, config.side_channel_port)
        self.draining = False
        #: Why the engine cannot serve beyond loading (a multi-node leader waiting for its workers).
        self.not_ready_reason: Callable[[], str | None] = lambda: None
        self.in_flight = 0                   # generation handlers running
        #: Injected fault (`PUT /xpyd/faults`): the side-channel hosts whose KV this engine cannot read,
        #: as if the link to them were down ("*": every host).
        self.unreadable_from: frozenset[str] = frozenset()
        self._streams: dict[EngineRequest, Stream] = {}
        self._held: dict[str, EngineRequest] = {}
        self._awaiting_kv: set[Stream] = set()
        self._unverified: set[Stream] = set()   # decode legs whose producer has not confirmed the KV yet
        self._relookups: set[Stream] = set()    # decode legs queued again after an admitted attempt
        self._inbox: list[tuple[float, int, Stream]] = []
        self._seq = itertools.count()
        self._next_block = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0
        self._ready_at = 0.0
        self._wake: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._lag_warned_at: float | None = None

    # --- lifecycle ---

    async def start(self) -> None:
        """Start the clock, the loading period and the scheduling loop."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._t0 = loop.time()
        self._ready_at = self.config.startup_delay_s / self.config.time_scale
        # Idle connections to producers close before their 5 s server-side keep-alive does.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_TIMEOUT_S / 2),
            timeout=aiohttp.ClientTimeout(total=SIDE_CHANNEL_TIMEOUT_S))
        if self.config.kv_events.publishes:   # bound even without prefix caching, as vLLM's is
            self.publisher = ZmqPublisher(self.config.kv_events, self.config.host, self.config.data_parallel_rank)
            self.publisher.start()
            log.info("KV events published on %s (replay: %s)", self.publisher.endpoint,
                     self.publisher.replay_endpoint or "none")
        self._task = loop.create_task(self._run(), name="engine-sim loop")
        self._task.add_done_callback(_report_crash)

    async def stop(self) -> None:
        """Stop the loop and the side-channel client."""
        for task in (self._task, *self._background):
            if task is not None:
                task.cancel()
        for task in (self._task, *self._background):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._session is not None:
            await self._session.close()
        if self.publisher is not None:
            await self.publisher.stop()
            self.publisher = None

    def now(self) -> float:
        """Wall seconds since start: the core's clock."""
        assert self._loop is not None, "the engine has not started"
        return self._loop.time() - self._t0

    @property
    def ready(self) -> bool:
        """Past the loading period, and nothing else in the way."""
        return self.now() >= self._ready_at and self.not_ready_reason() is None

    @property
    def loading_left_s(self) -> float:
        """Wall seconds until ready."""
        return max(0.0, self._ready_at - self.now())

    @property
    def num_held(self) -> int:
        """Finished prefill legs whose KV waits for a consumer."""
        return len(self._held)

    # --- requests ---

    def submit(self, request_id: str, token_ids: list[int], max_tokens: int,
               kv_transfer_params: dict[str, Any] | None, cache_salt: str | None = None,
               session_id: str | None = None) -> Stream:
        """Queue a request (see the module docstring for what `kv_transfer_params` do): its prompt's full
        blocks keyed by vLLM's hashes of its token ids (`cache_salt` keys the first), for the prefix cache."""
        arrival = self.now()
        params = kv_transfer_params if self.config.kv_role is not None and kv_transfer_params else {}
        keys: BlockKeys | None = None
        if self.hasher is not None:
            hashes = self.hasher.hashes(token_ids, cache_salt)
            if hashes:
                keys = BlockKeys.of(hashes)
                if self.kv_events is not None:
                    self.kv_events.track(keys, RequestTokens(token_ids, cache_salt, session_id))
        request = EngineRequest(self._internal_id(request_id), len(token_ids), max_tokens,
                                do_remote_decode=bool(params.get("do_remote_decode")),
                                do_remote_prefill=bool(params.get("do_remote_prefill")), block_keys=keys)
        stream = Stream(request)
        cached = params.get("remote_prefill_cached_tokens")
        if request.do_remote_prefill and isinstance(cached, int) and not isinstance(cached, bool):
            stream.remote_cached_tokens = cached
        if request.do_remote_prefill:
            try:
                stream.remote = _remote_kv(params)
            except KVLoadError as error:
                self._kv_load_failed(stream, error)
            else:
                # Until the producer answers, its lease is taken to have started now.
                stream.verified = False
                self._unverified.add(stream)
                request.remote_kv_deadline = arrival + self.core.config.kv_lease_seconds
                self._spawn(self._verify(stream))
        if not stream.finished:
            self._enqueue(arrival, stream)
        return stream

    def _internal_id(self, request_id: str) -> str:
        """vLLM's internal request id: the serving layer's id plus 8 random hex digits
        (`InputProcessor.assign_request_id`, from 0.16), unique among the requests this engine knows."""
        while True:
            internal = f"{request_id}-{self._rng.getrandbits(32):08x}"
            if internal not in self._held:
                return internal

    def _enqueue(self, arrival: float, stream: Stream) -> None:
        heapq.heappush(self._inbox, (arrival, next(self._seq), stream))
        self._kick()

    async def _verify(self, stream: Stream) -> None:
        """Ask the producer whether it holds the decode leg's KV and for how long. This runs beside the
        modelled transfer, as NIXL's handshake and read do; a transfer that ends first waits for it."""
        assert stream.remote is not None
        try:
            remaining = await self._locate(stream.remote)
        except KVLoadError as error:
            self._kv_load_failed(stream, error)
            return
        stream.verified = True
        self._unverified.discard(stream)
        if stream.cancelled:
            return
        request = stream.request
        if stream.parked:   # its KV "arrived" before the answer: load it again, from the original arrival
            stream.parked = False
            stream.request = EngineRequest(request.request_id, request.prompt_tokens, request.max_tokens,
                                           do_remote_prefill=True, remote_kv_deadline=self.now() + remaining,
                                           block_keys=request.block_keys)
            self._relookups.add(stream)
            self._enqueue(request.arrival_time, stream)
        elif request.phase is Phase.WAITING:
            request.remote_kv_deadline = self.now() + remaining

    def _kv_load_failed(self, stream: Stream, error: KVLoadError) -> None:
        """Apply `kv_load_failure_policy` to a decode leg whose KV cannot be loaded (before its first token:
        see `_verify`)."""
        if stream.cancelled:
            return
        request = stream.request
        in_core = request in self._streams
        waiting = request.phase is Phase.WAITING   # queued, not admitted yet
        stream.verified = True
        self._unverified.discard(stream)
        stream.parked = False
        if self.config.kv_load_failure_policy == "fail":
            log.warning("KV load failed for %s (kv_load_failure_policy=fail): %s", request.request_id, error)
            self._awaiting_kv.discard(stream)
            if in_core:
                del self._streams[request]
                self.core.abort(request, self.now())
                self._kick()
            self._fail(stream, f"KV transfer failed: {error}")
            return
        log.warning("KV load failed for %s, recomputing the prompt locally: %s", request.request_id, error)
        if waiting:
            request.remote_kv_deadline = -math.inf   # the core prefills it and counts the failed transfer
            return
        # The transfer had started: begin again as a local prefill, from the original arrival.
        if in_core:
            del self._streams[request]
            self.core.abort(request, self.now())
        stream.request = EngineRequest(request.request_id, request.prompt_tokens, request.max_tokens,
                                       do_remote_prefill=True, remote_kv_deadline=-math.inf,
                                       block_keys=request.block_keys)
        self._relookups.add(stream)
        self._enqueue(request.arrival_time, stream)

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def abort(self, stream: Stream) -> None:
        """The client went away before the request finished: drop it and free its KV."""
        if stream.finished or stream.cancelled:
            return
        stream.cancelled = True
        self._done(stream)
        self.connector.aborted_total += 1
        self._awaiting_kv.discard(stream)
        if self._streams.pop(stream.request, None) is not None:
            self.core.abort(stream.request, self.now())
            self._kick()   # the freed KV may admit a waiting request
        # Still in the inbox: skipped when it comes out.

    def held_kv(self, request_id: str) -> tuple[EngineRequest, float] | None:
        """A held prefill leg and its lease's remaining wall seconds, or None if not held."""
        request = self._held.get(request_id)
        if request is None:
            return None
        return request, request.lease_expiry - self.now()

    def release_kv(self, request_id: str) -> bool:
        """The consumer has the KV: free it now. False if it was not held."""
        if self._held.pop(request_id, None) is None:
            self.connector.nixl_num_notifications_after_expiry_total += 1
            return False
        released = self.core.release_kv(request_id, self.now())
        self._kick()
        return released

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's `reset_prefix_cache`: forget every cached block, which needs no request to hold KV.
        Preempting the running requests first (`reset_running_requests`) is not emulated: the reset then
        fails like one with requests running."""
        pool = self.core.pool
        if pool is None:
            return True   # vLLM's pool without caching resets trivially
        if self.core.kv_reserved_tokens:
            if reset_running_requests:
                log.warning("reset_prefix_cache with reset_running_requests: preempting running requests is not "
                            "emulated; the reset fails while requests hold KV")
            else:
                log.warning("Failed to reset prefix cache because some blocks are not freed yet")
            return False
        return pool.reset()

    def cached_blocks(self) -> list[tuple[int | bytes, int]]:
        """The prompt blocks the prefix cache holds now (in use or free), each as vLLM's KV events name it
        (`external_block_hash`: the low 64 bits, or the digest with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
        with its copies (two requests that computed a block side by side each cache one, as in vLLM).
        Blocks of generated tokens, which no prompt hits and no event names, are left out."""
        pool = self.core.pool
        if pool is None:
            return []
        as_int = self.config.kv_events_int_hashes
        out: list[tuple[int | bytes, int]] = []
        for run, copies in pool.runs():   # a key hashed from token ids: a run of one block
            assert isinstance(run, bytes)
            out.append((external_block_hash(run, as_int), copies))
        return out

    @property
    def kv_batches_published(self) -> int:
        """KV event batches published so far (the next batch's sequence number)."""
        return 0 if self.publisher is None else self.publisher.published

    def kv_transfer_params(self, stream: Stream) -> dict[str, Any]:
        """What a prefill leg returns for the decode leg (NixlConnector's `request_finished`)."""
        block_size = self.config.block_size
        blocks = -(-stream.request.prompt_tokens // block_size)
        pool = max(1, self.core.capacity // block_size)
        first = self._next_block
        self._next_block = (first + blocks) % pool
        host, port = self.side_channel
        tp_size = self.config.tensor_parallel_size
        # One block list per KV-cache group (a dense model has one). A prefill engine sends no expiry time
        # (vLLM sets it only for blocks pinned on a decode engine); its registration generation (0.33; 0.32
        # has none) counts the handshake payloads published, one per (pp, tp) rank at start-up. The
        # scheduler adds the prompt tokens the prefill engine found in its prefix cache.
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [[(first + i) % pool for i in range(blocks)]],
                "remote_engine_id": self.engine_id, "remote_request_id": stream.request.request_id,
                "remote_host": host, "remote_port": port, "tp_size": tp_size, "dcp_size": 1, "pp_size": 1,
                "remote_num_tokens": stream.request.prompt_tokens, "remote_blocks_expiry_time": None,
                "remote_registration_generation": tp_size, "transfer_mode": "pull",
                "remote_prefill_cached_tokens": stream.request.cached_tokens}

    def metrics_text(self) -> str:
        """The `/metrics` exposition."""
        kv_fetch = self.kv_fetch_stages() if self.config.kv_role in ("kv_consumer", "kv_both") else None
        return render_metrics(self.core, self.connector, self.config.model_name, kv_fetch=kv_fetch)

    def kv_fetch_stages(self) -> dict[str, int]:
        """Decode legs waiting for their KV, by vLLM's `KV_FETCH_STAGES`: queued (`waiting_to_start`),
        admitted while the KV is pulled (`in_progress`), pulled and waiting for a running slot
        (`completed_waiting`)."""
        stages = dict.fromkeys(KV_FETCH_STAGES, 0)
        for request in self._streams:
            if request.do_remote_prefill:
                stage = _KV_FETCH_STAGE_OF_PHASE.get(request.phase)
                if stage is not None:
                    stages[stage] += 1
        return stages

    # --- the loop ---

    async def _run(self) -> None:
        core = self.core
        t = self.now()
        while True:
            self._admit(t)
            self._on_events(self._poll(t))
            self._expire_waiting(t)
            step = core.next_step(t)
            if self._relookups:
                self._count_relookups()
            if step is None:
                t = await self._idle(t)
                continue
            await self._sleep_until(step.end)
            self._on_events(core.complete(step, step.end))
            self._deliver(step)
            if self.kv_events is not None:
                self._publish_kv_events()
            t = step.end
            lag = self.now() - t
            if lag > MAX_LAG_S:
                if self._lag_warned_at is None or t - self._lag_warned_at > LAG_WARNING_INTERVAL_S:
                    log.warning("engine-sim fell %.0f ms behind its schedule (time scale %g): resetting to the "
                                "wall clock", lag * 1e3, self.config.time_scale)
                    self._lag_warned_at = t
                t = self.now()

    async def _sleep_until(self, deadline: float) -> None:
        remaining = deadline - self.now()
        if remaining > TIMER_SLACK_S:
            await asyncio.sleep(remaining - TIMER_SLACK_S)
        while self.now() < deadline:
            await asyncio.sleep(0)

    async def _idle(self, t: float) -> float:
        """Wait for an arrival or the core's next timer; returns the time to go on from."""
        timer = self.core.next_timer()
        if not self._inbox:
            assert self._loop is not None
            wake: asyncio.Future[None] = self._loop.create_future()
            self._wake = wake
            handle = self._loop.call_at(self._t0 + timer, _resolve, wake) if timer is not None else None
            try:
                await wake
            finally:
                self._wake = None
                if handle is not None:
                    handle.cancel()
        due = [self._inbox[0][0]] if self._inbox else []
        if timer is not None and timer <= self.now():
            due.append(timer)
        return max(t, min(due)) if due else t

    def _kick(self) -> None:
        """Wake an idle loop: an arrival, or a release that freed KV a waiting request may need."""
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _admit(self, t: float) -> None:
        """Hand the core the arrivals stamped up to `t`."""
        inbox = self._inbox
        fail = self.config.kv_load_failure_policy == "fail"
        while inbox and inbox[0][0] <= t:
            arrival, _, stream = heapq.heappop(inbox)
            if stream.cancelled or stream.finished:
                continue
            request = stream.request
            self.core.add(request, arrival)
            self._streams[request] = stream
            if fail and request.do_remote_prefill:
                self._awaiting_kv.add(stream)

    def _expire_waiting(self, t: float) -> None:
        """Under `fail`, a decode leg whose producer's lease ended before admission fails (the core,
        which models `recompute`, would prefill it locally)."""
        if not self._awaiting_kv:
            return
        for stream in list(self._awaiting_kv):
            request = stream.request
            if request.phase is not Phase.WAITING:
                self._awaiting_kv.discard(stream)
            elif t > request.remote_kv_deadline:
                self._awaiting_kv.discard(stream)
                self._streams.pop(request, None)
                self.core.abort(request, t)
                log.warning("KV load failed for %s (kv_load_failure_policy=fail): the producer's lease expired "
                            "before admission", request.request_id)
                self._fail(stream, "KV transfer failed: the prefill engine's KV lease expired before the request "
                           "was scheduled")

    def _poll(self, t: float) -> list[Event]:
        """The core's `poll`, except that a decode leg whose (modelled) transfer lands before its producer
        confirmed the KV caches nothing: it is parked and loads again (see `_on_events`), or fails, and
        KV that never arrived must not be found in the prefix cache."""
        aside: list[tuple[EngineRequest, BlockKeys]] = []
        for stream in self._unverified:
            request = stream.request
            if request.phase is Phase.TRANSFERRING and request.block_keys is not None:
                aside.append((request, request.block_keys))
                request.block_keys = None
        try:
            return self.core.poll(t)
        finally:
            for request, keys in aside:
                request.block_keys = keys

    def _count_relookups(self) -> None:
        """A decode leg admitted again (parked, or recomputing after its transfer had started) was looked up
        in the prefix cache at its first admission already: its second lookup is not vLLM's to count."""
        metrics = self.connector
        for stream in list(self._relookups):
            request = stream.request
            if request.phase is not Phase.WAITING:
                self._relookups.discard(stream)
                if self.core.pool is not None:
                    metrics.repeated_prefix_cache_queries += request.prompt_tokens
                    metrics.repeated_prefix_cache_hits += request.cached_tokens

    def _publish_kv_events(self) -> None:
        """The step's KV events as one batch, as vLLM's scheduler publishes them after each step."""
        assert self.kv_events is not None
        events = self.kv_events.take()
        if events and self.publisher is not None:
            self.publisher.publish(events)

    def _done(self, stream: Stream) -> None:
        """A request that caches no more blocks: its tokens are no longer needed for KV events."""
        self._unverified.discard(stream)
        self._relookups.discard(stream)
        if self.kv_events is not None:
            self.kv_events.forget(stream.request.block_keys)

    def _fail(self, stream: Stream, message: str) -> None:
        self._done(stream)
        stream.error = message
        stream.finished = True
        self.connector.errored_total += 1
        self.connector.nixl_num_failed_transfers_total += 1
        stream.notify()

    def _on_events(self, events: list[Event]) -> None:
        for event in events:
            request = event.request
            kind = event.kind
            if kind is EventKind.KV_RELEASED:
                if self._held.pop(request.request_id, None) is not None:
                    self.connector.nixl_num_kv_expired_reqs_total += 1
                continue
            stream = self._streams.get(request)
            if stream is None:
                continue
            if kind is EventKind.FIRST_TOKEN:
                stream.tokens = max(stream.tokens, 1)
                self._count_cached(stream)
            elif kind is EventKind.FINISHED:
                stream.tokens = request.limit
                stream.finished = True
                self._done(stream)
                del self._streams[request]
                if request.do_remote_decode:
                    self._held[request.request_id] = request
            elif stream.verified:   # KV_LOADED: the pull is done
                self._on_kv_loaded(stream, event.time)
                continue
            else:   # the transfer ended before the producer confirmed the KV: wait for that (see _verify)
                del self._streams[request]
                self.core.abort(request, event.time)
                stream.parked = True
                continue
            stream.notify()

    def _count_cached(self, stream: Stream) -> None:
        """At the first token, as vLLM's output processor: the prompt tokens found cached (its local hits and
        the KV it loaded; a decode leg reports the prefill engine's hits instead when it was told them), and
        those the prefill wrote to the prefix cache (its full blocks less what it found)."""
        request = stream.request
        found = request.cached_tokens + (0 if request.local_prefill else request.prompt_tokens - request.cached_tokens)
        cached_blocks = request.prompt_tokens // self.config.block_size if self.core.pool is not None else 0
        stream.created_cache_tokens = max(0, cached_blocks * self.config.block_size - found)
        stream.cached_tokens = found if stream.remote_cached_tokens is None else stream.remote_cached_tokens

    def _on_kv_loaded(self, stream: Stream, time_s: float) -> None:
        request = stream.request
        self.connector.nixl_xfer_time_seconds.observe(time_s - request.scheduled_time)
        if self.config.kv_bytes_per_token:
            self.connector.nixl_bytes_transferred.observe(request.prompt_tokens * self.config.kv_bytes_per_token)
        if stream.remote is not None:
            self._spawn(self._release_remote(stream.remote))

    def _deliver(self, step: EngineStep) -> None:
        streams = self._streams
        core = self.core
        for request in step.decode:
            stream = streams.get(request)
            if stream is not None:
                stream.tokens = core.generated_tokens(request)
                stream.notify()

    # --- the side channel (client) ---

    async def _locate(self, remote: RemoteKV) -> float:
        """The producer's remaining lease (wall seconds) for the KV; KVLoadError if there is none."""
        assert self._session is not None
        if remote.host in self.unreadable_from or "*" in self.unreadable_from:
            raise KVLoadError(f"cannot read KV from the prefill engine at {remote.host}:{remote.port}: the link is "
                              "down (an injected fault)")
        try:
            async with self._session.get(remote.url()) as response:
                if response.status == 404:
                    raise KVLoadError(f"the prefill engine at {remote.host}:{remote.port} holds no KV for "
                                      f"{remote.request_id} (unknown, released, or its lease expired)")
                if response.status != 200:
                    raise KVLoadError(f"the prefill engine at {remote.host}:{remote.port} answered "
                                      f"HTTP {response.status}")
                body = await response.json()
                if not isinstance(body, dict):
                    raise ValueError("not a JSON object")
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            raise KVLoadError(f"cannot reach the prefill engine's side channel {remote.host}:{remote.port}: "
                              f"{error or type(error).__name__}") from error
        if remote.engine_id is not None and body.get("engine_id") != remote.engine_id:
            raise KVLoadError(f"engine {remote.engine_id} is gone: {remote.host}:{remote.port} is now engine "
                              f"{body.get('engine_id')}")
        remaining = body.get("lease_remaining_s")
        if not isinstance(remaining, int | float):
            raise KVLoadError(f"the prefill engine at {remote.host}:{remote.port} sent no lease")
        return float(remaining)

    async def _release_remote(self, remote: RemoteKV) -> None:
        assert self._session is not None
        try:
            async with self._session.post(remote.url("/release")) as response:
                if response.status != 200:
                    log.info("releasing KV %s on %s:%s: HTTP %s (its lease had expired)", remote.request_id,
                             remote.host, remote.port, response.status)
        except (aiohttp.ClientError, TimeoutError) as error:
            log.info("releasing KV %s on %s:%s failed: %s", remote.request_id, remote.host, remote.port, error)


def _report_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the engine loop crashed", exc_info=task.exception())


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _remote_kv(params: dict[str, Any]) -> RemoteKV:
    host, port, request_id = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
    engine_id = params.get("remote_engine_id")
    if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int) \
            or not isinstance(request_id, str) or not (engine_id is None or isinstance(engine_id, str)):
        raise KVLoadError("kv_transfer_params with do_remote_prefill need remote_host, remote_port and "
                          "remote_request_id (as a prefill engine returns them)")
    if params.get("remote_block_ids") is not None and not _block_ids(params["remote_block_ids"]):
        raise KVLoadError("remote_block_ids must be a list of block ids per KV-cache group (or one flat list, "
                          "as vLLM before 0.18 sent)")
    try:
        require_loopback(host, "NIXL side channel")
    except NonLoopbackAddress as error:
        raise KVLoadError(str(error)) from None
    return RemoteKV(host, port, request_id, engine_id)




def _block_ids(value: Any) -> bool:
    """Whether `remote_block_ids` has a shape vLLM sends: one list of ints per KV-cache group (0.18 and
    later) or one flat list of ints (before)."""
    def ints(items: Any) -> bool:
        return isinstance(items, list | tuple) and all(isinstance(i, int) and not isinstance(i, bool) for i in items)
    return ints(value) or (isinstance(value, list | tuple) and bool(value) and all(ints(group) for group in value))
