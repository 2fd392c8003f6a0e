"""The benchmarks under `benchmarks/` still run and print their tables (tiny, bounded runs: the
figures themselves are not checked, only that every row is there and nothing failed)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def load(name: str) -> Any:
    """A benchmark script as a module (`autoscaler_eval` first: the others import it)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def load_eval() -> Any:
    return load("autoscaler_eval")


def test_autoscaler_eval_frontier_helpers() -> None:
    evaluation = load_eval()
    points = [(1.0, 0.5), (2.0, 0.4), (3.0, 0.9), (4.0, 0.9), (5.0, 0.99)]
    assert evaluation.frontier(points) == [(1.0, 0.5), (3.0, 0.9), (5.0, 0.99)]
    assert evaluation.cheapest(points, 0.9) == (3.0, 0.9) and evaluation.cheapest(points, 0.995) is None
    assert evaluation.gpu_hours_at(points, 0.7) == pytest.approx(2.0)     # halfway from (1, 0.5) to (3, 0.9)
    assert evaluation.gpu_hours_at(points, 0.3) == 1.0 and evaluation.gpu_hours_at(points, 0.999) is None
    beaten = evaluation.dominance(points, [(3.5, 0.92), (6.0, 0.99)])
    assert beaten.met and not beaten.vacuous and len(beaten.checks) == 5    # 90, 95, 99%, and both points
    worse = evaluation.dominance(points, [(2.5, 0.95)])      # xpyd: 5.0 at 95% (swept), 4.11 along its frontier
    assert not worse.met and "worst at 95%: xpyd 5.00 vs 2.50 GPU-hours (2.00x)" in worse.detail("static")
    short = evaluation.dominance(points, [(9.0, 0.999)])
    assert not short.met and "does not reach" in short.detail("static")
    assert evaluation.dominance(points, [(0.5, 0.8)]).vacuous
    sizes = evaluation.static_sizes(evaluation.Desired(10, 2), evaluation.Desired(18, 4))
    assert sizes == [evaluation.Desired(p, d) for p, d in ((6, 1), (8, 2), (10, 2), (12, 2), (14, 3), (16, 4),
                                                            (18, 4))]


CELL = re.compile(r"(\d+\.\d\d) \(\d+\.\d\dx, (.+)\)|unreachable \(best (\d+\.\d)%\)")


def needs(readme: str, heading: str) -> dict[tuple[str, str], list[str]]:
    table = readme[readme.index(heading):].split("\n\n")[2].splitlines()
    return {(cells[0], cells[1]): cells[2:] for cells in ([c.strip() for c in row.split("|")[1:-1]]
                                                          for row in table[2:])}


