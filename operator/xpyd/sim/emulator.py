"""`xpyd engine-sim`: one process that behaves like one vLLM engine on the wire, in real time.

The engine is an `EngineCore` (the continuous-batching model the cluster simulator uses) driven by
the wall clock: the loop asks the core for the next step, sleeps through it, applies it and hands
the tokens to the HTTP handlers. Behind it is an aiohttp server with vLLM 0.33's OpenAI-compatible
surface: `/v1/completions`, `/v1/chat/completions` (streamed or not), `/v1/models`, `/health`,
`/ping`, `/version` and `/metrics`.

Time
====

`--time-scale K` runs the model K times faster than real time: every modelled duration (prefill and
decode steps, KV transfers, the KV lease, `--startup-delay-s`) is divided by K. The core runs on the
process's monotonic clock in *wall seconds* with a performance model scaled by 1/K, so everything the
engine reports -- `/metrics` histograms, rates Prometheus derives from its counters -- is in the wall
seconds a client experiences; multiply by K for modelled seconds. (`--shutdown-timeout` and HTTP
keep-alive are real seconds: Kubernetes and clients count them.)

The loop keeps a nominal schedule: a step that ends at `t` starts the next one at `t` even when the
process woke up late, so wake-up jitter delays when tokens are delivered but never accumulates into
the modelled timeline. asyncio's timers are up to a millisecond late (epoll counts whole
milliseconds), so the loop sleeps to within `TIMER_SLACK_S` of a step's end and spins the event loop
(handlers keep running) for the rest: about 0.5 ms of CPU per step while the engine is busy. Arrivals wait in an inbox
stamped with their wall time and enter the core at the first step boundary at or after it, as in the
simulator. If the process falls more than `MAX_LAG_S` behind (CPU starvation, or a time scale the
process cannot keep up with), the schedule is reset to the wall clock and a warning logged.

Wire behaviour (vLLM 0.33 unless noted)
=======================================

- Every request generates exactly its `max_tokens` (`max_completion_tokens` wins when both are
  set) and finishes with `finish_reason: "length"`, as if `ignore_eos` were set. Defaults: 16 for
  completions, `max_model_len - prompt` for chat. Each token's text is `" tok"`. A streamed response
  sends one SSE event per token; tokens that are ready together go out in one write.
- Prompt tokens: a prompt of token ids (`[1, 2, 3]`, or a one-element batch of it) counts exactly;
  text counts `ceil(characters / 4)` (at least 1); a chat prompt counts like Llama 3's chat template:
  1 (BOS) + per message (5 framing tokens + its text) + 4 (the assistant header). Batched prompts,
  `n > 1` and non-text chat content are rejected with 400 (not emulated).
- Errors use vLLM's envelope `{"error": {"message", "type", "param", "code"}}`: 400
  `BadRequestError` for bad JSON, bad types, `max_tokens < 1`, prompt + max_tokens over
  `--max-model-len`, `stream_options` without `stream`; 404 `NotFoundError` ("The model `x` does not
  exist.") for an unknown model (an absent `model` is the served model, as in vLLM); 503 while loading
  or draining; 500 `InternalServerError` when a KV load fails under `kv_load_failure_policy: fail` (in a
  stream: an error event, then `data: [DONE]`).
- `/health` and `/ping` answer 200 when ready and 503 while "loading" (`--startup-delay-s`) or
  draining; so do the generation endpoints. Real vLLM refuses connections until loaded; the 503
  window lets probes and proxies be tested against a loading engine. Idle keep-alive connections are
  closed after 5 s, as vLLM's uvicorn does.
- SIGTERM: stop listening for HTTP, answer 503 on connections still open, finish in-flight requests
  and wait for held KV to be pulled (the NIXL side channel stays up), up to `--shutdown-timeout`
  (default 0: abort them at once), then exit 0.

P/D (NixlConnector, pull), when a KV connector is configured (`--kv-transfer-config` or `--role`)
==============================================================================================

Roles follow the request, as in vLLM; `kv_role` only names the engine's intent.

- `kv_transfer_params.do_remote_decode` (the prefill leg): the request stops after its first token and
  the response carries `kv_transfer_params` `{do_remote_prefill: true, do_remote_decode: false,
  remote_engine_id, remote_block_ids (synthetic, one per 16 tokens), remote_host, remote_port,
  remote_request_id, tp_size}`. `remote_host`/`remote_port` are the NIXL side channel:
  `VLLM_NIXL_SIDE_CHANNEL_HOST` (default `--host`) and `VLLM_NIXL_SIDE_CHANNEL_PORT` (default 5600; 0
  picks a free port). The engine serves its HTTP API on that address too and holds the request's KV
  until the consumer releases it or the lease (`kv_lease_duration` from the connector's extra config,
  or `--kv-lease-s`, default 30 s) expires.
- `kv_transfer_params.do_remote_prefill` (the decode leg): the request is queued at once; admitted,
  it waits the modelled KV transfer (`PerfModel.kv_transfer_seconds`), counts its prompt as
  `external_kv_transfer` and decodes only. Beside the transfer, as NIXL's handshake and read would,
  the engine asks the producer's side channel (`GET /xpyd/kv/{remote_request_id}`, loopback only)
  whether it holds the KV and how long its lease has left (until it answers, the lease is taken to
  start at arrival); a transfer that ends before the answer waits for it (then loads again, which
  only matters when a round trip outlasts the transfer, i.e. at high time scales). When the KV has
  arrived the engine tells the producer (`POST /xpyd/kv/{remote_request_id}/release`), which frees
  the blocks before the lease ends, as NIXL's completion notification does.
- A KV load that cannot happen -- the producer is unreachable or outside loopback, it holds no such
  request (unknown, or its lease expired), the parameters are incomplete, or the lease expires while
  the request waits for admission -- follows `kv_load_failure_policy`: `fail` answers 500 (counted in
  `vllm:request_success_total{finished_reason="error"}` and `vllm:nixl_num_failed_transfers_total`);
  `recompute` prefills the prompt locally (`local_compute`, and a failed transfer).
- No `kv_transfer_params` on any engine: the prompt is computed locally (`local_compute`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import json
import logging
import math
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp import web

from xpyd.cluster.netguard import NonLoopbackAddress, require_loopback
from xpyd.sim.core import EngineConfig, EngineCore, EnginePerf, EngineRequest, Event, EventKind, Phase, Step
from xpyd.sim.exposition import CONTENT_TYPE, ConnectorMetrics, render_metrics

log = logging.getLogger(__name__)

EMULATED_VLLM_VERSION = "0.33.0"
DEFAULT_PROFILE = Path(__file__).resolve().parent / "profiles" / "h200_llama31_8b_fp8_tp1"
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DEFAULT_SIDE_CHANNEL_PORT = 5600
DEFAULT_LINK_GBPS = 100.0
BLOCK_SIZE = 16
"""Tokens per KV block (vLLM's default on CUDA): sizes the synthetic `remote_block_ids`."""
KEEPALIVE_TIMEOUT_S = 5.0
"""uvicorn's idle keep-alive, which vLLM keeps: a proxy holding idle connections longer gets resets."""
MAX_LAG_S = 0.05
"""How far (wall seconds) the nominal schedule may trail the clock before it is reset to it."""
LAG_WARNING_INTERVAL_S = 10.0
SIDE_CHANNEL_TIMEOUT_S = 5.0
TIMER_SLACK_S = 0.001
"""The last part of a step the loop spins through instead of sleeping (asyncio's timer granularity)."""
TOKEN_TEXT = " tok"
COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_MESSAGE_FRAMING_TOKENS = 5
CHAT_ASSISTANT_HEADER_TOKENS = 4
FAILURE_POLICIES = ("fail", "recompute")
KV_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


# --- configuration --------------------------------------------------------------------------------

@dataclass(frozen=True)
class EmulatorConfig:
    """One emulated engine. Durations marked "modelled" are divided by `time_scale`."""

    model: str = DEFAULT_MODEL
    served_model_names: tuple[str, ...] = ()   # empty: the model
    host: str = "127.0.0.1"
    port: int = 8000
    kv_role: str | None = None                 # kv_producer | kv_consumer | kv_both; None: no KV connector
    kv_load_failure_policy: str = "fail"
    engine_id: str | None = None               # None: a random uuid, as vLLM does
    side_channel_host: str | None = None       # None: `host`
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    tensor_parallel_size: int = 1
    max_model_len: int = 131072
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_kv_tokens: int | None = None           # None: the performance model's
    kv_lease_s: float = 30.0                   # modelled
    kv_bytes_per_token: int | None = None      # sizes vllm:nixl_bytes_transferred
    time_scale: float = 1.0
    startup_delay_s: float = 0.0               # modelled
    shutdown_timeout_s: float = 0.0            # wall
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.time_scale > 0 or not math.isfinite(self.time_scale):
            raise ValueError(f"--time-scale must be a positive number, not {self.time_scale}")
        for name in ("startup_delay_s", "shutdown_timeout_s", "kv_lease_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must not be negative")
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, not {self.kv_role!r}")
        if self.kv_load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {', '.join(FAILURE_POLICIES)}, "
                             f"not {self.kv_load_failure_policy!r}")
        if min(self.max_model_len, self.max_num_batched_tokens, self.max_num_seqs, self.tensor_parallel_size) < 1:
            raise ValueError("--max-model-len, --max-num-batched-tokens, --max-num-seqs and "
                             "--tensor-parallel-size must be at least 1")
        require_loopback(self.host, "--host")
        require_loopback(self.side_channel_host or self.host, "NIXL side-channel host")

    @property
    def model_name(self) -> str:
        """The name responses carry: the first served name."""
        return self.served_model_names[0] if self.served_model_names else self.model

    @property
    def role(self) -> str:
        """prefill, decode, both (kv_both) or none (no KV connector)."""
        return KV_ROLES[self.kv_role] if self.kv_role else "none"


