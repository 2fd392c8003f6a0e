"""One vLLM engine's continuous batching as a pure, clock-free state machine.

`EngineCore` is the scheduling model shared by the discrete-event cluster simulator (which jumps a
simulated clock from event to event) and the real-time engine emulator (which sleeps through each
step). Neither the core nor its callers' clocks leak into each other: every call takes `now`, and the
core only says what runs next and how long it takes (from an `EnginePerf`).

The driver loop, the same for both drivers::

    core.add(request, now)                    # a request arrives (any time, even mid-step)
    events = core.poll(now)                   # transfers finished / leases expired by `now`
    step = core.next_step(now)                # only while no step is in flight
    ...  wait until step.end (sleep, or an event heap) ...
    events = core.complete(step, step.end)    # first tokens, finished requests
    # idle (next_step returned None)? wake up at core.next_timer() or at the next add()

Scheduling rules (vLLM V1's scheduler, simplified where noted):

- Token budget: one step schedules at most `max_num_batched_tokens` tokens. Running requests go
  first: every decoding request takes one token, then partially prefilled prompts continue in
  admission order; then waiting requests are admitted first-come-first-served. A prompt longer than
  what is left of the budget is prefilled in chunks over several steps (chunked prefill).
- Admission (KV rule): a waiting request is admitted only when `prompt + max_tokens` tokens fit in
  what is left of `max_kv_tokens` after every admitted request's own reservation, and while fewer
  than `max_num_seqs` requests run. The queue is strict FCFS: when the head does not fit, nothing
  behind it is admitted. vLLM allocates blocks lazily and preempts on exhaustion; reserving the whole
  output up front is the no-preemption bound of that policy, so `num_preemptions` stays 0.
  `kv_cache_usage_perc` reports the reserved share, which is what blocks admission.
- Step time (`p = prefill_seconds`): a step's prompt tokens are batched, `p(all of them)` (batched
  prefill is throughput-bound), except that a continued chunk of `c` tokens at offset `o` costs at
  least its marginal cost in context, `p(o + c) - p(o)` (its attention over the context already
  computed): the step costs `max(p(N), p(N_new) + marginal)` with `N_new` the tokens of newly
  started prompts, and `marginal` alone when it only continues a prompt. So a prompt prefilled alone
  over several chunks costs exactly its profiled batch-1 time `p(L)` (a profile shows no per-chunk
  overhead to add), and a saturated engine runs `max_num_batched_tokens` per `p(8192)`. A step that
  also carries decode tokens adds `decode_step_seconds(batch, kv_tokens)` (mixed steps are summed). When a step only
  decodes, the driver may let the core fuse up to `max_decode_steps` identical decode steps into one
  `EngineStep` (every step of it the same length, timed at the midpoint KV), ending at the latest at
  the next composition change the core can foresee (a request finishing, a transfer or lease timer);
  `shorten()` cuts it at the next step boundary when something arrives. The emulator uses one step.
- Roles follow the request, as in vLLM: `do_remote_decode` (the prefill leg of a P/D request)
  finishes after the first token and keeps its KV reserved until `release_kv()` (the consumer pulled
  it) or until `kv_lease_seconds` pass. `do_remote_prefill` (the decode leg) is admitted like any
  request, then waits `kv_transfer_seconds(prompt)` for its KV (counted as waiting, as vLLM's
  WAITING_FOR_REMOTE_KVS is), then decodes only: its first decode step produces its first token. If
  its `remote_kv_deadline` passed before admission (the producer's lease expired), or it has no KV
  parameters at all, the prompt is prefilled locally (counted as `local_compute`).
- Prefix caching (`enable_prefix_caching`, on by default as in vLLM): the engine's KV is a
  `kvcache.BlockPool` of `capacity // block_size` blocks. A request's `block_keys` (`kvcache.BlockKeys`,
  in runs) key its full prompt blocks. At admission it takes its longest cached prefix (at most
  `prompt - 1` tokens: a prompt that hits entirely still recomputes its last block) and
  `(prompt + limit) // block_size` blocks in all (its partial last block is never cached, so the pool
  counts only full ones); the KV rule above still reserves its whole prompt and output in tokens,
  hits included. A prefill computes only the tokens
  past the hit: its first chunk is a continued chunk at the hit's offset (its marginal cost in
  context), and a step that starts a prompt, hit or not, costs at least `p(N)` of all its prompt
  tokens. A decode leg loads only the tokens past its local hit (`kv_transfer_seconds(prompt - hit)`),
  as NIXL asks for the prompt less the local hits. Blocks are cached when their tokens are
  scheduled, or when the transfer has landed; a finished request frees its blocks into the pool, those
  of its generated tokens as blocks no other request can hit. Requests without keys (a trace without
  prefix blocks) share nothing. Each admission counts `prefix_cache_queries` (prompt tokens) and
  `prefix_cache_hits` (hit tokens) as vLLM does.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import NamedTuple, Protocol

from xpyd.kvcache.pool import BlockKeys, BlockPool, RequestBlocks


class EnginePerf(Protocol):
    """What the scheduling model needs to know about the hardware (implemented by `perf.PerfModel`)."""

    max_kv_tokens: int

    def prefill_seconds(self, batch_tokens: int) -> float:
        """Duration of one prefill step over `batch_tokens` prompt tokens."""
        ...

    def decode_step_seconds(self, batch_size: int, kv_tokens: int) -> float:
        """Duration of one decode step (ITL) for `batch_size` sequences holding `kv_tokens` KV in total."""
        ...

    def kv_transfer_seconds(self, tokens: int) -> float:
        """Time to hand off the KV cache of a prompt of `tokens` tokens from prefill to decode."""
        ...


# vLLM 0.33 `vllm/v1/metrics/loggers.py` bucket layouts.
TTFT_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                  7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                                              50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


ITERATION_TOKENS_BUCKETS: tuple[float, ...] = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0,
                                               4096.0, 8192.0, 16384.0)
REQUEST_PARAMS_N_BUCKETS: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 20.0)
REQUEST_NUM_PREEMPTIONS_BUCKETS: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)
"""vLLM 0.33's default buckets (`vllm/v1/metrics/buckets.py`) of `vllm:iteration_tokens_total`,
`vllm:request_params_n` and `vllm:request_num_preemptions`."""


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `max_value`."""
    buckets: list[float] = []
    base = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * base
            if value > max_value:
                return tuple(buckets)
            buckets.append(float(value))
        base *= 10


