"""`xpyd bench` against real `xpyd engine-sim` processes behind a real `xpyd proxy` (loopback only):
the CLI's output, the JSON report, TTFT and TPOT against the emulator's performance model, the exit
codes (3 for an impossible SLO, 2 for bad arguments), and failures counted per request: refused
connections, timeouts, overflow of the concurrency cap. Every run is a few dozen requests at most."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.processes import kill, start_engine, start_proxy
from xpyd.bench import BenchConfig, RequestRecord, SloMs, run_bench
from xpyd.cli import main as xpyd_main
from xpyd.cluster.controlplane import free_ports
from xpyd.common.netguard import LOOPBACK_ONLY_ENV, require_loopback
from xpyd.sim.emulator.config import DEFAULT_MODEL, ScaledPerf
from xpyd.sim.emulator.main import config_from_args
from xpyd.traces import TraceRequest

pytestmark = pytest.mark.integration

HOST = require_loopback("127.0.0.1")
TIME_SCALE = 5.0
"""Modelled time runs this many times faster than the wall clock."""
TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
AZURE = TRACES / "azure_conv_2023_head200.csv"
MOONCAKE = TRACES / "mooncake_synthetic_head50.jsonl"
#: The engine processes' performance model (their default profile and KV size) in wall seconds.
PERF = ScaledPerf(config_from_args(["--role", "decode"])[1], TIME_SCALE)


@dataclass
class Cluster:
    proxy: str
    processes: list[subprocess.Popen[bytes]]


def _wait_healthy(url: str, process: subprocess.Popen[bytes], ready: str = "", timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"{url} exited"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200 and ready in response.read().decode():
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never became healthy")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """One prefill and one decode engine (time scale 5) behind the proxy, shared by the module's tests."""
    prefill_port, decode_port, proxy_port, *side_ports = free_ports(5)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        engines = {}
        for role, port, side_port in (("prefill", prefill_port, side_ports[0]), ("decode", decode_port, side_ports[1])):
            engines[role] = f"http://{HOST}:{port}"
            processes.append(start_engine(role, port, side_port, str(TIME_SCALE)))
        proxy = f"http://{HOST}:{proxy_port}"
        processes.append(start_proxy(proxy_port, [engines["prefill"]], [engines["decode"]]))
        for url, process in zip([*engines.values(), proxy], processes, strict=True):
            _wait_healthy(url, process)
        _wait_healthy(proxy, processes[-1], ready='"decode": {"eligible": 1')
        yield Cluster(proxy, processes)
    finally:
        kill(processes)


