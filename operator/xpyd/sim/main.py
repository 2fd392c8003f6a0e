"""`xpyd sim`: the simulator's command line (load a trace and a profile, replay, report, plot)."""

from __future__ import annotations

import argparse
import json
import sys
import time as wallclock
from pathlib import Path
from typing import Any, TextIO

from xpyd.api.models import DEFAULT_REACT_SECONDS
from xpyd.autoscaler.observation import Slo
from xpyd.sim.core import EngineConfig, EnginePerf
from xpyd.sim.oracle import OracleRefusal, run_verdict
from xpyd.sim.policies import POLICIES, simulate_policy
from xpyd.sim.simulator import SimConfig


class ProgressBar:
    """A one-line progress bar on a stream (stderr), redrawn in place."""

    def __init__(self, stream: TextIO, label: str = "xpyd sim", width: int = 30) -> None:
        self.stream = stream
        self.label = label
        self.width = width

    def __call__(self, done: int, total: int, sim_time_s: float) -> None:
        """Redraw for `done` of `total` arrivals at simulated time `sim_time_s`."""
        filled = self.width * done // total
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {done}/{total} requests, t={sim_time_s:,.0f} s")
        if done == total:
            self.stream.write("\n")
        self.stream.flush()


def add_parser(subparsers: Any) -> None:
    """Register `xpyd sim` on an argparse sub-parsers object."""
    sim = subparsers.add_parser("sim", help="replay a request trace through a simulated P/D cluster under an "
                                "autoscaling policy")
    sim.add_argument("--trace", required=True, help="trace file: CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or "
                     "Mooncake JSONL (timestamp ms, input_length, output_length, hash_ids)")
    sim.add_argument("--profile", required=True, help="performance profile prefix: PREFIX_prefill.csv and "
                     "PREFIX_decode.csv")
    sim.add_argument("--model", default="llama-3.1-8b", help="model whose KV shape sizes the P->D transfer "
                     "(default llama-3.1-8b, the shipped profile's)")
    sim.add_argument("--kv-dtype", default="bf16", help="KV-cache dtype for the transfer size (default bf16)")
    sim.add_argument("--link-gbps", type=float, default=100.0, help="prefill-to-decode link in Gb/s (default 100)")
    sim.add_argument("--policy", default="static", help=f"autoscaling policy ({', '.join(sorted(POLICIES))}); "
                     "oracle: the hindsight schedule of 60 s windows, each meeting --attainment of its requests, "
                     "verified as it runs (this start-up and interval, from its own starting sizes, not "
                     "--prefill/--decode); where it cannot meet that it exits 2 naming the windows, rather than "
                     "print a run that misses it")
    sim.add_argument("--prefill", type=int, default=1, help="prefill replicas (static size, or the starting size)")
    sim.add_argument("--decode", type=int, default=1, help="decode replicas (static size, or the starting size)")
    sim.add_argument("--speedup", type=float, default=1.0, help="compress the trace's time K times (quick looks)")
    sim.add_argument("--rate-scale", type=int, default=1, metavar="K", help="replay each request as K requests "
                     "with its lengths, spread within a seeded jitter of the mean gap / K: K times the load at the "
                     "trace's own time scale, for large pools (default 1)")
    sim.add_argument("--start", type=float, default=0.0, help="window start, seconds of trace time")
    sim.add_argument("--duration", type=float, default=None, help="window length, seconds of trace time")
    sim.add_argument("--slo-ttft-ms", type=float, default=500.0, help="time-to-first-token target")
    sim.add_argument("--slo-tpot-ms", type=float, default=50.0, help="time-per-output-token target")
    sim.add_argument("--startup-delay-s", type=float, default=120.0, help="time a new replica takes to serve")
    sim.add_argument("--interval-s", type=float, default=30.0, help="seconds between policy decisions")
    sim.add_argument("--window-s", type=float, default=60.0, help="metrics window the policy sees")
    sim.add_argument("--scale-to-zero", type=float, default=None, metavar="IDLE_S",
                     help="let the pool go to zero (policy xpyd: after IDLE_S idle seconds; --prefill/--decode may "
                     "be 0): the proxy holds requests while no pair is ready, up to 2 x start-up + 60 s, and a held "
                     "request brings a decision forward by --signal-delay-s; the room holds 512 requests (two "
                     "proxies' default)")
    sim.add_argument("--signal-delay-s", type=float, default=1.0,
                     help="with --scale-to-zero: how soon a held request makes the policy decide (default 1)")
    sim.add_argument("--attainment", type=float, default=0.95, metavar="A",
                     help="the target attainment, the share of requests to meet both SLOs (0 < A < 1; default 0.95): "
                     "policy xpyd aims at it (its model sizes each SLO at percentile 100 A); the oracle, "
                     "static-peak and static-mean size from an oracle search for it")
    sim.add_argument("--react-seconds", type=float, default=float(DEFAULT_REACT_SECONDS), metavar="S",
                     help="policy xpyd: between decisions, read the gauges every S seconds and scale up at once on a "
                     f"backlog, as the operator's autoscaling.reactSeconds (default {DEFAULT_REACT_SECONDS}; 0: off)")
    sim.add_argument("--max-num-batched-tokens", type=int, default=8192, help="engine token budget per step")
    sim.add_argument("--max-num-seqs", type=int, default=256, help="engine running-request limit")
    sim.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                     help="the engines' prefix caches (vLLM's default: on); a trace's prefix blocks (Mooncake's "
                     "hash_ids) say which prompts share blocks, a trace without them shares nothing")
    sim.add_argument("--block-size", type=int, default=16, help="engine KV block size in tokens (default 16)")
    sim.add_argument("--report", help="write the report JSON here")
    sim.add_argument("--plot", help="write a PNG of load, replicas, TTFT and TPOT over time here")
    sim.add_argument("--seed", type=int, default=0, help="seed of the routing tie-breaks and the --rate-scale "
                     "jitter")
    sim.add_argument("--progress", action="store_true", help="show a progress bar even when stderr is no TTY")
    sim.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """`xpyd sim`: load, simulate, report. Bad input: a message on stderr and exit code 2."""
    from xpyd.sim.report import build_report, summary
    from xpyd.traces import TraceError, load_trace

    def fail(message: str) -> int:
        sys.stderr.write(f"xpyd sim: {message}\n")
        return 2

    try:
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            if not getattr(args, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if not 0.0 < args.attainment < 1.0:
            raise ValueError(f"--attainment must be between 0 and 1 (exclusive), not {args.attainment:g}")
        if not args.react_seconds >= 0:
            raise ValueError(f"--react-seconds must be 0 (off) or positive, not {args.react_seconds:g}")
        if args.policy not in POLICIES:
            raise ValueError(f"unknown policy {args.policy!r} (known: {', '.join(sorted(POLICIES))})")
        config = SimConfig(
            prefill=args.prefill, decode=args.decode,
            slo=Slo(ttft_s=args.slo_ttft_ms / 1000.0, tpot_s=args.slo_tpot_ms / 1000.0),
            startup_delay_s=args.startup_delay_s, interval_s=args.interval_s, window_s=args.window_s,
            seed=args.seed, engine=EngineConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                                max_num_seqs=args.max_num_seqs,
                                                enable_prefix_caching=args.enable_prefix_caching,
                                                block_size=args.block_size),
            **(scale_to_zero(args.startup_delay_s, args.signal_delay_s) if args.scale_to_zero is not None else {}))
        trace = load_trace(args.trace, speedup=args.speedup, start_s=args.start, duration_s=args.duration,
                           rate_scale=args.rate_scale, seed=args.seed)
        perf = _load_profile(args.profile, args.model, args.kv_dtype, args.link_gbps)
    except (TraceError, OSError, ValueError, KeyError) as error:
        return fail(str(error))
    progress = ProgressBar(sys.stderr) if args.progress or sys.stderr.isatty() else None
    started = wallclock.perf_counter()
    try:
        result = simulate_policy(args.policy, trace, perf, config, progress, idle_s=args.scale_to_zero,
                                 attainment=args.attainment, react_s=args.react_seconds or None)
    except OracleRefusal as error:   # no oracle result that silently misses what it was built for
        return fail(str(error))
    wall_s = wallclock.perf_counter() - started
    report = build_report(result, trace_name=Path(args.trace).name, speedup=args.speedup,
                          rate_scale=args.rate_scale)
    if args.policy == "oracle":
        report["oracle"] = run_verdict(result, args.attainment)
    try:
        if args.report:
            Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
        if args.plot:
            from xpyd.sim.report import plot
            plot(result, args.plot, title=f"{Path(args.trace).name} x{args.speedup:g}")
    except OSError as error:
        return fail(f"cannot write: {error}")
    verdict = f"  {report['oracle']['summary']}\n" if "oracle" in report else ""
    sys.stdout.write(summary(report, wall_s) + "\n" + verdict)
    return 0


def scale_to_zero(startup_delay_s: float, signal_delay_s: float | None, room: int = 2 * 256) -> dict[str, Any]:
    """The `SimConfig` fields of a pool that scales to zero, as the operator renders its proxies: the
    waiting room holds a request up to 2 x start-up + 60 s (`autoscaling.scaleToZero.waitSeconds`'
    default) and `room` requests at most (default: `maxWaitingRequests`' 256 in each of the default
    two proxies), and the demand signal reaches the policy in `signal_delay_s` (None: no signal)."""
    return {"min_replicas": 0, "wait_timeout_s": 2 * startup_delay_s + 60.0, "wait_max_requests": room,
            "signal_delay_s": signal_delay_s}


def _load_profile(prefix: str, model: str, kv_dtype: str, link_gbps: float) -> EnginePerf:
    from xpyd.perf.model import PerfModel
    from xpyd.perf.shapes import lookup_model

    if not link_gbps > 0:
        raise ValueError("--link-gbps must be positive")
    kv_bytes_per_token = lookup_model(model).kv_bytes_per_token(kv_dtype)
    perf: EnginePerf = PerfModel.from_profile(prefix).with_kv_transfer(kv_bytes_per_token, link_gbps)
    return perf