class BucketHistogram:
    """A Prometheus histogram: per-bucket counts (the last one is `+Inf`), sum and count."""

    __slots__ = ("buckets", "count", "counts", "sum")

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets: tuple[float, ...] = tuple(buckets)
        self.counts: list[int] = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        """Record `value` (`times` times: a fused decode step observes one ITL per token)."""
        self.counts[bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def cumulative(self) -> list[int]:
        """Counts as Prometheus exposes them: `_bucket{le=...}` is cumulative, the last is `+Inf`."""
        total = 0
        out: list[int] = []
        for n in self.counts:
            total += n
            out.append(total)
        return out

    def add(self, other: BucketHistogram) -> None:
        """Add `other`'s observations (same buckets) into this one."""
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.sum += other.sum
        self.count += other.count

    def minus(self, earlier: BucketHistogram) -> BucketHistogram:
        """The observations made since `earlier` (a snapshot of the same series): what rate() sees."""
        out = BucketHistogram(self.buckets)
        out.counts = [a - b for a, b in zip(self.counts, earlier.counts, strict=True)]
        out.sum = self.sum - earlier.sum
        out.count = self.count - earlier.count
        return out

    def copy(self) -> BucketHistogram:
        """A snapshot."""
        out = BucketHistogram(self.buckets)
        out.counts = list(self.counts)
        out.sum = self.sum
        out.count = self.count
        return out

    def quantile(self, q: float) -> float:
        """`histogram_quantile(q, ...)` with Prometheus' rules (NaN without observations)."""
        return histogram_quantile(q, self.buckets, self.counts)


def histogram_quantile(q: float, buckets: Sequence[float], counts: Sequence[int]) -> float:
    """Prometheus' `histogram_quantile`: linear interpolation inside the bucket holding rank q·total.

    `counts` are per-bucket (not cumulative), one more than `buckets` (the `+Inf` bucket). A rank in
    the `+Inf` bucket returns the highest finite bound, as Prometheus does; no observations: NaN.
    """
    total = sum(counts)
    if total <= 0:
        return math.nan
    rank = q * total
    seen = 0
    for i, n in enumerate(counts):
        if n > 0 and seen + n >= rank:
            if i == len(buckets):
                return buckets[-1]
            lower = buckets[i - 1] if i > 0 else 0.0
            return lower + (buckets[i] - lower) * (rank - seen) / n
        seen += n
    return buckets[-1]


@dataclass
class EngineMetrics:
    """What one vLLM engine exports under `vllm:*` (counters and histograms; gauges are on the core)."""

    max_model_len: int = 131072
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    request_success_total: int = 0
    prompt_tokens_local_compute: int = 0         # vllm:prompt_tokens_by_source_total{source="local_compute"}
    prompt_tokens_local_cache_hit: int = 0       # ...{source="local_cache_hit"}
    prompt_tokens_external_kv_transfer: int = 0  # ...{source="external_kv_transfer"}
    prefix_cache_queries: int = 0                # vllm:prefix_cache_queries_total: prompt tokens looked up
    prefix_cache_hits: int = 0                   # vllm:prefix_cache_hits_total: of them, found cached
    num_preemptions_total: int = 0
    kv_transfer_failures_total: int = 0          # remote KV gone (lease expired): recomputed locally
    time_to_first_token_seconds: BucketHistogram = field(default_factory=lambda: BucketHistogram(TTFT_BUCKETS))
    inter_token_latency_seconds: BucketHistogram = field(default_factory=lambda: BucketHistogram(ITL_BUCKETS))
    request_time_per_output_token_seconds: BucketHistogram = field(default_factory=lambda: BucketHistogram(ITL_BUCKETS))
    e2e_request_latency_seconds: BucketHistogram = field(
        default_factory=lambda: BucketHistogram(REQUEST_LATENCY_BUCKETS))
    request_queue_time_seconds: BucketHistogram = field(
        default_factory=lambda: BucketHistogram(REQUEST_LATENCY_BUCKETS))
    request_prefill_time_seconds: BucketHistogram = field(
        default_factory=lambda: BucketHistogram(REQUEST_LATENCY_BUCKETS))
    request_decode_time_seconds: BucketHistogram = field(
        default_factory=lambda: BucketHistogram(REQUEST_LATENCY_BUCKETS))
    request_inference_time_seconds: BucketHistogram = field(
        default_factory=lambda: BucketHistogram(REQUEST_LATENCY_BUCKETS))
    request_prompt_tokens: BucketHistogram = field(init=False)
    request_generation_tokens: BucketHistogram = field(init=False)
    request_params_max_tokens: BucketHistogram = field(init=False)
    request_prefill_kv_computed_tokens: BucketHistogram = field(init=False)  # prompt minus KV received
    iteration_tokens_total: BucketHistogram = field(   # per forward pass: prompt tokens computed + tokens generated
        default_factory=lambda: BucketHistogram(ITERATION_TOKENS_BUCKETS))

    def __post_init__(self) -> None:
        for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens",
                     "request_prefill_kv_computed_tokens"):
            setattr(self, name, BucketHistogram(build_1_2_5_buckets(self.max_model_len)))

    def histograms(self) -> dict[str, BucketHistogram]:
        """Every histogram by its `vllm:` name (without the prefix).

        Three follow from the others, so they are made here rather than observed per request:
        every request has n = 1 (`request_params_n` holds one 1 per finished request, and
        `request_max_num_generation_tokens` is `request_generation_tokens`) and none is preempted
        (`request_num_preemptions` holds one 0 per finished request).
        """
        out = {name: value for name, value in self._fields().items() if isinstance(value, BucketHistogram)}
        out["request_max_num_generation_tokens"] = self.request_generation_tokens.copy()
        finished = self.request_success_total
        for name, buckets, value in (("request_params_n", REQUEST_PARAMS_N_BUCKETS, 1.0),
                                     ("request_num_preemptions", REQUEST_NUM_PREEMPTIONS_BUCKETS, 0.0)):
            histogram = BucketHistogram(buckets)
            if finished:
                histogram.observe(value, finished)
            out[name] = histogram
        return out

    def counters(self) -> dict[str, int]:
        """Every counter by name (without the `vllm:` prefix)."""
        return {name: value for name, value in self._fields().items()
                if isinstance(value, int) and name != "max_model_len"}

    def _fields(self) -> dict[str, object]:
        # By the dataclass's fields, not vars(): a class compiled by mypyc has no __dict__.
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class EngineConfig:
    """vLLM engine arguments the scheduling model uses (defaults as vLLM V1's)."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_kv_tokens: int | None = None   # None: the performance model's `max_kv_tokens`
    kv_lease_seconds: float = 30.0     # NIXL `kv_lease_duration`: a producer frees unclaimed KV after it
    max_model_len: int = 131072        # only sizes the token-count histograms
    enable_prefix_caching: bool = True  # vLLM's --enable-prefix-caching (its default)
    block_size: int = 16               # vLLM's --block-size (its default on GPUs)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.block_size < 1:
            raise ValueError("max_num_batched_tokens, max_num_seqs and block_size must be at least 1")
        if self.max_kv_tokens is not None and self.max_kv_tokens < 1:
            raise ValueError("max_kv_tokens must be at least 1")


class Phase(Enum):
    """Where a request is inside one engine."""

    WAITING = "waiting"            # queued for admission
    TRANSFERRING = "transferring"  # admitted, its remote KV is on the way
    READY = "ready"                # remote KV loaded, waiting for a running slot
    PREFILLING = "prefilling"      # running, prompt partly computed
    DECODING = "decoding"          # running, generating
    HELD = "held"                  # finished (do_remote_decode), KV kept for the consumer
    FINISHED = "finished"
    ABORTED = "aborted"            # dropped by abort() (the client went away)


@dataclass(eq=False, slots=True)
class EngineRequest:
    """One request as an engine sees it. The first block is the input; the rest is set by the core.

    `tag` is the driver's own handle (e.g. an index into its request table). Identity, not value,
    is what the core compares.
    """

    request_id: str
    prompt_tokens: int
    max_tokens: int
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_kv_deadline: float = math.inf
    tag: int = -1
    block_keys: BlockKeys | None = None  # keys of its full prompt blocks (prefix caching); None shares nothing
    phase: Phase = Phase.WAITING
    arrival_time: float = math.nan
    scheduled_time: float = math.nan     # first admitted
    first_token_time: float = math.nan
    finish_time: float = math.nan
    computed_tokens: int = 0             # prompt tokens whose KV is present
    generated_tokens: int = 0            # final once finished; while decoding see EngineCore.generated_tokens
    local_prefill: bool = False          # the prompt was computed here
    cached_tokens: int = 0               # prompt tokens found in this engine's prefix cache at admission
    blocks: RequestBlocks | None = None  # its blocks in the engine's pool (prefix caching)
    limit: int = 0                       # tokens this engine generates (1 for do_remote_decode)
    reserved: int = 0                    # KV tokens reserved at admission
    join_step: int = 0                   # decode step index when it joined the batch
    join_generated: int = 0              # tokens it had then
    lease_expiry: float = math.inf


class EventKind(Enum):
    """What a driver is told about."""

    FIRST_TOKEN = "first_token"
    FINISHED = "finished"
    KV_LOADED = "kv_loaded"        # a do_remote_prefill request has its KV: the producer may free it
    KV_RELEASED = "kv_released"    # a held lease ended by expiry (not by release_kv)


class Event(NamedTuple):
    """Something that happened to `request` at `time` (a named tuple: the simulator makes millions)."""

    kind: EventKind
    request: EngineRequest
    time: float


class EngineStep(NamedTuple):
    """What the engine runs next: `num_steps` equal forward passes of `step_seconds` each from `start`.

    `prefill` lists (request, prompt tokens) chunks (only in single steps); `decode` lists the
    requests that produce one token per pass, `joiners` those of them whose first token it is.
    A named tuple, cheap to make (one per step); the core tells steps apart by identity.
    """

    start: float
    num_steps: int
    step_seconds: float
    prefill: tuple[tuple[EngineRequest, int], ...]
    decode: tuple[EngineRequest, ...]
    joiners: tuple[EngineRequest, ...]
    kv_tokens: int

    @property
    def duration(self) -> float:
        """Total time of the step's passes."""
        return self.num_steps * self.step_seconds

    @property
    def end(self) -> float:
        """When the step's last pass finishes."""
        return self.start + self.num_steps * self.step_seconds


