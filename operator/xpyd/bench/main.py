"""`xpyd bench`: replay a trace (or a synthetic Poisson load) against an OpenAI-compatible endpoint
and measure TTFT, TPOT, SLO attainment and goodput.

    xpyd bench --url http://127.0.0.1:8000 --trace azure_conv_2023.csv --speedup 10 --duration 60
    xpyd bench --url http://127.0.0.1:8000 --rate 5 --isl 1024 --osl 128 --duration 30

Requests are streamed `/v1/completions` with prompts of the trace's lengths and `ignore_eos`, sent
open-loop at their arrival times. Exit codes: 0 done; 2 bad arguments, an unreadable trace or no
model to ask for; 3 attainment below `--min-attainment`. Failed requests (refused connections,
timeouts, HTTP errors, overflow of `--max-concurrency`) are counted, not fatal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from xpyd.bench.report import SloMs, attainment_message, exit_code, format_summary
from xpyd.bench.runner import BenchConfig, BenchError, BenchResult, run_bench_sync
from xpyd.common.netguard import LOOPBACK_ONLY_ENV

API_KEY_ENV = "OPENAI_API_KEY"
"""Set to 1 to refuse URLs outside 127.0.0.0/8 (as `--loopback-only`)."""


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, not {text}")
    return value


def add_parser(subparsers: Any) -> None:
    """Register `xpyd bench` on the `xpyd` command's sub-parsers."""
    parser = subparsers.add_parser("bench", help="replay a trace (or synthetic load) against an OpenAI-compatible "
                                   "endpoint and measure SLO attainment", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000 (the proxy or a "
                        "vLLM engine; /v1/completions is appended)")
    parser.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"bearer token (default ${API_KEY_ENV})")
    load = parser.add_argument_group("load (one of --trace, --rate)")
    source = load.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="trace file: CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or Mooncake "
                        "JSONL (timestamp ms, input_length, output_length, hash_ids)")
    source.add_argument("--rate", type=float, help="synthetic Poisson load, requests per second")
    load.add_argument("--isl", type=int, default=1024, help="--rate: prompt tokens per request (default 1024)")
    load.add_argument("--osl", type=int, default=128, help="--rate: output tokens per request (default 128)")
    load.add_argument("--speedup", type=float, default=1.0, help="--trace: compress the trace's time K times")
    load.add_argument("--start", type=float, default=0.0, help="--trace: window start, seconds of trace time")
    load.add_argument("--duration", type=float, default=None, help="window length: seconds of trace time for "
                      "--trace (the run takes duration/speedup), wall seconds for --rate")
    load.add_argument("--max-requests", type=int, default=None, help="send at most this many requests")
    load.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals and the prompt texts")
    limits = parser.add_argument_group("limits")
    limits.add_argument("--max-concurrency", type=int, default=1024, help="requests in flight; arrivals beyond "
                        "it are dropped and counted as failed, never delayed (default 1024)")
    limits.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    limits.add_argument("--loopback-only", action="store_true", default=os.environ.get(LOOPBACK_ONLY_ENV) == "1",
                        help=f"refuse a URL outside 127.0.0.0/8 (also ${LOOPBACK_ONLY_ENV}=1)")
    slo = parser.add_argument_group("SLOs and output")
    slo.add_argument("--slo-ttft-ms", type=float, default=500.0, help="time-to-first-token target (default 500)")
    slo.add_argument("--slo-tpot-ms", type=float, default=50.0, help="time-per-output-token target (default 50)")
    slo.add_argument("--min-attainment", type=_fraction, default=None,
                     help="exit 3 when the share of requests meeting both SLOs is below this (0-1)")
    slo.add_argument("--report", help="write the summary and every request's record as JSON here")
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The run's configuration from parsed flags; BenchError on bad values."""
    try:
        slo = SloMs(args.slo_ttft_ms, args.slo_tpot_ms)
    except ValueError as error:
        raise BenchError(str(error)) from None
    return BenchConfig(url=args.url, model=args.model, trace=args.trace, rate_rps=args.rate, isl=args.isl,
                       osl=args.osl, speedup=args.speedup, start_s=args.start, duration_s=args.duration,
                       max_requests=args.max_requests, max_concurrency=args.max_concurrency,
                       timeout_s=args.timeout, api_key=args.api_key or None,
                       slo=slo, seed=args.seed,
                       loopback_only=args.loopback_only)


def _title(result: BenchResult) -> str:
    config = result.config
    load = (f"{Path(config.trace).name} x{config.speedup:g}" if config.trace is not None
            else f"Poisson {config.rate_rps:g} req/s, ISL {config.isl}, OSL {config.osl}")
    return f"{load} -> {config.completions_url} (model {result.model or '-'})"


def run(args: argparse.Namespace) -> int:
    """`xpyd bench`: run, print the summary, write the report; see the module docstring for exit codes."""
    try:
        result = run_bench_sync(config_from_args(args))
    except BenchError as error:
        sys.stderr.write(f"xpyd bench: {error}\n")
        return 2
    sys.stdout.write(format_summary(result.summary, _title(result)) + "\n")
    if args.report:
        try:
            Path(args.report).write_text(json.dumps(result.report(), indent=1) + "\n")
        except OSError as error:
            sys.stderr.write(f"xpyd bench: cannot write {args.report}: {error.strerror or error}\n")
            return 2
    code = exit_code(result.attainment, args.min_attainment)
    if code:
        sys.stderr.write(f"xpyd bench: {attainment_message(result.attainment, args.min_attainment)}\n")
    return code
