"""`xpyd bench`: an open-loop load generator and SLO checker for OpenAI-compatible endpoints.

Library use (the demo and the e2e tests call it)::

    from xpyd.bench import BenchConfig, SloMs, run_bench, run_bench_sync

    result = run_bench_sync(BenchConfig(url="http://127.0.0.1:8000", trace="trace.csv", speedup=10,
                                        duration_s=60, slo=SloMs(ttft_ms=500, tpot_ms=50)))
    result.attainment, result.summary["ttft_ms"]["p90"], result.report()

`load` plans arrivals and prompts, `client` sends and times one streamed request, `runner` runs the
open loop, `report` holds the pure statistics, `main` the command line.
"""

from xpyd.bench.report import RequestRecord, SloMs
from xpyd.bench.runner import BenchConfig, BenchError, BenchResult, run_bench, run_bench_sync

__all__ = ["BenchConfig", "BenchError", "BenchResult", "RequestRecord", "SloMs", "run_bench", "run_bench_sync"]
