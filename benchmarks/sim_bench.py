"""How fast `xpyd sim` replays the one-hour Azure conversation trace (the target: under 10 s of wall time
at any speed-up up to 50, with 2 prefill and 4 decode replicas on the H200 profile).

    python benchmarks/sim_bench.py [--trace FILE] [--profile PREFIX] [--prefill 2] [--decode 4]

Prints one row per speed-up: wall seconds of the replay (best of `--repeat`; trace loading shown
apart), requests simulated per wall second, discrete events, simulated span and SLO attainment.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from xpyd.perf.model import PerfModel
from xpyd.perf.shapes import lookup_model
from xpyd.sim.report import build_report
from xpyd.sim.simulator import SimConfig, simulate
from xpyd.traces import load_trace

DATA = Path(__file__).resolve().parents[1] / "data"


def main() -> int:
    """Run the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(DATA / "traces" / "azure_conv_2023.csv"))
    parser.add_argument("--profile", default=str(DATA / "profiles" / "h200_llama31_8b_fp8_tp1"))
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=4)
    parser.add_argument("--speedups", type=float, nargs="+", default=[1, 10, 20, 50])
    parser.add_argument("--repeat", type=int, default=1, help="runs per speed-up (the best is shown)")
    args = parser.parse_args()

    kv_bytes = lookup_model("llama-3.1-8b").kv_bytes_per_token("bf16")
    perf = PerfModel.from_profile(args.profile).with_kv_transfer(kv_bytes, 100.0)
    config = SimConfig(prefill=args.prefill, decode=args.decode)
    out = sys.stdout
    out.write(f"{Path(args.trace).name}, {args.prefill}P/{args.decode}D, {Path(args.profile).name}\n")
    out.write(f"{'speedup':>8} {'requests':>9} {'load s':>7} {'wall s':>7} {'req/s simulated':>16} "
              f"{'events':>8} {'sim span s':>11} {'attainment':>11}\n")
    for speedup in args.speedups:
        started = time.perf_counter()
        trace = load_trace(args.trace, speedup=speedup)
        load_s = time.perf_counter() - started
        best = float("inf")
        for _ in range(args.repeat):
            started = time.perf_counter()
            result = simulate(trace, perf, config)
            best = min(best, time.perf_counter() - started)
        report = build_report(result)
        out.write(f"{speedup:>8g} {len(trace):>9,} {load_s:>7.2f} {best:>7.2f} {len(trace) / best:>16,.0f} "
                  f"{result.events:>8,} {result.end_s:>11,.1f} {report['attainment']:>11.1%}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
