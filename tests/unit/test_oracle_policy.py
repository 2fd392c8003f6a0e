"""`--policy oracle` meets the target it was built for under the run's start-up, or refuses with the reason
(issue 30, item 6)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.paths import H200_PROFILE
from xpyd.autoscaler.observation import Desired, Observation, Slo
from xpyd.perf.model import PerfModel
from xpyd.sim.main import add_parser
from xpyd.sim.oracle import (
    OraclePolicy,
    OracleRefusal,
    OracleSchedule,
    OracleWindow,
    attainment_by_window,
    oracle_schedule,
    refusal,
    run_verdict,
)
from xpyd.sim.policies import build_policy, simulate_policy
from xpyd.sim.policy import PolicyContext
from xpyd.sim.simulator import SimConfig, simulate
from xpyd.traces import TraceRequest

pytestmark = pytest.mark.unit

PERF = PerfModel.from_profile(H200_PROFILE).with_kv_transfer(131072, 100.0)
SLO = Slo(ttft_s=0.5, tpot_s=0.025)
RUN = SimConfig(slo=SLO, startup_delay_s=120.0, interval_s=30.0)


def steady(rate: float, seconds: float, start_s: float = 0.0, isl: int = 1000, osl: int = 100) -> list[TraceRequest]:
    return [TraceRequest(start_s + i / rate, isl, osl) for i in range(int(rate * seconds))]


def ramp() -> list[TraceRequest]:
    """A light first window, then twelve times the load: the busy window begins before any replica
    ordered at the first decision (t = 30 s) can serve (t = 150 s)."""
    return steady(10.0, 60.0) + steady(120.0, 60.0, start_s=60.0)


def test_the_bound_ignores_start_up_and_an_oracle_started_at_its_first_window_misses_the_next() -> None:
    """The cause: the schedule was verified without start-up; run under 120 s from the first window's
    sizes (what `--policy oracle` did), the busy window is served by the light window's pool."""
    bound = oracle_schedule(ramp(), PERF, SLO)
    assert bound.met and bound.lead_s is None and bound.windows[1].prefill > bound.windows[0].prefill
    first = bound.windows[0]
    result = simulate(ramp(), PERF, SimConfig(prefill=first.prefill, decode=first.decode, slo=SLO),
                      OraclePolicy(bound.windows, 150.0))
    assert attainment_by_window(result)[1][1] < 0.5


def test_the_oracle_policy_starts_with_what_its_first_order_cannot_serve() -> None:
    windows = (OracleWindow(0.0, 60.0, 1, 1, 10), OracleWindow(60.0, 120.0, 2, 1, 10),
               OracleWindow(120.0, 180.0, 1, 3, 10), OracleWindow(180.0, 240.0, 5, 5, 10))
    assert OraclePolicy(windows, 150.0).initial == Desired(2, 3)
    assert OraclePolicy(windows, 30.0).initial == Desired(1, 1)
    assert OraclePolicy(windows, 150.0).run_config(RUN) == SimConfig(prefill=2, decode=3, slo=SLO)


def test_the_oracle_run_is_its_verifying_replay_and_meets_every_window() -> None:
    result = simulate_policy("oracle", ramp(), PERF, SimConfig(slo=SLO))   # --prefill 1 --decode 1 ignored
    shares = attainment_by_window(result)
    assert [n for n, _ in shares] == [600, 7200]
    assert all(share >= 0.95 for _, share in shares)
    schedule = oracle_schedule(ramp(), PERF, SLO, run=SimConfig(slo=SLO))
    assert schedule.met and schedule.lead_s == 150.0
    policy = OraclePolicy(schedule.windows, 150.0)
    assert (result.config.prefill, result.config.decode) == (policy.initial.prefill, policy.initial.decode)
    again = simulate(ramp(), PERF, policy.run_config(SimConfig(slo=SLO)), policy)
    assert again.ttft_s == result.ttft_s and again.e2e_s == result.e2e_s
    assert result.gpu_seconds == schedule.result.gpu_seconds
    verdict = run_verdict(result)
    assert verdict["met"] and verdict["windows"] == 2 and "built for 95%" in verdict["summary"]
    assert "120 s start-up" in verdict["summary"]