def bench(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """`xpyd bench ARGS` as a process."""
    return subprocess.run([sys.executable, "-m", "xpyd.cli", "bench", *args], capture_output=True, text=True,
                          timeout=timeout_s, check=False)


def test_trace_replay_through_the_proxy_reports_plausible_latencies(cluster: Cluster, tmp_path: Path) -> None:
    report_path = tmp_path / "bench.json"
    done = bench("--url", cluster.proxy, "--trace", str(AZURE), "--speedup", "10", "--max-requests", "30",
                 "--slo-ttft-ms", "5000", "--slo-tpot-ms", "500", "--min-attainment", "0.9",
                 "--report", str(report_path), "--loopback-only")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == (f"xpyd bench: {AZURE.name} x10 -> {cluster.proxy}/v1/completions (model {DEFAULT_MODEL})")
    assert lines[1].startswith("  30 requests in ") and "30 succeeded, 0 failed (0 dropped)" in lines[1]
    assert lines[2].startswith("  attainment 100.0% (TTFT <= 5000 ms: 100.0%, TPOT <= 500 ms: 100.0%)")
    assert [line.split()[0] for line in lines[3:7]] == ["TTFT", "TPOT", "ITL", "E2E"]

    report = json.loads(report_path.read_text())
    for key in ("requests", "attainment", "goodput_rps", "gpu_hours", "goodput_per_gpu_hour", "ttft_ms", "tpot_ms",
                "scaling_actions"):
        assert key in report
    assert report["requests"] == 30 and report["attainment"] == 1.0 and report["errors"] == {}
    assert report["goodput_rps"] == pytest.approx(30 / report["duration_s"], rel=1e-3)
    assert report["config"]["model"] == DEFAULT_MODEL and report["config"]["speedup"] == 10.0
    records = report["records"]
    assert [r["index"] for r in records] == list(range(30))
    # The prompt builder's text is exactly ISL tokens to the engines, and ignore_eos gives exactly OSL tokens.
    assert all(r["prompt_tokens"] == r["isl"] and r["output_tokens"] == r["osl"] for r in records)
    # Open loop: sends follow the trace's (scaled) arrival times, the trace's first at 0.
    assert records[0]["scheduled_s"] == 0.0
    assert all(r["sent_s"] >= r["scheduled_s"] for r in records)
    for r in records:
        # Never faster than the model allows: the prompt's prefill and KV hand-off before the first
        # token, at least a batch-1 decode step for each later one (5% for clock jitter). (A single
        # TPOT may beat the step time: a first token read late shortens the rest of the stream.)
        floor_ttft_s = PERF.prefill_seconds(r["isl"]) + PERF.kv_transfer_seconds(r["isl"])
        assert r["ttft_s"] >= 0.95 * floor_ttft_s, r
        assert r["e2e_s"] >= 0.95 * (floor_ttft_s + (r["osl"] - 1) * PERF.decode_step_seconds(1, r["isl"])), r
        assert len(r["itl_s"]) <= r["osl"] - 1
    steps = [PERF.decode_step_seconds(1, r["isl"]) for r in records if r["osl"] > 1]
    assert report["tpot_ms"]["mean"] / 1000.0 >= 0.5 * sum(steps) / len(steps)
    # ... nor absurdly slower at this light load (a few requests in flight on each engine).
    median = sorted(records, key=lambda r: r["ttft_s"])[15]
    assert median["ttft_s"] < 20 * (PERF.prefill_seconds(median["isl"]) + PERF.kv_transfer_seconds(median["isl"])
                                    + PERF.decode_step_seconds(1, median["isl"])) + 0.5
    assert report["tpot_ms"]["p50"] / 1000.0 < 20 * PERF.decode_step_seconds(1, 2000)


def test_an_impossible_slo_exits_3_with_one_line(cluster: Cluster) -> None:
    done = bench("--url", cluster.proxy, "--model", DEFAULT_MODEL, "--rate", "20", "--isl", "64", "--osl", "4",
                 "--max-requests", "5", "--slo-ttft-ms", "0.001", "--min-attainment", "0.5")
    assert done.returncode == 3, done.stderr
    assert done.stderr == "xpyd bench: attainment 0.0% is below --min-attainment 50.0%\n"
    assert "5 succeeded" in done.stdout and "attainment 0.0%" in done.stdout


async def test_library_run_with_a_live_callback_and_a_mooncake_trace(cluster: Cluster) -> None:
    seen: list[RequestRecord] = []
    config = BenchConfig(url=cluster.proxy, trace=MOONCAKE, speedup=1000.0, max_requests=3,
                         slo=SloMs(ttft_ms=60_000.0, tpot_ms=1000.0), loopback_only=True)
    result = await run_bench(config, on_result=seen.append)
    assert sorted(r.index for r in seen) == [0, 1, 2] and tuple(sorted(seen, key=lambda r: r.index)) == result.records
    assert result.model == DEFAULT_MODEL and result.attainment == 1.0
    # 20-40k-token prompts arrive exactly as long as the trace says.
    assert [(r.prompt_tokens, r.output_tokens) for r in result.records] == [(40160, 6), (36640, 4), (23769, 3)]
    report = result.report()
    assert report["requests"] == 3 and len(report["records"]) == 3 and report["config"]["trace"] == str(MOONCAKE)


async def test_overflow_of_the_concurrency_cap_is_dropped_not_delayed(cluster: Cluster) -> None:
    burst = [TraceRequest(0.0, 32, 200) for _ in range(5)]
    config = BenchConfig(url=cluster.proxy, model=DEFAULT_MODEL, requests=burst, max_concurrency=2)
    result = await run_bench(config)
    assert [r.ok for r in result.records] == [True, True, False, False, False]
    assert all(r.error_kind == "dropped" for r in result.records[2:])
    assert result.summary["dropped"] == 3 and result.summary["errors"] == {"dropped": 3}
    assert result.attainment == pytest.approx(0.4)


async def test_a_request_over_its_timeout_fails_and_the_run_still_ends(cluster: Cluster) -> None:
    # 20,000 tokens take the emulated engine seconds; the run gives up on it after half a second.
    config = BenchConfig(url=cluster.proxy, model=DEFAULT_MODEL, requests=[TraceRequest(0.0, 16, 20_000)],
                         timeout_s=0.5)
    started = time.monotonic()
    result = await run_bench(config)
    assert time.monotonic() - started < 5.0
    (record,) = result.records
    assert not record.ok and record.error_kind == "timeout" and record.ttft_s is not None
    assert result.summary["errors"] == {"timeout": 1}


async def test_setting_stop_ends_the_arrivals_early(cluster: Cluster) -> None:
    stop = asyncio.Event()
    config = BenchConfig(url=cluster.proxy, model=DEFAULT_MODEL, rate_rps=2.0, isl=16, osl=2, duration_s=60.0)
    result = await run_bench(config, on_result=lambda record: stop.set(), stop=stop)
    assert 1 <= len(result.records) <= 3 and result.wall_s < 10.0
    assert all(r.ok for r in result.records)


def test_refused_connections_are_counted_per_request() -> None:
    (port,) = free_ports(1)   # nothing listens there
    done = bench("--url", f"http://{HOST}:{port}", "--model", "m", "--rate", "50", "--max-requests", "4",
                 "--isl", "8", "--osl", "2", timeout_s=30)
    assert done.returncode == 0, done.stderr
    assert "4 requests in" in done.stdout and "0 succeeded, 4 failed" in done.stdout
    assert "errors: connect 4" in done.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--trace", "/nonexistent/trace.csv"], "cannot read"),
    (["--trace", str(AZURE), "--start", "1e9"], "no requests in the window"),
    (["--rate", "5"], "needs a bound"),
    (["--rate", "5", "--duration", "1", "--speedup", "2"], "trace only"),
    (["--rate", "-5", "--duration", "1"], "rate must be a positive"),
    (["--rate", "5", "--duration", "1", "--timeout", "0"], "timeout must be"),
    (["--rate", "5", "--duration", "1", "--slo-tpot-ms", "0"], "TPOT target"),
    (["--rate", "5", "--duration", "1", "--max-concurrency", "0"], "max-concurrency"),
])
def test_bad_arguments_exit_2_with_a_message(args: list[str], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # Nothing is dialled: every problem is found before the first request.
    assert xpyd_main(["bench", "--url", f"http://{HOST}:9", "--model", "m", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xpyd bench: ") and message in err and err.count("\n") == 1


def test_loopback_only_refuses_other_hosts_before_dialling(capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["bench", "--url", "http://10.0.0.1:8000", "--model", "m", "--rate", "1", "--max-requests", "1"]
    assert xpyd_main([*args, "--loopback-only"]) == 2
    assert "outside 127.0.0.0/8" in capsys.readouterr().err
    monkeypatch.setenv(LOOPBACK_ONLY_ENV, "1")
    assert xpyd_main(args) == 2
    assert "outside 127.0.0.0/8" in capsys.readouterr().err


def test_argparse_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for args in (["--url", "http://127.0.0.1:9"],                                       # no load
                 ["--url", "http://127.0.0.1:9", "--rate", "1", "--trace", "t.csv"],     # two loads
                 ["--url", "http://127.0.0.1:9", "--rate", "1", "--min-attainment", "1.5"]):
        with pytest.raises(SystemExit) as exit_info:
            xpyd_main(["bench", *args])
        assert exit_info.value.code == 2
    assert "xpyd bench: error:" in capsys.readouterr().err
