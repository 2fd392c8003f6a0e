"""Can any fixed headroom land a target attainment within 1 point? (issue 30, target (c))

    python benchmarks/headroom_steps.py [--workloads conv ...] [--targets 0.8 0.9 0.95 0.97]
                                        [--starts warm cold] [--low -0.5] [--high 1.0] [--step 0.05]
                                        [--fine 0.01] [--duration S] [--jobs N] [--out benchmarks/results]
                                        [--evaluation benchmarks/results] [--report | --relearn]
                                        [--floor H]

`xpyd` sizes each pool for `(1 + h)` times its forecast load, `h` the headroom it learns from the
attainment it measures (`xpyd.autoscaler.attainment`). This sweeps the other way round: for each
workload, target attainment and start, the same `xpyd` policy as `autoscaler_eval.py` runs it (the
operator's `decide()`, 120 s start-up, warm from the oracle's first sizes or cold from 1 P / 1 D),
but with its headroom held at each value of a grid for the whole run, learning nothing (the
learner's bounds both at that value, and its state starting there; every decision's state is
checked to hold it). First every `--step` from `--low` to `--high`, then every `--fine` within each
pair of adjacent values whose attainments fall on either side of the band target +-1 point with
neither in it. Attainment is judged as `autoscaler_eval.py` judges target (c): warm over the whole
run, cold over the requests arriving after the start-up and two windows.

A headroom held all run is a choice made in hindsight, once per workload: it is the best the
headroom alone can do. Where no value of it, at 0.01 apart, lands within the band, attainment jumps
across the band between two pool sizes that differ by a few replicas for a few minutes, and a
learner that only moves the headroom cannot land in it either, except by luck. Where a value does,
the learner's own run (learning, as in the evaluation) shows how close it gets.

Per workload, target and start it prints (and writes to `<out>/headroom_steps.md`, with a plot per
start, `<out>/headroom_steps_<start>.png`) the attainment and GPU-hours at each held headroom, the
value closest to the target, the steepest step at the finest spacing, the cheapest held headroom
that reaches the band or above, the learner's run, and the target this proposes in place of
"within 1 point": the learner attains at least the target less 1 point on at most `HELD_RATIO`
times that held headroom's GPU-hours (n/a where no held headroom reaches the band); every run's
figures go to `<out>/headroom_steps.json`.

The warm held runs of a workload, over every target swept, are a family of their own: `xpyd` with
a headroom chosen in hindsight, as `dynamo-sla`'s margin and `static`'s sizes are. The report judges
them, beside the learner, against the baselines `autoscaler_eval.py` swept (`--evaluation`: its
`<workload>/frontiers.json`, 120 s start-up) as it judges its target (a): where the learner misses
and a held headroom dominates, the gap is the learner's; where both miss, no headroom held all run
closes it. `--report` writes the report again from `<out>/headroom_steps.json`, replaying nothing
(after a new evaluation, say); `--relearn` replays the learner's runs only (after a change to the
learner: a held run learns nothing, so it does not change). `--floor H` runs the learner with its
lowest headroom at `H` instead of `attainment.MIN_HEADROOM` (an experiment on the learner; the
report says so): with `--relearn --out DIR` on a copy of a saved sweep, the learner's runs against
the same held ones.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import autoscaler_eval as ev  # beside this script: its workloads, oracles and runs

from xpyd.autoscaler import attainment
from xpyd.autoscaler.attainment import AttainmentState
from xpyd.autoscaler.decide import AutoscalerState
from xpyd.autoscaler.observation import Desired
from xpyd.sim.policies import XpydPolicy
from xpyd.sim.policy import Policy

HERE = Path(__file__).resolve().parent
STARTUP_S = 120.0
TOLERANCE = 0.01
#: The proposed target: the learner attains at least the target less `TOLERANCE` on at most this many
#: times the GPU-hours of the cheapest held headroom that does.
HELD_RATIO = 1.15


@contextmanager
def bounds(low: float, high: float) -> Iterator[None]:
    """The learner's bounds (`attainment.MIN_HEADROOM`, `MAX_HEADROOM`) at `low` and `high`: both at one
    headroom holds it there, whatever a window teaches."""
    saved = attainment.MIN_HEADROOM, attainment.MAX_HEADROOM
    attainment.MIN_HEADROOM, attainment.MAX_HEADROOM = low, high
    try:
        yield
    finally:
        attainment.MIN_HEADROOM, attainment.MAX_HEADROOM = saved


#: One workload, target and start (warm or cold).
Case = tuple[str, float, str]


@dataclass(frozen=True)
class Task:
    case: Case
    headroom: float | None        # None: the learner's own run
    initial: Desired
    duration_s: float | None
    floor: float                  # the learner's lowest headroom in its own run


def run(task: Task) -> dict[str, Any]:
    """One `xpyd` replay at `STARTUP_S`, its headroom held (or learnt): the attainment its start is
    judged on (warm: the whole run; cold: after the start-up and two windows, as `autoscaler_eval.py`
    judges target (c)), the GPU-hours, and the headrooms its decisions held (a held run must show
    only its own)."""
    name, target, start = task.case
    workload = replace(next(w for w in ev.WORKLOADS if w.name == name), duration_s=task.duration_s)
    knob = ev.Run(ev.XPYD, target, STARTUP_S, start)
    if task.headroom is None:
        with bounds(task.floor, attainment.MAX_HEADROOM):
            result, policy, _ = ev.simulate(workload, knob, task.initial)
    else:
        headroom = task.headroom

        def start_held(policy: Policy) -> None:
            assert isinstance(policy, XpydPolicy)
            policy.state = AutoscalerState(attainment=AttainmentState(headroom=headroom))

        with bounds(headroom, headroom):
            result, policy, _ = ev.simulate(workload, knob, task.initial, prepare=start_held)
    assert isinstance(policy, XpydPolicy)
    report = ev.report_for(result, workload, STARTUP_S, {})
    headrooms = sorted({round(d.state.attainment.headroom, 6) for _, d, _ in policy.decisions})
    return {"attainment": ev.attained(report, settled=start == ev.COLD), "gpu_hours": report["gpu_hours"],
            "headrooms": headrooms}


def grid(low: float, high: float, step: float) -> list[float]:
    count = round((high - low) / step)
    return [round(low + i * step, 6) for i in range(count + 1)]


def straddles(points: Sequence[tuple[float, float]], target: float) -> list[tuple[float, float]]:
    """Adjacent (headroom, attainment) pairs on either side of the band target +-`TOLERANCE`, neither
    in it: where a finer spacing may find a headroom within the band."""
    low, high = target - TOLERANCE, target + TOLERANCE
    return [(a[0], b[0]) for a, b in itertools.pairwise(points)
            if (a[1] < low and b[1] > high) or (a[1] > high and b[1] < low)]


@dataclass(frozen=True)
class Summary:
    """One workload, target and start: the held runs by headroom, and the learner's run."""

    workload: str
    target: float
    start: str
    held: dict[float, dict[str, Any]]
    learnt: dict[str, Any]
    fine: float

    def closest(self) -> tuple[float, dict[str, Any]]:
        return min(self.held.items(), key=lambda item: (abs(item[1]["attainment"] - self.target), item[1]["gpu_hours"]))

    def within(self) -> bool:
        return abs(self.closest()[1]["attainment"] - self.target) <= TOLERANCE + 1e-9

    def cheapest_reaching(self) -> tuple[float, dict[str, Any]] | None:
        reaching = [(h, r) for h, r in self.held.items() if r["attainment"] >= self.target - TOLERANCE]
        return min(reaching, key=lambda item: item[1]["gpu_hours"]) if reaching else None

    def proposed(self) -> str:
        """The proposed target's verdict: met, missed (why), or n/a (no held headroom reaches the band)."""
        reach = self.cheapest_reaching()
        if reach is None:
            return "n/a"
        learnt = self.learnt
        if learnt["attainment"] < self.target - TOLERANCE:
            return "missed (under)"
        ratio = learnt["gpu_hours"] / reach[1]["gpu_hours"]
        return "met" if ratio <= HELD_RATIO else f"missed ({ratio:.2f}x)"

    def steepest(self) -> tuple[float, float, float] | None:
        """The largest attainment step between held headrooms `fine` apart: (from, to, points)."""
        ordered = sorted(self.held.items())
        steps = [(a[0], b[0], 100 * (b[1]["attainment"] - a[1]["attainment"]))
                 for a, b in itertools.pairwise(ordered) if abs(b[0] - a[0] - self.fine) < 1e-6]
        return max(steps, key=lambda s: abs(s[2])) if steps else None


