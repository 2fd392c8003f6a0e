"""The autoscaler's model (sizing, forecasts) and the simulator policies it is judged against."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from tests.paths import FIXTURE_TRACES, H200_PROFILE
from xpyd.autoscaler.forecast import HoltForecaster, LastValueForecaster, SeriesState, ahead, seen
from xpyd.autoscaler.observation import Desired, Observation, Quantiles, RoleObservation, Slo
from xpyd.autoscaler.sizing import Burst, PoolModel, PromptMix
from xpyd.perf.model import PerfModel
from xpyd.sim.dynamo import ArimaLikePredictor, DynamoSlaPolicy
from xpyd.sim.oracle import OraclePolicy, SchedulePolicy, _fewest, oracle_schedule
from xpyd.sim.policies import (
    POLICIES,
    NowcastPolicy,
    QueueThresholdPolicy,
    XpydPolicy,
    build_policy,
    simulate_policy,
)
from xpyd.sim.policy import PolicyContext
from xpyd.sim.report import build_report
from xpyd.sim.simulator import SimConfig, SimResult, simulate
from xpyd.traces import TraceRequest, read_trace, scale_prompts, scale_rate, surge

pytestmark = pytest.mark.unit

PERF = PerfModel.from_profile(H200_PROFILE).with_kv_transfer(131072, 100.0)
MODEL = PoolModel(PERF, ttft_target_s=0.5, tpot_target_s=0.025, quantile=0.95)
SLO = Slo(ttft_s=0.5, tpot_s=0.025)


def steady_trace(rate: float, seconds: float, isl: int = 1000, osl: int = 100) -> list[TraceRequest]:
    return [TraceRequest(i / rate, isl, osl) for i in range(int(rate * seconds))]


# --- sizing -----------------------------------------------------------------------------------------

def test_prefill_sizing_grows_with_load_and_keeps_queueing_headroom() -> None:
    mix = PromptMix.from_quantiles(1000.0, Quantiles(900.0, 2000.0))
    sizes = [MODEL.size_prefill(rate, mix, 0.02) for rate in (5.0, 50.0, 150.0)]
    assert [s.replicas for s in sizes] == sorted(s.replicas for s in sizes)
    assert sizes[-1].replicas > sizes[0].replicas
    assert all(s.attainment >= 0.95 and s.utilisation <= MODEL.max_utilisation for s in sizes)
    assert MODEL.saturated_tokens_per_s() == pytest.approx(8192 / PERF.prefill_seconds(8192))


def test_a_replicas_prompt_rate_on_a_mix_is_the_budgets_rate_until_prompts_outgrow_the_budget() -> None:
    short = PromptMix((500.0, 1000.0, 8192.0))
    assert MODEL.mix_tokens_per_s(short) == pytest.approx(MODEL.saturated_tokens_per_s())
    assert MODEL.mix_tokens_per_s(short, k=0.8) == pytest.approx(0.8 * MODEL.saturated_tokens_per_s())
    single = PromptMix((32_000.0,))
    assert MODEL.mix_tokens_per_s(single) == pytest.approx(32_000.0 / PERF.prefill_seconds(32_000))
    assert MODEL.mix_tokens_per_s(single) < MODEL.mix_tokens_per_s(PromptMix((1000.0, 32_000.0))) \
        < MODEL.saturated_tokens_per_s()
    sizing = MODEL.size_prefill(10.0, single, 0.02)
    assert sizing.tokens_per_s_per_replica == pytest.approx(MODEL.mix_tokens_per_s(single))
    assert sizing.utilisation == pytest.approx(sizing.demand_tokens_per_s / (sizing.replicas
                                                                            * sizing.tokens_per_s_per_replica))


def test_prompts_too_long_for_the_target_are_not_sized_for() -> None:
    mix = PromptMix((1000.0, 60_000.0))
    sizing = MODEL.size_prefill(1.0, mix, 0.02)
    assert sizing.feasible_share == 0.5 and sizing.attainment >= 0.95


def test_decode_sizing_follows_the_itl_frontier() -> None:
    sizing = MODEL.size_decode(50.0, 1000.0, 200.0)
    assert sizing.limit == "ITL" and sizing.itl_s <= 0.025 * MODEL.itl_margin
    assert sizing.replicas == math.ceil(50.0 * 200.0 * sizing.itl_s / sizing.batch)
    longer = MODEL.size_decode(50.0, 12_000.0, 200.0)
    assert longer.batch < sizing.batch and longer.replicas >= sizing.replicas
    assert MODEL.decode_shortfall(sizing.replicas, sizing) == 0.0 and MODEL.decode_shortfall(1, sizing) > 0


def test_prompt_mix_keeps_the_mean() -> None:
    mix = PromptMix.from_quantiles(1500.0, Quantiles(1000.0, 3000.0))
    assert mix.mean == pytest.approx(1500.0) and max(mix.isl_tokens) > 3000.0
    assert PromptMix.from_samples([1, 2, 3]).isl_tokens == (1.0, 2.0, 3.0)


@pytest.mark.parametrize(("tokens", "share"), [
    (0.0, 1.0), (50.0, 0.75), (100.0, 0.5), (300.0, 0.1), (1200.0, 0.01), (1300.0, 0.0), (5000.0, 0.0)])
def test_burst_share_waiting_follows_its_quantiles(tokens: float, share: float) -> None:
    # p50 100, p90 300, p99 1200 tokens ahead; past p99 at the p90-p99 slope (900 per 9 points) to 1300.
    assert Burst(0.0, 100.0, 2, 100.0, 300.0, 1200.0).share_waiting_over(tokens) == pytest.approx(share)


def test_burst_replicas_keep_the_bursts_misses_within_the_error_budget() -> None:
    mix = PromptMix.from_quantiles(1000.0, Quantiles(900.0, 2000.0))
    rate = MODEL.saturated_tokens_per_s() * MODEL.queue_budget_s(mix, 0.02)     # tokens one replica drains in budget
    burst = Burst(0.0, 100.0, 4, 2 * rate, 6 * rate, 9 * rate)
    # Judged against its own 100 requests the burst needs its p95 drained: 7.5 replicas' worth -> 8.
    assert MODEL.burst_replicas(((1.0, burst),), 100.0, mix, 0.02) == 8
    # One such burst among 200 requests: 10 (10% of it) may miss -> its p90, 6 replicas; among 1000
    # half of it may -> its p50, 2 replicas; among 10,000 it needs nothing.
    assert MODEL.burst_replicas(((1.0, burst),), 200.0, mix, 0.02) == 6
    assert MODEL.burst_replicas(((1.0, burst),), 1000.0, mix, 0.02) == 2
    assert MODEL.burst_replicas(((1.0, burst),), 10_000.0, mix, 0.02) == 1
    # Weighted down by age it counts less (half: 20% may miss, its p80, 5 replicas).
    assert MODEL.burst_replicas(((0.5, burst),), 200.0, mix, 0.02) == 5
    # Steady queueing shares the error budget: a busy pool needs more on top of the same burst.
    assert MODEL.burst_replicas(((1.0, burst),), 200.0, mix, 0.02, rate=300.0) > 6
    assert MODEL.burst_miss_share(((1.0, burst),), 200.0, 6, mix, 0.02) == pytest.approx(0.1 * 100 / 200)


# --- forecasts ---------------------------------------------------------------------------------------

def test_holt_follows_a_trend_within_bounds() -> None:
    holt = HoltForecaster()
    state = SeriesState()
    assert math.isnan(holt.predict(state, 60.0))
    for step in range(8):
        state = holt.update(state, 30.0 * step, 10.0 + step)
    assert state.trend_per_s > 0
    assert holt.predict(state, 150.0) > state.level
    assert holt.predict(state, 1e6) <= state.level * holt.max_ratio
    assert holt.update(state, 30.0 * 7, 99.0) == state          # no time passed: ignored
    assert holt.update(state, 999.0, math.nan) == state         # missing sample: ignored


RISING = SeriesState(level=100.0, trend_per_s=1.0, time_s=0.0, samples=5)   # Holt: 100 now, rising 1/s


@pytest.mark.parametrize(("state", "current", "as_seen", "along_trend"), [
    (RISING, 90.0, 100.0, 150.0),       # the level; ahead, the forecast (at its bound, 1.5x the level)
    (RISING, 500.0, 500.0, 500.0),      # a window above both
    (SeriesState(), 80.0, 80.0, 80.0),  # no state yet: the window
    (SeriesState(), math.nan, math.nan, math.nan),                  # nothing known
    (SeriesState(level=-1.0, samples=1), 0.0, math.nan, math.nan),  # nothing positive
])
def test_a_series_is_sized_as_seen_or_ahead(state: SeriesState, current: float, as_seen: float,
                                             along_trend: float) -> None:
    holt = HoltForecaster()
    assert seen(state, current) == pytest.approx(as_seen, nan_ok=True)
    assert ahead(holt, state, current, 180.0) == pytest.approx(along_trend, nan_ok=True)


def test_last_value_forecaster() -> None:
    forecaster = LastValueForecaster()
    state = forecaster.update(forecaster.update(SeriesState(), 0.0, 3.0), 30.0, 5.0)
    assert forecaster.predict(state, 300.0) == 5.0


# --- baselines ---------------------------------------------------------------------------------------

def role(**fields: float) -> RoleObservation:
    return RoleObservation(**fields)  # type: ignore[arg-type]


def test_queue_threshold_steps_one_replica_per_period() -> None:
    policy = QueueThresholdPolicy(Desired(1, 1))
    busy = Observation(time_s=30.0, window_s=60.0, prefill=role(replicas=2, ready=2, num_requests_waiting=20.0),
                       decode=role(replicas=2, ready=2, kv_cache_usage_perc=0.95))
    assert policy.desired_sizes(busy) == Desired(3, 3)
    later = Observation(time_s=120.0, window_s=60.0, prefill=busy.prefill, decode=busy.decode)
    assert policy.desired_sizes(later) == Desired(2, 2)          # within 3 min of the last step up
    idle = Observation(time_s=240.0, window_s=60.0, prefill=role(replicas=3, ready=3),
                       decode=role(replicas=3, ready=3, kv_cache_usage_perc=0.1))
    assert policy.desired_sizes(idle) == Desired(2, 2)
    assert policy.desired_sizes(Observation(time_s=300.0, window_s=60.0, prefill=idle.prefill,
                                     decode=idle.decode)) == Desired(3, 3)   # 5 min between steps down


def test_arima_like_predictor() -> None:
    predictor = ArimaLikePredictor()
    predictor.add(0.0)                      # leading idle period skipped
    assert predictor.predict() == 0.0
    for value in (5.0, 5.0, 5.0):
        predictor.add(value)
    assert predictor.predict() == 5.0       # under five points: the last value
    trend = ArimaLikePredictor()
    for value in (10.0, 20.0, 30.0, 40.0, 50.0, 60.0):
        trend.add(value)
    assert trend.predict() == pytest.approx(70.0, rel=0.1)


def dynamo_observation(time_s: float, rate: float, isl: float = 2000.0, osl: float = 150.0) -> Observation:
    return Observation(time_s=time_s, window_s=60.0, request_rate=rate, isl_mean=isl, osl_mean=osl,
                       ttft_seconds=Quantiles(mean=1.0), tpot_seconds=Quantiles(mean=0.02),
                       decode=role(replicas=2, ready=2, generation_tokens_per_s=rate * osl,
                                   inter_token_latency_seconds=Quantiles(mean=0.02)))  # type: ignore[arg-type]


def test_dynamo_plans_every_180s_with_its_formulas() -> None:
    policy = DynamoSlaPolicy(PERF, 0.5, 0.025, Desired(1, 1))
    for time_s in (30.0, 60.0, 90.0, 120.0, 150.0):
        assert policy.desired_sizes(dynamo_observation(time_s, 20.0)) == Desired(1, 1)
    desired = policy.desired_sizes(dynamo_observation(180.0, 20.0))
    num_req = 20.0 * 180.0
    # p_correction = 1 s / prefill(2000) > 1, so min(1, .) leaves the demand as it is.
    assert desired.prefill == math.ceil(num_req * 2000 / 180.0 / PERF.prefill_tokens_per_second(2000))
    itl = 0.025 / policy.d_correction
    batch = PERF.max_batch_for_itl(itl, 2075.0)
    assert desired.decode == math.ceil(num_req * 150 / 180.0 / PERF.decode_tokens_per_second(batch, 2075.0))
    assert policy.desired_sizes(dynamo_observation(210.0, 80.0)) == desired  # holds until the next interval


# --- oracle ------------------------------------------------------------------------------------------

def step_trace() -> list[TraceRequest]:
    return steady_trace(10.0, 60.0) + [TraceRequest(60.0 + i / 120.0, 1000, 100) for i in range(120 * 60)]


def test_oracle_windows_grow_with_load_and_its_replay_meets_every_window() -> None:
    schedule = oracle_schedule(step_trace(), PERF, SLO)
    windows = schedule.windows
    assert len(windows) == 2 and windows[1].prefill > windows[0].prefill
    assert schedule.met and schedule.feasible
    assert all(w.attained >= w.goal == 0.95 for w in windows)
    assert build_report(schedule.result)["attainment"] >= 0.95
    assert schedule.gpu_hours == pytest.approx(sum(schedule.result.gpu_seconds.values()) / 3600)
    assert schedule.peak == Desired(max(w.prefill for w in windows), max(w.decode for w in windows))
    assert schedule.mean.prefill == math.ceil((windows[0].prefill + windows[1].prefill) / 2)
    policy = OraclePolicy(windows, lead_s=30.0)
    assert policy.desired_sizes(Observation(time_s=30.0, window_s=60.0)) == Desired(windows[0].prefill,
                                                                                     windows[0].decode)
    assert policy.desired_sizes(Observation(time_s=60.0, window_s=60.0)) == Desired(windows[1].prefill,
                                                                                     windows[1].decode)
    early = OraclePolicy(windows, lead_s=150.0)
    assert early.desired_sizes(Observation(time_s=30.0, window_s=60.0)).prefill == windows[1].prefill
    assert policy.initial == Desired(windows[0].prefill, windows[0].decode)


def test_the_oracle_is_the_fewest_the_simulator_shows_meeting_the_target() -> None:
    """One prefill or decode replica fewer in the busy window misses its goal in the same replay."""
    schedule = oracle_schedule(step_trace(), PERF, SLO)
    busy = schedule.windows[1]
    for fewer in (replace(busy, prefill=busy.prefill - 1), replace(busy, decode=busy.decode - 1)):
        if min(fewer.prefill, fewer.decode) < 1:
            continue
        windows = (schedule.windows[0], fewer)
        result = simulate(step_trace(), PERF, SimConfig(prefill=windows[0].prefill, decode=windows[0].decode,
                                                        slo=SLO, startup_delay_s=0.0, interval_s=60.0),
                          SchedulePolicy(windows))
        tpot = result.tpot_s()
        late = [i for i, t in enumerate(result.arrival_s) if t >= 60.0]
        good = sum(1 for i in late if result.ttft_s[i] <= SLO.ttft_s and tpot[i] <= SLO.tpot_s)
        assert good / len(late) < 0.95, fewer


def test_the_nowcast_knows_each_window_once_it_begins_and_pays_the_start_up_delay() -> None:
    schedule = oracle_schedule(step_trace(), PERF, SLO)
    quiet, busy = schedule.windows
    nowcast = NowcastPolicy(schedule.windows, Desired(1, 2))
    assert nowcast.initial == Desired(quiet.prefill + 1, quiet.decode + 2)
    assert nowcast.desired_sizes(Observation(time_s=59.9, window_s=60.0)) == Desired(quiet.prefill + 1,
                                                                                      quiet.decode + 2)
    assert nowcast.desired_sizes(Observation(time_s=60.0, window_s=60.0)) == Desired(busy.prefill + 1, busy.decode + 2)
    assert nowcast.desired_sizes(Observation(time_s=900.0, window_s=60.0)) == Desired(busy.prefill + 1, busy.decode + 2)
    with pytest.raises(ValueError, match="windows"):
        NowcastPolicy(())
    with pytest.raises(ValueError, match="negative"):
        NowcastPolicy(schedule.windows, Desired(-1, 0))

    def attainment(startup_s: float, extra: Desired) -> float:
        policy = NowcastPolicy(schedule.windows, extra)
        config = SimConfig(prefill=policy.initial.prefill, decode=policy.initial.decode, slo=SLO,
                           startup_delay_s=startup_s)
        return float(build_report(simulate(step_trace(), PERF, config, policy))["attainment"])

    # Without a start-up delay the nowcast is the oracle's own schedule; with one, the step to the busy
    # window is served late, and headroom held from the start is what makes up for it.
    assert attainment(0.0, Desired(0, 0)) >= 0.95
    late = attainment(60.0, Desired(0, 0))
    assert late < 0.95
    assert attainment(60.0, Desired(busy.prefill - quiet.prefill, busy.decode - quiet.decode)) >= 0.95 > late


def fixture_workloads() -> dict[str, tuple[list[TraceRequest], Slo]]:
    """The evaluation's kinds of workload on the fixture slices: each trace at a rate that needs
    several replicas, a surge built from one, a long-context variant of one."""
    conv = read_trace(FIXTURE_TRACES / "azure_conv_2023_600s_240s.csv")
    code = [r for r in read_trace(FIXTURE_TRACES / "azure_code_2023_600s_720s.csv") if r.arrival_s < 180.0]
    mooncake = read_trace(FIXTURE_TRACES / "mooncake_synthetic_head50.jsonl")
    long_slo = Slo(ttft_s=3.0, tpot_s=0.030)
    return {
        "conv": (scale_rate(conv, 4), SLO),
        "code": (scale_rate(code, 4), SLO),
        "mooncake": (scale_rate(mooncake, 4), long_slo),
        "surge": (surge(scale_rate(conv, 2), 60.0, 120.0, 4), SLO),
        "long": (scale_prompts(scale_rate(conv, 2), 8.0, max_isl=32768), long_slo),
    }


@pytest.mark.parametrize("name", ["conv", "code", "mooncake", "surge", "long"])
def test_the_oracle_meets_the_target_on_every_kind_of_workload(name: str) -> None:
    trace, slo = fixture_workloads()[name]
    schedule = oracle_schedule(trace, PERF, slo)
    assert schedule.feasible and schedule.met, [(w.prefill, w.decode, w.attained) for w in schedule.windows]
    report = build_report(schedule.result)
    assert report["attainment"] >= 0.95
    assert max(w.prefill + w.decode for w in schedule.windows) >= 3   # a pool to size, not one pair


def test_the_oracles_search_replays_the_prefix_blocks_its_verifying_replay_caches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import xpyd.sim.oracle as oracle

    trace, slo = fixture_workloads()["mooncake"]
    replayed: list[Sequence[TraceRequest]] = []

    def recording(requests: Sequence[TraceRequest], *args: Any, **kwargs: Any) -> SimResult:
        replayed.append(requests)
        return simulate(requests, *args, **kwargs)

    monkeypatch.setattr(oracle, "simulate", recording)
    oracle_schedule(trace, PERF, slo)
    searched = [requests for requests in replayed if requests is not trace]
    assert searched and all(r.prefix_blocks for requests in searched for r in requests)


def test_the_oracle_refuses_what_it_cannot_search() -> None:
    with pytest.raises(ValueError, match="needs the trace"):
        oracle_schedule([], PERF, SLO)
    with pytest.raises(ValueError, match="start at 0 s or later"):
        oracle_schedule([TraceRequest(-1.0, 100, 10)], PERF, SLO)
    with pytest.raises(ValueError, match="at least one verifying replay"):
        oracle_schedule(steady_trace(1.0, 10.0), PERF, SLO, rounds=0)


def test_a_window_an_idle_pool_cannot_serve_is_infeasible_at_its_slo() -> None:
    too_long = [TraceRequest(i * 0.5, 60_000 if i % 4 == 0 else 1000, 20) for i in range(100)]
    schedule = oracle_schedule(too_long, PERF, SLO)
    assert not schedule.feasible
    assert all(w.goal == pytest.approx(0.95 * 0.75) for w in schedule.windows if w.requests == 50)
    assert schedule.met   # the feasible requests' share of the goal is still met


@pytest.mark.parametrize(("start", "threshold", "limit", "expected"), [
    (1, 5, 64, 5), (9, 5, 64, 5), (5, 5, 64, 5), (40, 1, 64, 1), (1, 63, 64, 63), (1, 65, 64, None),
    (100, 3, 64, 3),
])
def test_fewest_searches_outward_from_its_start(start: int, threshold: int, limit: int,
                                                expected: int | None) -> None:
    tried: list[int] = []

    def meets(n: int) -> bool:
        tried.append(n)
        return n >= threshold

    assert _fewest(start, meets, limit) == expected
    assert all(1 <= n <= limit for n in tried)
    if expected is not None:
        assert len(tried) <= 2 * max(1, abs(expected - min(start, limit))).bit_length() + 3


# --- registry and end to end --------------------------------------------------------------------------

def test_registry_holds_every_policy() -> None:
    assert {"static", "xpyd", "static-peak", "static-mean", "queue-threshold", "dynamo-sla", "oracle"} <= set(POLICIES)
    context = PolicyContext(Desired(1, 1), SLO, PERF, 30.0, 120.0, steady_trace(20.0, 120.0))
    assert isinstance(build_policy("xpyd", context), XpydPolicy)
    with pytest.raises(ValueError, match="trace"):
        build_policy("static-peak", PolicyContext(Desired(1, 1), SLO, PERF, 30.0, 120.0))


def test_static_baselines_come_from_the_oracle_and_run_from_the_start() -> None:
    trace = step_trace()
    schedule = oracle_schedule(trace, PERF, SLO)
    assert schedule.peak.prefill > schedule.mean.prefill or schedule.peak.decode > schedule.mean.decode
    result = simulate_policy("static-peak", trace, PERF, SimConfig(prefill=1, decode=1, slo=SLO))
    first = result.replicas[0]
    assert (first.prefill_ready, first.decode_ready) == (schedule.peak.prefill, schedule.peak.decode)
    assert result.scaling_actions == 0 and build_report(result)["attainment"] >= 0.95


@pytest.mark.parametrize("name", ["xpyd", "static-peak", "static-mean", "queue-threshold", "dynamo-sla"])
def test_every_policy_replays_a_trace(name: str) -> None:
    trace = [TraceRequest(r.arrival_s / 4, r.isl, r.osl)
             for r in read_trace(FIXTURE_TRACES / "azure_conv_2023_head200.csv")]
    result = simulate_policy(name, trace, PERF, SimConfig(prefill=1, decode=1, slo=SLO, startup_delay_s=30.0))
    report = build_report(result)
    assert report["requests"] == len(trace) and report["policy"] == name
    assert 0.0 <= report["attainment"] <= 1.0 and report["gpu_hours"] > 0


@pytest.mark.parametrize("rate", [60.0, 90.0])
def test_xpyd_makes_few_changes_over_ten_minutes_of_steady_load(rate: float) -> None:
    """The e2e runs a minute of steady load on the local cluster; ten simulated minutes of Poisson
    arrivals (the same decide(), 30 s decisions over 60 s windows, 120 s start-up), starting from the
    model's sizes for the mean, show the long view: noise alone makes at most a couple of changes."""
    import random

    rng = random.Random(7)
    arrivals, t = [], 0.0
    while t < 600.0:
        t += rng.expovariate(rate)
        arrivals.append(TraceRequest(t, rng.randint(600, 1400), rng.randint(60, 140)))
    prefill = MODEL.size_prefill(rate, PromptMix.from_quantiles(1000.0), 0.02).replicas
    decode = MODEL.size_decode(rate, 1000.0, 100.0).replicas
    assert prefill + decode >= 3   # a pool of several replicas, where flapping could show
    config = SimConfig(prefill=prefill, decode=decode, slo=SLO, startup_delay_s=120.0)
    report = build_report(simulate_policy("xpyd", arrivals, PERF, config))
    assert report["scaling_actions"] <= 2
    assert report["attainment"] >= 0.95
