"""How fast `xpyd sim` replays: the target is 30,000 simulated requests per second on one core, and a
synthetic day of a million requests in under 30 s (issue 13).

    python benchmarks/sim_bench.py [--trace FILE] [--profile PREFIX] [--prefill 2] [--decode 4]
                                   [--speedups 1 10 20 50] [--rate-scales 10] [--day [REQUESTS]]
                                   [--no-pure] [--repeat 1]

One row per speed-up of the trace (`--speedup`, on the given pools), then one per rate scale at x1
(`--rate-scale K`, each request K times, on K times the pools: the same load per replica as the x1
row), then with `--day` the synthetic day: REQUESTS (default 1,000,000) arrivals over 24 hours at a
diurnal rate (a sine, trough at midnight, peak at noon 4x the trough), with prompt and output lengths
drawn from the trace, on the pools scaled by the day's peak rate over the trace's mean rate (at the
peak, the x1 row's load per replica).

Each row runs twice, side by side: with the modules `make native` compiled (`xpyd.common.native`),
as `xpyd sim` runs, and in a child process with `XPYD_NATIVE=off` (pure Python; `--no-pure` skips
it); the last column is their ratio. Columns: CPU seconds of the replay (best of `--repeat`; the
machine may be shared, so CPU time rather than wall time; trace loading apart), requests simulated
per CPU second, discrete events, simulated span and SLO attainment (the same in both builds).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from xpyd.common import native
from xpyd.perf.model import PerfModel
from xpyd.perf.shapes import lookup_model
from xpyd.sim.report import build_report
from xpyd.sim.simulator import SimConfig, simulate
from xpyd.traces import TraceRequest, load_trace

DATA = Path(__file__).resolve().parents[1] / "data"
DAY_S = 86_400.0


def synthetic_day(requests: int, lengths: Sequence[TraceRequest], seed: int = 0) -> list[TraceRequest]:
    """`requests` arrivals over one day at the rate 1 - 0.6 cos(2 pi t / day) (times a constant), each with
    the prompt and output lengths of a request drawn from `lengths`; seeded, sorted by arrival."""
    rng = random.Random(seed)
    times: list[float] = []
    while len(times) < requests:
        t = rng.random() * DAY_S
        if rng.random() * 1.6 < 1.0 - 0.6 * math.cos(2.0 * math.pi * t / DAY_S):   # thinning
            times.append(t)
    times.sort()
    picks = rng.choices(lengths, k=requests)
    return [TraceRequest(t, r.isl, r.osl) for t, r in zip(times, picks, strict=True)]


def measure(trace: list[TraceRequest], perf: PerfModel, config: SimConfig, repeat: int) -> dict[str, Any]:
    """The replay's best CPU seconds of `repeat`, and what it simulated."""
    best = math.inf
    for _ in range(repeat):
        started = time.process_time()
        result = simulate(trace, perf, config)
        best = min(best, time.process_time() - started)
    return {"cpu_s": best, "events": result.events, "end_s": result.end_s,
            "attainment": build_report(result)["attainment"]}


def rows(args: argparse.Namespace) -> Iterator[tuple[str, Callable[[], tuple[list[TraceRequest], SimConfig]]]]:
    """Each row's label and how to make its trace and pools."""
    def sped_up(speedup: float) -> tuple[list[TraceRequest], SimConfig]:
        return load_trace(args.trace, speedup=speedup), SimConfig(prefill=args.prefill, decode=args.decode)

    def rate_scaled(scale: int) -> tuple[list[TraceRequest], SimConfig]:
        return (load_trace(args.trace, rate_scale=scale),
                SimConfig(prefill=args.prefill * scale, decode=args.decode * scale))

    for speedup in args.speedups:
        yield f"x{speedup:g}", functools.partial(sped_up, speedup)
    for scale in args.rate_scales:
        yield f"x1 rate x{scale}", functools.partial(rate_scaled, scale)
    if args.day:
        def day() -> tuple[list[TraceRequest], SimConfig]:
            lengths = load_trace(args.trace)
            peak_rps = 1.6 * args.day / DAY_S        # the rate's mean is 1, its peak 1.6
            ratio = peak_rps / (len(lengths) / (lengths[-1].arrival_s - lengths[0].arrival_s))
            return synthetic_day(args.day, lengths), SimConfig(prefill=math.ceil(args.prefill * ratio),
                                                               decode=math.ceil(args.decode * ratio))
        yield "synthetic day", day