def row(summary: Summary) -> str:
    h, best = summary.closest()
    verdict = "yes" if summary.within() else "no"
    steep = summary.steepest()
    step = f"{steep[2]:+.1f} points from {steep[0]:+.2f} to {steep[1]:+.2f}" if steep else "-"
    reach = summary.cheapest_reaching()
    learnt = summary.learnt
    ratio = f" ({learnt['gpu_hours'] / reach[1]['gpu_hours']:.2f}x)" if reach else ""
    reach_cell = f"{reach[0]:+.2f}: {reach[1]['attainment']:.1%} on {reach[1]['gpu_hours']:.2f}" if reach else \
        "none reaches it"
    return (f"| {summary.workload} | {summary.target:.0%} | {summary.start} | {verdict} | {h:+.2f}: "
            f"{best['attainment']:.1%} on {best['gpu_hours']:.2f} | {step} | {reach_cell} | "
            f"{learnt['attainment']:.1%} on {learnt['gpu_hours']:.2f}{ratio} | {summary.proposed()} |")


HEAD = ("| workload | target | start | a held headroom within 1 point | closest (headroom: attainment on GPU-hours) "
        "| steepest step at the finest spacing | cheapest held headroom within 1 point or above "
        "| the learner (its GPU-hours over that one's) "
        f"| the learner: at least the target less 1 point, on at most {HELD_RATIO:.2f}x |\n"
        "|---|---|---|---|---|---|---|---|---|")


