"""How fast `xpyd sim` replays: the target is 30,000 simulated requests per second on one core, and a
synthetic day of a million requests in under 30 s of wall time (issue 13).

    python benchmarks/sim_bench.py [--trace FILE] [--profile PREFIX] [--prefill 2] [--decode 4]
                                   [--speedups 1 10 20 50] [--rate-scales 10] [--day [REQUESTS]]

One row per speed-up of the trace (`--speedup`, on the given pools), then one per rate scale at x1
(`--rate-scale K`, each request K times, on K times the pools: the same load per replica as the x1
row), then with `--day` the synthetic day: REQUESTS (default 1,000,000) arrivals over 24 hours at a
diurnal rate (a sine, trough at midnight, peak at noon 4x the trough), with prompt and output lengths
drawn from the trace, on the pools scaled by the day's peak rate over the trace's mean rate (at the
peak, the x1 row's load per replica). Columns: wall seconds of the replay (best of `--repeat`; trace
loading shown apart), requests simulated per wall second, discrete events, simulated span and SLO
attainment.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

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


def row(out: TextIO, label: str, trace: list[TraceRequest], load_s: float, perf: PerfModel, config: SimConfig,
        repeat: int) -> None:
    best = math.inf
    for _ in range(repeat):
        started = time.perf_counter()
        result = simulate(trace, perf, config)
        best = min(best, time.perf_counter() - started)
    attainment = build_report(result)["attainment"]
    pools = f"{config.prefill}P/{config.decode}D"
    out.write(f"{label:>14} {pools:>9} {len(trace):>10,} {load_s:>7.2f} {best:>7.2f} {len(trace) / best:>16,.0f} "
              f"{result.events:>10,} {result.end_s:>11,.1f} {attainment:>11.1%}\n")
    out.flush()


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
    args = parser.parse_args()

    kv_bytes = lookup_model("llama-3.1-8b").kv_bytes_per_token("bf16")
    perf = PerfModel.from_profile(args.profile).with_kv_transfer(kv_bytes, 100.0)
    config = SimConfig(prefill=args.prefill, decode=args.decode)
    out = sys.stdout
    out.write(f"{Path(args.trace).name}, {Path(args.profile).name}, one process\n")
    out.write(f"{'run':>14} {'pools':>9} {'requests':>10} {'load s':>7} {'wall s':>7} {'req/s simulated':>16} "
              f"{'events':>10} {'sim span s':>11} {'attainment':>11}\n")
    for speedup in args.speedups:
        started = time.perf_counter()
        trace = load_trace(args.trace, speedup=speedup)
        row(out, f"x{speedup:g}", trace, time.perf_counter() - started, perf, config, args.repeat)
    for scale in args.rate_scales:
        started = time.perf_counter()
        trace = load_trace(args.trace, rate_scale=scale)
        scaled = SimConfig(prefill=args.prefill * scale, decode=args.decode * scale)
        row(out, f"x1 rate x{scale}", trace, time.perf_counter() - started, perf, scaled, args.repeat)
    if args.day:
        started = time.perf_counter()
        lengths = load_trace(args.trace)
        day = synthetic_day(args.day, lengths)
        load_s = time.perf_counter() - started
        peak_rps = 1.6 * args.day / DAY_S        # the rate's mean is 1, its peak 1.6
        ratio = peak_rps / (len(lengths) / (lengths[-1].arrival_s - lengths[0].arrival_s))
        pools = SimConfig(prefill=math.ceil(args.prefill * ratio), decode=math.ceil(args.decode * ratio))
        row(out, "synthetic day", day, load_s, perf, pools, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