def test_the_registered_oracle_is_verified_under_the_contexts_start_up() -> None:
    context = PolicyContext(initial=Desired(1, 1), slo=SLO, perf=PERF, interval_s=30.0, startup_delay_s=120.0,
                            trace=ramp())
    policy = build_policy("oracle", context)
    assert isinstance(policy, OraclePolicy) and policy.lead_s == 150.0
    assert policy.desired_sizes(Observation(time_s=0.0, window_s=60.0)) == policy.initial
    assert policy.initial.prefill >= 2


def long_prompts() -> list[TraceRequest]:
    """Half the prompts take longer than 0.5 s to prefill on an idle pool: infeasible at TTFT 0.5 s."""
    return [TraceRequest(i * 0.5, 30_000 if i % 2 else 500, 20) for i in range(240)]


def test_an_oracle_that_cannot_meet_its_target_refuses_with_the_reason() -> None:
    with pytest.raises(OracleRefusal, match=r"the oracle cannot meet 95%: 2 of 2 windows are infeasible at "
                                            r"TTFT 0\.5 s, TPOT 25 ms \(their feasible share 50\.0%"):
        simulate_policy("oracle", long_prompts(), PERF, SimConfig(slo=SLO))


def test_refusal_names_the_windows_still_missing_when_the_rounds_ran_out() -> None:
    schedule = oracle_schedule(ramp(), PERF, SLO)
    assert refusal(schedule, SLO) is None
    windows = (schedule.windows[0], OracleWindow(60.0, 120.0, 1, 1, 7200, 0.95, 0.41))
    short = OracleSchedule(windows, schedule.result, rounds=8)
    assert refusal(short, SLO) == ("the oracle cannot meet 95%: after 8 verifying replays 1 of 2 windows still "
                                   "miss it at TTFT 0.5 s, TPOT 25 ms (worst: [60, 120) s attained 41.0%)")


def test_the_oracles_run_must_share_the_searchs_slo() -> None:
    with pytest.raises(ValueError, match="SLO"):
        oracle_schedule(ramp(), PERF, SLO, run=SimConfig(slo=Slo(ttft_s=1.0, tpot_s=0.025)))


# --- the command line -----------------------------------------------------------------------------

def sim(tmp_path: Path, trace: list[TraceRequest], *extra: str) -> argparse.Namespace:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": round(r.arrival_s * 1000), "input_length": r.isl,
                                        "output_length": r.osl}) + "\n" for r in trace))
    parser = argparse.ArgumentParser(prog="xpyd")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["sim", "--trace", str(path), "--profile", str(H200_PROFILE), "--policy", "oracle",
                              "--slo-ttft-ms", "500", "--slo-tpot-ms", "25", *extra])


def test_cli_oracle_refuses_with_exit_2_and_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "r.json"
    args = sim(tmp_path, long_prompts(), "--report", str(report))
    assert args.func(args) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("xpyd sim: the oracle cannot meet 95%: 2 of 2 windows are infeasible")
    assert captured.err.count("\n") == 1 and captured.out == "" and not report.exists()


def test_cli_oracle_says_what_it_was_built_for_and_that_the_run_met_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "r.json"
    args = sim(tmp_path, ramp(), "--report", str(report))
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "oracle: built for 95% of each 60 s window's requests meeting both SLOs" in printed
    assert "this run met it in all 2 windows" in printed
    saved = json.loads(report.read_text())
    assert saved["oracle"]["met"] and saved["attainment"] >= 0.95
    assert saved["config"]["prefill"] > 1   # its own starting sizes, not --prefill 1