def test_autoscaler_eval_sweeps_each_family_into_frontiers_tables_and_verdicts(tmp_path: Path) -> None:
    """Two workloads (one without the prefix cache), 4 minutes of each, one start-up delay: every family's
    sweep, its table checked against the saved reports, the verdicts, the plots; then the saved oracle reused."""
    evaluation = load_eval()
    args = ("--workloads", "conv", "mooncake-nocache", "--duration", "240", "--startups", "30", "--jobs", "2",
            "--out", str(tmp_path))
    out = run("autoscaler_eval.py", *args, timeout=600)
    assert "reused" not in out.splitlines()[-1], out
    assert re.search(r"^\d+ runs \(conv \d+, mooncake-nocache \d+\) after \d+\.\d min of oracles; ", out,
                     re.MULTILINE), out
    readme = (tmp_path / "README.md").read_text()
    for heading in ("## Workloads", "## Families and their knobs", "## GPU-hours to reach 95%", "## Verdicts (30 s",
                    "#### conv, start-up delay 30 s", "#### mooncake-nocache, start-up delay 30 s"):
        assert heading in readme, readme
    causal = {"queue-threshold": evaluation.QUEUE_SCALES, "dynamo-sla": evaluation.DYNAMO_MARGINS,
              "xpyd": evaluation.XPYD_TARGETS}
    for workload in ("conv", "mooncake-nocache"):
        directory = tmp_path / workload
        oracle = json.loads((directory / "oracle.json").read_text())
        assert oracle["oracle_met"] and oracle["oracle_key"], oracle.keys()
        assert oracle["prefix_caching"] is (workload == "conv")
        files = {
            ("static", "fixed"): sorted(directory.glob("static_p*d*.json")),
            **{(family, start): sorted(directory.glob(f"{family}_*_{start}_startup30.json"))
               for family in causal for start in ("warm", "cold")},
            ("nowcast", "-"): sorted(directory.glob("nowcast_p*d*_startup30.json"))}
        static = evaluation.static_sizes(evaluation.sizes(oracle, "oracle_mean"),
                                         evaluation.sizes(oracle, "oracle_peak"))
        assert {f.name for f in files["static", "fixed"]} == {f"static_p{s.prefill}d{s.decode}.json" for s in static}
        assert {f.name for f in files["xpyd", "cold"]} == {f"xpyd_att{t:g}_cold_startup30.json"
                                                          for t in evaluation.XPYD_TARGETS}
        assert {f.name for f in files["dynamo-sla", "warm"]} == {f"dynamo-sla_margin{m:g}_warm_startup30.json"
                                                                for m in evaluation.DYNAMO_MARGINS}
        assert {f.name for f in files["queue-threshold", "warm"]} == {f"queue-threshold_x{s:g}_warm_startup30.json"
                                                                     for s in evaluation.QUEUE_SCALES}
        assert len(files["nowcast", "-"]) == 12
        reports = {key: [json.loads(f.read_text()) for f in paths] for key, paths in files.items()}
        for (family, start), swept in reports.items():
            assert all(r["family"] == family and r["start"] == start and r["workload"] == workload
                       and r["prefix_caching"] is (workload == "conv") for r in swept), (family, start)
        xpyd = {r["knob"]: r for r in reports["xpyd", "warm"]}
        assert sorted(xpyd) == list(evaluation.XPYD_TARGETS)
        # only the runs the timeline plots keep their time series
        assert all(key in xpyd[evaluation.FOCUS_TARGET] for key in evaluation.SERIES_KEYS)
        assert not any(key in xpyd[0.8] for key in evaluation.SERIES_KEYS)
        # the decision log is kept for the focus target only (the others' would add megabytes)
        assert [k for k, r in xpyd.items() if r.get("autoscaler_decisions")] == [evaluation.FOCUS_TARGET]
        assert all(d["t_s"] > 0 for d in xpyd[evaluation.FOCUS_TARGET]["autoscaler_decisions"])
        cold = reports["xpyd", "cold"][0]
        assert cold["initial"] == {"prefill": 1, "decode": 1} and cold["settled_after_s"] == 150.0
        # the table is each family's cheapest swept point reaching the level, else its best attainment
        table = needs(readme, f"#### {workload}, start-up delay 30 s")
        assert list(table) == list(reports), table
        for key, swept in reports.items():
            cells = table[key]
            assert cells[-1] == str(len(swept)) and cells[-2] == f"{max(r['attainment'] for r in swept):.1%}"
            for level, cell in zip(evaluation.LEVELS, cells, strict=False):
                match = CELL.fullmatch(cell)
                assert match, cell
                reaching = [r["gpu_hours"] for r in swept if r["attainment"] >= level]
                if reaching:
                    assert match.group(1) == f"{min(reaching):.2f}", (key, level, cell)
                else:
                    assert match.group(3) == f"{100 * max(r['attainment'] for r in swept):.1f}", (key, level, cell)
        frontiers = json.loads((directory / "frontiers.json").read_text())["30"]
        for key, swept in reports.items():
            line = [(p["gpu_hours"], p["attainment"]) for p in frontiers[f"{key[0]}/{key[1]}"]["frontier"]]
            assert line == evaluation.frontier([(r["gpu_hours"], r["attainment"]) for r in swept]), key
        for name in (f"{workload}_frontier.png", f"{workload}_timeline.png"):
            assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
    verdicts = [row.split(" | ") for row in readme[readme.index("## Verdicts"):].splitlines()
                if row.startswith("| conv")]
    targets = [cells[1] for cells in verdicts]
    assert targets == [f"(a) warm: frontier dominates {f}" for f in ("static", "queue-threshold", "dynamo-sla")] + [
        f"(a) cold: frontier dominates {f}" for f in ("queue-threshold", "dynamo-sla")] + [
        "(b) warm: <= 1.10x the nowcast's GPU-hours at 95%"] + [
        f"(c) {start}: target {100 * t:g}% attained within 1 point" for start in ("warm", "cold")
        for t in evaluation.XPYD_TARGETS], targets
    assert all(cells[2] in {"met", "missed", "vacuous", "n/a"} for cells in verdicts), verdicts
    oracle = json.loads((tmp_path / "conv" / "oracle.json").read_text())
    again = run("autoscaler_eval.py", "--workloads", "conv", *args[3:], timeout=600)
    assert again.splitlines()[-1].endswith("(saved oracles reused: conv)"), again
    assert json.loads((tmp_path / "conv" / "oracle.json").read_text()) == oracle


