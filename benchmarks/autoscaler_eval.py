"""The autoscaler evaluation (issues 13 and 30): every policy family on the same simulator, each swept
over its own knob, real-time traces, profile and start-up delays, judged by frontiers of attainment
against GPU-hours and against a hindsight oracle the simulator itself verifies.

    python benchmarks/autoscaler_eval.py [--out benchmarks/results] [--startups 120 30 300]
                                         [--workloads conv code ...] [--duration S] [--jobs N]
                                         [--cold-all]

Every workload replays at real time; pools are made large by `--rate-scale`-style copies of each
request (`xpyd.traces.scale_rate`), so bursts and trends keep their shape. Every run (and every
workload's oracle) is its own process, `--jobs` at a time (default: one per core); each run is
deterministic, so the results do not depend on `--jobs`. `--duration S` keeps each workload's first
S seconds (quick looks and the smoke test).

The families and their knobs (`Run`): `xpyd` over its target attainment (`XPYD_TARGETS`), `static`
over fixed sizes (from below the oracle's time-weighted mean sizes up to its peak sizes, running from
t=0), `queue-threshold` over its thresholds (queue per prefill pod and decode KV-usage target, scaled
together: `QUEUE_SCALES`), `dynamo-sla` over a margin on its predicted load (`DYNAMO_MARGINS`), and
the `nowcast` reference (`xpyd.sim.policies.NowcastPolicy`: each oracle window's sizes asked for the
moment the window begins, plus a fixed headroom, `NOWCAST_EXTRAS`). The causal families start warm
(`warm_sizes`: the largest of the oracle's sizes until replicas ordered at the first decision serve)
at every start-up delay and cold (1 prefill, 1 decode) at the
first (every one with `--cold-all`). The `oracle` itself (`xpyd.sim.oracle`: per 60 s window the
fewest replicas the simulator shows meeting 95% of the window's requests, carried queues included,
start-up ignored, verified by replaying the whole schedule) is the point every "x oracle" divides by.

Per workload and start-up delay: each family's frontier (its swept points no other of its points
beats on both GPU-hours and attainment), the GPU-hours each family needs at 90%, 95% and 99% (its
cheapest swept point reaching the level), and at the first start-up delay the verdicts of issue 30's
targets for `xpyd` (`verdicts`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from xpyd.autoscaler.observation import Desired, Slo
from xpyd.perf.model import PerfModel
from xpyd.perf.shapes import lookup_model
from xpyd.sim.core import EngineConfig
from xpyd.sim.dynamo import DynamoSlaPolicy
from xpyd.sim.oracle import OraclePolicy, OracleSchedule, OracleWindow, oracle_schedule
from xpyd.sim.policies import POLICIES, NowcastPolicy, QueueThresholdPolicy, XpydPolicy
from xpyd.sim.policy import Policy, PolicyContext, StaticPolicy
from xpyd.sim.report import build_report
from xpyd.sim.simulator import SimConfig, SimResult, Simulator
from xpyd.traces import TraceRequest, load_trace, scale_prompts, surge

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "data" / "traces"
PROFILE = "h200_llama31_8b_fp8_tp1"

STATIC, QUEUE, DYNAMO, NOWCAST, XPYD = "static", "queue-threshold", "dynamo-sla", "nowcast", "xpyd"
FAMILIES = (STATIC, QUEUE, DYNAMO, NOWCAST, XPYD)
CAUSAL = (QUEUE, DYNAMO, XPYD)
"""The families a real cluster can run: they see only the past (the static sizes and the nowcast's
windows come from the oracle's hindsight)."""
BASELINES = (STATIC, QUEUE, DYNAMO)
"""The families `xpyd`'s frontier must dominate (the nowcast is a reference with its own target)."""
FIXED, WARM, COLD, OWN = "fixed", "warm", "cold", "-"
COLD_SIZES = Desired(1, 1)

XPYD_TARGETS = (0.80, 0.90, 0.95, 0.97, 0.99, 0.995, 0.999)
"""The targets `xpyd` is swept over, up to the API's largest (`autoscaling.slo.attainment` <= 0.999)."""
STATIC_BELOW = (0.6, 0.8)
"""Static sizes below the oracle's mean: these shares of it (at least 1), so the frontier reaches low attainment."""
STATIC_STEPS = (0.0, 0.25, 0.5, 0.75, 1.0)
"""Static sizes from the oracle's mean (0) to its peak (1) sizes, each role rounded."""
QUEUE_PER_POD, KV_USAGE_TARGET = 5.0, 0.8
QUEUE_SCALES = (1.0, 0.5, 0.2, 0.1)
"""`queue-threshold`'s thresholds, both scaled by these (1: KEDA's 5 waiting per pod and KV usage 0.8)."""
DYNAMO_MARGINS = (0.0, 0.5, 1.0, 2.0)
NOWCAST_EXTRAS = tuple(Desired(prefill, decode) for prefill in range(4) for decode in range(3))

LEVELS = (0.90, 0.95, 0.99)
FOCUS_TARGET = 0.95
"""The target attainment of the `xpyd` runs the timeline plot shows."""
NOWCAST_RATIO = 1.10
TOLERANCE = 0.01
WINDOW_S = 60.0
TASK_OVERHEAD_S = 0.8
"""A run's time beyond its replay (loading the trace and the profile, the report), when a saved report
does not say (`task_s`)."""
LONG_MAX_ISL = 32_768
SHORT_SLO = Slo(ttft_s=0.5, tpot_s=0.025)
LONG_SLO = Slo(ttft_s=3.0, tpot_s=0.030)


@dataclass(frozen=True)
class Workload:
    """A trace at real time, `rate_scale` copies of each request, optionally a surge or longer prompts,
    replayed on engines with or without their prefix caches."""

    name: str
    trace: str
    rate_scale: int
    slo: Slo
    how: str
    surge: tuple[float, float, int] | None = None
    prompt_scale: float = 1.0
    duration_s: float | None = None
    prefix_caching: bool = True

    def load(self) -> list[TraceRequest]:
        requests = load_trace(TRACES / self.trace, rate_scale=self.rate_scale, duration_s=self.duration_s)
        if self.prompt_scale != 1.0:
            requests = scale_prompts(requests, self.prompt_scale, max_isl=LONG_MAX_ISL)
        if self.surge is not None:
            start, end, factor = self.surge
            requests = surge(requests, start, end, factor, seed=1)
        return requests

    @property
    def engine(self) -> EngineConfig:
        """The engines' arguments (vLLM's defaults, the prefix cache as the workload says)."""
        return EngineConfig(enable_prefix_caching=self.prefix_caching)


WORKLOADS = (
    Workload("conv", "azure_conv_2023.csv", 10, SHORT_SLO, "`azure_conv_2023.csv`, each request x10"),
    Workload("code", "azure_code_2023.csv", 10, SHORT_SLO, "`azure_code_2023.csv`, each request x10"),
    Workload("mooncake", "mooncake_synthetic.jsonl", 8, LONG_SLO,
             "`mooncake_synthetic.jsonl` (ISL mean 15k), each request x8, prefix caches on"),
    Workload("mooncake-nocache", "mooncake_synthetic.jsonl", 8, LONG_SLO,
             "the same as `mooncake` with the engines' prefix caches off", prefix_caching=False),
    Workload("long", "azure_conv_2023.csv", 3, LONG_SLO,
             f"`azure_conv_2023.csv` with every prompt x8 (at most {LONG_MAX_ISL:,} tokens; ISL mean ~9k), "
             "each request x3", prompt_scale=8.0),
    Workload("surge", "azure_conv_2023.csv", 5, SHORT_SLO,
             "`azure_conv_2023.csv`, each request x5, and x4 again from 1,200 s to 1,500 s "
             "(a 5-minute surge to 4x with sharp edges)", surge=(1200.0, 1500.0, 4)),
)


@dataclass(frozen=True)
class Run:
    """One point of a family's sweep: its knob's value (a target attainment, a scale, a margin, sizes
    or a headroom), the start-up delay (0 for the fixed pools) and how it starts."""

    family: str
    knob: float | Desired
    startup_s: float
    start: str

    @property
    def label(self) -> str:
        """The knob's value as the tables show it."""
        knob = self.knob
        if isinstance(knob, Desired):
            return f"{knob.prefill} P / {knob.decode} D" if self.family == STATIC else \
                f"+{knob.prefill} P, +{knob.decode} D"
        if self.family == XPYD:
            return f"target {100 * knob:g}%"
        if self.family == QUEUE:
            return f"queue {QUEUE_PER_POD * knob:g}/pod, KV {KV_USAGE_TARGET * knob:g}"
        return f"margin {knob:g}"

    @property
    def stem(self) -> str:
        """The report's file name without `.json`: family, knob, start and start-up delay."""
        knob = self.knob
        if isinstance(knob, Desired):
            value = f"p{knob.prefill}d{knob.decode}"
        else:
            value = {XPYD: f"att{knob:g}", QUEUE: f"x{knob:g}", DYNAMO: f"margin{knob:g}"}[self.family]
        suffix = "" if self.start == FIXED else f"_startup{self.startup_s:g}" if self.start == OWN else \
            f"_{self.start}_startup{self.startup_s:g}"
        return f"{self.family}_{value}{suffix}"

    def order(self) -> tuple[float, ...]:
        """Sorts a family's points by knob (sizes by prefill, then decode)."""
        knob = self.knob
        return (knob.prefill, knob.decode) if isinstance(knob, Desired) else (knob,)


def perf_model() -> PerfModel:
    kv_bytes = lookup_model("llama-3.1-8b").kv_bytes_per_token("bf16")
    return PerfModel.from_profile(PROFILE).with_kv_transfer(kv_bytes, 100.0)


def report_for(result: SimResult, workload: Workload, startup_s: float, extra: dict[str, Any]) -> dict[str, Any]:
    """The `xpyd sim` report plus the attainment of requests arriving after the first start-up delay
    and two decision windows (what a cold start is judged on)."""
    report = build_report(result, trace_name=workload.trace, rate_scale=workload.rate_scale)
    _, good = result.meets(workload.slo)
    settle_s = startup_s + 2 * WINDOW_S
    later = [g for g, t in zip(good, result.arrival_s, strict=True) if t >= settle_s]
    report["settled_after_s"] = settle_s
    report["attainment_settled"] = round(sum(later) / len(later), 6) if later else None
    report.update(extra)
    return report


def build(run: Run, workload: Workload, perf: PerfModel, initial: Desired, windows: tuple[OracleWindow, ...],
          interval_s: float) -> tuple[Policy, Desired]:
    """The run's policy and the sizes its pool starts with."""
    knob = run.knob
    if run.family == STATIC:
        assert isinstance(knob, Desired)
        return StaticPolicy(knob), knob
    if run.family == NOWCAST:
        assert isinstance(knob, Desired)
        nowcast = NowcastPolicy(windows, knob)   # started warm as the causal families are, plus its headroom
        own = nowcast.initial
        return nowcast, Desired(max(own.prefill, initial.prefill), max(own.decode, initial.decode))
    assert isinstance(knob, float)
    if run.family == XPYD:
        context = PolicyContext(initial=initial, slo=workload.slo, perf=perf, interval_s=interval_s,
                                startup_delay_s=run.startup_s, engine=workload.engine, attainment=knob)
        return POLICIES[XPYD](context), initial   # as `xpyd sim --policy xpyd --attainment` builds it
    if run.family == QUEUE:
        return QueueThresholdPolicy(initial, queue_per_pod=QUEUE_PER_POD * knob,
                                    kv_usage_target=KV_USAGE_TARGET * knob), initial
    if run.family == DYNAMO:
        return DynamoSlaPolicy(perf, workload.slo.ttft_s, workload.slo.tpot_s, initial, margin=knob), initial
    raise ValueError(f"unknown family {run.family!r}")


def simulate(workload: Workload, run: Run, initial: Desired, windows: tuple[OracleWindow, ...] = (),
             prepare: Callable[[Policy], None] | None = None) -> tuple[SimResult, Policy, float]:
    """One replay of `run` on `workload`: its result, its policy (with what it decided) and the replay's
    wall time. `initial` is the causal families' starting sizes; `windows` the oracle's, for the
    nowcast; `prepare` sees the policy before the replay starts."""
    perf = perf_model()
    trace = workload.load()
    interval_s = SimConfig().interval_s
    policy, initial = build(run, workload, perf, initial, windows, interval_s)
    if prepare is not None:
        prepare(policy)
    config = SimConfig(prefill=initial.prefill, decode=initial.decode, slo=workload.slo,
                       startup_delay_s=run.startup_s, interval_s=interval_s, engine=workload.engine)
    started = time.perf_counter()
    result = Simulator(trace, perf, policy, config, run.family).run()
    return result, policy, time.perf_counter() - started


def run_one(workload: Workload, run: Run, initial: Desired, windows: tuple[OracleWindow, ...] = ()) -> dict[str, Any]:
    """One simulated run (`simulate`); returns its report (with the xpyd decisions' reasons when it is
    xpyd)."""
    task_started = time.perf_counter()
    result, policy, wall_s = simulate(workload, run, initial, windows)
    knob = run.knob
    extra: dict[str, Any] = {"wall_s": round(wall_s, 2), "workload": workload.name,
                             "family": run.family, "knob": knob if isinstance(knob, float) else
                             {"prefill": knob.prefill, "decode": knob.decode}, "knob_label": run.label,
                             "start": run.start, "startup_s": run.startup_s,
                             "prefix_caching": workload.prefix_caching,
                             "initial": {"prefill": initial.prefill, "decode": initial.decode}}
    if isinstance(policy, XpydPolicy) and knob == FOCUS_TARGET:   # the others' logs would only add megabytes
        extra["autoscaler_decisions"] = [
            {"t_s": t, "prefill": d.prefill.replicas, "decode": d.decode.replicas, "reason": d.reason,
             "between_decisions": reacted, "recommended_ratio": d.recommended_ratio,
             "prefill_reason": d.prefill.reason, "decode_reason": d.decode.reason, "message": d.message}
            for t, d, reacted in policy.decisions]
    report = report_for(result, workload, run.startup_s, extra)
    report["task_s"] = round(time.perf_counter() - task_started, 2)
    return report


ORACLE_SOURCES = ("xpyd/sim/oracle.py", "xpyd/sim/simulator.py", "xpyd/sim/core.py", "xpyd/perf/model.py",
                  "xpyd/traces.py", "xpyd/kvcache/pool.py", "xpyd/kvcache/chains.py")


def oracle_key(workload: Workload) -> str:
    """What an oracle depends on: the workload (its engines' prefix cache too), the profile, and the
    code that searches and replays. A saved oracle with the same key is the same oracle (the search is
    deterministic)."""
    import hashlib

    import xpyd

    digest = hashlib.sha256(repr((workload, PROFILE)).encode())
    package = Path(xpyd.__file__).resolve().parent.parent
    for source in ORACLE_SOURCES:
        digest.update((package / source).read_bytes())
    digest.update((ROOT / "data" / "profiles" / f"{PROFILE}_prefill.csv").read_bytes())
    digest.update((ROOT / "data" / "profiles" / f"{PROFILE}_decode.csv").read_bytes())
    return digest.hexdigest()[:16]


def saved_json(path: Path) -> dict[str, Any] | None:
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def saved_oracle(workload: Workload, out: Path) -> dict[str, Any] | None:
    """The oracle a previous run saved for this workload, if nothing it depends on changed."""
    saved = saved_json(out / workload.name / "oracle.json")
    return saved if saved is not None and saved.get("oracle_key") == oracle_key(workload) else None


def compute_oracle(workload: Workload) -> dict[str, Any]:
    """The workload's oracle, on the workload's engines: its windows, its verifying replay's report and
    its search time."""
    perf = perf_model()
    trace = workload.load()
    started = time.process_time()
    schedule = oracle_schedule(trace, perf, workload.slo, workload.engine)
    cpu_s = time.process_time() - started
    report = report_for(schedule.result, workload, 0.0, {"workload": workload.name, "start": "-", "startup_s": 0.0,
                                                         "prefix_caching": workload.prefix_caching})
    report.update(oracle_fields(schedule, cpu_s))
    report["oracle_key"] = oracle_key(workload)
    return report


def oracle_fields(schedule: OracleSchedule, cpu_s: float) -> dict[str, Any]:
    return {
        "oracle_met": schedule.met, "oracle_feasible": schedule.feasible, "oracle_rounds": schedule.rounds,
        "oracle_cpu_s": round(cpu_s, 1),
        "oracle_peak": {"prefill": schedule.peak.prefill, "decode": schedule.peak.decode},
        "oracle_mean": {"prefill": schedule.mean.prefill, "decode": schedule.mean.decode},
        "oracle_windows": [{"start_s": w.start_s, "prefill": w.prefill, "decode": w.decode, "requests": w.requests,
                            "goal": round(w.goal, 6), "attained": round(w.attained, 6), "feasible": w.feasible}
                           for w in schedule.windows]}


def windows_of(oracle: dict[str, Any]) -> tuple[OracleWindow, ...]:
    return tuple(OracleWindow(w["start_s"], w["start_s"] + WINDOW_S, w["prefill"], w["decode"], w["requests"],
                              w["goal"], w["attained"], w["feasible"]) for w in oracle["oracle_windows"])


def sizes(oracle: dict[str, Any], key: str) -> Desired:
    return Desired(oracle[key]["prefill"], oracle[key]["decode"])


def warm_sizes(windows: Sequence[OracleWindow], startup_s: float) -> Desired:
    """A warm start: the pool the oracle needs until replicas ordered at the first decision serve
    (the largest sizes among its windows overlapping [0, start-up + interval)), as the `oracle`
    policy starts. A pool of only the first window's sizes would miss, whatever the policy, every
    window before then that needs more: that is the start, not the policy."""
    return OraclePolicy(tuple(windows), startup_s + SimConfig().interval_s).initial


def static_sizes(mean: Desired, peak: Desired) -> list[Desired]:
    """The static sweep: shares of the mean below it, then from the mean to the peak (each role
    rounded), without repeats."""
    below = [Desired(max(1, round(mean.prefill * share)), max(1, round(mean.decode * share))) for share in STATIC_BELOW]
    between = [Desired(mean.prefill + round(step * (peak.prefill - mean.prefill)),
                       mean.decode + round(step * (peak.decode - mean.decode))) for step in STATIC_STEPS]
    return list(dict.fromkeys([*below, *between]))


def plan(oracle: dict[str, Any], startups: Sequence[float], cold_all: bool) -> list[Run]:
    """Every run of one workload's sweep."""
    runs = [Run(STATIC, knob, 0.0, FIXED) for knob in static_sizes(sizes(oracle, "oracle_mean"),
                                                                     sizes(oracle, "oracle_peak"))]
    knobs: dict[str, Sequence[float]] = {QUEUE: QUEUE_SCALES, DYNAMO: DYNAMO_MARGINS, XPYD: XPYD_TARGETS}
    for index, startup in enumerate(startups):
        starts = (WARM, COLD) if cold_all or index == 0 else (WARM,)
        runs += [Run(family, knob, startup, start) for family in CAUSAL for start in starts
                 for knob in knobs[family]]
        runs += [Run(NOWCAST, extra, startup, OWN) for extra in NOWCAST_EXTRAS]
    return runs


Task = tuple[Workload, Run, Desired, tuple[OracleWindow, ...]]


def _task(args: Task) -> tuple[str, Run, dict[str, Any]]:
    workload, run, initial, windows = args
    return workload.name, run, run_one(workload, run, initial, windows)


def estimate_s(tasks: Sequence[Task], out: Path) -> tuple[float, int]:
    """CPU seconds the tasks should take, from the run times the saved reports under `out` record
    (per workload: their mean `task_s`, or `wall_s` plus `TASK_OVERHEAD_S`), and how many tasks have
    no saved report of their workload to estimate from."""
    means: dict[str, float] = {}
    for name in {workload.name for workload, *_ in tasks}:
        seconds = []
        for path in (out / name).glob("*.json"):
            report = saved_json(path)
            if report is not None and "wall_s" in report:
                seconds.append(float(report.get("task_s", report["wall_s"] + TASK_OVERHEAD_S)))
        if seconds:
            means[name] = sum(seconds) / len(seconds)
    known = [means[workload.name] for workload, *_ in tasks if workload.name in means]
    return sum(known), len(tasks) - len(known)


# --- frontiers ------------------------------------------------------------------------------------

Point = tuple[float, float]
"""(GPU-hours, attainment)."""


def attained(report: dict[str, Any], settled: bool = False) -> float:
    """The run's attainment: over the whole run, or (`settled`) over the requests arriving after the
    start-up delay and two windows."""
    value = report["attainment_settled"] if settled else None
    return float(report["attainment"] if value is None else value)


def frontier(points: Iterable[Point]) -> list[Point]:
    """The points no other point beats on both GPU-hours and attainment, cheapest first (so
    attainment rises along it)."""
    out: list[Point] = []
    for gpu_hours, attainment in sorted(points, key=lambda p: (p[0], -p[1])):
        if not out or attainment > out[-1][1]:
            out.append((gpu_hours, attainment))
    return out


def cheapest(points: Iterable[Point], level: float) -> Point | None:
    """The cheapest point reaching `level` (None: none does)."""
    reaching = [p for p in points if p[1] >= level]
    return min(reaching, key=lambda p: (p[0], -p[1])) if reaching else None


def gpu_hours_at(points: Iterable[Point], level: float) -> float | None:
    """The GPU-hours the frontier through `points` needs at `level`: linear between the two frontier
    points around it, its cheapest point's when that one is already above it, None above its best."""
    line = frontier(points)
    if not line or level > line[-1][1]:
        return None
    if level <= line[0][1]:
        return line[0][0]
    for (g0, a0), (g1, a1) in itertools.pairwise(line):
        if a0 < level <= a1:
            return g0 + (g1 - g0) * (level - a0) / (a1 - a0)
    return None   # not reached: level <= line[-1][1]


@dataclass(frozen=True)
class Dominance:
    """Whether one frontier needs fewer GPU-hours than another's points at every level >= 90% the
    other reaches; `checks` are (what, mine, theirs) with mine None where mine cannot reach it."""

    checks: tuple[tuple[str, float | None, float], ...]
    best_theirs: float

    @property
    def vacuous(self) -> bool:
        return not self.checks

    @property
    def met(self) -> bool:
        return all(mine is not None and mine < theirs for _, mine, theirs in self.checks)

    def detail(self, theirs_name: str) -> str:
        if self.vacuous:
            return f"{theirs_name} never reaches {LEVELS[0]:.0%} (best {self.best_theirs:.1%})"
        failing = [(what, mine, theirs) for what, mine, theirs in self.checks if mine is None or mine >= theirs]
        unreachable = [what for what, mine, _ in failing if mine is None]
        ratios = [(mine / theirs, what, mine, theirs) for what, mine, theirs in self.checks if mine is not None]
        text = f"{len(self.checks)} checks"
        if ratios:
            ratio, what, mine, theirs = max(ratios)
            text += f"; worst {what}: xpyd {mine:.2f} vs {theirs:.2f} GPU-hours ({ratio:.2f}x)"
        if unreachable:
            text += "; xpyd's frontier does not reach: " + ", ".join(unreachable)
        if failing and not unreachable:
            text += f"; {len(failing)} not fewer"
        return text


def dominance(mine: Sequence[Point], theirs: Sequence[Point]) -> Dominance:
    """Does `mine` (xpyd) need fewer GPU-hours than `theirs` at each of 90/95/99% that theirs reaches
    (each side's cheapest point reaching it) and at each of their points of 90% or more (mine
    interpolated along its frontier)?"""
    checks: list[tuple[str, float | None, float]] = []
    for level in LEVELS:
        point = cheapest(theirs, level)
        if point is not None:
            mine_point = cheapest(mine, level)
            checks.append((f"at {level:.0%}", None if mine_point is None else mine_point[0], point[0]))
    for gpu_hours, attainment in sorted(theirs):
        if attainment >= LEVELS[0]:
            checks.append((f"their point {attainment:.1%}", gpu_hours_at(mine, attainment), gpu_hours))
    return Dominance(tuple(checks), max((a for _, a in theirs), default=0.0))


# --- the results ----------------------------------------------------------------------------------

Runs = dict[Run, dict[str, Any]]


def family_runs(runs: Runs, family: str, startup: float, start: str) -> list[tuple[Run, dict[str, Any]]]:
    """One family's swept runs at a start-up delay and start (the fixed pools at any start-up), by knob."""
    chosen = [(run, report) for run, report in runs.items() if run.family == family and run.start == start
              and (family == STATIC or run.startup_s == startup)]
    return sorted(chosen, key=lambda item: item[0].order())


def points(chosen: Sequence[tuple[Run, dict[str, Any]]], settled: bool = False) -> list[Point]:
    return [(report["gpu_hours"], attained(report, settled)) for _, report in chosen]


def lines(runs: Runs, startup: float) -> list[tuple[str, str]]:
    """The (family, start) lines present at this start-up delay, in table order."""
    out = [(STATIC, FIXED)]
    for family in (QUEUE, DYNAMO, XPYD):
        out += [(family, start) for start in (WARM, COLD) if family_runs(runs, family, startup, start)]
    if family_runs(runs, NOWCAST, startup, OWN):
        out.append((NOWCAST, OWN))
    return out


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, pattern)


