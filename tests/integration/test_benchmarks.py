"""The benchmarks under `benchmarks/` still run and print their tables (tiny, bounded runs: the
figures themselves are not checked, only that every row is there and nothing failed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run(script: str, *args: str, timeout: float = 120) -> str:
    result = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                            timeout=timeout, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_proxy_bench_compares_every_stack_with_both_baselines_and_soaks() -> None:
    stacks = ("xpyd", "xpyd+asyncio", "aiohttp")
    out = run("proxy_bench.py", "--seconds", "0.3", "--clients", "1", "--stacks", ",".join(stacks),
              "--paced-rps", "50", "--soak-seconds", "3")
    lines = [line for line in out.splitlines() if re.match(r"(unstreamed|stream64|paced) ", line)]
    for mode in ("unstreamed", "stream64", "paced"):
        targets = {line[20:32].strip() for line in lines if line.startswith(mode)}   # the target column
        assert targets == {"direct", "direct P+D", *stacks}, out
    assert all(line.split()[-1] == "0" for line in lines), out       # no request failed
    stack_rows = [line.split() for line in lines if line[20:32].strip() in stacks]
    assert len(stack_rows) == 9 and all(len(row) == 11 and float(row[3]) > 0 for row in stack_rows), out
    assert re.search(r"growth after warm-up: [+-]\d+\.\d MiB", out), out


def test_engine_sim_bench_prints_each_mode() -> None:
    out = run("engine_sim_bench.py", "--streams", "1", "--tokens", "8", "--prompt", "16", "--rounds", "1")
    assert {line.split()[0] for line in out.splitlines()[2:] if line.strip()} >= {"flat", "real", "10x"}, out


def test_sim_bench_prints_a_row_per_speedup_rate_scale_and_the_day_compiled_and_pure() -> None:
    out = run("sim_bench.py", "--speedups", "50", "100", "--rate-scales", "2", "--day", "3000")
    assert "compiled modules from" in out.splitlines()[0], out
    rows = {(line[:14].strip(), cells[0]): cells[1:]
            for line in out.splitlines()[2:] if (cells := line[14:].split())}
    labels = ["x50", "x100", "x1 rate x2", "synthetic day"]
    assert list(rows) == [(label, build) for label in labels for build in ("compiled", "pure")], out
    assert rows["x1 rate x2", "compiled"][0] == "4P/8D" and rows["x1 rate x2", "compiled"][1] == f"{2 * 19_366:,}", out
    assert rows["synthetic day", "pure"][1] == "3,000"
    assert float(rows["synthetic day", "compiled"][6].replace(",", "")) > 80_000, out   # simulated span
    for label in labels:
        compiled, pure = rows[label, "compiled"], rows[label, "pure"]
        assert compiled[5:8] == pure[5:8], out     # events, span and attainment: the builds agree
        assert float(compiled[4].replace(",", "")) > 0 and pure[-1].endswith("x"), out   # req/CPU s; speed-up


def test_prefix_cache_prints_the_repeat_share_and_a_row_per_prefill_pool() -> None:
    trace = BENCHMARKS.parent / "tests" / "fixtures" / "traces" / "mooncake_synthetic_head50.jsonl"
    out = run("prefix_cache.py", "--trace", str(trace), "--prefill", "1", "2")
    assert re.search(r"repeat share \d+\.\d\d% of its prefix blocks; one prefill engine that never evicts "
                     r"hits \d+\.\d\d%", out), out
    rows = [line.split() for line in out.splitlines()[3:]]
    assert [row[0] for row in rows] == ["1", "2"] and all(len(row) == 10 for row in rows), out
    assert all(row[1].endswith("%") and int(row[2].replace(",", "")) > 0 for row in rows), out


def test_kv_routing_prints_a_row_per_policy_and_writes_its_table_and_plot(tmp_path: Path) -> None:
    out = run("kv_routing.py", "--prefill", "2", "--workloads", "mooncake", "--no-autoscaler", "--out", str(tmp_path))
    rows = {cells[2]: cells for cells in (line.split(" | ") for line in out.splitlines())
            if len(cells) == 11 and cells[0] == "| mooncake"}
    assert set(rows) == {"RoundRobin", "LeastLoaded", "PowerOfTwo", "KVAware Routed", "KVAware Events", "ceiling"}, out
    assert rows["ceiling"][4] == "100%", out
    assert (tmp_path / "kv_routing.png").stat().st_size > 0
    assert "python benchmarks/kv_routing.py --prefill 2" in (tmp_path / "kv_routing.md").read_text()


def test_cold_start_bench_times_the_overflow_and_the_release() -> None:
    out = run("cold_start_bench.py", "--held", "4", "--overflow", "20", "--rounds", "1")
    overflow = re.search(r"overflow \(429 from a full waiting room of 4\): 20 requests, p50 ([\d.]+) ms", out)
    assert overflow and float(overflow.group(1)) > 0, out
    assert re.search(r"release \(4 held, engines listening -> first byte\): first \d+ ms; last \d+ ms; failed 0",
                     out), out


def test_scale_to_zero_eval_compares_each_run_with_min_replicas_one(tmp_path: Path) -> None:
    out = run("scale_to_zero_eval.py", "--startups", "30", "--idles", "300", "--duration", "3000", "--out",
              str(tmp_path / "zero.json"))
    rows = {line.split()[1]: line.split() for line in out.splitlines() if line.strip().startswith("30s")}
    assert set(rows) == {"min1", "zero/300", "zero/300/room-4096", "zero/300/no-signal"}, out
    report = json.loads((tmp_path / "zero.json").read_text())["runs"]["startup30"]
    assert report["zero/300"]["gpu_hours"] < report["min1"]["gpu_hours"], report
    assert report["zero/300"]["held"]["requests"] > 0 and report["zero/300"]["cold_starts"] >= 1, report


def test_metrics_bench_prints_both_implementations_and_their_ratio() -> None:
    out = run("metrics_bench.py", "--requests", "200", "--rounds", "1")
    rows = {line.split()[0]: float(line.split()[1]) for line in out.splitlines()
            if re.match(r"(hand-written|prometheus_client) +\d+$", line)}
    assert set(rows) == {"hand-written", "prometheus_client"} and all(ns > 0 for ns in rows.values()), out
    assert re.search(r"ratio prometheus_client / hand-written: \d+\.\d\d$", out, re.MULTILINE), out


def test_autoscaler_eval_writes_its_tables_reports_and_plots_and_reuses_its_oracles(tmp_path: Path) -> None:
    args = ("--workloads", "conv", "long", "--duration", "240", "--startups", "30", "--jobs", "2",
            "--out", str(tmp_path))
    out = run("autoscaler_eval.py", *args, timeout=300)
    assert "reused" not in out.splitlines()[-1], out
    readme = (tmp_path / "README.md").read_text()
    for heading in ("## Workloads", "## GPU-hours to meet 95%", "## Targets", "#### conv, start-up delay 30 s",
                    "#### long, start-up delay 30 s"):
        assert heading in readme, readme
    table = readme[readme.index("#### conv, start-up delay 30 s"):].split("\n\n")[1].splitlines()
    policies = [row.split("|")[1:3] for row in table[2:]]
    rows = [(p.strip(), s.strip()) for p, s in policies]
    assert rows[:8] + rows[9:] == [
        ("static-peak", "t=0"), ("static-mean", "t=0"), ("queue-threshold", "warm"), ("queue-threshold", "cold"),
        ("dynamo-sla", "warm"), ("dynamo-sla", "cold"), ("xpyd", "warm"), ("xpyd", "cold"),
        ("oracle", "no start-up")], readme
    assert rows[8][0] == "nowcast" and re.fullmatch(r"\+[0-3] P, \+[0-2] D", rows[8][1]), readme
    tried = json.loads((tmp_path / "conv" / "nowcast_tried_startup30.json").read_text())
    assert len(tried) == 12 and {(t["extra"]["prefill"], t["extra"]["decode"]) for t in tried} == {
        (p, d) for p in range(4) for d in range(3)}
    chosen = json.loads((tmp_path / "conv" / "nowcast_startup30.json").read_text())
    meeting = [t["gpu_hours"] for t in tried if t["attainment"] >= 0.95]
    assert chosen["gpu_hours"] == (min(meeting) if meeting else chosen["gpu_hours"]), (chosen["gpu_hours"], tried)
    if not meeting:
        assert chosen["attainment"] == max(t["attainment"] for t in tried)
    headline = readme[readme.index("## GPU-hours to meet 95%"):readme.index("\n## Targets\n")]
    assert "| nowcast |" in headline.splitlines()[2], headline
    oracle = json.loads((tmp_path / "conv" / "oracle.json").read_text())
    assert oracle["oracle_met"] and oracle["attainment"] >= 0.95 and oracle["oracle_key"], oracle.keys()
    cold = json.loads((tmp_path / "conv" / "xpyd_cold_startup30.json").read_text())
    assert cold["initial"] == {"prefill": 1, "decode": 1} and cold["settled_after_s"] == 150.0
    assert cold["autoscaler_decisions"] and 0.0 <= cold["attainment_settled"] <= 1.0
    for name in ("conv.png", "long.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
    again = run("autoscaler_eval.py", *args, timeout=300)
    assert again.splitlines()[-1].endswith("(saved oracles reused: conv, long)"), again
    assert json.loads((tmp_path / "conv" / "oracle.json").read_text()) == oracle
