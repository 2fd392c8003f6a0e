"""KV-cache-aware routing against the blind policies and the ceiling, in the simulator (issue 29).

    python benchmarks/kv_routing.py [--prefill 4 8 16] [--workloads mooncake conversations]
                                    [--out benchmarks/results]

Workloads:
- `mooncake`: `data/traces/mooncake_synthetic.jsonl` as recorded (3,993 requests, ISL mean 15,325,
  64% of its prefix blocks repeat an earlier one).
- `conversations`: `xpyd.workloads.conversations()` with its defaults (3,000 multi-turn conversations
  starting 6 a second, 8 shared system prompts of 4,096 tokens, 5 turns on average, each prompt
  the conversation so far; the module says how it is built).

Every engine is the H200 profile's (Llama-3.1-8B FP8, TP1) at its real KV capacity (945,029 tokens,
59,064 blocks of 16), prefix caching on. Static pools of 4, 8 and 16 prefill engines (decode: a
quarter of prefill, at least 2, for Mooncake; half, at least 4, for the conversations) replay
each workload at its own rate under each routing policy:
RoundRobin, LeastLoaded, PowerOfTwo, KVAware over what was routed (`Routed`, the approximate index)
and over the engines' caches (`Events`, the precise index, as the engines' KV events tell it), and
the ceiling: LeastLoaded over one cache shared by all the prefill engines, of their total size.

Per row: the prefill engines' hit rate (prompt tokens found cached / prompt tokens) and its share of
the ceiling's, the prefill GPU-seconds at work and their change against LeastLoaded, TTFT p50 and p99,
and max/mean prefill load (the busiest prefill engine's GPU-seconds at work over the mean).

Then, under LeastLoaded and KVAware (Events) routing, with arrivals `--sizing-speedup` times faster
(default 4: at their own rate both workloads fit on 2-3 prefill engines whatever the routing), the
GPU-hours each needs to serve the workload at 95% SLO attainment (TTFT <= 3 s and TPOT <= 30 ms):
the smallest static pool that reaches 95% (every prefill size up to 16 with the fewest decode
engines that reach it), and the xpyd autoscaler (started at 4 prefill, 2 decode, 120 s start-up)
with its GPU-hours and attainment.

Writes `kv_routing.md` (the tables and this command) and `kv_routing.png` to `--out`.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from xpyd.api.naming import PREFILL
from xpyd.autoscaler.observation import Desired, Slo
from xpyd.common.stats import percentile
from xpyd.perf.model import PerfModel
from xpyd.perf.shapes import lookup_model
from xpyd.sim.policies import simulate_policy
from xpyd.sim.policy import StaticPolicy
from xpyd.sim.report import prefix_cache
from xpyd.sim.simulator import (
    EVENTS,
    KV_AWARE,
    LEAST_LOADED,
    POWER_OF_TWO,
    ROUND_ROBIN,
    ROUTED,
    Routing,
    SimConfig,
    SimResult,
    Simulator,
)
from xpyd.traces import TraceRequest, load_trace
from xpyd.workloads import Conversations, conversations

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "data" / "profiles" / "h200_llama31_8b_fp8_tp1"
SLO = Slo(ttft_s=3.0, tpot_s=0.030)
TARGET = 0.95
CEILING = "ceiling"

POLICIES: dict[str, Routing] = {
    ROUND_ROBIN: Routing(policy=ROUND_ROBIN),
    LEAST_LOADED: Routing(policy=LEAST_LOADED),
    POWER_OF_TWO: Routing(policy=POWER_OF_TWO),
    "KVAware Routed": Routing(policy=KV_AWARE, index=ROUTED),
    "KVAware Events": Routing(policy=KV_AWARE, index=EVENTS),
    CEILING: Routing(policy=LEAST_LOADED, shared_cache=True),
}

WORKLOADS: dict[str, Callable[[float], list[TraceRequest]]] = {
    "mooncake": lambda speedup: load_trace(ROOT / "data" / "traces" / "mooncake_synthetic.jsonl", speedup=speedup),
    "conversations": lambda speedup: conversations(Conversations(rate_per_s=Conversations.rate_per_s * speedup)),
}


@dataclass(frozen=True)
class Row:
    workload: str
    prefill: int
    policy: str
    hit_rate: float
    busy_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    max_over_mean: float
    attainment: float


def perf_model() -> PerfModel:
    return PerfModel.from_profile(str(PROFILE)).with_kv_transfer(
        lookup_model("llama-3.1-8b").kv_bytes_per_token("bf16"), 100.0)


def decode_for(workload: str, prefill: int) -> int:
    """Enough decode engines that decode is not what limits the pool (conversations' answers are twice as long)."""
    return max(2, prefill // 4) if workload == "mooncake" else max(4, prefill // 2)


def attainment(result: SimResult) -> float:
    _, met = result.meets(SLO)
    return sum(met) / len(met)


def replay(trace: list[TraceRequest], perf: PerfModel, prefill: int, decode: int, routing: Routing) -> tuple[
        SimResult, list[float]]:
    """One static replay; the prefill engines' GPU-seconds at work, each."""
    simulator = Simulator(trace, perf, StaticPolicy(Desired(prefill, decode)),
                          SimConfig(prefill=prefill, decode=decode, slo=SLO, routing=routing))
    result = simulator.run()
    return result, [core.busy_seconds for core in simulator.engines(PREFILL)]


def row(workload: str, trace: list[TraceRequest], perf: PerfModel, prefill: int, policy: str) -> Row:
    result, busy = replay(trace, perf, prefill, decode_for(workload, prefill), POLICIES[policy])
    ttft = sorted(t for t in result.ttft_s if not math.isnan(t))
    mean = sum(busy) / len(busy)
    return Row(workload, prefill, policy, prefix_cache(result)[PREFILL]["hit_rate"], sum(busy),
               percentile(ttft, 0.5), percentile(ttft, 0.99), max(busy) / mean if mean else math.nan,
               attainment(result))


def smallest_static(trace: list[TraceRequest], perf: PerfModel, routing: Routing) -> tuple[int, int, float, float]:
    """The static pool of the fewest GPUs reaching TARGET: (prefill, decode, GPU-hours, attainment)."""
    best: tuple[int, int, float, float] | None = None
    for prefill in range(1, 17):
        for decode in range(1, 9):
            if best is not None and prefill + decode >= best[0] + best[1]:
                break
            result, _ = replay(trace, perf, prefill, decode, routing)
            reached = attainment(result)
            if reached >= TARGET:
                best = (prefill, decode, sum(result.gpu_seconds.values()) / 3600, reached)
                break
    if best is None:
        raise SystemExit(f"no static pool up to 16 prefill and 8 decode reaches {TARGET:.0%}")
    return best


def autoscaled(trace: list[TraceRequest], perf: PerfModel, routing: Routing) -> tuple[float, float]:
    config = SimConfig(prefill=4, decode=2, slo=SLO, startup_delay_s=120.0, routing=routing)
    result = simulate_policy("xpyd", trace, perf, config)
    return sum(result.gpu_seconds.values()) / 3600, attainment(result)


def table(rows: list[Row]) -> list[str]:
    ceiling = {(r.workload, r.prefill): r.hit_rate for r in rows if r.policy == CEILING}
    blind = {(r.workload, r.prefill): r.busy_s for r in rows if r.policy == LEAST_LOADED}
    lines = ["| workload | prefill | policy | hit rate | of ceiling | prefill GPU-s | vs LeastLoaded | TTFT p50 s "
             "| TTFT p99 s | max/mean load | attainment |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        key = (r.workload, r.prefill)
        share = r.hit_rate / ceiling[key] if ceiling.get(key) else math.nan
        lines.append(f"| {r.workload} | {r.prefill} | {r.policy} | {r.hit_rate:.1%} | {share:.0%} | {r.busy_s:,.0f} | "
                     f"{r.busy_s / blind[key] - 1:+.0%} | {r.ttft_p50_s:.2f} | {r.ttft_p99_s:.2f} | "
                     f"{r.max_over_mean:.2f} | {r.attainment:.1%} |")
    return lines


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r.workload for r in rows}, key=list(WORKLOADS).index)
    sizes = sorted({r.prefill for r in rows})
    figure, axes = plt.subplots(2, len(workloads), figsize=(6.5 * len(workloads), 8), squeeze=False)
    width = 0.8 / len(POLICIES)
    for column, workload in enumerate(workloads):
        for number, policy in enumerate(POLICIES):
            picked = {r.prefill: r for r in rows if r.workload == workload and r.policy == policy}
            xs = [i + (number - len(POLICIES) / 2 + 0.5) * width for i in range(len(sizes))]
            axes[0][column].bar(xs, [picked[s].hit_rate * 100 if s in picked else 0 for s in sizes], width,
                                label=policy)
            axes[1][column].bar(xs, [picked[s].busy_s if s in picked else 0 for s in sizes], width, label=policy)
        for line, label in ((0, "prefill hit rate (%)"), (1, "prefill GPU-seconds at work")):
            axes[line][column].set_xticks(range(len(sizes)), [f"{s} prefill" for s in sizes])
            axes[line][column].set_ylabel(label)
            axes[line][column].grid(axis="y", alpha=0.3)
        axes[0][column].set_title(workload)
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(POLICIES), fontsize=9)
    figure.suptitle("KV-aware routing vs blind policies and the shared-cache ceiling (H200 profile, real KV capacity)")
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> int:
    """Run the tables, print them, write them and the plot."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--speedup", type=float, default=1.0,
                        help="arrivals this many times faster (Mooncake: its timestamps divided; conversations: "
                             "started this many times faster)")
    parser.add_argument("--sizing-speedup", type=float, default=4.0,
                        help="arrivals this many times faster for the GPU-hours at 95%% (default 4)")
    parser.add_argument("--no-autoscaler", action="store_true", help="skip the GPU-hours at 95%% (the slow part)")
    args = parser.parse_args()
    if min(args.prefill) < 1:
        parser.error("--prefill sizes must be at least 1")

    perf = perf_model()
    out = sys.stdout
    rows: list[Row] = []
    sizing: list[str] = []
    for workload in args.workloads:
        trace = WORKLOADS[workload](args.speedup)
        for prefill in args.prefill:
            for policy in POLICIES:
                rows.append(row(workload, trace, perf, prefill, policy))
            out.write("\n".join(table([r for r in rows if (r.workload, r.prefill) == (workload, prefill)])) + "\n")
            out.flush()
        if not args.no_autoscaler:
            trace = WORKLOADS[workload](args.speedup * args.sizing_speedup)
            for policy in (LEAST_LOADED, "KVAware Events"):
                routing = POLICIES[policy]
                prefill, decode, hours, reached = smallest_static(trace, perf, routing)
                scaled_hours, scaled = autoscaled(trace, perf, routing)
                sizing.append(f"| {workload} | {policy} | {prefill} P + {decode} D | {hours:.2f} | {reached:.1%} "
                              f"| {scaled_hours:.2f} | {scaled:.1%} |")
                out.write(sizing[-1] + "\n")
                out.flush()

    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/kv_routing.py " + " ".join(sys.argv[1:])
    text = ["# KV-aware routing (benchmarks/kv_routing.py)", "", f"    {command.strip()}", "",
            *table(rows), ""]
    if sizing:
        text += [f"GPU-hours to serve each workload at {TARGET:.0%} attainment (TTFT <= 3 s, TPOT <= 30 ms), arrivals "
                 f"{args.sizing_speedup:g} times faster:", "",
                 "| workload | routing | smallest static pool | GPU-hours | attainment | xpyd autoscaler GPU-hours "
                 "| attainment |", "|---|---|---|---:|---:|---:|---:|", *sizing, ""]
    (args.out / "kv_routing.md").write_text("\n".join(text))
    plot(rows, args.out / "kv_routing.png")
    out.write(f"wrote {args.out / 'kv_routing.md'} and {args.out / 'kv_routing.png'}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
