"""Discrete-event replay of a request trace through a simulated P/D cluster (`xpyd sim`).

The cluster: prefill and decode replicas, each an `EngineCore`; a proxy that routes each request's
prefill leg (`max_tokens=1`, `do_remote_decode`) to a prefill replica and, when it returns, the
decode leg (`do_remote_prefill`, the KV lease as deadline) to a decode replica (NIXL pull). The
decode engine waits out the KV transfer, then tells the proxy, which frees the producer's KV.

Routing (`SimConfig.routing`, the proxy's `routingPolicy`), ties broken by a seeded RNG:
- LeastLoaded (the default): the prefill replica with the fewest outstanding prompt tokens, the
  decode replica with the fewest outstanding requests. PowerOfTwo: the less loaded of two drawn at
  random. RoundRobin: the replicas in turn, in the order they became ready.
- KVAware: prefill to the least `expected compute + kv_weight x (prompt tokens not cached there)`,
  where a replica's expected compute is the prompt tokens it was sent less those expected cached
  when they were sent; decode to the least `outstanding requests - decode_credit x (share of the
  prompt held there)` (held blocks are not transferred). What a replica holds comes from its `index`:
  `Events`, the engine's own cache as its KV events would tell the proxy, without their delivery
  lag; `Routed`, a `kvcache.PrefixIndex` of what was sent there, forgotten `ttl_s` after the last
  request that carried it, capped at `index_blocks` (the proxy's default, whatever the engine's KV
  capacity).
- `shared_cache`: the routing ceiling. The prefill engines share one block pool of their total size
  (`config.prefill` engines' blocks; replicas started later share it without growing it), so a
  prefix cached anywhere hits everywhere: what no router over separate caches can beat.

Time is simulated: an event heap of step ends, engine timers, replica start-ups and policy ticks,
merged with the trace's open-loop arrivals; nothing sleeps. Every `interval_s` the policy sees an
`Observation` and returns desired sizes. Scaling up starts replicas that serve after
`startup_delay_s` (the initial replicas are ready at 0); scaling down first cancels starting
replicas, then drains ready ones (out of routing, they finish what they hold, KV leases included).
A replica uses its GPUs from its start until it has drained. The run ends when every request has
finished.

Scaling to zero (`SimConfig.min_replicas` 0): the policy may leave a role with no replica, and the
proxy's waiting room holds every request that arrives while the pool has no routable prefill and
decode pair (`SimResult.held`), sending them on as soon as it has one; a request held beyond
`wait_timeout_s`, or arriving at a room of `wait_max_requests`, is dropped (`SimResult.dropped`:
`expired`, `overflow`; NaN latencies). The demand signal (`signal_delay_s`): a request held while
no policy call is due within that delay brings one forward to then, outside the interval's
schedule, as the proxies' pod condition brings the operator's decision forward; the observation
carries what is held (`Observation.held_requests`).

Per request: TTFT is arrival to the decode engine's first token (prefill queue, prefill, proxy hop,
decode admission, KV transfer, first decode step); TPOT is (e2e - TTFT) / (OSL - 1), 0 for OSL 1.

Prefix caching (`SimConfig.engine.enable_prefix_caching`, on by default): a request with prefix
blocks (Mooncake's `hash_ids`) gets the keys of its full blocks at the engines' block size from
`kvcache.chains.TraceKeys` (made for the whole trace as the replay starts), and both its legs carry
them: the prefill engine
computes only what its cache lacks, the decode engine loads only what its own cache lacks. Requests
without prefix blocks (the Azure traces) share nothing. Per request and role the result keeps the
prompt tokens found cached and those computed there.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from xpyd.api.naming import DECODE, PREFILL, ROLES
from xpyd.autoscaler.observation import Desired, Observation, Quantiles, RoleObservation, Slo, hit_rate
from xpyd.common.bunching import BUCKETS as ARRIVAL_BUCKETS
from xpyd.common.bunching import WINDOWS_S as ARRIVAL_WINDOWS_S
from xpyd.common.bunching import ArrivalSlots
from xpyd.kvcache.chains import TraceKeys
from xpyd.kvcache.index import PrefixIndex
from xpyd.kvcache.pool import BlockKeys, BlockPool
from xpyd.kvcache.scoring import decode_cost, hit_limit, least, least_loaded, prefill_cost
from xpyd.sim.core import (
    ITL_BUCKETS,
    TTFT_BUCKETS,
    BucketHistogram,
    EngineConfig,
    EngineCore,
    EnginePerf,
    EngineRequest,
    Event,
    EventKind,
)
from xpyd.sim.policy import Policy, ReactingPolicy, StaticPolicy
from xpyd.traces import TraceRequest

# The proxy's routing policies (`spec.proxy.routingPolicy`; the API's names) and, for KVAware, where
# its view of the engines' caches comes from (`spec.proxy.kvAware.index`).
LEAST_LOADED, POWER_OF_TWO, ROUND_ROBIN, KV_AWARE = "LeastLoaded", "PowerOfTwo", "RoundRobin", "KVAware"
ROUTING_POLICIES = (LEAST_LOADED, POWER_OF_TWO, ROUND_ROBIN, KV_AWARE)
EVENTS, ROUTED = "Events", "Routed"
KV_INDEXES = (EVENTS, ROUTED)


@dataclass(frozen=True)
class Routing:
    """How the simulated proxy picks instances (see the module docstring)."""

    policy: str = LEAST_LOADED
    index: str = EVENTS              # KVAware: the engines' caches (Events) or what was routed where (Routed)
    kv_weight: float = 1.0           # KVAware prefill: load + kv_weight x prompt tokens not cached there
    decode_credit: float = 1.0       # KVAware decode: outstanding requests - credit x share of the prompt held
    ttl_s: float = 600.0             # Routed: a run is forgotten this long after the last request with it
    index_blocks: int = 131072       # Routed: blocks indexed per engine (the API's kvAware.indexBlocks default)
    shared_cache: bool = False       # the ceiling: the prefill engines share one cache of their total size

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy {self.policy!r}: not one of {', '.join(ROUTING_POLICIES)}")
        if self.index not in KV_INDEXES:
            raise ValueError(f"KV index {self.index!r}: not one of {', '.join(KV_INDEXES)}")
        if not (self.kv_weight >= 0 and self.decode_credit >= 0 and self.ttl_s > 0 and self.index_blocks >= 1):
            raise ValueError("kv_weight and decode_credit must not be negative, ttl_s must be positive and "
                             "index_blocks at least 1")


@dataclass(frozen=True)
class SimConfig:
    """How the simulated cluster is set up."""

    prefill: int = 1
    decode: int = 1
    slo: Slo = field(default_factory=Slo)
    startup_delay_s: float = 120.0
    interval_s: float = 30.0
    window_s: float = 60.0
    seed: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)
    gpus_per_replica: int = 1
    max_decode_steps: int = 1 << 30   # fused decode passes per step (1: pass by pass; same results, slower)
    routing: Routing = field(default_factory=Routing)
    min_replicas: int = 1             # the fewest replicas a policy leaves a role (0: the pool scales to zero)
    wait_timeout_s: float = math.inf  # min_replicas 0: how long the waiting room holds a request
    wait_max_requests: int = 1 << 30  # min_replicas 0: the most requests it holds
    signal_delay_s: float | None = None  # min_replicas 0: a held request calls the policy this soon (None: ticks only)

    def __post_init__(self) -> None:
        if self.min_replicas not in (0, 1):
            raise ValueError("min_replicas must be 0 (scale to zero) or 1")
        if self.prefill < self.min_replicas or self.decode < self.min_replicas:
            raise ValueError(f"--prefill and --decode must be at least {self.min_replicas}")
        if not (self.wait_timeout_s > 0 and self.wait_max_requests >= 1
                and (self.signal_delay_s is None or self.signal_delay_s >= 0)):
            raise ValueError("wait_timeout_s must be positive, wait_max_requests at least 1, signal_delay_s not "
                             "negative")
        for name in ("startup_delay_s", "window_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must not be negative")
        if not self.interval_s > 0:
            raise ValueError("interval_s must be positive")
        if self.gpus_per_replica < 1 or self.max_decode_steps < 1:
            raise ValueError("gpus_per_replica and max_decode_steps must be at least 1")


@dataclass(frozen=True)
class ReplicaSample:
    """Replica counts per role from `time_s` on."""

    time_s: float
    prefill_ready: int
    prefill_starting: int
    prefill_draining: int
    decode_ready: int
    decode_starting: int
    decode_draining: int


@dataclass(frozen=True)
class PolicyCall:
    """One policy call: when, what it saw of the sizes, what it asked for."""

    time_s: float
    prefill_before: int
    decode_before: int
    prefill: int
    decode: int


@dataclass
class SimResult:
    """Everything a report needs: per-request latencies, replica history, decisions, GPU time."""

    config: SimConfig
    policy: str
    arrival_s: list[float]
    isl: list[int]
    osl: list[int]
    ttft_s: list[float]            # NaN for rejected requests
    e2e_s: list[float]
    rejected: int                  # requests that can never fit an engine's KV cache
    end_s: float                   # when the last request finished
    gpu_seconds: dict[str, float]  # per role
    busy_seconds: dict[str, float]  # per role: GPU time of the engines' steps (at work, not idle)
    cached_tokens: dict[str, list[int]]    # per role, per request: prompt tokens its leg found cached (-1: no leg)
    computed_tokens: dict[str, list[int]]  # per role, per request: prompt tokens its leg computed there
    replicas: list[ReplicaSample]
    decisions: list[PolicyCall]
    scaling_actions: int           # policy decisions that changed a role's size (per role)
    replicas_started: int
    replicas_stopped: int
    events: int                    # discrete events processed
    held: list[bool] = field(default_factory=list)           # per request: arrived with no ready pair (at zero)
    dropped: dict[str, int] = field(default_factory=dict)    # held requests dropped: overflow, expired

    def tpot_s(self) -> list[float]:
        """Per-request time per output token: (e2e - TTFT) / (OSL - 1), 0 for one-token outputs."""
        return [(e - t) / (o - 1) if o > 1 else (math.nan if math.isnan(e) else 0.0)
                for t, e, o in zip(self.ttft_s, self.e2e_s, self.osl, strict=True)]

    def meets(self, slo: Slo) -> tuple[list[bool], list[bool]]:
        """Per request, whether it met the TTFT SLO, and whether it met both (rejected requests,
        with NaN latencies, meet neither)."""
        fast = [t <= slo.ttft_s for t in self.ttft_s]
        return fast, [ok and p <= slo.tpot_s for ok, p in zip(fast, self.tpot_s(), strict=True)]


ProgressCallback = Callable[[int, int, float], None]

_STEP, _TIMER, _READY, _TICK, _EXPIRE, _SIGNAL, _REACT = 0, 1, 2, 3, 4, 5, 6
_FIRST_TOKEN, _FINISHED, _KV_LOADED = EventKind.FIRST_TOKEN, EventKind.FINISHED, EventKind.KV_LOADED

# The vllm:* series `observe()` reads (the autoscaler's queries): only these are summed per tick.
_WINDOW_HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_queue_time_seconds",
                      "request_prompt_tokens", "request_generation_tokens")
_WINDOW_COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "request_success_total",
                    "prefix_cache_queries", "prefix_cache_hits")


class _Replica:
    __slots__ = ("core", "created_s", "draining", "index", "name", "outstanding_computed", "outstanding_requests",
                 "outstanding_tokens", "ready", "role", "step_end", "step_token", "stopped_s", "timer_s")

    def __init__(self, name: str, role: str, core: EngineCore, created_s: float, ready: bool) -> None:
        self.name = name
        self.role = role
        self.core = core
        self.created_s = created_s
        self.stopped_s = math.nan
        self.ready = ready
        self.draining = False
        self.step_token = 0
        self.step_end = math.inf
        self.timer_s = math.inf
        self.outstanding_requests = 0
        self.outstanding_tokens = 0
        self.outstanding_computed = 0    # prompt tokens KVAware expects it to compute (not found cached)
        self.index: PrefixIndex | None = None   # KVAware with the Routed index: what was routed there


@dataclass
class _RoleMetrics:
    """Cumulative vllm:* series of a role (all its engines, also stopped ones) at one tick: those `observe()`
    reads."""

    histograms: dict[str, BucketHistogram]
    counters: dict[str, int]


class Simulator:
    """One replay: build it, `run()` it once."""

    def __init__(self, trace: Sequence[TraceRequest], perf: EnginePerf, policy: Policy, config: SimConfig,
                 policy_name: str = "custom", progress: ProgressCallback | None = None) -> None:
        if not trace:
            raise ValueError("the trace has no requests")
        self.trace = trace
        self.perf = perf
        self.policy = policy
        self._reacting: ReactingPolicy | None = None
        self._react_s = 0.0
        self._called_s = -math.inf     # the last policy call: a look comes react_s after it, as the operator's
        if isinstance(policy, ReactingPolicy) and policy.react_s is not None:
            self._reacting, self._react_s = policy, policy.react_s
        self.policy_name = policy_name
        self.config = config
        self.progress = progress
        self._rng = random.Random(config.seed)
        self._heap: list[tuple[float, int, int, _Replica | None, int]] = []
        self._seq = 0
        self._replicas: dict[str, list[_Replica]] = {PREFILL: [], DECODE: []}
        self._routable: dict[str, list[_Replica]] = {PREFILL: [], DECODE: []}
        self._proxy_queue: dict[str, deque[int]] = {PREFILL: deque(), DECODE: deque()}
        n = len(trace)
        self._ttft = [math.nan] * n
        self._e2e = [math.nan] * n
        self._prefill_of: list[_Replica | None] = [None] * n
        self._expected = [0] * n     # prompt tokens the prefill instance was expected to compute (routing)
        self._turns = {PREFILL: 0, DECODE: 0}
        self._keys = (TraceKeys([r.prefix_blocks for r in trace], [r.isl for r in trace], config.engine.block_size)
                      if config.engine.enable_prefix_caching and any(r.prefix_blocks for r in trace) else None)
        self._cached: dict[str, list[int]] = {PREFILL: [-1] * n, DECODE: [-1] * n}
        self._computed: dict[str, list[int]] = {PREFILL: [0] * n, DECODE: [0] * n}
        self._lease_deadline = [math.inf] * n
        self._done = 0
        self._rejected = 0
        self._samples: list[ReplicaSample] = []
        self._decisions: list[PolicyCall] = []
        self._scaling_actions = 0
        self._started = 0
        self._stopped = 0
        self._arrived = 0
        self._client_ttft = BucketHistogram(TTFT_BUCKETS)
        self._client_tpot = BucketHistogram(ITL_BUCKETS)
        # The proxy's arrival histograms (`common.bunching`): one per slot length, fed at arrival.
        self._arrival_histograms = {window: BucketHistogram(ARRIVAL_BUCKETS) for window in ARRIVAL_WINDOWS_S}
        self._arrival_slots = ArrivalSlots(self._observe_slot, ARRIVAL_WINDOWS_S)
        self._holding = config.min_replicas == 0
        self._waiting: dict[int, None] = {}      # held requests, in arrival order
        self._waiting_tokens = 0
        self._held = [False] * n
        self._dropped = {"overflow": 0, "expired": 0}
        self._signal_pending = False
        self._history: deque[tuple[float, int, dict[str, _RoleMetrics], BucketHistogram, BucketHistogram,
                                   dict[float, BucketHistogram]]] = deque()
        probe = EngineCore(perf, config.engine)
        self._capacity = probe.capacity
        routing = config.routing
        self._shared_pool = (BlockPool(config.prefill * probe.pool.num_blocks)
                             if routing.shared_cache and probe.pool is not None else None)

    def engines(self, role: str) -> list[EngineCore]:
        """Every engine the role has had (started, draining or stopped), oldest first. Their metrics
        hold only what `observe()` reads (`EngineCore(all_metrics=False)`)."""
        return [replica.core for replica in self._replicas[role]]

    # --- the run ----------------------------------------------------------------------------------

    def run(self) -> SimResult:
        """Replay the whole trace; returns the per-request latencies and the cluster's history."""
        config = self.config
        for role, count in ((PREFILL, config.prefill), (DECODE, config.decode)):
            for _ in range(count):
                self._start_replica(role, 0.0, ready=True)
        self._sample(0.0)
        self._snapshot(0.0)
        self._push(config.interval_s, _TICK, None, 0)
        if self._reacting is not None:
            self._push(self._react_s, _REACT, None, 0)
        trace = self.trace
        total = len(trace)
        heap = self._heap
        progress = self.progress
        progress_every = max(1, total // 200)
        events = 0
        index = 0
        now = 0.0
        next_arrival = trace[0].arrival_s
        while self._done < total:
            events += 1
            if heap and heap[0][0] <= next_arrival:
                now, _, kind, replica, token = heapq.heappop(heap)
                if kind == _STEP:
                    assert replica is not None
                    if token == replica.step_token:
                        self._on_step_end(replica, now)
                elif kind == _TIMER:
                    assert replica is not None
                    if now >= replica.timer_s:
                        replica.timer_s = math.inf
                    if math.isnan(replica.stopped_s):
                        self._kick(replica, now, arrived=False)
                elif kind == _READY:
                    assert replica is not None
                    self._on_ready(replica, now)
                elif kind == _TICK:
                    self._on_tick(now)
                elif kind == _EXPIRE:
                    self._on_expire(token, now)
                elif kind == _REACT:
                    self._on_react(now)
                else:
                    self._signal_pending = False
                    self._call_policy(now)
            else:
                now = next_arrival
                self._on_arrival(index, now)
                index += 1
                self._arrived = index
                next_arrival = trace[index].arrival_s if index < total else math.inf
                if progress is not None and (index % progress_every == 0 or index == total):
                    progress(index, total, now)
        end_s = now
        self._sample(end_s)
        gpu_seconds: dict[str, float] = {role: 0.0 for role in ROLES}
        busy_seconds: dict[str, float] = {role: 0.0 for role in ROLES}
        for role, replicas in self._replicas.items():
            for replica in replicas:
                stop = end_s if math.isnan(replica.stopped_s) else replica.stopped_s
                gpu_seconds[role] += (stop - replica.created_s) * config.gpus_per_replica
                busy_seconds[role] += replica.core.busy_seconds * config.gpus_per_replica
        return SimResult(
            config=config, policy=self.policy_name, arrival_s=[r.arrival_s for r in trace],
            isl=[r.isl for r in trace], osl=[r.osl for r in trace], ttft_s=self._ttft, e2e_s=self._e2e,
            rejected=self._rejected, end_s=end_s, gpu_seconds=gpu_seconds, busy_seconds=busy_seconds,
            cached_tokens=self._cached, computed_tokens=self._computed, replicas=self._samples,
            decisions=self._decisions, scaling_actions=self._scaling_actions, replicas_started=self._started,
            replicas_stopped=self._stopped, events=events, held=self._held, dropped=dict(self._dropped))

    # --- request flow -------------------------------------------------------------------------

    def _observe_slot(self, window_s: float, tokens: float, requests: int) -> None:
        self._arrival_histograms[window_s].observe(tokens, requests)

    def _on_arrival(self, index: int, now: float) -> None:
        request = self.trace[index]
        self._arrival_slots.add(now, float(request.isl))   # every request the proxy is offered
        if request.isl + request.osl > self._capacity:
            self._rejected += 1
            self._done += 1
            return
        if self._holding and not (self._routable[PREFILL] and self._routable[DECODE]):
            self._hold(index, now)
            return
        replica = self._route(PREFILL, index, now)
        if replica is None:
            self._proxy_queue[PREFILL].append(index)
        else:
            self._send_prefill(index, replica, now)

    def _hold(self, index: int, now: float) -> None:
        """The waiting room: hold a request that found no pair, or drop it when the room is full;
        a held request calls the policy within `signal_delay_s` (the demand signal)."""
        config = self.config
        self._held[index] = True
        if len(self._waiting) >= config.wait_max_requests:
            self._dropped["overflow"] += 1
            self._done += 1
            return
        self._waiting[index] = None
        self._waiting_tokens += self.trace[index].isl
        if math.isfinite(config.wait_timeout_s):
            self._push(now + config.wait_timeout_s, _EXPIRE, None, index)
        if config.signal_delay_s is not None and not self._signal_pending:
            self._signal_pending = True
            self._push(now + config.signal_delay_s, _SIGNAL, None, 0)

    def _on_expire(self, index: int, now: float) -> None:
        if index in self._waiting:
            del self._waiting[index]
            self._waiting_tokens -= self.trace[index].isl
            self._dropped["expired"] += 1
            self._done += 1

    def _release(self, now: float) -> None:
        """A pair is routable: every held request goes on, in arrival order."""
        held = list(self._waiting)
        self._waiting.clear()
        self._waiting_tokens = 0
        for index in held:
            target = self._route(PREFILL, index, now)
            assert target is not None
            self._send_prefill(index, target, now)

    def _send_prefill(self, index: int, replica: _Replica, now: float) -> None:
        request = self.trace[index]
        isl = request.isl
        replica.outstanding_tokens += isl
        replica.outstanding_requests += 1
        replica.outstanding_computed += self._expected[index]
        self._prefill_of[index] = replica
        keys = self._keys.keys(index) if self._keys is not None else None
        replica.core.add(EngineRequest(str(index), isl, 1, do_remote_decode=True, tag=index, block_keys=keys), now)
        self._kick(replica, now, arrived=True)

    def _send_decode(self, index: int, replica: _Replica, now: float) -> None:
        request = self.trace[index]
        replica.outstanding_requests += 1
        replica.outstanding_tokens += request.isl
        replica.core.add(EngineRequest(str(index), request.isl, request.osl, do_remote_prefill=True,
                                       remote_kv_deadline=self._lease_deadline[index], tag=index,
                                       block_keys=self._keys.keys(index) if self._keys is not None else None), now)
        self._kick(replica, now, arrived=True)

    def _route(self, role: str, index: int, now: float) -> _Replica | None:
        """The instance of `role` for request `index`'s leg, as `config.routing` picks it, or None when
        the role has none ready. Sets the prompt tokens the prefill instance is expected to compute."""
        candidates = self._routable[role]
        if not candidates:
            return None
        routing = self.config.routing
        policy = routing.policy
        keys = self._keys.keys(index) if self._keys is not None else None
        if role == PREFILL:
            self._expected[index] = self.trace[index].isl
        if policy == KV_AWARE:
            best = self._route_kv(role, index, candidates, keys, now)
            if best.index is not None and keys is not None:
                best.index.record(keys, now)
            return best
        if policy == ROUND_ROBIN:
            # In the order the replicas became ready; the proxy's (`proxy.picking.pick`) is by name, as its
            # discovery lists instances in no stable order. A simulated replica has no name to sort by.
            turn = self._turns[role]
            self._turns[role] = turn + 1
            return candidates[turn % len(candidates)]
        by_tokens = role == PREFILL
        loads = [replica.outstanding_tokens if by_tokens else replica.outstanding_requests for replica in candidates]
        return candidates[least_loaded(loads, self._rng, power_of_two=policy == POWER_OF_TWO)]  # the proxy's pick

    def _route_kv(self, role: str, index: int, candidates: list[_Replica], keys: BlockKeys | None,
                  now: float) -> _Replica:
        """KVAware, scored as the proxy scores it (`kvcache.scoring`): prefill to the least expected
        compute after this prompt, decode to the fewest outstanding requests less a credit for the
        share of the prompt it holds; seeded random ties (`scoring.least`)."""
        routing = self.config.routing
        isl = self.trace[index].isl
        block_size = self.config.engine.block_size
        limit = hit_limit(isl, block_size)
        hits: list[int] = []
        costs: list[float] = []
        for replica in candidates:
            hit = 0
            if keys is not None:
                if replica.index is not None:
                    hit = replica.index.match(keys, now, limit) * block_size
                elif replica.core.pool is not None:
                    hit = replica.core.pool.lookup(keys, limit) * block_size
            hits.append(hit)
            costs.append(prefill_cost(replica.outstanding_computed, isl, hit, routing.kv_weight) if role == PREFILL
                         else decode_cost(replica.outstanding_requests, isl, hit, routing.decode_credit))
        chosen = least(costs, self._rng)
        if role == PREFILL:
            self._expected[index] = isl - hits[chosen]   # a lone instance too: it is charged what it computes
        return candidates[chosen]

    def _handle(self, replica: _Replica, events: list[Event]) -> None:
        trace = self.trace
        if replica.role == PREFILL:
            for kind, engine_request, time in events:
                if kind is _FINISHED:
                    index = engine_request.tag
                    isl = trace[index].isl
                    replica.outstanding_tokens -= isl
                    replica.outstanding_requests -= 1
                    replica.outstanding_computed -= self._expected[index]
                    self._cached[PREFILL][index] = engine_request.cached_tokens
                    self._computed[PREFILL][index] = isl - engine_request.cached_tokens
                    self._lease_deadline[index] = engine_request.lease_expiry
                    target = self._route(DECODE, index, time)
                    if target is None:
                        self._proxy_queue[DECODE].append(index)
                    else:
                        self._send_decode(index, target, time)
            return
        for kind, engine_request, time in events:
            index = engine_request.tag
            if kind is _KV_LOADED:
                producer = self._prefill_of[index]
                assert producer is not None
                if producer.core.release_kv(engine_request.request_id, time):
                    self._kick(producer, time, arrived=False)
            elif kind is _FIRST_TOKEN:
                ttft = time - trace[index].arrival_s
                self._ttft[index] = ttft
                self._client_ttft.observe(ttft)
                cached = engine_request.cached_tokens
                self._cached[DECODE][index] = cached
                if engine_request.local_prefill:
                    self._computed[DECODE][index] = trace[index].isl - cached
            elif kind is _FINISHED:
                request = trace[index]
                e2e = time - request.arrival_s
                self._e2e[index] = e2e
                if request.osl > 1:
                    self._client_tpot.observe((e2e - self._ttft[index]) / (request.osl - 1))
                replica.outstanding_requests -= 1
                replica.outstanding_tokens -= request.isl
                self._done += 1

    # --- engines ----------------------------------------------------------------------------------

    def _kick(self, replica: _Replica, now: float, arrived: bool) -> None:
        """Let an engine move on at `now`: poll its timers, start its next step, or cut a fused one."""
        core = replica.core
        step = core.step_in_flight
        if step is not None:
            if arrived and step.num_steps > 1:
                step = core.shorten(step, now)
                if step.end < replica.step_end:
                    self._push_step(replica, step.end)
            return
        events = core.poll(now)
        if events:
            self._handle(replica, events)
            if core.step_in_flight is not None:   # handling re-entered this engine
                return
        step = core.next_step(now, self.config.max_decode_steps)
        if step is not None:
            self._push_step(replica, step.end)
            return
        timer = core.next_timer()
        if timer is not None and timer < replica.timer_s:
            replica.timer_s = timer
            self._push(timer, _TIMER, replica, 0)
        if replica.draining and core.is_idle:
            self._stop(replica, now)

    def _on_step_end(self, replica: _Replica, now: float) -> None:
        core = replica.core
        step = core.step_in_flight
        assert step is not None
        replica.step_end = math.inf
        events = core.complete(step, now)
        if events:
            self._handle(replica, events)
        self._kick(replica, now, arrived=False)

    def _push_step(self, replica: _Replica, end: float) -> None:
        replica.step_token += 1
        replica.step_end = end
        self._seq += 1
        heapq.heappush(self._heap, (end, self._seq, _STEP, replica, replica.step_token))

    def _push(self, time: float, kind: int, replica: _Replica | None, token: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, kind, replica, token))

    # --- replicas ---------------------------------------------------------------------------------

    def _start_replica(self, role: str, now: float, ready: bool) -> None:
        replicas = self._replicas[role]
        shared = self._shared_pool if role == PREFILL else None
        core = EngineCore(self.perf, self.config.engine, all_metrics=False, pool=shared)   # observe() reads no more
        replica = _Replica(f"{role}-{len(replicas)}", role, core, now, ready)
        routing = self.config.routing
        if routing.policy == KV_AWARE and routing.index == ROUTED and core.pool is not None:
            replica.index = PrefixIndex(routing.index_blocks, routing.ttl_s)
        replicas.append(replica)
        if ready:
            self._routable[role].append(replica)
        else:
            self._started += 1
            self._push(now + self.config.startup_delay_s, _READY, replica, 0)

    def _on_ready(self, replica: _Replica, now: float) -> None:
        if not math.isnan(replica.stopped_s):
            return
        replica.ready = True
        self._routable[replica.role].append(replica)
        self._sample(now)
        queue = self._proxy_queue[replica.role]
        while queue:
            index = queue.popleft()
            target = self._route(replica.role, index, now)
            assert target is not None
            if replica.role == PREFILL:
                self._send_prefill(index, target, now)
            else:
                self._send_decode(index, target, now)
        if self._waiting and self._routable[PREFILL] and self._routable[DECODE]:
            self._release(now)

    def _stop(self, replica: _Replica, now: float) -> None:
        replica.stopped_s = now
        self._stopped += 1
        self._sample(now)

    def _scale(self, role: str, desired: int, now: float) -> None:
        live = [r for r in self._replicas[role] if not r.draining and math.isnan(r.stopped_s)]
        for _ in range(desired - len(live)):
            self._start_replica(role, now, ready=False)
        excess = len(live) - desired
        if excess <= 0:
            return
        # Cancel the newest starting replicas first, then drain the ready ones with the least work.
        starting = [r for r in reversed(live) if not r.ready]
        ready = sorted((r for r in live if r.ready), key=lambda r: (r.outstanding_requests, -live.index(r)))
        for replica in (starting + ready)[:excess]:
            replica.draining = True
            if replica.ready:
                self._routable[role].remove(replica)
                if replica.core.step_in_flight is None and replica.core.is_idle:
                    self._stop(replica, now)
            else:
                self._stop(replica, now)

    # --- the policy loop ----------------------------------------------------------------------------

    def _on_tick(self, now: float) -> None:
        self._call_policy(now)
        self._push(now + self.config.interval_s, _TICK, None, 0)

    def _on_react(self, now: float) -> None:
        reacting = self._reacting
        assert reacting is not None
        self._push(now + self._react_s, _REACT, None, 0)
        if now - self._called_s < self._react_s - 1e-9:
            return     # as the operator: no look within react_s of a decision (it just saw the pool)
        observation = self.gauges(now)
        desired = reacting.react(observation)
        if desired is not None:
            self._apply(now, observation, desired)

    def _call_policy(self, now: float) -> None:
        """One policy call at `now` (a tick, or the demand signal's) and its scaling."""
        self._snapshot(now)
        self._called_s = now
        observation = self.observe(now)
        self._apply(now, observation, self.policy.desired_sizes(observation))

    def _apply(self, now: float, observation: Observation, desired: Desired) -> None:
        """Scale each role to what a policy call asked for (at least `min_replicas`), recorded."""
        least = self.config.min_replicas
        wanted = {PREFILL: max(least, int(desired.prefill)), DECODE: max(least, int(desired.decode))}
        before = {PREFILL: observation.prefill.replicas, DECODE: observation.decode.replicas}
        self._decisions.append(PolicyCall(now, before[PREFILL], before[DECODE], wanted[PREFILL], wanted[DECODE]))
        changed = False
        for role in ROLES:
            if wanted[role] != before[role]:
                self._scaling_actions += 1
                self._scale(role, wanted[role], now)
                changed = True
        if changed:
            self._sample(now)

    def _snapshot(self, now: float) -> None:
        roles: dict[str, _RoleMetrics] = {}
        for role, replicas in self._replicas.items():
            histograms: dict[str, BucketHistogram] = {}
            counters: dict[str, int] = {}
            for replica in replicas:
                metrics = replica.core.metrics
                for name in _WINDOW_HISTOGRAMS:
                    histogram: BucketHistogram = getattr(metrics, name)
                    if name in histograms:
                        histograms[name].add(histogram)
                    else:
                        histograms[name] = histogram.copy()
                for name in _WINDOW_COUNTERS:
                    counters[name] = counters.get(name, 0) + getattr(metrics, name)
            roles[role] = _RoleMetrics(histograms, counters)
        history = self._history
        self._arrival_slots.flush(now)   # as the proxy does before a scrape
        arrivals = {window: histogram.copy() for window, histogram in self._arrival_histograms.items()}
        history.append((now, self._arrived, roles, self._client_ttft.copy(), self._client_tpot.copy(), arrivals))
        # Keep one snapshot at or before the window's start.
        while len(history) > 1 and history[1][0] <= now - self.config.window_s:
            history.popleft()

    def observe(self, now: float) -> Observation:
        """What an autoscaler reading Prometheus (and the Kubernetes API) would see at `now`.

        Window quantities are the increments between the latest snapshot and the one at or before
        `now - window_s` (the run's start at first). Call after a snapshot at `now`.
        """
        history = self._history
        t1, arrived1, roles1, ttft1, tpot1, arrivals1 = history[-1]
        t0, arrived0, roles0, ttft0, tpot0, arrivals0 = history[0]
        span = t1 - t0
        def rate(value: float) -> float:
            return value / span if span > 0 else 0.0

        def quantiles(histogram: BucketHistogram) -> Quantiles:
            return Quantiles(histogram.quantile(0.5), histogram.quantile(0.9), histogram.quantile(0.99),
                             histogram.sum / histogram.count if histogram.count > 0 else math.nan)

        def window(role: str) -> tuple[dict[str, BucketHistogram], dict[str, int]]:
            now_metrics, then = roles1[role], roles0[role]
            hists = {name: h.minus(then.histograms[name]) if name in then.histograms else h
                     for name, h in now_metrics.histograms.items()}
            for name in _WINDOW_HISTOGRAMS:  # a role that never had a replica (a pool that starts at zero)
                hists.setdefault(name, BucketHistogram(TTFT_BUCKETS))
            counts = {name: v - then.counters.get(name, 0) for name, v in now_metrics.counters.items()}
            return hists, counts

        def role_observation(role: str) -> RoleObservation:
            hists, counts = window(role)
            return replace(
                self._role_gauges(role),
                time_to_first_token_seconds=quantiles(hists["time_to_first_token_seconds"]),
                inter_token_latency_seconds=quantiles(hists["inter_token_latency_seconds"]),
                request_queue_time_seconds=quantiles(hists["request_queue_time_seconds"]),
                prompt_tokens_per_s=rate(counts.get("prompt_tokens_total", 0)),
                generation_tokens_per_s=rate(counts.get("generation_tokens_total", 0)),
                requests_per_s=rate(counts.get("request_success_total", 0)),
                prefix_cache_hit_rate=hit_rate(counts.get("prefix_cache_hits", 0),
                                               counts.get("prefix_cache_queries", 0)),
            )

        def cumulative(histogram: BucketHistogram) -> tuple[tuple[float, float], ...]:
            # As Prometheus exposes the buckets (le, cumulative count), +Inf last.
            return tuple(zip((*histogram.buckets, math.inf), map(float, histogram.cumulative()), strict=True))

        client_ttft, client_tpot = ttft1.minus(ttft0), tpot1.minus(tpot0)
        prefill_hists, _ = window(PREFILL)
        decode_hists, _ = window(DECODE)
        prompts = prefill_hists["request_prompt_tokens"]
        outputs = decode_hists["request_generation_tokens"]
        return Observation(
            time_s=now, window_s=span, request_rate=rate(arrived1 - arrived0),
            isl_mean=prompts.sum / prompts.count if prompts.count else math.nan,
            osl_mean=outputs.sum / outputs.count if outputs.count else math.nan,
            isl_quantiles=quantiles(prompts),
            ttft_seconds=quantiles(client_ttft), tpot_seconds=quantiles(client_tpot),
            prefill=role_observation(PREFILL), decode=role_observation(DECODE),
            held_requests=float(len(self._waiting)), held_prompt_tokens=float(self._waiting_tokens),
            ttft_buckets=cumulative(client_ttft), tpot_buckets=cumulative(client_tpot),
            arrival_prompt_tokens=tuple((window, quantiles(arrivals1[window].minus(arrivals0[window])))
                                        for window in ARRIVAL_WINDOWS_S))

    def gauges(self, now: float) -> Observation:
        """What the engines' gauges and the replica counts show at `now`, nothing of a window: what
        a policy's `react` reads between its decisions."""
        return Observation(time_s=now, window_s=0.0, prefill=self._role_gauges(PREFILL),
                           decode=self._role_gauges(DECODE), held_requests=float(len(self._waiting)),
                           held_prompt_tokens=float(self._waiting_tokens))

    def _role_gauges(self, role: str) -> RoleObservation:
        """A role's replica counts and its scraped engines' gauges (summed; the fullest engine's waiting
        requests; KV usage mean and max)."""
        replicas = self._replicas[role]
        scraped = [r for r in replicas if r.ready and math.isnan(r.stopped_s)]
        usage = [r.core.kv_cache_usage_perc for r in scraped]
        return RoleObservation(
            replicas=sum(1 for r in replicas if not r.draining and math.isnan(r.stopped_s)),
            ready=sum(1 for r in scraped if not r.draining),
            starting=sum(1 for r in replicas if not r.ready and math.isnan(r.stopped_s)),
            draining=sum(1 for r in scraped if r.draining),
            num_requests_running=float(sum(r.core.num_requests_running for r in scraped)),
            num_requests_waiting=float(sum(r.core.num_requests_waiting for r in scraped)),
            num_requests_waiting_max=float(max((r.core.num_requests_waiting for r in scraped), default=0)),
            kv_cache_usage_perc=sum(usage) / len(usage) if usage else 0.0,
            kv_cache_usage_perc_max=max(usage, default=0.0))

    def _sample(self, now: float) -> None:
        counts: dict[str, list[int]] = {}
        for role, replicas in self._replicas.items():
            alive = [r for r in replicas if math.isnan(r.stopped_s)]
            counts[role] = [sum(1 for r in alive if r.ready and not r.draining),
                            sum(1 for r in alive if not r.ready),
                            sum(1 for r in alive if r.draining and r.ready)]
        sample = ReplicaSample(now, *counts[PREFILL], *counts[DECODE])
        if self._samples and self._samples[-1].time_s == now:
            self._samples[-1] = sample
        else:
            self._samples.append(sample)


def simulate(trace: Sequence[TraceRequest], perf: EnginePerf, config: SimConfig, policy: Policy | None = None,
             progress: ProgressCallback | None = None, name: str | None = None) -> SimResult:
    """Replay `trace` under `policy` (default: the config's sizes, static); `name` labels the result
    (default: the policy's class). `xpyd.sim.policies.simulate_policy` replays a registered policy by name."""
    if policy is None:
        policy = StaticPolicy(Desired(config.prefill, config.decode))
        name = name or "static"
    return Simulator(trace, perf, policy, config, name or type(policy).__name__, progress).run()
