"""`oracle`: the hindsight bound on GPU-hours, found by search in the simulator itself
(`docs/evaluation.md`).

The trace is cut into windows (60 s). Window by window it finds the fewest prefill and decode
replicas with which the simulator shows `attainment` of the window's requests meeting both SLOs:
each candidate is tried by replaying the previous window's arrivals at the sizes already chosen for
it (so the queue the window inherits is carried over), then the window's arrivals at the candidate's
sizes until the last of them finishes. The requests keep their prefix blocks, so the candidates'
engines hit their prefix caches as the verifying replay's do, but from empty caches warmed only by
the previous window's arrivals (the verifying replay's hold what all earlier windows left).
Prefill is searched first with decode roomy, then decode with that prefill (prefill grows by one
when no decode reaches the goal). The sizes are the simulator's answer, not the autoscaler's
model's: the model only gives the search its first guess.

Then the whole schedule is replayed (sizes change at window boundaries, start-up ignored, drained
replicas count until they are idle): a window that misses its goal in the replay gets one more
replica of the role behind the miss (prefill when TTFT alone misses it) and the replay repeats, until
every window meets its goal or `rounds` replays have been made. `OracleSchedule.met` says which; the
bound is the last replay's GPU-hours, so what the bound claims is what the simulator showed.

Given a `run` (a `SimConfig`), the verifying replay is instead that run of `OraclePolicy`, what
`xpyd sim --policy oracle` makes: the run's start-up, decisions every `interval_s`, each asking
start-up + interval ahead, from the policy's `initial` sizes (the largest among the windows its first
order cannot serve: the pool is there at t=0). The same repair rounds then fix whatever the start-up
changes, so what was verified is what runs. `refusal` says why a schedule must not be run as meeting
the target: infeasible windows, or windows still missing when the rounds ran out.

A request an idle pool cannot serve within the TTFT target (`PerfModel.ttft_seconds(isl,
disaggregated=True)`), or that fits no engine's KV cache, misses whatever the sizes: a window whose
feasible share is below `attainment` has as goal `attainment` of its feasible share and is marked
infeasible (`OracleWindow.feasible`): the workload cannot meet the target at that SLO.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from xpyd.autoscaler.observation import Desired, Observation, Slo
from xpyd.autoscaler.sizing import PoolModel
from xpyd.perf.model import PerfModel
from xpyd.sim.core import EngineConfig, EngineCore
from xpyd.sim.policy import StaticPolicy
from xpyd.sim.simulator import SimConfig, SimResult, simulate
from xpyd.traces import TraceRequest

WINDOW_S = 60.0
ATTAINMENT = 0.95
MAX_REPLICAS = 256
ROUNDS = 8


class OracleRefusal(ValueError):
    """The oracle's schedule does not meet its target in its own replay (`refusal` says why)."""


@dataclass(frozen=True)
class OracleWindow:
    """The fewest replicas found for the arrivals in [start_s, end_s), with what the schedule's replay
    showed: `attained` of the window's requests met both SLOs against a `goal`."""

    start_s: float
    end_s: float
    prefill: int
    decode: int
    requests: int
    goal: float = ATTAINMENT
    attained: float = math.nan
    feasible: bool = True


@dataclass(frozen=True)
class OracleSchedule:
    """The oracle's windows and its verifying replay (`result`: start-up ignored, or the given run of
    `OraclePolicy`, which asks `lead_s` ahead; None for the bound's replay)."""

    windows: tuple[OracleWindow, ...]
    result: SimResult
    rounds: int
    lead_s: float | None = None

    @property
    def met(self) -> bool:
        """Whether the replay met every window's goal."""
        return all(w.attained >= w.goal for w in self.windows)

    @property
    def feasible(self) -> bool:
        """Whether every window could meet the attainment target at all (see the module docstring)."""
        return all(w.feasible for w in self.windows)

    @property
    def gpu_hours(self) -> float:
        """The bound: GPU time of the verifying replay, in hours."""
        return sum(self.result.gpu_seconds.values()) / 3600.0

    @property
    def peak(self) -> Desired:
        """Each role's largest size over the windows."""
        return Desired(max(w.prefill for w in self.windows), max(w.decode for w in self.windows))

    @property
    def mean(self) -> Desired:
        """Each role's time-weighted mean size over the windows, rounded up."""
        span = sum(w.end_s - w.start_s for w in self.windows)

        def average(sizes: Sequence[int]) -> int:
            total = sum(n * (w.end_s - w.start_s) for n, w in zip(sizes, self.windows, strict=True)) / span
            return max(1, math.ceil(total - 1e-9))
        return Desired(average([w.prefill for w in self.windows]), average([w.decode for w in self.windows]))


