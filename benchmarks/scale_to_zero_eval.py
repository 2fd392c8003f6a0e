"""Scale to zero in the simulator (issue 31): the GPU-hours a pool at `minReplicas: 0` saves against
`minReplicas: 1` on a workload with idle gaps, and what the requests that arrive at zero get.

    python benchmarks/scale_to_zero_eval.py [--startups 120 30] [--idles 300 600 900] [--out FILE]

The workload ("office hours"): `data/traces/azure_conv_2023.csv` at real time (one hour, 19,366
requests, ~5.4 req/s) cut into its six consecutive 10-minute slices, laid end to end with idle
gaps of 5, 15, 30, 60 and 120 minutes between them (`idle_gaps`): 60 minutes of traffic in 4 h 50 min,
each request at its own offset within its slice. The gaps straddle the idle windows evaluated:
one shorter than all of them (no zero), one just above the shortest, three long.

Every run is the `xpyd` policy (`decide()`) on the same simulator, profile
`h200_llama31_8b_fp8_tp1`, SLOs TTFT <= 500 ms and TPOT <= 25 ms, decisions every 30 s over 60 s
windows:

- `min1`: minReplicas 1 on both roles (the pool steps down to 1P/1D in a gap and stays);
- `zero/<idle>`: minReplicas 0 on both roles and that idle window; the proxies' waiting rooms
  hold what arrives with no ready pair for up to 2 x start-up + 60 s (512 requests at most: the
  default 256 in each of the default two proxies, as the operator renders them), and the demand
  signal brings a decision forward 1 s after a request is held;
- `zero/<idle>/room-4096`: the same with rooms for 4,096 requests (`maxWaitingRequests: 2048`);
- `zero/<idle>/no-signal`: the same without the signal (the pool wakes at the next 30 s tick).

Reported per run: GPU-hours and the saving against `min1`, the attainment of all requests, of the
others and of those that arrived with no ready pair (held: at zero, or while it started from
zero), how many of those were served at all and their TTFT, the number of cold starts (scale-ups
from zero), and what the rooms dropped (429 when full, 503 after the timeout).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from xpyd.autoscaler.observation import Slo
from xpyd.perf.model import PerfModel
from xpyd.perf.shapes import lookup_model
from xpyd.sim.main import scale_to_zero
from xpyd.sim.policies import simulate_policy
from xpyd.sim.report import build_report
from xpyd.sim.simulator import SimConfig, SimResult
from xpyd.traces import TraceRequest, load_trace

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "data" / "traces" / "azure_conv_2023.csv"
PROFILE = "h200_llama31_8b_fp8_tp1"
SLO = Slo(ttft_s=0.5, tpot_s=0.025)
SLICE_S = 600.0
GAPS_S = (300.0, 900.0, 1800.0, 3600.0, 7200.0)


def idle_gaps(requests: list[TraceRequest], slice_s: float = SLICE_S,
              gaps_s: tuple[float, ...] = GAPS_S) -> list[TraceRequest]:
    """The trace's consecutive `slice_s` slices laid end to end with the idle gaps `gaps_s` between
    them (one slice more than gaps; the rest of the trace is dropped)."""
    out: list[TraceRequest] = []
    start = 0.0
    for index in range(len(gaps_s) + 1):
        lo, hi = index * slice_s, (index + 1) * slice_s
        out += [TraceRequest(start + r.arrival_s - lo, r.isl, r.osl, r.prefix_blocks)
                for r in requests if lo <= r.arrival_s < hi]
        start += slice_s + (gaps_s[index] if index < len(gaps_s) else 0.0)
    return out


def perf_model() -> PerfModel:
    kv_bytes = lookup_model("llama-3.1-8b").kv_bytes_per_token("bf16")
    return PerfModel.from_profile(PROFILE).with_kv_transfer(kv_bytes, 100.0)


def cold_starts(result: SimResult) -> int:
    """Policy calls that took the pool from zero of both roles to some."""
    return sum(1 for d in result.decisions if d.prefill_before == d.decode_before == 0 and (d.prefill or d.decode))


def run(trace: list[TraceRequest], startup_s: float, idle_s: float | None, signal: bool = True,
        room: int = 2 * 256) -> dict[str, Any]:
    base = SimConfig(slo=SLO, startup_delay_s=startup_s, interval_s=30.0, window_s=60.0)
    if idle_s is None:
        result = simulate_policy("xpyd", trace, perf_model(), base)
    else:
        fields = scale_to_zero(startup_s, 1.0 if signal else None, room)
        config = SimConfig(slo=SLO, startup_delay_s=startup_s, interval_s=30.0, window_s=60.0, **fields)
        result = simulate_policy("xpyd", trace, perf_model(), config, idle_s=idle_s)
    report = build_report(result, trace_name=TRACE.name)
    _, met = result.meets(SLO)
    others = [ok for ok, held in zip(met, result.held or [False] * len(met), strict=True) if not held]
    held = report.get("held", {"requests": 0, "served": None, "attainment": None, "overflow": 0, "expired": 0,
                                "ttft_ms": {"p50": None, "p99": None}})
    return {"gpu_hours": report["gpu_hours"], "attainment": report["attainment"], "held": held,
            "attainment_not_held": round(sum(others) / len(others), 6) if others else None,
            "cold_starts": cold_starts(result), "requests": report["requests"], "duration_s": report["duration_s"]}


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--startups", type=float, nargs="+", default=[120.0, 30.0])
    parser.add_argument("--idles", type=float, nargs="+", default=[300.0, 600.0, 900.0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scale_to_zero.json")
    parser.add_argument("--duration", type=float, default=None,
                        help="keep the workload's first S seconds (quick looks, the smoke test)")
    args = parser.parse_args()
    trace = idle_gaps(load_trace(TRACE))
    if args.duration is not None:
        trace = [r for r in trace if r.arrival_s < args.duration]
    span_h = trace[-1].arrival_s / 3600.0
    say(f"workload: {TRACE.name} in {len(GAPS_S) + 1} slices of {SLICE_S / 60:.0f} min with gaps of "
          + ", ".join(f"{g / 60:.0f}" for g in GAPS_S) + f" min: {len(trace):,} requests over {span_h:.2f} h")
    results: dict[str, Any] = {}
    header = (f"{'start-up':>8}  {'run':<22} {'GPU-h':>7} {'saved':>13} {'attain':>7} {'others':>7} {'held':>6} "
              f"{'served':>7} {'held att':>8} {'held TTFT p50/p99 s':>20} {'cold':>5} {'dropped':>7}")
    say(header)
    for startup in args.startups:
        runs: dict[str, Any] = {"min1": run(trace, startup, None)}
        for idle in args.idles:
            runs[f"zero/{idle:.0f}"] = run(trace, startup, idle)
        middle = args.idles[len(args.idles) // 2]
        runs[f"zero/{middle:.0f}/room-4096"] = run(trace, startup, middle, room=4096)
        runs[f"zero/{middle:.0f}/no-signal"] = run(trace, startup, middle, signal=False)
        baseline = runs["min1"]["gpu_hours"]
        for name, r in runs.items():
            saved = baseline - r["gpu_hours"]
            r["saved_gpu_hours"] = round(saved, 4)
            r["saved_share"] = round(saved / baseline, 4) if baseline else None
            held = r["held"]
            ttft = held["ttft_ms"]
            ttft_s = ("-" if ttft["p50"] is None else f"{ttft['p50'] / 1000:,.1f} / {ttft['p99'] / 1000:,.1f}")
            served = "-" if held["served"] is None else f"{held['served']:.1%}"
            held_att = "-" if held["attainment"] is None else f"{held['attainment']:.1%}"
            say(f"{startup:>7.0f}s  {name:<22} {r['gpu_hours']:>7.2f} {saved:>6.2f} ({r['saved_share']:>5.1%}) "
                  f"{r['attainment']:>7.1%} {r['attainment_not_held']:>7.1%} {held['requests']:>6} {served:>7} "
                  f"{held_att:>8} {ttft_s:>20} "
                  f"{r['cold_starts']:>5} {held['overflow'] + held['expired']:>7}")
        results[f"startup{startup:.0f}"] = runs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"workload": {"trace": TRACE.name, "slice_s": SLICE_S, "gaps_s": GAPS_S,
                                                 "requests": len(trace)}, "runs": results}, indent=2) + "\n")
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
