"""How prompt work bunches on arrival, and what it costs the steady prefill model (issue 30).

    python benchmarks/arrival_bunching.py [--trace data/traces/azure_conv_2023.csv] [--rate-scale 10]
                                          [--start 900] [--span 180] [--prefill 2 3 4] [--decode 4]

The autoscaler's steady prefill model (`sizing.PoolModel`, M/G/c) takes arrivals as Poisson; the
proxies measure how they really bunch (`xpyd.common.bunching`), and prefill is sized for that too
(`xpyd.autoscaler.arrivals`). This prints the evidence for a span of a trace (by default conv x10,
the three minutes from 900 s where the autoscaler, before, shrank prefill into misses):

- per slot length, the prompt tokens sharing a request's slot at the 90th and 99th percentile of
  requests over their mean over requests, for the trace, for the same trace unscaled (x1: whether the bunching is
  the trace's or its copies'), and for a Poisson stream of the same rate and prompts (seeded);
- per prefill pool size: the utilisation the model sees, the TTFT attainment (500 ms target) it
  predicts, and what a replay of the whole trace on that fixed pool shows for the span's requests.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from xpyd.autoscaler.observation import Slo
from xpyd.autoscaler.sizing import PoolModel, PromptMix
from xpyd.common.bunching import WINDOWS_S
from xpyd.perf.model import PerfModel
from xpyd.perf.shapes import lookup_model
from xpyd.sim.simulator import SimConfig, simulate
from xpyd.traces import TraceRequest, load_trace

ROOT = Path(__file__).resolve().parents[1]
SLO = Slo(ttft_s=0.5, tpot_s=0.025)
PROFILE = "h200_llama31_8b_fp8_tp1"


def slot_ratios(arrivals: Sequence[tuple[float, int]], window_s: float) -> tuple[float, float]:
    """The prompt tokens sharing a request's slot at p90 and p99 of requests, over their mean."""
    work: Counter[int] = Counter()
    for t, tokens in arrivals:
        work[int(t // window_s)] += tokens
    shares = sorted(work[int(t // window_s)] for t, _ in arrivals)
    mean = statistics.fmean(shares)
    return shares[int(0.9 * len(shares))] / mean, shares[min(len(shares) - 1, int(0.99 * len(shares)))] / mean


def poisson_like(arrivals: Sequence[tuple[float, int]], start: float, end: float,
                 seed: int = 0) -> list[tuple[float, int]]:
    """A Poisson stream over [start, end) at the same rate, its prompts drawn from the same ones."""
    rng = random.Random(seed)
    rate = len(arrivals) / (end - start)
    prompts = [tokens for _, tokens in arrivals]
    out: list[tuple[float, int]] = []
    t = start + rng.expovariate(rate)
    while t < end:
        out.append((t, rng.choice(prompts)))
        t += rng.expovariate(rate)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(ROOT / "data" / "traces" / "azure_conv_2023.csv"))
    parser.add_argument("--rate-scale", type=int, default=10)
    parser.add_argument("--start", type=float, default=900.0)
    parser.add_argument("--span", type=float, default=180.0)
    parser.add_argument("--prefill", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--decode", type=int, default=4)
    args = parser.parse_args()
    start, end = args.start, args.start + args.span

    def span_of(requests: Sequence[TraceRequest]) -> list[TraceRequest]:
        return [r for r in requests if start <= r.arrival_s < end]

    trace = load_trace(Path(args.trace), rate_scale=args.rate_scale)
    chosen = span_of(trace)
    if len(chosen) < 10:
        sys.stderr.write(f"only {len(chosen)} requests between {start:g} s and {end:g} s\n")
        return 2
    arrivals = [(r.arrival_s, r.isl) for r in chosen]
    unscaled = [(r.arrival_s, r.isl) for r in span_of(load_trace(Path(args.trace)))]
    rate = len(chosen) / args.span
    sys.stdout.write(f"{Path(args.trace).name} x{args.rate_scale}, {start:g}-{end:g} s: {len(chosen):,} requests, "
                     f"{rate:.1f} req/s, mean prompt {statistics.fmean(r.isl for r in chosen):.0f} tokens\n\n")
    sys.stdout.write("slot s | trace p90/mean | trace p99/mean | x1 p90/mean | x1 p99/mean | Poisson p90/mean | "
                     "Poisson p99/mean\n")
    poisson = poisson_like(arrivals, start, end)
    for window in WINDOWS_S:
        cells = [slot_ratios(a, window) if len(a) >= 10 else (float("nan"),) * 2 for a in (arrivals, unscaled, poisson)]
        sys.stdout.write(f"{window:g} | " + " | ".join(f"{v:.2f}x" for pair in cells for v in pair) + "\n")

    perf = PerfModel.from_profile(PROFILE).with_kv_transfer(lookup_model("llama-3.1-8b").kv_bytes_per_token("bf16"),
                                                            100.0)
    model = PoolModel(perf, ttft_target_s=SLO.ttft_s, tpot_target_s=SLO.tpot_s, quantile=0.95)
    mix = PromptMix.from_samples([r.isl for r in chosen])
    offered = rate * statistics.fmean(model.service_seconds(x) for x in mix.isl_tokens)
    itl_s = model.decode_frontier(mix.mean + 100.0)[1]
    sys.stdout.write("\nprefill | utilisation | model's TTFT attainment | replayed TTFT attainment\n")
    for prefill in args.prefill:
        result = simulate(trace, perf, SimConfig(prefill=prefill, decode=args.decode, slo=SLO, startup_delay_s=0.0))
        within = [t <= SLO.ttft_s for t, a in zip(result.ttft_s, result.arrival_s, strict=True) if start <= a < end]
        predicted = model.prefill_attainment(prefill, rate, mix, itl_s)
        sys.stdout.write(f"{prefill} | {offered / prefill:.2f} | {predicted:.1%} | {sum(within) / len(within):.1%}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
