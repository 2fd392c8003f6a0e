"""What the engines' prefix caches save on a trace with shared prefixes (issue 28).

    python benchmarks/prefix_cache.py [--trace data/traces/mooncake_synthetic.jsonl] [--prefill 1 4 8 16]
                                      [--decode 2] [--profile PREFIX]

First the trace's own repeat share (`xpyd.kvcache.chains.repeat_share`: the share of its prefix blocks
whose prefix an earlier request had) and the hit rate of one prefill engine that never evicts. Then
one row per prefill pool size, static pools replaying the trace at real time, every engine at the
profile's KV capacity (the H200 profile's 945,029 tokens, 59,064 blocks of 16), the simulator's proxy
routing each prefill to the engine with the fewest outstanding prompt tokens (least-loaded, blind to
the caches): the prefill engines' hit rate (prompt tokens found cached / prompt tokens), the prompt
tokens they computed, their GPU-seconds at work (the time their steps took) with the caches and
without them (`--no-enable-prefix-caching`), p90 TTFT with and without, and the decode engines' hit
rate and the prompt tokens they loaded from prefill.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from xpyd.api.naming import DECODE, PREFILL
from xpyd.autoscaler.observation import Slo
from xpyd.common.stats import percentile
from xpyd.kvcache.chains import repeat_share
from xpyd.perf.model import PerfModel
from xpyd.perf.shapes import lookup_model
from xpyd.sim.core import EngineConfig
from xpyd.sim.report import prefix_cache
from xpyd.sim.simulator import SimConfig, SimResult, simulate
from xpyd.traces import TraceRequest, load_trace

DATA = Path(__file__).resolve().parents[1] / "data"


def replay(trace: list[TraceRequest], perf: PerfModel, prefill: int, decode: int, *, caching: bool,
           max_kv_tokens: int | None = None) -> SimResult:
    engine = EngineConfig(enable_prefix_caching=caching, max_kv_tokens=max_kv_tokens)
    return simulate(trace, perf, SimConfig(prefill=prefill, decode=decode, slo=Slo(ttft_s=3.0, tpot_s=0.03),
                                           engine=engine))


def p90_ttft_s(result: SimResult) -> float:
    return percentile(sorted(t for t in result.ttft_s if not math.isnan(t)), 0.9)


def main() -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(DATA / "traces" / "mooncake_synthetic.jsonl"))
    parser.add_argument("--profile", default=str(DATA / "profiles" / "h200_llama31_8b_fp8_tp1"))
    parser.add_argument("--prefill", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--decode", type=int, default=2)
    args = parser.parse_args()

    perf = PerfModel.from_profile(args.profile).with_kv_transfer(
        lookup_model("llama-3.1-8b").kv_bytes_per_token("bf16"), 100.0)
    trace = load_trace(args.trace)
    out = sys.stdout
    unbounded = prefix_cache(replay(trace, perf, 1, args.decode, caching=True, max_kv_tokens=10**12))[PREFILL]
    out.write(f"{Path(args.trace).name}: {len(trace):,} requests, {sum(r.isl for r in trace):,} prompt tokens; "
              f"repeat share {repeat_share(r.prefix_blocks for r in trace):.2%} of its prefix blocks; "
              f"one prefill engine that never evicts hits {unbounded['hit_rate']:.2%}\n")
    out.write(f"KV capacity {perf.max_kv_tokens:,} tokens an engine ({perf.max_kv_tokens // 16:,} blocks of 16), "
              f"{args.decode} decode engines, least-loaded routing\n")
    out.write(f"{'prefill':>7} {'P hit rate':>10} {'P computed':>14} {'P busy GPU-s':>12} {'no cache':>9} "
              f"{'saved':>6} {'p90 TTFT s':>10} {'no cache':>9} {'D hit rate':>10} {'D loaded':>14}\n")
    for size in args.prefill:
        cached = replay(trace, perf, size, args.decode, caching=True)
        plain = replay(trace, perf, size, args.decode, caching=False)
        on, off = cached.busy_seconds[PREFILL], plain.busy_seconds[PREFILL]
        figures = prefix_cache(cached)
        out.write(f"{size:>7} {figures[PREFILL]['hit_rate']:>10.1%} {figures[PREFILL]['computed_tokens']:>14,} "
                  f"{on:>12,.0f} {off:>9,.0f} {1 - on / off:>6.1%} {p90_ttft_s(cached):>10.2f} "
                  f"{p90_ttft_s(plain):>9.2f} {figures[DECODE]['hit_rate']:>10.1%} "
                  f"{figures[DECODE]['transferred_tokens']:>14,}\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