def test_arrival_bunching_prints_the_slot_ratios_and_a_row_per_prefill_pool() -> None:
    trace = BENCHMARKS.parent / "tests" / "fixtures" / "traces" / "azure_conv_2023_600s_240s.csv"
    out = run("arrival_bunching.py", "--trace", str(trace), "--rate-scale", "2", "--start", "60", "--span", "60",
              "--prefill", "1", "2", "--decode", "2")
    lines = out.splitlines()
    assert lines[0].startswith("azure_conv_2023_600s_240s.csv x2, 60-120 s: "), out
    ratios = [line.split(" | ") for line in lines[3:6]]
    assert [row[0] for row in ratios] == ["0.25", "1", "4"], out
    # Each ratio is the slot work at p90 or p99 of requests over its mean over requests (here at least 1).
    assert all(len(row) == 7 and all(float(cell.rstrip("x")) >= 1.0 for cell in row[1:]) for row in ratios), out
    pools = [line.split(" | ") for line in lines[8:]]
    assert [row[0] for row in pools] == ["1", "2"] and all(row[3].endswith("%") for row in pools), out


def test_headroom_steps_holds_each_headroom_and_refines_where_the_band_is_straddled(tmp_path: Path) -> None:
    """conv's first 4 minutes at 75%, warm and cold, with the headroom held at -0.6, -0.2 and +0.2, then
    every 0.1 between two neighbours on either side of 74-76% with neither in it; the learner's own
    run beside."""
    elsewhere = ("--out", str(tmp_path), "--evaluation", str(tmp_path / "no-evaluation"))
    out = run("headroom_steps.py", "--workloads", "conv", "--duration", "240", "--targets", "0.75", "--low", "-0.6",
              "--high", "0.2", "--step", "0.4", "--fine", "0.1", *elsewhere, timeout=600)
    rows = [line for line in out.splitlines() if line.startswith("| conv | 75% |")]
    assert [row.split(" | ")[2] for row in rows] == ["warm", "cold"], out
    assert all(re.search(r"\| (met|missed \(.+\)|n/a) \|$", row) for row in rows), out
    curve = next(line for line in out.splitlines() if line.startswith("- conv at 75%, warm: "))
    held = {float(h): (float(a.rstrip("%")), float(g)) for h, a, g in
            re.findall(r"([+-]\d\.\d\d) (\d+\.\d)%/(\d+\.\d\d)", curve)}
    assert {-0.6, -0.2, 0.2} <= set(held), curve
    # Held, not learnt: more headroom holds a larger pool all run.
    assert held[-0.6][1] < held[-0.2][1] < held[0.2][1], curve
    assert len(held) > 3, curve    # some pair straddled the band (the test's premise)
    ordered = sorted(held)
    for low, high in itertools.pairwise(ordered):
        a, b = held[low][0], held[high][0]
        # Every coarse pair straddling the band without a point in it was refined (0.1 apart at most).
        assert not ((a < 74.0 and b > 76.0) or (a > 76.0 and b < 74.0)) or high - low <= 0.1 + 1e-9, curve
    assert all((tmp_path / f"headroom_steps_{start}.png").stat().st_size > 0 for start in ("warm", "cold"))
    saved = json.loads((tmp_path / "headroom_steps.json").read_text())
    cases = saved["cases"]
    assert saved["runs"] == len(cases) + sum(len(case["held"]) for case in cases), saved
    assert [case["start"] for case in cases] == ["warm", "cold"] and len(cases[0]["held"]) == len(held), saved
    assert len(cases[1]["held"]) >= 3 and 0 <= cases[1]["learnt"]["attainment"] <= 1, saved
    report = (tmp_path / "headroom_steps.md").read_text()
    assert all(row in report for row in rows)
    # The report written again from the saved runs, replaying nothing, is the same report.
    (tmp_path / "headroom_steps.md").unlink()
    run("headroom_steps.py", "--report", *elsewhere)
    assert (tmp_path / "headroom_steps.md").read_text() == report
    # Replaying only the learner's runs gives the same runs (each is deterministic), and says so.
    run("headroom_steps.py", "--relearn", *elsewhere)
    again = json.loads((tmp_path / "headroom_steps.json").read_text())
    assert again["cases"] == cases and again["relearnt"]["runs"] == 2, again
    assert "the learner's runs replayed again by `python3 benchmarks/headroom_steps.py --relearn" in \
        (tmp_path / "headroom_steps.md").read_text()
    # The learner's floor as an experiment: its warm run fell below -0.02 as shipped; with the floor there it
    # stops at it, the held runs stay as they were, and the report says what was changed.
    assert min(cases[0]["learnt"]["headrooms"]) < -0.02, cases[0]
    run("headroom_steps.py", "--relearn", "--floor", "-0.02", *elsewhere)
    floored = json.loads((tmp_path / "headroom_steps.json").read_text())
    assert floored["relearnt"]["floor"] == -0.02 and min(floored["cases"][0]["learnt"]["headrooms"]) == -0.02, floored
    assert [case["held"] for case in floored["cases"]] == [case["held"] for case in cases], floored
    assert "the learner's headroom no lower than -0.02 (as shipped: -0.15)" in \
        (tmp_path / "headroom_steps.md").read_text()
    for wrong, reason in ((("--relearn", "--floor", "-1"), "need -1 < H"),
                          (("--report", "--floor", "-0.3"), "--floor with --report")):
        refused = subprocess.run([sys.executable, str(BENCHMARKS / "headroom_steps.py"), *wrong, *elsewhere],
                                 capture_output=True, text=True, timeout=60, check=False)
        assert refused.returncode == 2 and reason in refused.stderr, refused
    refused = subprocess.run([sys.executable, str(BENCHMARKS / "headroom_steps.py"), "--report", "--out",
                              str(tmp_path / "empty")], capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2 and "no " in refused.stderr and "run the sweep first" in refused.stderr, refused
    both = subprocess.run([sys.executable, str(BENCHMARKS / "headroom_steps.py"), "--report", "--relearn", *elsewhere],
                          capture_output=True, text=True, timeout=60, check=False)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr, both


def test_headroom_steps_judges_the_held_headrooms_against_the_baselines(tmp_path: Path) -> None:
    """Target (a) both ways from a saved evaluation: the learner's points, and every warm held run over
    the targets swept (a cold one, however cheap, is not judged), against each baseline reaching 90%."""
    load_eval()
    steps = load("headroom_steps")

    def figures(attainment: float, gpu_hours: float) -> dict[str, float]:
        return {"attainment": attainment, "gpu_hours": gpu_hours}

    summaries = [steps.Summary("w", 0.8, "warm", {-0.1: figures(0.92, 4.0)}, figures(0.85, 3.0), 0.01),
                 steps.Summary("w", 0.95, "warm", {0.2: figures(0.99, 6.0)}, figures(0.95, 5.0), 0.01),
                 steps.Summary("w", 0.95, "cold", {0.0: figures(0.999, 1.0)}, figures(0.9, 2.0), 0.01),
                 steps.Summary("unevaluated", 0.8, "warm", {0.0: figures(0.99, 1.0)}, figures(0.9, 1.0), 0.01)]

    def line(*points: tuple[float, float]) -> dict[str, Any]:
        return {"points": [{"gpu_hours": g, "attainment": a} for g, a in points]}

    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "frontiers.json").write_text(json.dumps({"120": {
        "xpyd/warm": line((5.0, 0.93), (7.0, 0.99)),
        "static/fixed": line((5.0, 0.92)),               # the learner's 5.0 is not fewer; held -0.1's 4.0 is
        "dynamo-sla/warm": line((3.0, 0.91)),            # neither is (the cold 1.0 does not count)
        "queue-threshold/warm": line((1.0, 0.5))}}))     # never reaches 90%: no row
    head, rule, *rows = steps.against_baselines(summaries, tmp_path)
    assert head.startswith("| workload | baseline |") and rule.startswith("|---|")
    cells = [[c.strip() for c in row.split("|")[1:-1]] for row in rows]
    assert [c[:2] for c in cells] == [["w", "static"], ["w", "dynamo-sla"]], rows
    assert cells[0][2].startswith("missed:") and cells[0][3].startswith("met:"), rows
    assert cells[0][4] == "the learner's cost: a held headroom dominates", rows
    assert "xpyd 4.00 vs 5.00 GPU-hours" in cells[0][3], rows
    assert cells[1][2].startswith("missed:") and cells[1][3].startswith("missed:"), rows
    assert cells[1][4] == "beyond any headroom held all run", rows
    assert steps.against_baselines(summaries, tmp_path / "elsewhere") == []