@dataclass(frozen=True)
class SchedulePolicy:
    """Each window's sizes from its start (ticks at the window boundaries): the oracle's replay."""

    windows: tuple[OracleWindow, ...]

    def desired_sizes(self, observation: Observation) -> Desired:
        """The sizes of the window holding `observation.time_s` (the last after the trace)."""
        now = observation.time_s
        current = next((w for w in self.windows if w.start_s <= now < w.end_s), self.windows[-1])
        return Desired(current.prefill, current.decode)


def oracle_schedule(trace: Sequence[TraceRequest], perf: PerfModel, slo: Slo, engine: EngineConfig | None = None,
                    window_s: float = WINDOW_S, attainment: float = ATTAINMENT, rounds: int = ROUNDS,
                    seed: int = 0, run: SimConfig | None = None) -> OracleSchedule:
    """Per-window fewest sizes by search, verified by replaying the schedule (the module docstring):
    start-up ignored, or as `run` (its SLO, engines and seed those given) runs `OraclePolicy` from its
    initial sizes."""
    if not trace:
        raise ValueError("the oracle needs the trace's requests")
    if trace[0].arrival_s < 0:
        raise ValueError(f"the trace's arrivals must start at 0 s or later, not {trace[0].arrival_s:g} s")
    if rounds < 1:
        raise ValueError(f"the oracle needs at least one verifying replay, not {rounds}")
    engine = engine or EngineConfig()
    if run is not None and (run.slo, run.engine, run.seed) != (slo, engine, seed):
        raise ValueError("the oracle's run must have the SLO, engines and seed it is searched with")
    model = PoolModel(perf, slo.ttft_s, slo.tpot_s, max_num_batched_tokens=engine.max_num_batched_tokens,
                      max_num_seqs=engine.max_num_seqs)
    capacity = EngineCore(perf, engine).capacity
    possible = [r.isl + r.osl <= capacity and perf.ttft_seconds(r.isl, disaggregated=True) <= slo.ttft_s
                for r in trace]
    bounds = _window_bounds([request.arrival_s for request in trace], window_s)
    search = _WindowSearch(trace, perf, slo, engine, seed)
    windows: list[OracleWindow] = []
    previous: Desired | None = None
    for index, (first, stop) in enumerate(bounds):
        start_s, end_s = index * window_s, (index + 1) * window_s
        count = stop - first
        if count == 0:
            sizes = Desired(1, 1) if previous is None else previous
            windows.append(OracleWindow(start_s, end_s, sizes.prefill, sizes.decode, 0, goal=0.0, attained=1.0))
            previous = sizes
            continue
        share = sum(possible[first:stop]) / count
        feasible = share >= attainment
        goal = attainment if feasible else attainment * share
        warm = bounds[index - 1][0] if index > 0 and previous is not None else first
        sizes = search.fewest(warm, first, stop, start_s, previous, goal, _hint(model, trace[first:stop], window_s,
                                                                              previous))
        windows.append(OracleWindow(start_s, end_s, sizes.prefill, sizes.decode, count, goal, math.nan, feasible))
        previous = sizes

    lead_s = None if run is None else run.startup_delay_s + run.interval_s
    for made in range(1, rounds + 1):
        if run is None or lead_s is None:
            result = simulate(trace, perf, _replay_config(windows, slo, engine, window_s, seed),
                              SchedulePolicy(tuple(windows)), name="oracle")
        else:
            policy = OraclePolicy(tuple(windows), lead_s)
            result = simulate(trace, perf, policy.run_config(run), policy, name="oracle")
        ttft_share, both_share = _window_shares(result, bounds, slo)
        windows = [w if w.requests == 0 else
                   replace(w, attained=both_share[i]) for i, w in enumerate(windows)]
        missed = [i for i, w in enumerate(windows) if w.requests and w.attained < w.goal]
        if not missed or made == rounds:
            return OracleSchedule(tuple(windows), result, made, lead_s)
        for i in missed:
            w = windows[i]
            if ttft_share[i] < w.goal and w.prefill < MAX_REPLICAS:
                windows[i] = replace(w, prefill=w.prefill + 1)
            elif w.decode < MAX_REPLICAS:
                windows[i] = replace(w, decode=w.decode + 1)
    raise AssertionError("unreachable: the last round returns")


