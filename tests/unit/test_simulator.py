"""The discrete-event cluster simulator, its policy loop, its report and `xpyd sim`."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.paths import FIXTURE_TRACES, H200_PROFILE
from xpyd.api.naming import DECODE, PREFILL
from xpyd.autoscaler.observation import Desired, Observation, Slo
from xpyd.perf.model import PerfModel
from xpyd.sim.core import EngineConfig
from xpyd.sim.main import ProgressBar, add_parser
from xpyd.sim.policies import POLICIES, build_policy
from xpyd.sim.policy import PolicyContext, StaticPolicy
from xpyd.sim.report import build_report, percentile, summary, timeline_bin_s
from xpyd.sim.simulator import SimConfig, Simulator, simulate
from xpyd.traces import TraceRequest, read_trace

pytestmark = pytest.mark.unit

AZURE = FIXTURE_TRACES / "azure_conv_2023_head200.csv"
PROFILE = H200_PROFILE
KV_BYTES_LLAMA_8B_BF16 = 2 * 32 * 8 * 128 * 2


@dataclass
class LinearPerf:
    max_kv_tokens: int = 200_000

    def prefill_seconds(self, batch_tokens: int) -> float:
        return 0.01 + 2e-5 * batch_tokens if batch_tokens > 0 else 0.0

    def decode_step_seconds(self, batch_size: int, kv_tokens: int) -> float:
        return 0.005 + 1e-4 * batch_size + 1e-8 * kv_tokens

    def kv_transfer_seconds(self, tokens: int) -> float:
        return 1e-5 * tokens


def real_perf() -> PerfModel:
    return PerfModel.from_profile(PROFILE).with_kv_transfer(KV_BYTES_LLAMA_8B_BF16, 100.0)


def azure(speedup: float = 1.0) -> list[TraceRequest]:
    return [TraceRequest(r.arrival_s / speedup, r.isl, r.osl) for r in read_trace(AZURE)]


@dataclass
class Recorder:
    """A policy that records what it sees and follows a schedule of sizes."""

    schedule: list[tuple[float, Desired]]
    seen: list[Observation] = field(default_factory=list)

    def desired_sizes(self, observation: Observation) -> Desired:
        self.seen.append(observation)
        current = self.schedule[0][1]
        for at, desired in self.schedule:
            if observation.time_s >= at:
                current = desired
        return current


def test_same_seed_same_run_and_conservation() -> None:
    config = SimConfig(prefill=2, decode=3, seed=7)
    trace = azure(speedup=4)
    first = simulate(trace, LinearPerf(), config)
    again = simulate(trace, LinearPerf(), config)
    assert first.ttft_s == again.ttft_s and first.e2e_s == again.e2e_s
    assert build_report(first) == build_report(again)
    assert all(math.isfinite(t) and math.isfinite(e) and 0 < t <= e for t, e in zip(first.ttft_s, first.e2e_s,
                                                                                    strict=True))


def test_every_request_finishes_exactly_once_on_each_role() -> None:
    trace = azure(speedup=10)
    simulator = Simulator(trace, LinearPerf(), StaticPolicy(Desired(2, 2)), SimConfig(prefill=2, decode=2))
    result = simulator.run()
    for role in (PREFILL, DECODE):
        engines = simulator.engines(role)
        assert sum(e.metrics.request_success_total for e in engines) == len(trace)
        assert all(e.is_idle and e.kv_reserved_tokens == 0 for e in engines)
    decode_tokens = sum(e.metrics.generation_tokens_total for e in simulator.engines(DECODE))
    assert decode_tokens == sum(r.osl for r in trace)
    assert result.end_s == pytest.approx(max(r.arrival_s + e for r, e in zip(trace, result.e2e_s, strict=True)))


def test_routing_spreads_requests_over_every_replica() -> None:
    trace = [TraceRequest(0.0, 100, 5) for _ in range(8)]
    loads = []
    for seed in (1, 2):
        simulator = Simulator(trace, LinearPerf(), StaticPolicy(Desired(4, 4)), SimConfig(prefill=4, decode=4,
                                                                                           seed=seed))
        simulator.run()
        loads.append([e.metrics.request_success_total for e in simulator.engines(DECODE)])
    assert loads[0] == [2, 2, 2, 2] == loads[1]   # least outstanding spreads them evenly whatever the seed


def test_static_policy_keeps_the_sizes() -> None:
    result = simulate(azure(speedup=2), LinearPerf(), SimConfig(prefill=2, decode=3, interval_s=10.0))
    assert result.scaling_actions == 0 and result.replicas_started == 0
    assert result.decisions and all((d.prefill, d.decode) == (2, 3) for d in result.decisions)
    assert {(s.prefill_ready, s.decode_ready) for s in result.replicas} == {(2, 3)}
    assert result.gpu_seconds[PREFILL] == pytest.approx(2 * result.end_s)
    assert result.gpu_seconds[DECODE] == pytest.approx(3 * result.end_s)
    static = build_policy("static", PolicyContext(Desired(1, 2), Slo(), LinearPerf(), 30.0, 120.0))
    assert static.desired_sizes(Observation(time_s=0.0, window_s=60.0)) == Desired(1, 2)
    assert "static" in POLICIES
    with pytest.raises(ValueError, match="unknown policy"):
        build_policy("psychic", PolicyContext(Desired(1, 1), Slo(), LinearPerf(), 30.0, 120.0))


def test_scale_up_waits_for_startup_and_scale_down_drains() -> None:
    trace = [TraceRequest(i * 0.5, 500, 50) for i in range(400)]   # 200 s of load
    policy = Recorder([(0.0, Desired(1, 1)), (20.0, Desired(3, 2)), (120.0, Desired(1, 1))])
    config = SimConfig(prefill=1, decode=1, interval_s=10.0, startup_delay_s=30.0)
    simulator = Simulator(trace, LinearPerf(), policy, config)
    result = simulator.run()
    assert result.scaling_actions == 4 and result.replicas_started == 3
    at = {s.time_s: s for s in result.replicas}
    assert (at[20.0].prefill_ready, at[20.0].prefill_starting, at[20.0].decode_starting) == (1, 2, 1)
    assert (at[50.0].prefill_ready, at[50.0].decode_ready) == (3, 2)     # ready after the start-up delay
    assert all(math.isfinite(e) for e in result.e2e_s)                   # draining lost nothing
    assert result.replicas_stopped == 3
    # The late replicas used their GPUs from their start (loading included) to their drain.
    assert result.gpu_seconds[PREFILL] == pytest.approx(result.end_s + 2 * (120.0 - 20.0), abs=1.0)
    assert [e.metrics.request_success_total > 0 for e in simulator.engines(PREFILL)] == [True, True, True]
    seen = policy.seen
    assert seen[2].prefill.starting == 2 and seen[2].prefill.replicas == 3 and seen[2].prefill.ready == 1
    assert seen[5].prefill.ready == 3


def test_scaling_down_a_starting_replica_cancels_it() -> None:
    trace = [TraceRequest(i * 1.0, 100, 5) for i in range(100)]
    policy = Recorder([(0.0, Desired(1, 1)), (10.0, Desired(2, 1)), (20.0, Desired(1, 1))])
    result = simulate(trace, LinearPerf(), SimConfig(interval_s=10.0, startup_delay_s=60.0), policy)
    assert result.replicas_started == 1 and result.replicas_stopped == 1
    assert result.gpu_seconds[PREFILL] == pytest.approx(result.end_s + 10.0)


def test_observation_mirrors_prometheus_queries() -> None:
    trace = [TraceRequest(i * 0.1, 1000, 20) for i in range(1200)]   # 10 req/s for 120 s
    policy = Recorder([(0.0, Desired(1, 1))])
    simulate(trace, LinearPerf(), SimConfig(interval_s=30.0, window_s=60.0), policy)
    first, second = policy.seen[0], policy.seen[1]
    assert first.window_s == 30.0 and second.window_s == 60.0
    assert second.request_rate == pytest.approx(10.0, rel=0.02)
    assert second.isl_mean == pytest.approx(1000.0) and second.osl_mean == pytest.approx(20.0)
    assert second.prefill.prompt_tokens_per_s == pytest.approx(10_000.0, rel=0.05)
    assert second.decode.generation_tokens_per_s == pytest.approx(200.0, rel=0.05)
    assert 0 < second.ttft_seconds.p50 <= second.ttft_seconds.p90 <= second.ttft_seconds.p99
    assert second.decode.inter_token_latency_seconds.p50 > 0
    assert second.prefill.replicas == second.prefill.ready == 1 and second.decode.starting == 0
    assert 0 <= second.decode.kv_cache_usage_perc <= second.decode.kv_cache_usage_perc_max < 1
    for gauges in (second.prefill, second.decode):   # one engine per role: its queue is the fullest
        assert gauges.num_requests_waiting_max == gauges.num_requests_waiting


def test_the_fullest_engines_queue_is_reported_beside_the_sum() -> None:
    """One prefill replica queues 30 req/s of 4,000-token prompts (about 12 it serves) until three more
    serve at t=30 s: then new requests go to them, and the first drains its queue alone. At t=100 s
    100 req/s for 20 s queue on all four alike. The observations report the fullest engine's queue,
    within the sum: nearly all of it first, about a quarter of it then."""
    trace = [TraceRequest(i / 30.0, 4000, 5) for i in range(1800)]
    trace += [TraceRequest(100.0 + i / 100.0, 4000, 5) for i in range(2000)]
    policy = Recorder([(0.0, Desired(1, 1)), (10.0, Desired(4, 2))])
    simulate(trace, LinearPerf(), SimConfig(interval_s=10.0, startup_delay_s=20.0), policy)
    for seen in policy.seen:
        prefill = seen.prefill
        assert prefill.num_requests_waiting_max <= prefill.num_requests_waiting
        assert prefill.num_requests_waiting_max * max(prefill.ready + prefill.draining, 1) \
            >= prefill.num_requests_waiting
    pinned = [seen.prefill for seen in policy.seen
              if seen.time_s < 100.0 and seen.prefill.ready == 4 and seen.prefill.num_requests_waiting > 50]
    assert pinned and all(p.num_requests_waiting_max >= 0.8 * p.num_requests_waiting for p in pinned)
    shared = [seen.prefill for seen in policy.seen if seen.time_s > 100.0 and seen.prefill.num_requests_waiting > 100]
    assert shared and all(p.num_requests_waiting_max <= 0.4 * p.num_requests_waiting for p in shared)


def test_requests_that_never_fit_are_rejected_not_lost() -> None:
    trace = [TraceRequest(0.0, 100, 10), TraceRequest(1.0, 190_000, 20_000)]
    result = simulate(trace, LinearPerf(), SimConfig())
    assert result.rejected == 1 and math.isnan(result.ttft_s[1])
    report = build_report(result)
    assert report["attainment"] == 0.5 and report["rejected"] == 1


def test_report_keys_and_json() -> None:
    result = simulate(azure(speedup=4), LinearPerf(), SimConfig(prefill=1, decode=2))
    report = build_report(result, trace_name="azure", speedup=4)
    for key in ("requests", "attainment", "goodput_rps", "gpu_hours", "goodput_per_gpu_hour", "ttft_ms", "tpot_ms",
                "scaling_actions", "replicas", "decisions"):
        assert key in report
    for key in ("ttft_ms", "tpot_ms"):
        assert set(report[key]) >= {"p50", "p90", "p99"}
        assert report[key]["p50"] <= report[key]["p90"] <= report[key]["p99"]
    assert 0 <= report["attainment"] <= 1 and report["requests"] == 200
    assert report["goodput_per_gpu_hour"] == pytest.approx(report["good_requests"] / report["gpu_hours"], rel=1e-3)
    json.dumps(report, allow_nan=False)
    assert "attainment" in summary(report, wall_s=0.5)


def test_percentile_and_bins() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([5.0], 0.99) == 5.0 and math.isnan(percentile([], 0.5))
    assert timeline_bin_s(3600) == 60 and timeline_bin_s(180) == 2


def test_fused_decode_steps_do_not_change_the_answer() -> None:
    trace = azure(speedup=8)
    fused = simulate(trace, real_perf(), SimConfig(prefill=1, decode=2))
    single = simulate(trace, real_perf(), SimConfig(prefill=1, decode=2, max_decode_steps=1))
    assert fused.events < single.events / 3
    for a, b in zip(fused.e2e_s, single.e2e_s, strict=True):
        assert a == pytest.approx(b, rel=1e-3, abs=0.01)   # at most a pass of phase difference


# --- consistency with the measured profile --------------------------------------------------------

@pytest.mark.parametrize("isl", [100, 1117, 4168, 8236, 16372])
def test_low_load_ttft_matches_the_profile(isl: int) -> None:
    perf = real_perf()
    trace = [TraceRequest(i * 30.0, isl, 16) for i in range(3)]
    result = simulate(trace, perf, SimConfig(prefill=1, decode=1))
    expected = perf.ttft_seconds(isl, disaggregated=True)   # prefill + KV transfer + one decode step
    for ttft in result.ttft_s:
        assert ttft == pytest.approx(expected, rel=0.05)


def test_saturated_cluster_throughput_matches_the_profile() -> None:
    perf = real_perf()
    isl = 8236
    measured = isl / perf.prefill_seconds(isl)    # the profile's prefill_tokens_per_s_per_gpu at isl
    trace = [TraceRequest(0.0, isl, 2) for _ in range(300)]
    result = simulate(trace, perf, SimConfig(prefill=2, decode=1))
    first_leg_done = max(a + t for a, t in zip(result.arrival_s, result.ttft_s, strict=True))
    assert 300 * isl / first_leg_done / 2 == pytest.approx(measured, rel=0.05)


# --- the command line -----------------------------------------------------------------------------

def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="xpyd")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["sim", *argv])


def test_cli_writes_report_and_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    args = parse("--trace", str(AZURE), "--profile", str(PROFILE), "--policy", "static", "--prefill", "1",
                 "--decode", "2", "--speedup", "5", "--report", str(out), "--seed", "3")
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 200 and report["config"]["seed"] == 3 and report["speedup"] == 5
    assert report["rate_scale"] == 1
    printed = capsys.readouterr().out
    assert "attainment" in printed and "GPU-hours" in printed and "rate x" not in printed


def test_cli_rate_scale_multiplies_the_requests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    args = parse("--trace", str(AZURE), "--profile", str(PROFILE), "--prefill", "2", "--decode", "4",
                 "--rate-scale", "3", "--report", str(out))
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 600 and report["rate_scale"] == 3 and report["speedup"] == 1
    assert "x1, rate x3, 600 requests" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--trace", "absent.csv"], "cannot read"),
    (["--policy", "psychic"], "unknown policy"),
    (["--speedup", "0"], "speedup"),
    (["--rate-scale", "0"], "rate scale"),
    (["--prefill", "0"], "at least 1"),
    (["--block-size", "0"], "block_size"),
    (["--slo-ttft-ms", "-5"], "slo-ttft-ms"),
    (["--start", "99999"], "no requests in the window"),
    (["--profile", "/nonexistent/profile"], "No such file"),
    (["--model", "gpt-9"], "gpt-9"),
])
def test_cli_bad_input_exits_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = {"--trace": str(AZURE), "--profile": str(PROFILE)}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        base[flag] = value
    args = parse(*[part for pair in base.items() for part in pair])
    assert args.func(args) == 2
    assert message in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path: Path) -> None:
    from xpyd.sim.report import plot

    policy = Recorder([(0.0, Desired(1, 1)), (10.0, Desired(2, 2))])
    result = simulate(azure(speedup=2), LinearPerf(), SimConfig(interval_s=10.0, startup_delay_s=20.0), policy)
    path = tmp_path / "r.png"
    plot(result, path, title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    bar = ProgressBar(sys.stderr, width=10)
    bar(5, 10, 12.0)
    bar(10, 10, 30.0)
    err = capsys.readouterr().err
    assert "[#####-----] 5/10" in err and err.endswith("\n")


def test_engine_config_is_validated() -> None:
    with pytest.raises(ValueError):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError):
        SimConfig(interval_s=0)


@dataclass
class Reactor(Recorder):
    """A recorder that also reacts between its decisions: it asks for `grow_to` prefill replicas once."""

    react_s: float | None = 5.0
    grow_to: int = 3
    reacted: list[Observation] = field(default_factory=list)

    def react(self, observation: Observation) -> Desired | None:
        self.reacted.append(observation)
        if len(self.reacted) == 2:
            return Desired(self.grow_to, observation.decode.replicas)
        return None


def test_a_reacting_policy_sees_the_gauges_every_react_s_and_scales_between_decisions() -> None:
    trace = azure()
    policy = Reactor([(0.0, Desired(1, 1))])
    result = simulate(trace, LinearPerf(), SimConfig(prefill=1, decode=1, startup_delay_s=20.0), policy)
    times = [o.time_s for o in policy.reacted]
    assert times[:4] == [5.0, 10.0, 15.0, 20.0]
    assert 30.0 not in times and 35.0 in times        # as the operator: no look at a decision's instant
    assert all(o.window_s == 0.0 and o.request_rate == 0.0 for o in policy.reacted)   # gauges, no window
    assert policy.reacted[2].prefill.replicas == 3 and policy.reacted[2].prefill.starting == 2
    assert [(c.time_s, c.prefill_before, c.prefill) for c in result.decisions][:2] == [(10.0, 1, 3), (30.0, 3, 1)]
    assert any(s.time_s == 10.0 and s.prefill_starting == 2 for s in result.replicas)


def test_a_policy_without_react_s_is_called_at_its_interval_only() -> None:
    policy = Reactor([(0.0, Desired(1, 1))], react_s=None)
    simulate(azure(), LinearPerf(), SimConfig(prefill=1, decode=1), policy)
    assert policy.reacted == [] and policy.seen