def test_forecast_error_compares_each_series_as_sized_with_the_window_a_horizon_later(tmp_path: Path) -> None:
    """A steady rate with prompts growing 10 tokens a second: the rate is predicted exactly, ISL as seen
    (the window's or the level, not extrapolated) lags the rise by the horizon's growth, and along its
    trend it comes closer; the prompt tokens err as ISL as seen does. Then the script on conv's first
    15 minutes prints a row per series, and refuses a horizon that ends between decisions."""
    load_eval()
    forecast = load("forecast_error")
    horizon = forecast.horizon_s(120.0)
    series = {end: (10.0, 1000.0 + 10.0 * end, 100.0) for end in range(60, 1860, 30)}
    rows = forecast.errors(series, horizon)
    assert len(rows["rate"]) == len(series) - horizon / 30 - (forecast.WARMUP - 1)
    assert all(error == 0.0 for error in rows["rate"] + rows["OSL, as seen"] + rows["OSL, trend"]), rows
    judged = [end for end in sorted(series)[forecast.WARMUP - 1:] if end + horizon in series]
    lag = [(1000.0 + 10.0 * end) / (1000.0 + 10.0 * (end + horizon)) - 1 for end in judged]
    assert rows["ISL, as seen"] == pytest.approx(lag) and max(lag) < 0, rows["ISL, as seen"]

    def mean_abs(errors: list[float]) -> float:
        return sum(abs(e) for e in errors) / len(errors)

    assert mean_abs(rows["ISL, trend"]) < mean_abs(rows["ISL, as seen"]) / 2, rows
    assert rows["prompt tok/s"] == pytest.approx(rows["ISL, as seen"]), rows

    out = run("forecast_error.py", "--workloads", "conv", "--duration", "900", "--out", str(tmp_path))
    assert out.startswith("Horizon 180 s (120 s start-up):"), out
    assert (tmp_path / "forecast_error.md").read_text().endswith(out), out
    names = [line.split(" | ")[1] for line in out.splitlines() if line.startswith("| conv | ")]
    assert names == list(forecast.ROWS), out
    refused = subprocess.run([sys.executable, str(BENCHMARKS / "forecast_error.py"), "--startup", "100"],
                             capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2 and "must end on a decision" in refused.stderr, refused