def plot(summaries: Sequence[Summary], start: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(s.workload for s in summaries))
    columns = min(len(names), 3)
    rows = -(-len(names) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.9 * rows), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names, strict=False):
        for summary, color in zip((s for s in summaries if s.workload == name),
                                  ("#d62728", "#ff7f0e", "#1f77b4", "#2ca02c", "#9467bd"), strict=False):
            ordered = sorted(summary.held.items())
            ax.plot([h for h, _ in ordered], [100 * r["attainment"] for _, r in ordered], ".-", color=color,
                    label=f"held, target {summary.target:.0%}")
            ax.axhspan(100 * (summary.target - TOLERANCE), 100 * (summary.target + TOLERANCE), color=color, alpha=0.15)
            ax.axhline(100 * summary.learnt["attainment"], color=color, linestyle=":",
                       label=f"learnt, target {summary.target:.0%}")
        ax.set_title(f"{name}, {start}")
        ax.set_xlabel("headroom held all run")
        ax.set_ylabel("attainment (%)" if start == ev.WARM else "attainment after start-up + 2 windows (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def held_points(summaries: Sequence[Summary], workload: str) -> list[ev.Point]:
    """Every held run of a workload, warm, over all the targets swept: `xpyd` with a headroom chosen in
    hindsight (and its target), judged, as target (a) judges, over the whole run."""
    return [(r["gpu_hours"], r["attainment"]) for s in summaries if s.workload == workload and s.start == ev.WARM
            for r in s.held.values()]


def swept(lines: dict[str, Any], key: str) -> list[ev.Point]:
    """One family's swept points in the evaluation's `frontiers.json` (a start-up delay's `lines`)."""
    return [(p["gpu_hours"], p["attainment"]) for p in lines[key]["points"]]


def against_baselines(summaries: Sequence[Summary], evaluation: Path) -> list[str]:
    """Target (a), warm, both ways: the evaluation's `xpyd` (learning) and `xpyd` with each headroom held
    against each baseline family's swept points (`<evaluation>/<workload>/frontiers.json`, 120 s
    start-up), each judged by `autoscaler_eval.dominance`. Where the learner misses and a held headroom
    dominates, the gap is the learner's; where both miss, no headroom held all run gets there either."""
    rows: list[str] = []
    for workload in dict.fromkeys(s.workload for s in summaries if s.start == ev.WARM):
        path = evaluation / workload / "frontiers.json"
        if not path.is_file():
            continue
        lines = json.loads(path.read_text())[f"{STARTUP_S:g}"]
        learnt = swept(lines, f"{ev.XPYD}/{ev.WARM}")
        held = held_points(summaries, workload)
        for family in ev.BASELINES:
            key = f"{family}/{ev.FIXED if family == ev.STATIC else ev.WARM}"
            if key not in lines:
                continue
            theirs = swept(lines, key)
            as_learnt, as_held = ev.dominance(learnt, theirs), ev.dominance(held, theirs)
            if as_learnt.vacuous:
                continue
            shows = "-" if as_learnt.met else "the learner's cost: a held headroom dominates" if as_held.met else \
                "beyond any headroom held all run"
            rows.append(f"| {workload} | {family} | {'met' if as_learnt.met else 'missed'}: {as_learnt.detail(family)} "
                        f"| {'met' if as_held.met else 'missed'}: {as_held.detail(family)} | {shows} |")
    if not rows:
        return []
    return ["| workload | baseline | xpyd, learning (the evaluation's target (a)) "
            "| xpyd, each headroom held all run (any target swept) | what this shows |",
            "|---|---|---|---|---|", *rows]


def warm_starts(names: Sequence[str], duration_s: float | None) -> dict[str, Desired]:
    """Each workload's warm start, from the oracle the evaluation saved (else computed)."""
    warm: dict[str, Desired] = {}
    for name in names:
        workload = replace(next(w for w in ev.WORKLOADS if w.name == name), duration_s=duration_s)
        oracle = ev.saved_oracle(workload, HERE / "results") or ev.compute_oracle(workload)
        warm[name] = ev.warm_sizes(ev.windows_of(oracle), STARTUP_S)
    return warm


def task_for(case: Case, headroom: float | None, warm: dict[str, Desired], duration_s: float | None,
             floor: float) -> Task:
    """The replay of one case: warm from the workload's warm start, cold from `autoscaler_eval.COLD_SIZES`."""
    return Task(case, headroom, warm[case[0]] if case[2] == ev.WARM else ev.COLD_SIZES, duration_s, floor)


def command() -> str:
    return " ".join(["python3 benchmarks/headroom_steps.py", *sys.argv[1:]])


def replay(args: argparse.Namespace) -> tuple[list[Summary], dict[str, Any]]:
    """Every run the arguments ask for: the summaries and the sweep's own figures (`meta`)."""
    started = time.perf_counter()
    warm = warm_starts(args.workloads, args.duration)
    cases = [(name, target, start) for start in args.starts for name in args.workloads for target in args.targets]
    coarse = grid(args.low, args.high, args.step)
    results: dict[Case, dict[float | None, dict[str, Any]]] = {case: {} for case in cases}

    def task(case: Case, headroom: float | None) -> Task:
        return task_for(case, headroom, warm, args.duration, args.floor)

    def sweep(tasks: list[Task]) -> None:
        for done, result in zip(tasks, pool.map(run, tasks, chunksize=1), strict=True):
            if done.headroom is not None and result["headrooms"] not in ([done.headroom], []):
                raise SystemExit(f"{done.case}: held {done.headroom:+.2f} but its decisions held {result['headrooms']}")
            results[done.case][done.headroom] = result

    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        sweep([task(case, h) for case in cases for h in [None, *coarse]])
        refine: list[Task] = []
        for case in cases:
            curve = sorted((h, r["attainment"]) for h, r in results[case].items() if h is not None)
            for low, high in straddles(curve, case[1]):
                refine += [task(case, h) for h in grid(min(low, high), max(low, high), args.fine)[1:-1]]
        sweep(refine)
    summaries = [Summary(*case, {h: results[case][h] for h in sorted(h for h in results[case] if h is not None)},
                         results[case][None], args.fine) for case in cases]
    meta = {"command": command(), "runs": sum(len(r) for r in results.values()),
            "minutes": round((time.perf_counter() - started) / 60, 1), "jobs": args.jobs, "fine": args.fine,
            "duration": args.duration, "floor": args.floor}
    return summaries, meta


def relearn(summaries: list[Summary], meta: dict[str, Any], jobs: int,
            floor: float) -> tuple[list[Summary], dict[str, Any]]:
    """The saved sweep with only the learner's runs replayed (after a change to the learner: a held run
    learns nothing, so it stays as it was)."""
    started = time.perf_counter()
    duration = meta.get("duration")
    warm = warm_starts(list(dict.fromkeys(s.workload for s in summaries)), duration)
    tasks = [task_for((s.workload, s.target, s.start), None, warm, duration, floor) for s in summaries]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        learnt = list(pool.map(run, tasks, chunksize=1))
    again = {"command": command(), "runs": len(tasks), "minutes": round((time.perf_counter() - started) / 60, 1),
             "floor": floor}
    return [replace(s, learnt=r) for s, r in zip(summaries, learnt, strict=True)], {**meta, "relearnt": again}


def saved(path: Path) -> tuple[list[Summary], dict[str, Any]]:
    """The summaries and figures a sweep wrote to `headroom_steps.json`."""
    data = json.loads(path.read_text())
    summaries = [Summary(c["workload"], c["target"], c["start"], {h["headroom"]: {k: v for k, v in h.items()
                                                                                  if k != "headroom"}
                                                                   for h in c["held"]}, c["learnt"], data["fine"])
                 for c in data["cases"]]
    return summaries, {k: v for k, v in data.items() if k != "cases"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=[w.name for w in ev.WORKLOADS],
                        choices=[w.name for w in ev.WORKLOADS])
    parser.add_argument("--targets", type=float, nargs="+", default=[0.80, 0.90, 0.95, 0.97])
    parser.add_argument("--low", type=float, default=-0.5)
    parser.add_argument("--high", type=float, default=1.0)
    parser.add_argument("--step", type=float, default=0.05)
    parser.add_argument("--fine", type=float, default=0.01)
    parser.add_argument("--starts", nargs="+", default=[ev.WARM, ev.COLD], choices=[ev.WARM, ev.COLD])
    parser.add_argument("--duration", type=float, default=None, metavar="S", help="each workload's first S seconds")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--evaluation", default=str(HERE / "results"), metavar="DIR",
                        help="autoscaler_eval.py's results: the baselines target (a) is judged against")
    rewrite = parser.add_mutually_exclusive_group()
    rewrite.add_argument("--report", action="store_true",
                        help="replay nothing: write the report again from <out>/headroom_steps.json")
    rewrite.add_argument("--relearn", action="store_true",
                        help="as --report, but replay the learner's runs again (after a change to the learner)")
    parser.add_argument("--floor", type=float, default=attainment.MIN_HEADROOM, metavar="H",
                        help="the learner's lowest headroom in its own runs (default %(default)s, as shipped)")
    args = parser.parse_args()
    if not (args.low < args.high and 0 < args.fine <= args.step):
        parser.error("need --low < --high and 0 < --fine <= --step")
    if not -1.0 < args.floor <= attainment.MAX_HEADROOM:
        parser.error(f"--floor {args.floor:g}: need -1 < H <= {attainment.MAX_HEADROOM:g} (the learner's highest "
                     "headroom; at -1 a pool would be sized for no load)")
    if args.report and args.floor != attainment.MIN_HEADROOM:
        parser.error("--floor with --report: the report replays nothing (--relearn replays the learner's runs)")
    out = Path(args.out)
    if args.report or args.relearn:
        if not (out / "headroom_steps.json").is_file():
            parser.error(f"--report/--relearn: no {out / 'headroom_steps.json'} (run the sweep first)")
        summaries, meta = saved(out / "headroom_steps.json")
        if args.relearn:
            summaries, meta = relearn(summaries, meta, args.jobs, args.floor)
    else:
        summaries, meta = replay(args)
    table = "\n".join([HEAD, *(row(s) for s in summaries)])
    baselines = "\n".join(against_baselines(summaries, Path(args.evaluation)))
    curves = "\n".join(
        f"- {s.workload} at {s.target:.0%}, {s.start}: " +
        ", ".join(f"{h:+.2f} {r['attainment']:.1%}/{r['gpu_hours']:.2f}" for h, r in sorted(s.held.items()))
        for s in summaries)
    starts = list(dict.fromkeys(s.start for s in summaries))
    out.mkdir(parents=True, exist_ok=True)
    for start in starts:
        plot([s for s in summaries if s.start == start], start, out / f"headroom_steps_{start}.png")
    (out / "headroom_steps.json").write_text(json.dumps(
        {**meta, "cases": [{"workload": s.workload, "target": s.target, "start": s.start, "learnt": s.learnt,
                            "held": [{"headroom": h, **r} for h, r in sorted(s.held.items())]} for s in summaries]},
        indent=1) + "\n")
    against = (f"## Against the baselines (target (a), warm)\n\nEach held run above is `xpyd` with a headroom (and "
               "a target) chosen in hindsight; together, per workload, they are a frontier too. Judged as the "
               f"evaluation judges target (a), against the baselines' swept points (the evaluation's "
               f"`<workload>/frontiers.json`, {STARTUP_S:g} s start-up):\n\n"
               f"{baselines}\n\n") if baselines else ""
    relearnt = meta.get("relearnt")
    again = (f"; the learner's runs replayed again by `{relearnt['command']}`: {relearnt['runs']} runs in "
             f"{relearnt['minutes']:.1f} min") if relearnt else ""
    floor = (relearnt or meta).get("floor", attainment.MIN_HEADROOM)
    if floor != attainment.MIN_HEADROOM:
        again += f"; the learner's headroom no lower than {floor:+.2f} (as shipped: {attainment.MIN_HEADROOM:+.2f})"
    (out / "headroom_steps.md").write_text(
        f"# Attainment against a held headroom\n\n`{meta['command']}`: {meta['runs']} runs in {meta['minutes']:.1f} "
        f"min on {meta['jobs']} jobs{again} (`xpyd`, {STARTUP_S:g} s start-up; what each column means: the "
        f"script's docstring).\n\n{table}\n\n"
        + "".join(f"![{start}: attainment against the headroom held](headroom_steps_{start}.png)\n\n"
                  for start in starts)
        + against + f"Every run (headroom attainment/GPU-hours):\n\n{curves}\n")
    sys.stdout.write(f"{table}\n\n{baselines}\n\n{curves}\n\n{meta['runs']} runs in {meta['minutes']:.1f} min; "
                     f"wrote {out / 'headroom_steps.md'}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