def need_cell(chosen: Sequence[tuple[Run, dict[str, Any]]], level: float, bound: float) -> str:
    """The cheapest swept point reaching `level`: its GPU-hours, x oracle and knob, or unreachable."""
    reaching = [(report["gpu_hours"], -report["attainment"], run.label) for run, report in chosen
                if report["attainment"] >= level]
    if not reaching:
        return f"unreachable (best {max(r['attainment'] for _, r in chosen):.1%})"
    gpu_hours, _, label = min(reaching)
    return f"{gpu_hours:.2f} ({gpu_hours / bound:.2f}x, {label})"


def needs_table(workload: Workload, startup: float, runs: Runs, oracle: dict[str, Any]) -> str:
    bound = oracle["gpu_hours"]
    out = [f"#### {workload.name}, start-up delay {startup:g} s", "",
           f"GPU-hours each family needs (its cheapest swept point reaching the level; x the oracle's "
           f"{bound:.2f}, and the knob):", "",
           "| family | start | " + " | ".join(f"{level:.0%}" for level in LEVELS) + " | best | points |",
           "|---|---|" + "---:|" * len(LEVELS) + "---:|---:|"]
    for family, start in lines(runs, startup):
        chosen = family_runs(runs, family, startup, start)
        best = max(report["attainment"] for _, report in chosen)
        out.append(f"| {family} | {start} | " + " | ".join(need_cell(chosen, level, bound) for level in LEVELS)
                   + f" | {best:.1%} | {len(chosen)} |")
    return "\n".join(out) + "\n"