class EngineCore:
    """The continuous-batching model of one vLLM engine (see the module docstring for the rules)."""

    def __init__(self, perf: EnginePerf, config: EngineConfig | None = None, *, all_metrics: bool = True,
                 pool: BlockPool | None = None) -> None:
        """`all_metrics=False` observes only what an autoscaler reads (TTFT, ITL, queue time, prompt
        and generation tokens per request, and the counters), leaving the other histograms empty: the
        cluster simulator's choice, as it observes nothing else. `pool`: a block pool this engine
        shares with others (the routing ceiling: one cache across engines), instead of its own."""
        self.perf = perf
        self.config = config or EngineConfig()
        self.capacity = self.config.max_kv_tokens or perf.max_kv_tokens
        self.block_size = self.config.block_size
        self.pool: BlockPool | None = (pool if pool is not None else BlockPool(max(1, self.capacity // self.block_size))
                                       if self.config.enable_prefix_caching else None)
        self.metrics = EngineMetrics(max_model_len=self.config.max_model_len)
        self._all_metrics = all_metrics
        self.busy_seconds = 0.0   # time its steps took (the engine's GPU time at work)
        self._seq = 0
        self._waiting: deque[EngineRequest] = deque()
        self._transferring: list[tuple[float, int, EngineRequest]] = []
        self._ready: deque[EngineRequest] = deque()
        self._prefilling: list[EngineRequest] = []
        self._decoding: dict[EngineRequest, None] = {}
        self._finish_heap: list[tuple[int, int, EngineRequest]] = []
        self._held: dict[str, EngineRequest] = {}
        self._lease_heap: list[tuple[float, int, EngineRequest]] = []
        self._reserved_kv = 0
        self._decode_kv = 0    # prompt + generated tokens of the decoding requests
        self._decode_steps = 0
        self._step: EngineStep | None = None
        self._pending_aborts: list[EngineRequest] = []

    # --- inputs -------------------------------------------------------------------------------

    def add(self, request: EngineRequest, now: float) -> None:
        """Queue a request that arrived at `now`. Raises ValueError if it can never fit the KV cache."""
        if request.prompt_tokens < 1 or request.max_tokens < 1:
            raise ValueError(f"request {request.request_id}: prompt_tokens and max_tokens must be at least 1")
        request.limit = 1 if request.do_remote_decode else request.max_tokens
        if request.prompt_tokens + request.limit > self.capacity:
            raise ValueError(f"request {request.request_id}: {request.prompt_tokens} + {request.limit} tokens "
                             f"can never fit a KV cache of {self.capacity} tokens")
        request.phase = Phase.WAITING
        request.arrival_time = now
        self._waiting.append(request)

    def release_kv(self, request_id: str, now: float) -> bool:
        """The consumer pulled a held request's KV: free it. False if it was not held (expired, unknown)."""
        request = self._held.pop(request_id, None)
        if request is None:
            return False
        self._free(request)
        return True

    def abort(self, request: EngineRequest, now: float) -> bool:
        """Drop a request whose client went away, freeing its KV; False if it already ended here.

        Queued, transferring, ready and held requests leave at once; a running request included in
        the step in flight leaves when that step completes (vLLM applies aborts between steps), and
        it is not reported as finished.
        """
        phase = request.phase
        if phase in (Phase.FINISHED, Phase.ABORTED):
            return False
        if phase is Phase.HELD:
            return self.release_kv(request.request_id, now)
        if phase in (Phase.PREFILLING, Phase.DECODING) and self._step is not None:
            self._pending_aborts.append(request)
            return True
        if phase is Phase.WAITING:
            self._waiting.remove(request)
        elif phase is Phase.READY:
            self._ready.remove(request)
        elif phase is Phase.PREFILLING:
            self._prefilling.remove(request)
        elif phase is Phase.DECODING:
            request.generated_tokens = self.generated_tokens(request)
            self._decode_kv -= request.prompt_tokens + request.generated_tokens
            del self._decoding[request]       # its finish-heap entry is skipped when popped
        self._free(request)                   # TRANSFERRING: its heap entry is skipped by poll()
        request.phase = Phase.ABORTED
        return True

    def poll(self, now: float) -> list[Event]:
        """Apply the time-driven transitions due by `now`: KV transfers done, leases expired."""
        events: list[Event] = []
        transferring = self._transferring
        leases = self._lease_heap
        if not (transferring and transferring[0][0] <= now) and not (leases and leases[0][0] <= now):
            return events
        while transferring and transferring[0][0] <= now:
            done, _, request = heapq.heappop(transferring)
            if request.phase is not Phase.TRANSFERRING:
                continue
            request.phase = Phase.READY
            request.computed_tokens = request.prompt_tokens
            if request.block_keys is not None:
                self._cache_blocks(request, request.prompt_tokens)
            self._ready.append(request)
            events.append(Event(EventKind.KV_LOADED, request, done))
        while leases and leases[0][0] <= now:
            expiry, _, request = heapq.heappop(leases)
            if self._held.get(request.request_id) is request:
                del self._held[request.request_id]
                self._free(request)
                events.append(Event(EventKind.KV_RELEASED, request, expiry))
        return events

    def next_timer(self) -> float | None:
        """The earliest time `poll` has work (a transfer finishing, a lease expiring), or None."""
        leases = self._lease_heap
        held = self._held
        while leases and held.get(leases[0][2].request_id) is not leases[0][2]:
            heapq.heappop(leases)    # released early
        transferring = self._transferring
        if transferring:
            return min(transferring[0][0], leases[0][0]) if leases else transferring[0][0]
        return leases[0][0] if leases else None

    # --- stepping -----------------------------------------------------------------------------

    def next_step(self, now: float, max_decode_steps: int = 1) -> EngineStep | None:
        """Schedule the next step at `now` (admitting requests, starting KV transfers), or None if idle.

        Call `poll(now)` first. Only one step may be in flight. `max_decode_steps > 1` lets a
        decode-only step fuse that many passes (the simulator's speed-up; real-time drivers use 1).
        """
        if self._step is not None:
            raise RuntimeError("a step is already in flight")
        decoding = self._decoding
        if self._prefilling or self._ready or self._waiting:
            chunks, joiners, prefill_seconds = self._schedule_prompts(now)
        elif decoding:
            chunks, joiners, prefill_seconds = [], [], 0.0   # decode only (most steps): nothing to admit
        else:
            return None
        batch = len(decoding)
        if not chunks and not batch:
            return None
        perf = self.perf
        kv_tokens = self._decode_kv
        num_steps = 1
        if not chunks:
            num_steps = max(1, min(max_decode_steps, self._finish_heap[0][0] - self._decode_steps))
            if num_steps > 1 and (self._transferring or self._lease_heap):
                timer = self.next_timer()
                if timer is not None:
                    first = perf.decode_step_seconds(batch, kv_tokens)
                    num_steps = max(1, min(num_steps, math.ceil((timer - now) / first - 1e-9)))
        decode_seconds = perf.decode_step_seconds(batch, kv_tokens + batch * (num_steps - 1) // 2) if batch else 0.0
        step = EngineStep(now, num_steps, prefill_seconds + decode_seconds, tuple(chunks), tuple(decoding),
                          tuple(joiners), kv_tokens)
        self._step = step
        return step

    def _schedule_prompts(self, now: float) -> tuple[list[tuple[EngineRequest, int]], list[EngineRequest], float]:
        """The prompt side of `next_step`: continue partial prefills, let ready requests join the
        batch, admit waiting ones. Returns the prefill chunks, the joiners and the chunks' time."""
        config = self.config
        max_num_seqs = config.max_num_seqs
        decoding = self._decoding
        budget = config.max_num_batched_tokens - len(decoding)
        running = len(decoding) + len(self._prefilling)
        perf = self.perf
        chunks: list[tuple[EngineRequest, int]] = []
        chunk_tokens = 0
        continued_seconds = 0.0
        for request in self._prefilling:
            if budget <= 0:
                break
            chunk = min(request.prompt_tokens - request.computed_tokens, budget)
            offset = request.computed_tokens
            continued_seconds += perf.prefill_seconds(offset + chunk) - perf.prefill_seconds(offset)
            if request.block_keys is not None:
                self._cache_blocks(request, offset + chunk)
            chunks.append((request, chunk))
            chunk_tokens += chunk
            budget -= chunk
        first_tokens = 0
        started = False
        joiners: list[EngineRequest] = []
        ready = self._ready
        while ready and running < max_num_seqs and budget > 0:
            request = ready.popleft()
            self._join(request, 0)
            joiners.append(request)
            running += 1
            budget -= 1
        waiting = self._waiting
        while waiting and running < max_num_seqs:
            request = waiting[0]
            remote = request.do_remote_prefill and now <= request.remote_kv_deadline
            if not remote and budget <= 0:
                break
            need = request.prompt_tokens + request.limit
            if self._reserved_kv + need > self.capacity:
                break
            waiting.popleft()
            self._reserved_kv += need
            request.reserved = need
            request.scheduled_time = now
            hit = self._take_blocks(request) if self.pool is not None else 0
            if remote:
                request.phase = Phase.TRANSFERRING
                self._seq += 1
                heapq.heappush(self._transferring,
                               (now + perf.kv_transfer_seconds(request.prompt_tokens - hit), self._seq, request))
                continue
            if request.do_remote_prefill:
                self.metrics.kv_transfer_failures_total += 1
            request.phase = Phase.PREFILLING
            request.local_prefill = True
            request.computed_tokens = hit
            chunk = min(request.prompt_tokens - hit, budget)
            if hit:   # a prompt continued from its cached prefix: its chunk's marginal cost in context
                continued_seconds += perf.prefill_seconds(hit + chunk) - perf.prefill_seconds(hit)
            else:
                first_tokens += chunk
            started = True
            if request.block_keys is not None:
                self._cache_blocks(request, hit + chunk)
            self._prefilling.append(request)
            chunks.append((request, chunk))
            chunk_tokens += chunk
            budget -= chunk
            running += 1
        prefill_seconds = continued_seconds
        if started:
            prefill_seconds = max(perf.prefill_seconds(chunk_tokens),
                                  perf.prefill_seconds(first_tokens) + continued_seconds)
        return chunks, joiners, prefill_seconds

    def shorten(self, step: EngineStep, now: float) -> EngineStep:
        """Cut a fused decode step at its first pass boundary at or after `now` (something arrived).

        Returns the step now in flight (the same one when it cannot end sooner); complete that one.
        """
        if step is not self._step:
            raise RuntimeError("shorten() of a step that is not in flight")
        if step.num_steps == 1:
            return step
        # Fewer passes have an earlier KV midpoint, so shorter passes: re-time them, and take the
        # first boundary at or after `now` on the new timing.
        batch = len(step.decode)
        num_steps = max(1, math.ceil((now - step.start) / step.step_seconds - 1e-9))
        while num_steps < step.num_steps:
            seconds = self.perf.decode_step_seconds(batch, step.kv_tokens + batch * (num_steps - 1) // 2)
            if step.start + num_steps * seconds >= now:
                break
            num_steps += 1
        if num_steps >= step.num_steps:
            return step
        self._step = EngineStep(start=step.start, num_steps=num_steps, step_seconds=seconds, prefill=step.prefill,
                                decode=step.decode, joiners=step.joiners, kv_tokens=step.kv_tokens)
        return self._step

    def complete(self, step: EngineStep, now: float) -> list[Event]:
        """Apply the step that ran until `now` (normally `step.end`); returns first tokens and finishes.

        Token times inside a fused step are `now - (num_steps - i) * step_seconds` for pass i.
        """
        if step is not self._step:
            raise RuntimeError("complete() of a step that is not in flight")
        self._step = None
        self.busy_seconds += step.duration
        metrics = self.metrics
        events: list[Event] = []
        batch = len(step.decode)
        passes = step.num_steps
        prefill = step.prefill
        # vllm:iteration_tokens_total: prompt tokens computed plus tokens generated, per pass (a prefill
        # that completes generates its first token in its last chunk's pass).
        if self._all_metrics:
            if prefill:
                iteration_tokens = batch
                for request, tokens in prefill:
                    iteration_tokens += tokens + (request.computed_tokens + tokens >= request.prompt_tokens)
                metrics.iteration_tokens_total.observe(iteration_tokens)
            elif batch:
                metrics.iteration_tokens_total.observe(batch, passes)   # decode only: every pass is the batch
        if batch:
            self._decode_steps += passes
            decode_steps = self._decode_steps
            self._decode_kv += batch * passes
            metrics.generation_tokens_total += batch * passes
            joiners = step.joiners
            if joiners:
                first_time = now - (passes - 1) * step.step_seconds
                for request in joiners:
                    self._first_token(request, first_time, events)
            itl_count = batch * passes - len(joiners)
            if itl_count > 0:
                metrics.inter_token_latency_seconds.observe(step.step_seconds, itl_count)
            heap = self._finish_heap
            while heap and heap[0][0] <= decode_steps:
                _, _, request = heapq.heappop(heap)
                if request.phase is not Phase.DECODING:
                    continue
                del self._decoding[request]
                request.generated_tokens = request.limit
                self._decode_kv -= request.prompt_tokens + request.limit
                self._finish(request, now, events)
        if prefill:
            for request, chunk in prefill:
                request.computed_tokens += chunk
                metrics.prompt_tokens_local_compute += chunk
                if request.computed_tokens < request.prompt_tokens:
                    continue
                request.generated_tokens = 1
                metrics.generation_tokens_total += 1
                self._first_token(request, now, events)
                if request.limit == 1:
                    self._finish(request, now, events)
                else:
                    self._join(request, 1)
            self._prefilling = [r for r in self._prefilling if r.computed_tokens < r.prompt_tokens]
        if self._pending_aborts:
            aborts, self._pending_aborts = self._pending_aborts, []
            for request in aborts:
                self.abort(request, now)
        return events

    # --- gauges -------------------------------------------------------------------------------

    @property
    def step_in_flight(self) -> EngineStep | None:
        """The step scheduled and not yet completed."""
        return self._step

    @property
    def num_requests_running(self) -> int:
        """`vllm:num_requests_running`."""
        return len(self._decoding) + len(self._prefilling)

    @property
    def num_requests_waiting(self) -> int:
        """`vllm:num_requests_waiting` (including requests waiting for their remote KV)."""
        return len(self._waiting) + len(self._transferring) + len(self._ready)

    @property
    def num_requests_waiting_deferred(self) -> int:
        """The waiting requests vLLM counts as `reason="deferred"` (here: waiting for their remote KV); the
        others wait for capacity."""
        return len(self._transferring) + len(self._ready)

    @property
    def kv_cache_usage_perc(self) -> float:
        """`vllm:kv_cache_usage_perc`: reserved share of the KV cache, 0-1."""
        return self._reserved_kv / self.capacity

    @property
    def kv_reserved_tokens(self) -> int:
        """KV tokens reserved by admitted and held requests."""
        return self._reserved_kv

    @property
    def num_held(self) -> int:
        """Finished producer requests whose KV is still held for a consumer."""
        return len(self._held)

    @property
    def is_idle(self) -> bool:
        """Nothing queued, running, transferring or held, and no step in flight."""
        return (self._step is None and not self._waiting and not self._transferring and not self._ready
                and not self._prefilling and not self._decoding and not self._held)

    def generated_tokens(self, request: EngineRequest) -> int:
        """Tokens a request has produced so far on this engine."""
        if request.phase is Phase.DECODING:
            return request.join_generated + self._decode_steps - request.join_step
        return request.generated_tokens

    # --- internals ------------------------------------------------------------------------------

    def _join(self, request: EngineRequest, generated: int) -> None:
        request.phase = Phase.DECODING
        request.join_step = self._decode_steps
        request.join_generated = generated
        self._decoding[request] = None
        self._decode_kv += request.prompt_tokens + generated
        self._seq += 1
        heapq.heappush(self._finish_heap, (self._decode_steps + request.limit - generated, self._seq, request))

    def _first_token(self, request: EngineRequest, time: float, events: list[Event]) -> None:
        request.first_token_time = time
        metrics = self.metrics
        metrics.time_to_first_token_seconds.observe(time - request.arrival_time)
        metrics.prompt_tokens_total += request.prompt_tokens
        metrics.prompt_tokens_local_cache_hit += request.cached_tokens
        if not request.local_prefill:
            metrics.prompt_tokens_external_kv_transfer += request.prompt_tokens - request.cached_tokens
        events.append(Event(EventKind.FIRST_TOKEN, request, time))

    def _finish(self, request: EngineRequest, now: float, events: list[Event]) -> None:
        request.finish_time = now
        metrics = self.metrics
        generated = request.limit
        arrival, scheduled, first_token = request.arrival_time, request.scheduled_time, request.first_token_time
        metrics.request_success_total += 1
        metrics.request_queue_time_seconds.observe(scheduled - arrival)
        metrics.request_prompt_tokens.observe(request.prompt_tokens)
        metrics.request_generation_tokens.observe(generated)
        if self._all_metrics:
            decode_time = now - first_token
            metrics.e2e_request_latency_seconds.observe(now - arrival)
            metrics.request_prefill_time_seconds.observe(first_token - scheduled)
            metrics.request_decode_time_seconds.observe(decode_time)
            metrics.request_inference_time_seconds.observe(now - scheduled)
            metrics.request_params_max_tokens.observe(request.max_tokens)
            metrics.request_prefill_kv_computed_tokens.observe(
                request.prompt_tokens - request.cached_tokens if request.local_prefill else 0)
            metrics.request_time_per_output_token_seconds.observe(decode_time / (generated - 1) if generated > 1
                                                                  else 0.0)
        if request.do_remote_decode:
            request.phase = Phase.HELD
            request.lease_expiry = now + self.config.kv_lease_seconds
            self._held[request.request_id] = request
            self._seq += 1
            heapq.heappush(self._lease_heap, (request.lease_expiry, self._seq, request))
        else:
            self._free(request)
        events.append(Event(EventKind.FINISHED, request, now))

    def _free(self, request: EngineRequest) -> None:
        request.phase = Phase.FINISHED
        self._reserved_kv -= request.reserved
        request.reserved = 0
        blocks = request.blocks
        if blocks is not None and self.pool is not None:
            # Its full blocks of generated tokens (the last token has no KV yet) were cached under
            # hashes of its own output: they free into the LRU order, where nothing hits them.
            generated = 0
            if request.block_keys is not None and request.generated_tokens > 0:
                full = (request.prompt_tokens + request.generated_tokens - 1) // self.block_size
                generated = max(0, full - blocks.cached)
            self.pool.free(blocks, generated)
            request.blocks = None

    def _take_blocks(self, request: EngineRequest) -> int:
        """A request's blocks at admission: its longest cached prefix (at most prompt - 1 tokens) and
        new blocks for the rest of its prompt and output. Returns the prompt tokens it hit."""
        pool = self.pool
        assert pool is not None
        block_size = self.block_size
        prompt = request.prompt_tokens
        blocks = pool.admit(request.block_keys, (prompt - 1) // block_size, (prompt + request.limit) // block_size)
        request.blocks = blocks
        hit_tokens = blocks.hit * block_size
        request.cached_tokens = hit_tokens
        metrics = self.metrics
        metrics.prefix_cache_queries += prompt
        metrics.prefix_cache_hits += hit_tokens
        return hit_tokens

    def _cache_blocks(self, request: EngineRequest, tokens: int) -> None:
        """The request's first `tokens` prompt tokens are scheduled or loaded: cache its full blocks."""
        blocks = request.blocks
        keys = request.block_keys
        if blocks is not None and keys is not None and self.pool is not None:
            self.pool.cache(blocks, keys, tokens // self.block_size)