def pure_figures(index: int) -> dict[str, Any]:
    """Row `index` replayed in a child process on the pure-Python modules."""
    env = {**os.environ, "XPYD_NATIVE": "off"}
    child = subprocess.run([sys.executable, *sys.argv, "--row-json", str(index)], env=env, capture_output=True,
                           text=True, check=False)
    if child.returncode != 0:
        raise SystemExit(f"the pure-Python run of row {index} failed:\n{child.stderr}")
    figures: dict[str, Any] = json.loads(child.stdout)
    return figures


def cells(label: str, build: str, pools: SimConfig, requests: int, load_s: float, figures: dict[str, Any]) -> str:
    cpu = figures["cpu_s"]
    return (f"{label:>14} {build:>8} {f'{pools.prefill}P/{pools.decode}D':>9} {requests:>10,} {load_s:>7.2f} "
            f"{cpu:>7.2f} {requests / cpu:>13,.0f} {figures['events']:>10,} {figures['end_s']:>11,.1f} "
            f"{figures['attainment']:>11.1%}")


def main() -> int:
    """Run the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(DATA / "traces" / "azure_conv_2023.csv"))
    parser.add_argument("--profile", default=str(DATA / "profiles" / "h200_llama31_8b_fp8_tp1"))
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=4)
    parser.add_argument("--speedups", type=float, nargs="*", default=[1, 10, 20, 50])
    parser.add_argument("--rate-scales", type=int, nargs="*", default=[10], help="rows at x1 with K x the requests "
                        "and K x the pools")
    parser.add_argument("--day", type=int, nargs="?", const=1_000_000, default=None, metavar="REQUESTS",
                        help="add the synthetic day of REQUESTS requests (default 1,000,000)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per row (the best is shown)")
    parser.add_argument("--no-pure", action="store_true", help="skip the pure-Python run of each row")
    parser.add_argument("--row-json", type=int, default=None, help=argparse.SUPPRESS)   # the child's one row
    args = parser.parse_args()

    kv_bytes = lookup_model("llama-3.1-8b").kv_bytes_per_token("bf16")
    perf = PerfModel.from_profile(args.profile).with_kv_transfer(kv_bytes, 100.0)
    table = list(rows(args))
    if args.row_json is not None:
        trace, config = table[args.row_json][1]()
        sys.stdout.write(json.dumps(measure(trace, perf, config, args.repeat)) + "\n")
        return 0
    build = "compiled" if native.compiled() else "pure"
    out = sys.stdout
    out.write(f"{Path(args.trace).name}, {Path(args.profile).name}, one process per build; "
              f"{native.state()[1]}\n")
    out.write(f"{'run':>14} {'build':>8} {'pools':>9} {'requests':>10} {'load s':>7} {'CPU s':>7} "
              f"{'req/CPU s':>13} {'events':>10} {'sim span s':>11} {'attainment':>11} {'speed-up':>9}\n")
    for index, (label, make) in enumerate(table):
        started = time.perf_counter()
        trace, config = make()
        load_s = time.perf_counter() - started
        figures = measure(trace, perf, config, args.repeat)
        out.write(cells(label, build, config, len(trace), load_s, figures) + "\n")
        out.flush()
        if not args.no_pure and build != "pure":
            pure = pure_figures(index)
            out.write(f"{cells(label, 'pure', config, len(trace), load_s, pure)} "
                      f"{pure['cpu_s'] / figures['cpu_s']:>8.2f}x\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