def points_table(startup: float, runs: Runs, oracle: dict[str, Any]) -> str:
    bound = oracle["gpu_hours"]
    out = ["<details><summary>every swept point</summary>", "",
           "| family | start | knob | attainment | after start-up + 2 windows | GPU-hours | x oracle "
           "| goodput/GPU-hour | scaling actions |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for family, start in lines(runs, startup):
        for run, report in family_runs(runs, family, startup, start):
            out.append(f"| {family} | {start} | {run.label} | {report['attainment']:.1%} | "
                       f"{_fmt(report['attainment_settled'], '.1%')} | {report['gpu_hours']:.3f} | "
                       f"{report['gpu_hours'] / bound:.2f} | {_fmt(report['goodput_per_gpu_hour'], ',.0f')} | "
                       f"{report['scaling_actions']} |")
    out.append(f"| oracle | no start-up | 95% per window | {oracle['attainment']:.1%} | "
               f"{_fmt(oracle['attainment_settled'], '.1%')} | {bound:.3f} | 1.00 | "
               f"{_fmt(oracle['goodput_per_gpu_hour'], ',.0f')} | {oracle['scaling_actions']} |")
    return "\n".join([*out, "", "</details>"]) + "\n"


def frontiers_json(startups: Sequence[float], runs: Runs) -> dict[str, Any]:
    """Per start-up delay and (family, start): every swept point, the frontier and the needs."""
    out: dict[str, Any] = {}
    for startup in startups:
        section: dict[str, Any] = {}
        for family, start in lines(runs, startup):
            chosen = family_runs(runs, family, startup, start)
            swept = points(chosen)
            section[f"{family}/{start}"] = {
                "points": [{"knob": run.label, "file": f"{run.stem}.json", "gpu_hours": report["gpu_hours"],
                            "attainment": report["attainment"], "attainment_settled": report["attainment_settled"]}
                           for run, report in chosen],
                "frontier": [{"gpu_hours": g, "attainment": a} for g, a in frontier(swept)],
                "needs": {f"{level:.2f}": None if (p := cheapest(swept, level)) is None else p[0] for level in LEVELS}}
        out[f"{startup:g}"] = section
    return out


def verdicts(workload: Workload, startup: float, runs: Runs) -> list[tuple[str, str, str]]:
    """Issue 30's targets for `xpyd` at this start-up delay: (target, met / missed / vacuous / n/a, detail).

    (a) xpyd's frontier dominates each baseline family's (`dominance`; static against warm starts,
    the others start for start); (b) xpyd warm needs at most `NOWCAST_RATIO` x the nowcast's GPU-hours
    at 95%, where the nowcast reaches 95%; (c) each target asked is attained within `TOLERANCE`,
    wherever any causal family reaches it (warm: over the whole run; cold: after start-up + 2 windows).
    """
    out: list[tuple[str, str, str]] = []
    mine = {start: points(family_runs(runs, XPYD, startup, start)) for start in (WARM, COLD)}
    for start in (WARM, COLD):
        if not mine[start]:
            continue
        for family in BASELINES:
            their_start = FIXED if family == STATIC else start
            if family == STATIC and start == COLD:
                continue
            theirs = points(family_runs(runs, family, startup, their_start))
            if not theirs:
                continue
            result = dominance(mine[start], theirs)
            verdict = "vacuous" if result.vacuous else "met" if result.met else "missed"
            out.append((f"(a) {start}: frontier dominates {family}", verdict, result.detail(family)))
    nowcast = points(family_runs(runs, NOWCAST, startup, OWN))
    if nowcast and mine[WARM]:
        reference = cheapest(nowcast, FOCUS_TARGET)
        target = f"(b) warm: <= {NOWCAST_RATIO:.2f}x the nowcast's GPU-hours at {FOCUS_TARGET:.0%}"
        if reference is None:
            out.append((target, "n/a", f"the nowcast does not reach {FOCUS_TARGET:.0%} "
                                       f"(best {max(a for _, a in nowcast):.1%})"))
        else:
            needed = gpu_hours_at(mine[WARM], FOCUS_TARGET)
            swept = cheapest(mine[WARM], FOCUS_TARGET)
            if needed is None:
                out.append((target, "missed", f"xpyd does not reach {FOCUS_TARGET:.0%} (best "
                                              f"{max(a for _, a in mine[WARM]):.1%}); nowcast {reference[0]:.2f} "
                                              f"GPU-hours at {reference[1]:.1%}"))
            else:   # both sides read alike: along their frontiers, at exactly the level
                theirs = gpu_hours_at(nowcast, FOCUS_TARGET)
                assert theirs is not None
                ratio = needed / theirs
                out.append((target, "met" if ratio <= NOWCAST_RATIO else "missed",
                            f"{ratio:.2f}x: xpyd {needed:.2f} vs nowcast {theirs:.2f} GPU-hours along their frontiers "
                            f"at {FOCUS_TARGET:.0%} (cheapest swept points: xpyd {_fmt(swept and swept[0], '.2f')} at "
                            f"{_fmt(swept and swept[1], '.1%')}, nowcast {reference[0]:.2f} at {reference[1]:.1%})"))
    for start, settled in ((WARM, False), (COLD, True)):
        asked = family_runs(runs, XPYD, startup, start)
        causal = [report for family in CAUSAL for _, report in family_runs(runs, family, startup, start)]
        for run, report in asked:
            assert isinstance(run.knob, float)
            level = run.knob
            got = attained(report, settled)
            what = "after start-up + 2 windows" if settled else "whole run"
            target = f"(c) {start}: target {100 * level:g}% attained within {100 * TOLERANCE:g} point"
            best = max(attained(r, settled) for r in causal)
            if best < level:
                out.append((target, "n/a", f"{got:.1%} ({what}); no causal family reaches {100 * level:g}% "
                                           f"(best {best:.1%})"))
            else:
                out.append((target, "met" if abs(got - level) <= TOLERANCE + 1e-9 else "missed",
                            f"{got:.1%} ({what}), {100 * (got - level):+.1f} points, {report['gpu_hours']:.2f} "
                            "GPU-hours"))
    return out


def headline(workloads: Sequence[Workload], startup: float, runs: dict[str, Runs],
             oracles: dict[str, dict[str, Any]]) -> str:
    """GPU-hours each family needs at 95% (warm starts), or its best attainment."""
    families = FAMILIES
    out = [f"| workload | oracle | {' | '.join(families)} |", "|---|---:|" + "---:|" * len(families)]
    for workload in workloads:
        bound = oracles[workload.name]["gpu_hours"]
        cells = []
        for family in families:
            start = {STATIC: FIXED, NOWCAST: OWN}.get(family, WARM)
            chosen = family_runs(runs[workload.name], family, startup, start)
            cells.append(need_cell(chosen, FOCUS_TARGET, bound) if chosen else "-")
        out.append(f"| {workload.name} | {bound:.2f} | {' | '.join(cells)} |")
    return "\n".join(out) + "\n"


# --- plots ----------------------------------------------------------------------------------------

COLORS = {STATIC: "#7f7f7f", QUEUE: "#9467bd", DYNAMO: "#1f77b4", XPYD: "#d62728", NOWCAST: "#ff7f0e",
          "oracle": "#2ca02c", "static-peak": "#7f7f7f", "static-mean": "#bcbd22"}


def plot_frontiers(workload: Workload, startups: Sequence[float], runs: Runs, oracle: dict[str, Any],
                   path: Path) -> None:
    """Attainment (logit scale) against GPU-hours, a panel per start-up delay: every family's swept
    points (hollow where its own frontier beats them) and its frontier, warm solid, cold dashed."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot
    from matplotlib.ticker import FuncFormatter

    low, high = 0.005, 0.9995   # attainment drawn within (the logit scale has no 0 or 1)
    figure, axes = pyplot.subplots(1, len(startups), figsize=(max(6.5 * len(startups), 9.0), 6.0), squeeze=False)
    everything = [attained(report) for report in runs.values()] + [oracle["attainment"]]
    bottom = max(low * 0.8, min(everything) * 0.7)
    for axis, startup in zip(axes[0], startups, strict=True):
        for family, start in lines(runs, startup):
            swept = points(family_runs(runs, family, startup, start))
            line = frontier(swept)
            clip = [(g, min(max(a, low), high)) for g, a in swept]
            color = COLORS[family]
            axis.plot([g for g, _ in line], [min(max(a, low), high) for _, a in line], color=color,
                      linestyle="--" if start == COLD else "-", linewidth=2.2 if family == XPYD else 1.4,
                      marker="o", markersize=5, label=f"{family}" + (f" ({start})" if start in (WARM, COLD) else ""))
            beaten = [p for p, raw in zip(clip, swept, strict=True) if raw not in line]
            if beaten:
                axis.scatter([g for g, _ in beaten], [a for _, a in beaten], facecolors="none", edgecolors=color,
                             s=25, linewidths=1.0)
        axis.scatter([oracle["gpu_hours"]], [min(oracle["attainment"], high)], marker="*", s=180,
                     color=COLORS["oracle"], zorder=5, label="oracle (no start-up)")
        for level in LEVELS:
            axis.axhline(level, color="black", linewidth=0.7, linestyle=":", alpha=0.7)
            axis.annotate(f"{level:.0%}", (1.0, level), xycoords=("axes fraction", "data"), fontsize=7,
                          ha="right", va="bottom")
        axis.set_yscale("logit")
        axis.set_ylim(bottom, high)
        ticks = [t for t in (0.01, 0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 0.999) if bottom <= t <= high]
        axis.set_yticks(ticks)
        axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{100 * value:g}%"))
        axis.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: ""))
        axis.set_xlabel("GPU-hours")
        axis.set_ylabel("attainment (both SLOs; logit scale)")
        axis.set_title(f"start-up delay {startup:g} s", fontsize=10)
        axis.grid(alpha=0.25)
    axes[0][0].legend(loc="lower right", fontsize=7)
    figure.suptitle(f"{workload.name}: {workload.how}\nTTFT <= {workload.slo.ttft_s * 1e3:g} ms, "
                    f"TPOT <= {workload.slo.tpot_s * 1e3:g} ms, {PROFILE}\nlines: each family's frontier; "
                    "hollow: points its own frontier beats", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    pyplot.close(figure)


#: What a run's saved report keeps unless the timeline plots it: its time series (replicas, the
#: binned timeline, every policy call) would make the results some twenty megabytes.
SERIES_KEYS = ("replicas", "timeline", "decisions")


def summary_of(report: dict[str, Any]) -> dict[str, Any]:
    """A run's report without its time series (`SERIES_KEYS`): the figures every table reads."""
    return {key: value for key, value in report.items() if key not in SERIES_KEYS}


def timeline_rows(runs: Runs, oracle: dict[str, Any], startup: float) -> list[tuple[str, str, dict[str, Any]]]:
    """The runs the timeline shows: each family at its default knob (xpyd at 95%, warm and cold; the
    static pools at the oracle's mean and peak; the nowcast's cheapest headroom reaching 95%, else its
    best), and the oracle."""
    shown: list[tuple[str, str, dict[str, Any]]] = []
    for name, run in (("static-peak", Run(STATIC, sizes(oracle, "oracle_peak"), 0.0, FIXED)),
                      ("static-mean", Run(STATIC, sizes(oracle, "oracle_mean"), 0.0, FIXED)),
                      (QUEUE, Run(QUEUE, 1.0, startup, WARM)), (DYNAMO, Run(DYNAMO, 0.0, startup, WARM)),
                      (XPYD, Run(XPYD, FOCUS_TARGET, startup, WARM)), (XPYD, Run(XPYD, FOCUS_TARGET, startup, COLD))):
        if run in runs:
            shown.append((name, f"{run.label}, {run.start}", runs[run]))
    nowcast = family_runs(runs, NOWCAST, startup, OWN)
    if nowcast:
        reaching = [(r["gpu_hours"], run, r) for run, r in nowcast if r["attainment"] >= FOCUS_TARGET]
        _, run, report = min(reaching, key=lambda item: item[0]) if reaching else \
            max(((r["attainment"], run, r) for run, r in nowcast), key=lambda item: item[0])
        shown.append((NOWCAST, run.label, report))
    return [*shown, ("oracle", "no start-up", oracle)]


def plot_timeline(workload: Workload, startup: float, runs: Runs, oracle: dict[str, Any], path: Path) -> None:
    """Load (and what xpyd at 95% served within both SLOs) and every shown run's replicas over time."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    focus = Run(XPYD, FOCUS_TARGET, startup, WARM)
    if focus not in runs:
        return
    figure, axes = pyplot.subplots(3, 1, figsize=(12, 10), gridspec_kw={"height_ratios": [0.8, 1, 1]})
    load, prefill_axis, decode_axis = axes
    line = runs[focus]["timeline"]
    edges = [*line["t_s"], line["t_s"][-1] + line["bin_s"]]
    load.stairs(line["arrivals_rps"], edges, fill=True, color="#fcbba1", label="arrivals")
    load.stairs(line["good_rps"], edges, fill=True, color="#74c476",
                label=f"met both SLOs (xpyd at {FOCUS_TARGET:.0%}, warm)")
    load.set_ylabel("req/s")
    load.legend(loc="upper right", fontsize=8)
    shown = timeline_rows(runs, oracle, startup)
    for name, label, report in shown:
        samples = report["replicas"]
        times = [s["t_s"] for s in samples] + [report["duration_s"]]
        for axis, role in ((prefill_axis, "prefill"), (decode_axis, "decode")):
            counts = [s[role] + s[f"{role}_starting"] for s in samples]
            axis.stairs(counts, times, baseline=None, color=COLORS[name], linewidth=2.4 if name == XPYD else 1.4,
                        linestyle={"oracle": "--", NOWCAST: "-."}.get(name, ":" if label.endswith(COLD) else "-"),
                        label=f"{name} ({label}): {report['attainment']:.1%}, {report['gpu_hours']:.2f} GPU-h")
    for axis, role in ((prefill_axis, "prefill"), (decode_axis, "decode")):
        axis.set_ylabel(f"{role} replicas\n(ready + starting)")
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    prefill_axis.legend(loc="upper left", fontsize=7, ncol=2)
    for axis in (load, prefill_axis, decode_axis):
        axis.set_xlim(0, max(report["duration_s"] for _, _, report in shown))
    decode_axis.set_xlabel(f"simulated time (s), start-up delay {startup:g} s")
    figure.suptitle(f"{workload.name}: {workload.how}\nTTFT <= {workload.slo.ttft_s * 1e3:g} ms, "
                    f"TPOT <= {workload.slo.tpot_s * 1e3:g} ms, {PROFILE}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    pyplot.close(figure)


README_HEAD = """# Autoscaler evaluation

Every policy family replays the same real-time traces through the same simulated P/D cluster (`xpyd
sim`'s simulator), profile `{profile}` (Llama-3.1-8B KV in bf16 over 100 Gb/s), decisions every 30 s
over a 60 s metrics window, start-up delays {startups}. Each family is swept over its own knob, so
each gives a frontier of attainment against GPU-hours rather than one point. Made by:

    {command}

({runs} runs, about {minutes:.0f} minutes on {jobs} jobs{reuse_note}). Files, per workload:
`<workload>/<family>_<knob>[_<start>_startup<S>].json` (the `xpyd sim --report` keys, plus the knob,
`attainment_settled`: the share of requests arriving after the start-up delay and two 60 s windows,
`wall_s`/`task_s`: the replay's and the whole run's seconds, and for `xpyd` at 95% every decision's
reason and message; only the runs the timeline plots keep their time series: replicas, timeline and policy calls; the
knob is in the name: `xpyd_att0.95`, `static_p5d3`, `queue-threshold_x0.5`,
`dynamo-sla_margin1`, `nowcast_p1d2`), `<workload>/oracle.json` (its windows, what its replay
attained per window, its search time; a later run reuses it while the workload, profile and
simulator code are unchanged: `oracle_key`), `<workload>/frontiers.json` (per start-up delay and
family: its points, its frontier, its GPU-hours at 90/95/99%), `<workload>_frontier.png`
(attainment against GPU-hours, a panel per start-up delay) and `<workload>_timeline.png` (load and
replicas over time at {focus:g} s start-up: `xpyd` at 95%, each baseline at its default knob).

## Workloads

Real time, large pools by copies of each request (`xpyd.traces.scale_rate`: the copies land within
the trace's mean gap over K, so every burst and trend keeps its shape, K times as tall). K is chosen
so that the oracle needs several replicas of each role at the peak where the trace allows it (the
code trace's ~28-token outputs need at most {code_decode} decode replicas at x10). The engines' prefix
caches are on (vLLM's default) except in `mooncake-nocache`; only the Mooncake trace says which prompts
share prefix blocks (its `hash_ids`), so only the Mooncake workloads differ by it.

| workload | how it is built | requests | SLOs (per request) | oracle P (min-max) | oracle D (min-max) |
|---|---|---:|---|---|---|
{workload_rows}

## Families and their knobs

- `xpyd`: `decide()`, the operator's own code, with a target attainment ({xpyd_targets}): the share
  of requests to meet both SLOs (`autoscaling.slo.attainment`; `xpyd sim --attainment`). Its model
  sizes each SLO at the target's share, the headroom is learnt online, and the target paces
  scale-down (window and N-1 margin; `autoscaler.config.caution`).
- `static`: fixed from t=0 (no start-up) at sizes from the oracle's time-weighted mean sizes (rounded
  up) to its largest sizes (each role's maximum over its windows), at {static_steps} of the way,
  plus {static_below} of the mean sizes so the frontier reaches low attainment (repeats dropped).
  Sizing them needs hindsight.
- `queue-threshold`: KEDA/HPA (prefill: waiting requests per pod over a threshold adds one; decode:
  KV usage over a target adds one; one step per 3 min up / 5 min down) with both thresholds scaled by
  {queue_scales} (1: 5 waiting per pod and KV usage 0.8).
- `dynamo-sla`: NVIDIA Dynamo's throughput planner (180 s interval, ARIMA-like predictor, correction
  factors) sizing for (1 + margin) x its predicted load, margin {dynamo_margins} (0: the planner as it
  is).
- `nowcast`: not a policy anyone can run but a reference for what the start-up delay costs: each
  oracle window's sizes asked for the moment the window begins (knowing the present exactly, nothing
  of the future), plus a fixed headroom of 0-3 prefill and 0-2 decode replicas (12 points).
- `xpyd`, `queue-threshold` and `dynamo-sla` are causal (they see only the past). They start warm
  (the largest of the oracle's sizes until replicas ordered at the first decision serve) at every
  start-up delay and cold (1 prefill, 1 decode) at
  {cold_at}. The nowcast starts warm too, its first window's sizes plus its headroom if larger.
- `oracle`: per 60 s window the fewest replicas with which the simulator shows 95% of the window's
  requests meeting both SLOs, the queue carried over from the previous window, start-up ignored;
  then the whole schedule is replayed and any window that misses gets one more replica, until every
  window meets 95% in the replay. Its GPU-hours are that replay's: the point every "x oracle" divides
  by, and the star on the frontier plots.

A family's **frontier** at a start-up delay and start is its swept points that no other of its points
beats on both GPU-hours and attainment (whole-run attainment). The **tables** give, for 90%, 95% and
99%, the GPU-hours of each family's cheapest swept point reaching the level (with its knob), or
"unreachable (best X%)".

## Targets (`xpyd`, {focus:g} s start-up, warm and cold)

- (a) `xpyd`'s frontier dominates each baseline family's (`static`, `queue-threshold`, `dynamo-sla`):
  fewer GPU-hours at every level of 90% or more that the baseline reaches. Checked at 90/95/99%
  (each side's cheapest swept point reaching the level) and at each baseline point of 90% or more
  (`xpyd`'s GPU-hours there interpolated linearly along its frontier). Warm against warm, cold
  against cold; `static` (a pool there from t=0) against warm. "vacuous": the baseline never
  reaches 90%.
- (b) Warm: at most {nowcast_ratio:.2f}x the nowcast's GPU-hours at 95% (each read along its own
  frontier at exactly 95%; the nowcast starts warm too, plus its headroom), wherever the nowcast
  reaches 95% ("n/a" otherwise).
- (c) Each target attainment asked is attained within {tolerance:g} point, wherever any causal family
  reaches that level at that start ("n/a" otherwise): warm over the whole run, cold over the requests
  arriving after the start-up delay and two windows (`attainment_settled`, for reaching too).
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--startups", type=float, nargs="+", default=[120.0, 30.0, 300.0],
                        help="start-up delays, the first the targets' (default 120 30 300)")
    parser.add_argument("--workloads", nargs="+", default=[w.name for w in WORKLOADS],
                        choices=[w.name for w in WORKLOADS])
    parser.add_argument("--duration", type=float, default=None, metavar="S", help="each workload's first S seconds")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs in parallel (default: cores)")
    parser.add_argument("--cold-all", action="store_true",
                        help="cold starts at every start-up delay (default: at the first only)")
    args = parser.parse_args()
    out = Path(args.out)
    started = time.perf_counter()
    workloads = [replace(w, duration_s=args.duration) for w in WORKLOADS if w.name in args.workloads]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        oracles = {w.name: saved for w in workloads if (saved := saved_oracle(w, out)) is not None}
        missing = [w for w in workloads if w.name not in oracles]
        if missing:
            previous = [saved_json(out / w.name / "oracle.json") for w in missing]
            known = [float(p["oracle_cpu_s"]) for p in previous if p is not None and "oracle_cpu_s" in p]
            sys.stdout.write(f"searching {len(missing)} oracle(s): {', '.join(w.name for w in missing)}"
                             + (f" (their last searches took {sum(known):.0f} CPU s in all)\n" if known else "\n"))
            sys.stdout.flush()
        oracles |= dict(zip((w.name for w in missing), pool.map(compute_oracle, missing), strict=True))
        reused = sorted(set(oracles) - {w.name for w in missing})
        tasks: list[Task] = []
        for workload in workloads:
            oracle = oracles[workload.name]
            windows = windows_of(oracle)
            tasks += [(workload, run, COLD_SIZES if run.start == COLD else warm_sizes(windows, run.startup_s),
                       windows if run.family == NOWCAST else ()) for run in plan(oracle, args.startups, args.cold_all)]
        counts = {w.name: sum(task[0].name == w.name for task in tasks) for w in workloads}
        cpu_s, unknown = estimate_s(tasks, out)
        if unknown < len(tasks):   # the runs of workloads without saved times at the others' mean
            minutes = cpu_s * len(tasks) / (len(tasks) - unknown) / 60 / args.jobs
            guess = f"estimated {minutes:.1f} min on {args.jobs} jobs from the saved runs' times" + (
                f" ({unknown} runs of workloads without saved times taken at the others' mean)" if unknown else "")
        else:
            guess = "no saved run times to estimate from"
        sys.stdout.write(f"{len(tasks)} runs ({', '.join(f'{n} {c}' for n, c in counts.items())}) after "
                         f"{(time.perf_counter() - started) / 60:.1f} min of oracles; {guess}\n")
        sys.stdout.flush()
        results = list(pool.map(_task, tasks, chunksize=1))
    runs: dict[str, Runs] = {w.name: {} for w in workloads}
    for name, run, report in results:
        runs[name][run] = report
    sections: list[str] = []
    targets: list[str] = []
    workload_rows: list[str] = []
    focus = args.startups[0]
    for workload in workloads:
        directory = out / workload.name
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("*.json"):
            stale.unlink()
        (out / f"{workload.name}.png").unlink(missing_ok=True)   # the plot before the frontiers
        oracle = oracles[workload.name]
        (directory / "oracle.json").write_text(json.dumps(oracle, indent=1) + "\n")
        plotted = {id(report) for _, _, report in timeline_rows(runs[workload.name], oracle, focus)}
        for run, report in runs[workload.name].items():
            kept = report if id(report) in plotted else summary_of(report)
            (directory / f"{run.stem}.json").write_text(json.dumps(kept, indent=1) + "\n")
        (directory / "frontiers.json").write_text(json.dumps(frontiers_json(args.startups, runs[workload.name]),
                                                             indent=1) + "\n")
        busy = [w for w in windows_of(oracle) if w.requests]
        workload_rows.append(
            f"| {workload.name} | {workload.how} | {oracle['requests']:,} | TTFT <= {workload.slo.ttft_s * 1e3:g} ms, "
            f"TPOT <= {workload.slo.tpot_s * 1e3:g} ms | {min(w.prefill for w in busy)}-{max(w.prefill for w in busy)} "
            f"| {min(w.decode for w in busy)}-{max(w.decode for w in busy)} |")
        state = "met 95% in every window" if oracle["oracle_met"] else "did NOT meet 95% in every window"
        sections.append(
            f"### {workload.name}\n\n![{workload.name}]({workload.name}_frontier.png)\n\nOracle: {state} of its "
            f"replay ({oracle['attainment']:.1%} overall) after {oracle['oracle_rounds']} replay(s), "
            f"{oracle['gpu_hours']:.3f} GPU-hours; searched in {oracle['oracle_cpu_s']:.0f} CPU s"
            + ("" if oracle["oracle_feasible"] else "; some windows are infeasible at these SLOs")
            + f". Timeline at {focus:g} s start-up: [{workload.name}_timeline.png]({workload.name}_timeline.png).\n")
        for startup in args.startups:
            text = needs_table(workload, startup, runs[workload.name], oracle)
            sections.append(text + "\n" + points_table(startup, runs[workload.name], oracle))
            sys.stdout.write(text + "\n")
        for target, verdict, detail in verdicts(workload, focus, runs[workload.name]):
            targets.append(f"| {workload.name} | {target} | {verdict} | {detail} |")
        plot_frontiers(workload, args.startups, runs[workload.name], oracle, out / f"{workload.name}_frontier.png")
        plot_timeline(workload, focus, runs[workload.name], oracle, out / f"{workload.name}_timeline.png")
    minutes = (time.perf_counter() - started) / 60
    command = "python3 benchmarks/autoscaler_eval.py"
    if args.startups != [120.0, 30.0, 300.0]:
        command += " --startups " + " ".join(f"{s:g}" for s in args.startups)
    if args.workloads != [w.name for w in WORKLOADS]:
        command += " --workloads " + " ".join(args.workloads)
    if args.duration is not None:
        command += f" --duration {args.duration:g}"
    if args.cold_all:
        command += " --cold-all"
    code_decode = max((w["decode"] for w in oracles["code"]["oracle_windows"]), default=1) if "code" in oracles else 1
    tally: dict[str, int] = {}
    for row in targets:
        verdict = row.split(" | ")[2]
        tally[verdict] = tally.get(verdict, 0) + 1
    readme = README_HEAD.format(
        profile=PROFILE, startups=", ".join(f"{s:g} s" for s in args.startups), command=command, runs=len(tasks),
        minutes=max(minutes, 1), jobs=args.jobs, focus=focus, code_decode=code_decode,
        workload_rows="\n".join(workload_rows), nowcast_ratio=NOWCAST_RATIO, tolerance=100 * TOLERANCE,
        xpyd_targets=", ".join(f"{100 * t:g}%" for t in XPYD_TARGETS),
        static_steps=", ".join(f"{s:g}" for s in STATIC_STEPS[:-1]) + f" and {STATIC_STEPS[-1]:g}",
        static_below=" and ".join(f"{s:g}" for s in STATIC_BELOW),
        queue_scales=", ".join(f"{s:g}" for s in QUEUE_SCALES),
        dynamo_margins=", ".join(f"{m:g}" for m in DYNAMO_MARGINS),
        cold_at="every start-up delay" if args.cold_all else f"the first ({focus:g} s)",
        reuse_note=f", reusing the saved oracles of {', '.join(reused)}" if reused else "")
    readme += (f"\n## GPU-hours to reach {FOCUS_TARGET:.0%} ({focus:g} s start-up, warm starts)\n\n"
               + headline(workloads, focus, runs, oracles)
               + f"\n## Verdicts ({focus:g} s start-up)\n\n"
               + ", ".join(f"{v}: {tally[v]}" for v in ("met", "missed", "vacuous", "n/a") if v in tally)
               + ".\n\n| workload | target | verdict | detail |\n|---|---|---|---|\n" + "\n".join(targets)
               + "\n\n## Results\n\n" + "\n".join(sections))
    (out / "README.md").write_text(readme)
    sys.stdout.write(f"wrote {out}: {len(tasks)} runs in {minutes:.1f} min on {args.jobs} jobs"
                     + (f" (saved oracles reused: {', '.join(reused)})" if reused else "") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