class ScaledPerf:
    """A performance model run `time_scale` times faster than real time: every duration divided by it."""

    def __init__(self, perf: EnginePerf, time_scale: float) -> None:
        self.perf = perf
        self.time_scale = time_scale
        self.max_kv_tokens = perf.max_kv_tokens

    def prefill_seconds(self, batch_tokens: int) -> float:
        """The model's prefill step, scaled."""
        return self.perf.prefill_seconds(batch_tokens) / self.time_scale

    def decode_step_seconds(self, batch_size: int, kv_tokens: int) -> float:
        """The model's decode step, scaled."""
        return self.perf.decode_step_seconds(batch_size, kv_tokens) / self.time_scale

    def kv_transfer_seconds(self, tokens: int) -> float:
        """The model's KV hand-off, scaled."""
        return self.perf.kv_transfer_seconds(tokens) / self.time_scale


# --- the real-time engine -------------------------------------------------------------------------

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
    """One request's progress as its HTTP handler sees it: tokens so far, finished, or an error."""

    __slots__ = ("cancelled", "error", "finished", "parked", "remote", "request", "tokens", "total", "verified",
                 "waiter")

    def __init__(self, request: EngineRequest, remote: RemoteKV | None = None) -> None:
        self.request = request
        self.remote = remote
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
            max_model_len=config.max_model_len))
        if self.core.capacity < config.max_model_len:
            raise ValueError(f"the model's max seq len ({config.max_model_len}) is larger than the maximum number "
                             f"of tokens that can be stored in KV cache ({self.core.capacity}): lower "
                             "--max-model-len or raise --max-kv-tokens")
        self.connector = ConnectorMetrics()
        self._rng = random.Random(config.seed)
        self.engine_id = config.engine_id or str(uuid.UUID(int=self._rng.getrandbits(128), version=4))
        self.side_channel: tuple[str, int] = (config.side_channel_host or config.host, config.side_channel_port)
        self.draining = False
        self.in_flight = 0                   # generation handlers running
        self._streams: dict[EngineRequest, Stream] = {}
        self._held: dict[str, EngineRequest] = {}
        self._awaiting_kv: set[Stream] = set()
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

    def now(self) -> float:
        """Wall seconds since start: the core's clock."""
        assert self._loop is not None, "the engine has not started"
        return self._loop.time() - self._t0

    @property
    def ready(self) -> bool:
        """Past the loading period."""
        return self.now() >= self._ready_at

    @property
    def loading_left_s(self) -> float:
        """Wall seconds until ready."""
        return max(0.0, self._ready_at - self.now())

    @property
    def num_held(self) -> int:
        """Finished prefill legs whose KV waits for a consumer."""
        return len(self._held)

    # --- requests ---

    def submit(self, request_id: str, prompt_tokens: int, max_tokens: int,
               kv_transfer_params: dict[str, Any] | None) -> Stream:
        """Queue a request (see the module docstring for what `kv_transfer_params` do)."""
        arrival = self.now()
        params = kv_transfer_params if self.config.kv_role is not None and kv_transfer_params else {}
        request = EngineRequest(f"{request_id}-{next(self._seq)}", prompt_tokens, max_tokens,
                                do_remote_decode=bool(params.get("do_remote_decode")),
                                do_remote_prefill=bool(params.get("do_remote_prefill")))
        stream = Stream(request)
        if request.do_remote_prefill:
            try:
                stream.remote = _remote_kv(params)
            except KVLoadError as error:
                self._kv_load_failed(stream, error)
            else:
                # Until the producer answers, its lease is taken to have started now.
                stream.verified = False
                request.remote_kv_deadline = arrival + self.core.config.kv_lease_seconds
                self._spawn(self._verify(stream))
        if not stream.finished:
            self._enqueue(arrival, stream)
        return stream

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
        if stream.cancelled:
            return
        request = stream.request
        if stream.parked:   # its KV "arrived" before the answer: load it again, from the original arrival
            stream.parked = False
            stream.request = EngineRequest(request.request_id, request.prompt_tokens, request.max_tokens,
                                           do_remote_prefill=True, remote_kv_deadline=self.now() + remaining)
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
                                       do_remote_prefill=True, remote_kv_deadline=-math.inf)
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
            return False
        released = self.core.release_kv(request_id, self.now())
        self._kick()
        return released

    def kv_transfer_params(self, stream: Stream) -> dict[str, Any]:
        """What a prefill leg returns for the decode leg (NixlConnector's `request_finished`)."""
        blocks = -(-stream.request.prompt_tokens // BLOCK_SIZE)
        pool = max(1, self.core.capacity // BLOCK_SIZE)
        first = self._next_block
        self._next_block = (first + blocks) % pool
        host, port = self.side_channel
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [(first + i) % pool for i in range(blocks)],
                "remote_engine_id": self.engine_id, "remote_request_id": stream.request.request_id,
                "remote_host": host, "remote_port": port, "tp_size": self.config.tensor_parallel_size}

    def metrics_text(self) -> str:
        """The `/metrics` exposition."""
        return render_metrics(self.core, self.connector, self.config.model_name)

    # --- the loop ---

    async def _run(self) -> None:
        core = self.core
        t = self.now()
        while True:
            self._admit(t)
            self._on_events(core.poll(t))
            self._expire_waiting(t)
            step = core.next_step(t)
            if step is None:
                t = await self._idle(t)
                continue
            await self._sleep_until(step.end)
            self._on_events(core.complete(step, step.end))
            self._deliver(step)
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

    def _fail(self, stream: Stream, message: str) -> None:
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
            elif kind is EventKind.FINISHED:
                stream.tokens = request.limit
                stream.finished = True
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

    def _on_kv_loaded(self, stream: Stream, time_s: float) -> None:
        request = stream.request
        self.connector.nixl_xfer_time_seconds.observe(time_s - request.scheduled_time)
        if self.config.kv_bytes_per_token:
            self.connector.nixl_bytes_transferred.observe(request.prompt_tokens * self.config.kv_bytes_per_token)
        if stream.remote is not None:
            self._spawn(self._release_remote(stream.remote))

    def _deliver(self, step: Step) -> None:
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
    try:
        require_loopback(host, "NIXL side channel")
    except NonLoopbackAddress as error:
        raise KVLoadError(str(error)) from None
    return RemoteKV(host, port, request_id, engine_id)


# --- HTTP: request parsing ------------------------------------------------------------------------

class ApiError(Exception):
    """An error answered in vLLM's envelope."""

    def __init__(self, status: int, message: str, error_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type


def error_response(status: int, message: str, error_type: str) -> web.Response:
    """vLLM's `ErrorResponse`: `{"error": {"message", "type", "param", "code"}}`."""
    return web.json_response(_error_body(message, error_type, status), status=status)


def _error_body(message: str, error_type: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": None, "code": status}}


def text_tokens(text: str) -> int:
    """Prompt tokens of a text: about four characters per token, at least one."""
    return max(1, -(-len(text) // 4))


def _prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]   # a batch of one
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise ApiError(400, "batched prompts are not emulated: send one prompt per request")
    raise ApiError(400, "prompt must be a non-empty string or a non-empty list of token ids")


def _chat_prompt_tokens(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    total = 1 + CHAT_ASSISTANT_HEADER_TOKENS
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "every message needs a string role")
        content = message.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, "only text content parts are emulated")
                parts.append(part["text"])
            text = "".join(parts)
        else:
            raise ApiError(400, "message content must be a string, a list of parts or null")
        total += CHAT_MESSAGE_FRAMING_TOKENS + -(-len(text) // 4)
    return total


def _optional_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, not {json.dumps(value)}")
    if value < 1:
        raise ApiError(400, f"{name} must be at least 1, got {value}.")
    return value


@dataclass(frozen=True)
class Generation:
    """A validated `/v1/completions` or `/v1/chat/completions` body."""

    chat: bool
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    kv_transfer_params: dict[str, Any] | None


def parse_generation(body: Any, chat: bool, config: EmulatorConfig) -> Generation:
    """Validate a request body like vLLM's protocol models and `_validate_input` do; raises ApiError."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or model not in (config.served_model_names or
                                                                          (config.model,))):
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
    prompt_tokens = _chat_prompt_tokens(body.get("messages")) if chat else _prompt_tokens(body.get("prompt"))
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object")
        if not stream:
            raise ApiError(400, "Stream options can only be defined when `stream=True`.")
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, "n other than 1 is not emulated")
    kv_transfer_params = body.get("kv_transfer_params")
    if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
        raise ApiError(400, "kv_transfer_params must be an object")
    max_len = config.max_model_len
    if prompt_tokens >= max_len:
        raise ApiError(400, f"This model's maximum context length is {max_len} tokens. However, your request has "
                       f"{prompt_tokens} input tokens. Please reduce the length of the input messages.")
    max_tokens = _optional_int(body, "max_completion_tokens") or _optional_int(body, "max_tokens")
    if max_tokens is None:
        max_tokens = max_len - prompt_tokens if chat else COMPLETION_DEFAULT_MAX_TOKENS
    if prompt_tokens + max_tokens > max_len:
        raise ApiError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                       f"maximum context length is {max_len} tokens and your request has {prompt_tokens} input "
                       f"tokens ({max_tokens} > {max_len} - {prompt_tokens}).")
    include_usage = bool(options is not None and options.get("include_usage", True))
    continuous = bool(options is not None and options.get("continuous_usage_stats", False))
    return Generation(chat, prompt_tokens, max_tokens, bool(stream), include_usage, continuous, kv_transfer_params)


# --- HTTP: responses ------------------------------------------------------------------------------

ENGINE: web.AppKey[Engine] = web.AppKey("engine", Engine)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _Chunks:
    """The SSE events of one streamed response (pre-rendered: most events are the same token)."""

    def __init__(self, response_id: str, model: str, created: int, generation: Generation) -> None:
        self.generation = generation
        self.head = {"id": response_id, "object": "chat.completion.chunk" if generation.chat else "text_completion",
                     "created": created, "model": model}
        self.token = _sse(self.event(None))

    def event(self, finish_reason: str | None, usage: dict[str, Any] | None = None,
              role: bool = False) -> dict[str, Any]:
        if self.generation.chat:
            delta = {"role": "assistant", "content": ""} if role else {"content": TOKEN_TEXT}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": TOKEN_TEXT, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None}
        payload: dict[str, Any] = {**self.head, "choices": [choice]}
        if usage is not None:
            payload["usage"] = usage
        return payload

    def tokens(self, first: int, count: int, total: int) -> str:
        """Events for tokens first+1 .. first+count of `total`."""
        generation = self.generation
        if generation.continuous_usage:
            return "".join(_sse(self.event("length" if i == total else None, _usage(generation.prompt_tokens, i)))
                           for i in range(first + 1, first + count + 1))
        if first + count < total:
            return self.token * count
        return self.token * (count - 1) + _sse(self.event("length"))

    def usage(self, completion_tokens: int) -> str:
        return _sse({**self.head, "choices": [], "usage": _usage(self.generation.prompt_tokens, completion_tokens)})


def _not_ready(engine: Engine) -> web.Response | None:
    if engine.draining:
        return error_response(503, "The server is shutting down.", "ServiceUnavailableError")
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
        generation = parse_generation(body, chat, config)
    except ApiError as error:
        return error_response(error.status, error.message, error.error_type)
    base = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{base}"
    engine.in_flight += 1
    stream: Stream | None = None
    try:
        if generation.stream:
            return await _stream(request, engine, generation, response_id)
        stream = engine.submit(response_id, generation.prompt_tokens, generation.max_tokens,
                               generation.kv_transfer_params)
        while not stream.finished:
            await stream.wait()
        if stream.error is not None:
            return error_response(500, stream.error, "InternalServerError")
        return web.json_response(_full_response(engine, stream, generation, response_id))
    finally:
        engine.in_flight -= 1
        if stream is not None:
            engine.abort(stream)   # no-op once finished


def _full_response(engine: Engine, stream: Stream, generation: Generation, response_id: str) -> dict[str, Any]:
    text = TOKEN_TEXT * stream.tokens
    params = engine.kv_transfer_params(stream) if stream.request.do_remote_decode else None
    head = {"id": response_id, "created": int(time.time()), "model": engine.config.model_name}
    usage = _usage(generation.prompt_tokens, stream.tokens)
    if generation.chat:
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                                   "audio": None, "function_call": None, "tool_calls": [], "reasoning_content": None}
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "length",
                             "stop_reason": None}],
                "service_tier": None, "system_fingerprint": None, "usage": usage, "prompt_logprobs": None,
                "kv_transfer_params": params}
    return {**head, "object": "text_completion",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None,
                         "prompt_logprobs": None}],
            "service_tier": None, "system_fingerprint": None, "usage": usage, "kv_transfer_params": params}


async def _stream(request: web.Request, engine: Engine, generation: Generation,
                  response_id: str) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    chunks = _Chunks(response_id, engine.config.model_name, int(time.time()), generation)
    if generation.chat:
        await response.write(_sse(chunks.event(None, role=True)).encode())
    stream = engine.submit(response_id, generation.prompt_tokens, generation.max_tokens,
                           generation.kv_transfer_params)
    try:
        sent = 0
        total = stream.total
        while True:
            while stream.tokens == sent and not stream.finished:
                await stream.wait()
            if stream.error is not None:
                await response.write(_sse(_error_body(stream.error, "InternalServerError", 500)).encode())
                break
            count = stream.tokens - sent
            if count:
                await response.write(chunks.tokens(sent, count, total).encode())
                sent += count
            if stream.finished:
                if generation.include_usage:
                    await response.write(chunks.usage(sent).encode())
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
              "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                              "created": created, "allow_create_engine": False, "allow_sampling": True,
                              "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                              "allow_fine_tuning": False, "organization": "*", "group": None,
                              "is_blocking": False}]}
             for name in (config.served_model_names or (config.model,))]
    return web.json_response({"object": "list", "data": cards})


async def health(request: web.Request) -> web.Response:
    """`GET /health` and `/ping`: 200 with an empty body when ready, 503 while loading or draining."""
    unavailable = _not_ready(request.app[ENGINE])
    return unavailable if unavailable is not None else web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    """`GET /version`: the emulated vLLM release."""
    return web.json_response({"version": EMULATED_VLLM_VERSION})


async def metrics(request: web.Request) -> web.Response:
    """`GET /metrics`: Prometheus text format 0.0.4."""
    return web.Response(body=request.app[ENGINE].metrics_text().encode(), headers={"Content-Type": CONTENT_TYPE})


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
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/xpyd/kv/{request_id}", kv_lookup)
    app.router.add_post("/xpyd/kv/{request_id}/release", kv_release)
    return app


# --- serving --------------------------------------------------------------------------------------

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
        """Graceful stop (SIGTERM): stop listening, finish in-flight requests and held KV up to the
        shutdown timeout, then close everything."""
        engine = self.engine
        engine.draining = True
        deadline = time.monotonic() + engine.config.shutdown_timeout_s
        await self.http_site.stop()
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


# --- command line ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """`xpyd engine-sim` options: DESIGN's contract plus the `vllm serve` arguments the operator renders."""
    parser = argparse.ArgumentParser(
        prog="xpyd engine-sim", description="Emulate one vLLM engine (OpenAI API, vllm:* metrics, NIXL P/D "
        "hand-off) in real time. Accepts a pod's `vllm serve` arguments unchanged; other vLLM flags are "
        "ignored with a warning.")
    parser.add_argument("model", nargs="?", default=None, help=f"model name or path (default {DEFAULT_MODEL})")
    parser.add_argument("--model", dest="model_option", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=["prefill", "decode"], help="P/D role (NixlConnector kv_producer or "
                        "kv_consumer) when no --kv-transfer-config says it")
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE), help="performance profile prefix "
                        "(PREFIX_prefill.csv, PREFIX_decode.csv; default: the bundled H200 Llama-3.1-8B FP8 one)")
    parser.add_argument("--host", default=os.environ.get("POD_IP") or "127.0.0.1",
                        help="loopback address to bind (default $POD_IP, else 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    parser.add_argument("--served-model-name", nargs="+", default=None, help="names the API accepts and answers "
                        "with (default: the model)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="reported as tp_size")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="accepted, not modelled")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="accepted; one engine is emulated")
    parser.add_argument("--max-model-len", type=_token_count, default=131072, help="context limit (e.g. 8192, 32k)")
    parser.add_argument("--revision", default=None, help="accepted, not used")
    parser.add_argument("--shutdown-timeout", type=float, default=0.0, help="seconds SIGTERM waits for in-flight "
                        "requests and held KV (default 0: abort at once)")
    parser.add_argument("--kv-transfer-config", default=None, help="vLLM KVTransferConfig JSON (kv_role, "
                        "kv_load_failure_policy, engine_id, kv_connector_extra_config.kv_lease_duration)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="KV dtype for the transfer size (auto = bf16)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per step")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="running-request limit")
    parser.add_argument("--max-kv-tokens", type=int, default=None, help="KV capacity in tokens (default: the "
                        "profile's)")
    parser.add_argument("--kv-lease-s", type=float, default=None, help="modelled seconds a prefill engine holds "
                        "unclaimed KV (default: the connector's kv_lease_duration, else 30)")
    parser.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_GBPS, help="prefill-to-decode link in "
                        f"Gb/s for the KV transfer time (default {DEFAULT_LINK_GBPS:g})")
    parser.add_argument("--startup-delay-s", type=float, default=0.0, help="modelled seconds of 'loading' "
                        "(503 on /health) before serving")
    parser.add_argument("--time-scale", type=float, default=1.0, help="run K times faster than real time: every "
                        "modelled duration is divided by K")
    parser.add_argument("--seed", type=int, default=None, help="seed of the engine id and block ids")
    return parser


def _token_count(text: str) -> int:
    """An integer, or vLLM's human-readable form (32k, 1m; k = 1000, K = 1024)."""
    factors = {"k": 1000, "m": 1_000_000, "K": 1024, "M": 1024 * 1024}
    try:
        if text and text[-1] in factors:
            return int(float(text[:-1]) * factors[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r}") from None


def _split_dotted(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Take `--kv-transfer-config.KEY VALUE` / `=VALUE` (vLLM's dotted form) out of argv."""
    rest: list[str] = []
    dotted: dict[str, Any] = {}
    items = iter(argv)
    prefix = "--kv-transfer-config."
    for arg in items:
        if not arg.startswith(prefix):
            rest.append(arg)
            continue
        key, _, value = arg[len(prefix):].partition("=")
        if not _:
            value = next(items, "")
        try:
            dotted[key] = json.loads(value)
        except ValueError:
            dotted[key] = value
    return rest, dotted


def config_from_args(argv: Sequence[str]) -> tuple[EmulatorConfig, EnginePerf, list[str]]:
    """Parse `xpyd engine-sim` arguments: (config, performance model, ignored vLLM arguments).

    Raises ValueError, OSError (profile) or KeyError (KV dtype); argparse exits on --help and bad flags.
    """
    from xpyd.sim.perf import PerfModel

    argv, dotted = _split_dotted(argv)
    args, ignored = build_parser().parse_known_args(argv)
    kv: dict[str, Any] = {}
    if args.kv_transfer_config:
        try:
            kv = json.loads(args.kv_transfer_config)
        except ValueError as error:
            raise ValueError(f"--kv-transfer-config is not JSON: {error}") from None
        if not isinstance(kv, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
    kv.update(dotted)
    kv_role = kv.get("kv_role")
    role_of = {"prefill": "kv_producer", "decode": "kv_consumer"}
    if args.role is not None:
        if kv_role not in (None, "kv_both", role_of[args.role]):
            raise ValueError(f"--role {args.role} contradicts kv_role {kv_role} in --kv-transfer-config")
        kv_role = kv_role or role_of[args.role]
    elif kv and kv_role is None:
        raise ValueError("--kv-transfer-config needs kv_role once a connector is set")
    connector = kv.get("kv_connector", "NixlConnector")
    if kv_role is not None and connector not in ("NixlConnector", "NixlPullConnector"):
        log.warning("kv_connector %s: only the NixlConnector pull protocol is emulated", connector)
    if args.data_parallel_size > 1:
        log.warning("--data-parallel-size %d: one engine is emulated", args.data_parallel_size)
    if not args.link_gbps > 0:
        raise ValueError("--link-gbps must be positive")
    extra = kv.get("kv_connector_extra_config") or {}
    lease = args.kv_lease_s if args.kv_lease_s is not None else float(extra.get("kv_lease_duration", 30.0))
    side_port = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    model = args.model or args.model_option or DEFAULT_MODEL
    served = tuple(args.served_model_name or ())
    kv_bytes = _kv_bytes_per_token(model, served, args.kv_cache_dtype)
    config = EmulatorConfig(
        model=model, served_model_names=served, host=args.host, port=args.port, kv_role=kv_role,
        kv_load_failure_policy=kv.get("kv_load_failure_policy", "fail"), engine_id=kv.get("engine_id"),
        side_channel_host=os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or None,
        side_channel_port=int(side_port) if side_port else DEFAULT_SIDE_CHANNEL_PORT,
        tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_kv_tokens=args.max_kv_tokens, kv_lease_s=lease, kv_bytes_per_token=kv_bytes, time_scale=args.time_scale,
        startup_delay_s=args.startup_delay_s, shutdown_timeout_s=args.shutdown_timeout, seed=args.seed)
    perf = PerfModel.from_profile(args.profile).with_kv_transfer(kv_bytes, args.link_gbps)
    return config, perf, ignored


def _kv_bytes_per_token(model: str, served: tuple[str, ...], kv_cache_dtype: str) -> int:
    """KV bytes per token of the first known name among the model and its served names (else the
    bundled profile's Llama-3.1-8B), in the KV dtype (`auto`: bf16)."""
    from xpyd.sim.shapes import lookup_model

    dtype = "fp8" if kv_cache_dtype.startswith("fp8") else {"auto": "bf16", "bfloat16": "bf16",
                                                             "float16": "fp16"}.get(kv_cache_dtype, kv_cache_dtype)
    for name in (model, *served):
        with contextlib.suppress(KeyError):
            return lookup_model(name).kv_bytes_per_token(dtype)
    return lookup_model("llama-3.1-8b").kv_bytes_per_token(dtype)


async def serve(config: EmulatorConfig, perf: EnginePerf) -> None:
    """Run one engine until SIGTERM or SIGINT, then drain it (see `EmulatorServer.drain`)."""
    server = await start_server(config, perf)
    engine = server.engine
    host, port = engine.side_channel
    log.info("engine-sim %s (%s) serving %s on %s; NIXL side channel %s; time scale %g; ready in %.1f s",
             engine.engine_id, config.role, config.model_name, server.url,
             f"{host}:{port}" if config.kv_role else "off", config.time_scale, engine.loading_left_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
        log.info("engine-sim draining (shutdown timeout %g s)", config.shutdown_timeout_s)
        await server.drain()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await server.close()


def main(argv: Sequence[str] | None = None) -> int:
    """`xpyd engine-sim ARGS`: exit 0 after a graceful stop, 2 on a bad configuration, 1 if it cannot bind."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config, perf, ignored = config_from_args(sys.argv[1:] if argv is None else argv)
    except (ValueError, OSError, KeyError, NonLoopbackAddress) as error:
        sys.stderr.write(f"xpyd engine-sim: {error}\n")
        return 2
    if ignored:
        log.warning("ignoring vLLM arguments the emulator does not model: %s", " ".join(ignored))
    try:
        asyncio.run(serve(config, perf))
    except ValueError as error:   # a configuration the engine cannot run
        sys.stderr.write(f"xpyd engine-sim: {error}\n")
        return 2
    except OSError as error:      # cannot bind
        sys.stderr.write(f"xpyd engine-sim: {error}\n")
        return 1
    return 0


def add_parser(subparsers: Any) -> None:
    """Register `xpyd engine-sim`. Its arguments pass through untouched (a pod's `vllm serve` arguments
    include flags only vLLM knows) and are parsed by `run`, which prints its own `--help`."""
    command = subparsers.add_parser("engine-sim", help="emulate one vLLM engine (OpenAI API, vllm:* metrics, "
                                    "NIXL P/D hand-off) in real time", add_help=False, prefix_chars="\0")
    command.add_argument("argv", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    command.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """`xpyd engine-sim`, from `add_parser`'s namespace."""
    return main(list(args.argv))


if __name__ == "__main__":
    sys.exit(main())