def _window_bounds(arrivals: Sequence[float], window_s: float) -> list[tuple[int, int]]:
    """Per window, the [first, stop) indices of the requests arriving in it (the arrivals are sorted)."""
    count = int(arrivals[-1] // window_s) + 1
    bounds: list[tuple[int, int]] = []
    index = 0
    for window in range(count):
        first = index
        end = (window + 1) * window_s
        while index < len(arrivals) and arrivals[index] < end:
            index += 1
        bounds.append((first, index))
    return bounds


def _replay_config(windows: Sequence[OracleWindow], slo: Slo, engine: EngineConfig, window_s: float,
                   seed: int) -> SimConfig:
    return SimConfig(prefill=windows[0].prefill, decode=windows[0].decode, slo=slo, startup_delay_s=0.0,
                     interval_s=window_s, window_s=window_s, seed=seed, engine=engine)


def refusal(schedule: OracleSchedule, slo: Slo, attainment: float = ATTAINMENT) -> str | None:
    """Why the schedule does not meet `attainment` of every window's requests in its own replay (None
    when it does): windows infeasible at the SLOs (with the share of their requests an idle pool could
    serve in time), or windows still missing their goal when the rounds ran out."""
    windows = schedule.windows
    head = f"the oracle cannot meet {attainment * 100:g}%"
    slos = f"TTFT {slo.ttft_s:g} s, TPOT {slo.tpot_s * 1000:g} ms"
    infeasible = [w for w in windows if not w.feasible]
    if infeasible:
        requests = sum(w.requests for w in infeasible)
        share = sum(w.goal / attainment * w.requests for w in infeasible) / requests
        return (f"{head}: {len(infeasible)} of {len(windows)} windows are infeasible at {slos} (their feasible "
                f"share {share:.1%}: the rest fit no engine's KV cache or take longer than the TTFT target on an "
                f"idle pool)")
    missed = [w for w in windows if w.requests and w.attained < w.goal]
    if missed:
        worst = min(missed, key=lambda w: w.attained)
        return (f"{head}: after {schedule.rounds} verifying replays {len(missed)} of {len(windows)} windows still "
                f"miss it at {slos} (worst: [{worst.start_s:g}, {worst.end_s:g}) s attained {worst.attained:.1%})")
    return None


def attainment_by_window(result: SimResult, window_s: float = WINDOW_S) -> list[tuple[int, float]]:
    """Per `window_s` window of arrivals, its request count and the share meeting both of the run's
    SLOs (1.0 for an empty window), as the search judges its windows (`_window_shares`)."""
    if not result.arrival_s:
        return []
    bounds = _window_bounds(result.arrival_s, window_s)
    _, both = _window_shares(result, bounds, result.config.slo)
    return [(stop - first, share) for (first, stop), share in zip(bounds, both, strict=True)]


def run_verdict(result: SimResult, attainment: float = ATTAINMENT, window_s: float = WINDOW_S) -> dict[str, Any]:
    """What an oracle run was built for (`attainment` of each window's requests meeting both SLOs, verified
    under the run's start-up) and whether this run met it: per-window counts, the worst window, a summary line."""
    shares = [share for n, share in attainment_by_window(result, window_s) if n]
    missed = sum(1 for share in shares if share < attainment)
    worst = min(shares, default=1.0)
    built = (f"oracle: built for {attainment * 100:g}% of each {window_s:g} s window's requests meeting both SLOs, "
             f"its schedule verified as this run, under its {result.config.startup_delay_s:g} s start-up")
    line = (f"{built}; this run MISSED it in {missed} of {len(shares)} windows (worst {worst:.1%})" if missed else
            f"{built}; this run met it in all {len(shares)} windows (worst {worst:.1%})")
    return {"target_attainment": attainment, "window_s": window_s, "startup_delay_s": result.config.startup_delay_s,
            "windows": len(shares), "windows_missed": missed, "worst_window_attainment": worst, "met": not missed,
            "summary": line}


def _window_shares(result: SimResult, bounds: Sequence[tuple[int, int]], slo: Slo) -> tuple[list[float], list[float]]:
    """Per window, the share of its requests meeting TTFT, and both SLOs (NaN latencies miss)."""
    fast, met = result.meets(slo)
    ttft_share, both_share = [], []
    for first, stop in bounds:
        if stop == first:
            ttft_share.append(1.0)
            both_share.append(1.0)
            continue
        ttft_share.append(sum(fast[first:stop]) / (stop - first))
        both_share.append(sum(met[first:stop]) / (stop - first))
    return ttft_share, both_share


def _hint(model: PoolModel, requests: Sequence[TraceRequest], window_s: float, previous: Desired | None) -> Desired:
    """Where the search starts: the previous window's sizes, else the fluid prefill bound and the
    model's decode sizes."""
    if previous is not None:
        return previous
    rate = len(requests) / window_s
    isl = sum(r.isl for r in requests) / len(requests)
    osl = sum(r.osl for r in requests) / len(requests)
    prefill = max(1, math.floor(rate * isl / model.saturated_tokens_per_s()))
    return Desired(prefill, model.size_decode(rate, isl, osl).replicas)


@dataclass
class _WindowSearch:
    trace: Sequence[TraceRequest]
    perf: PerfModel
    slo: Slo
    engine: EngineConfig
    seed: int

    def fewest(self, warm: int, first: int, stop: int, start_s: float, previous: Desired | None, goal: float,
               hint: Desired) -> Desired:
        """The fewest prefill, then decode, meeting `goal` for requests [first, stop) (arrivals from `warm`
        replayed at `previous`)."""
        origin = self.trace[warm].arrival_s if warm < first else start_s
        replay = [TraceRequest(r.arrival_s - origin, r.isl, r.osl, r.prefix_blocks) for r in self.trace[warm:stop]]
        inside = range(first - warm, stop - warm)
        switch_s = start_s - origin
        cache: dict[tuple[int, int], tuple[float, float]] = {}

        def shares(prefill: int, decode: int) -> tuple[float, float]:
            if (prefill, decode) not in cache:
                cache[prefill, decode] = self._shares(replay, inside, previous if warm < first else None, switch_s,
                                                      Desired(prefill, decode))
            return cache[prefill, decode]

        def decode_meets(prefill: int) -> Callable[[int], bool]:
            return lambda decode: shares(prefill, decode)[1] >= goal

        roomy = 2 * hint.decode + 2
        limit = max(roomy, 4 * hint.decode + 8)
        prefill = _fewest(hint.prefill, lambda p: shares(p, roomy)[0] >= goal, MAX_REPLICAS) or MAX_REPLICAS
        # A prefill that only just meets TTFT leaves no slack for TPOT misses among the same requests,
        # which decode then buys back dearly: the fewest replicas in all may have more prefill.
        best: Desired | None = None
        guess, last = hint.decode, min(MAX_REPLICAS, prefill + 8)
        while prefill <= last and (best is None or prefill + 1 < best.prefill + best.decode):
            decode = _fewest(guess, decode_meets(prefill), limit)
            if decode is not None:
                if best is None or prefill + decode < best.prefill + best.decode:
                    best = Desired(prefill, decode)
                guess = decode
            prefill += 1
        return best or Desired(last, limit)   # not met: the replay shows by how much

    def _shares(self, replay: Sequence[TraceRequest], inside: range, previous: Desired | None, switch_s: float,
                sizes: Desired) -> tuple[float, float]:
        start = previous or sizes
        config = SimConfig(prefill=start.prefill, decode=start.decode, slo=self.slo, startup_delay_s=0.0,
                           interval_s=switch_s if previous is not None and switch_s > 0 else 1e9,
                           seed=self.seed, engine=self.engine)
        result = simulate(replay, self.perf, config, StaticPolicy(sizes))
        fast, met = result.meets(self.slo)
        return sum(fast[i] for i in inside) / len(inside), sum(met[i] for i in inside) / len(inside)


def _fewest(start: int, meets: Callable[[int], bool], limit: int) -> int | None:
    """The fewest n in [1, limit] with `meets(n)` (taken as monotone), searched outward from `start`:
    galloping down or up, then bisection. None if even `limit` does not meet it."""
    n = min(max(1, start), limit)
    if meets(n):
        low, high, step = 0, n, 1          # low: known to miss (0 always does), high: known to meet
        while high - step >= 1:
            if meets(high - step):
                high -= step
                step *= 2
            else:
                low = high - step
                break
    else:
        low, step = n, 1
        while True:
            candidate = min(limit, low + step)
            if meets(candidate):
                high = candidate
                break
            if candidate >= limit:
                return None
            low, step = candidate, step * 2
    while high - low > 1:
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle
    return high


@dataclass(frozen=True)
class OraclePolicy:
    """Follows the oracle's windows, asking `lead_s` (start-up + interval) ahead for every window
    the next replicas will serve. It starts at `initial`: the windows before its first order can
    serve are served by the starting pool."""

    windows: tuple[OracleWindow, ...]
    lead_s: float

    def desired_sizes(self, observation: Observation) -> Desired:
        """The largest sizes among the windows overlapping [now, now + lead)."""
        now = observation.time_s
        ahead = [w for w in self.windows if w.end_s > now and w.start_s < now + self.lead_s] or [self.windows[-1]]
        return Desired(max(w.prefill for w in ahead), max(w.decode for w in ahead))

    @property
    def initial(self) -> Desired:
        """What the pool starts with: the largest sizes among the windows overlapping [0, lead), the
        ones no replica ordered at the first decision serves in time."""
        return self.desired_sizes(Observation(time_s=self.windows[0].start_s, window_s=0.0))

    def run_config(self, run: SimConfig) -> SimConfig:
        """`run` starting at `initial`: the pool is there from t=0, as a fixed pool's is."""
        return replace(run, prefill=self.initial.prefill, decode=self.initial.decode)
