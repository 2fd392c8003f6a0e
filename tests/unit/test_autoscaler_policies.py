"""The autoscaler's model (sizing, forecasts) and the simulator policies it is judged against."""

from __future__ import annotations

import math

import pytest

from tests.paths import FIXTURE_TRACES, H200_PROFILE
from xpyd.autoscaler.forecast import HoltForecaster, LastValueForecaster, SeriesState
from xpyd.autoscaler.observation import Desired, Observation, Quantiles, RoleObservation, Slo
from xpyd.autoscaler.sizing import Burst, PoolModel, PromptMix
from xpyd.perf.model import PerfModel
from xpyd.sim.dynamo import ArimaLikePredictor, DynamoSlaPolicy
from xpyd.sim.oracle import OraclePolicy, OracleWindow, oracle_gpu_hours, oracle_windows
from xpyd.sim.policies import (
    POLICIES,
    QueueThresholdPolicy,
    XpydPolicy,
    build_policy,
    queued_work,
    simulate_policy,
    size_for,
    static_sizes,
)
from xpyd.sim.policy import PolicyContext
from xpyd.sim.report import build_report
from xpyd.sim.simulator import SimConfig
from xpyd.traces import TraceRequest, read_trace

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
    assert policy.decide(busy) == Desired(3, 3)
    later = Observation(time_s=120.0, window_s=60.0, prefill=busy.prefill, decode=busy.decode)
    assert policy.decide(later) == Desired(2, 2)                 # within 3 min of the last step up
    idle = Observation(time_s=240.0, window_s=60.0, prefill=role(replicas=3, ready=3),
                       decode=role(replicas=3, ready=3, kv_cache_usage_perc=0.1))
    assert policy.decide(idle) == Desired(2, 2)
    assert policy.decide(Observation(time_s=300.0, window_s=60.0, prefill=idle.prefill,
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
        assert policy.decide(dynamo_observation(time_s, 20.0)) == Desired(1, 1)
    desired = policy.decide(dynamo_observation(180.0, 20.0))
    num_req = 20.0 * 180.0
    # p_correction = 1 s / prefill(2000) > 1, so min(1, .) leaves the demand as it is.
    assert desired.prefill == math.ceil(num_req * 2000 / 180.0 / PERF.prefill_tokens_per_second(2000))
    itl = 0.025 / policy.d_correction
    batch = PERF.max_batch_for_itl(itl, 2075.0)
    assert desired.decode == math.ceil(num_req * 150 / 180.0 / PERF.decode_tokens_per_second(batch, 2075.0))
    assert policy.decide(dynamo_observation(210.0, 80.0)) == desired   # holds until the next interval


# --- oracle ------------------------------------------------------------------------------------------

def test_oracle_windows_grow_with_load_and_lead_by_the_startup() -> None:
    trace = steady_trace(10.0, 60.0) + [TraceRequest(60.0 + i / 120.0, 1000, 100) for i in range(120 * 60)]
    windows = oracle_windows(trace, PERF, SLO)
    assert len(windows) == 2 and windows[1].prefill > windows[0].prefill
    assert oracle_gpu_hours(windows) == pytest.approx(sum(w.prefill + w.decode for w in windows) * 60 / 3600)
    policy = OraclePolicy(tuple(windows), lead_s=30.0)
    assert policy.decide(Observation(time_s=30.0, window_s=60.0)) == Desired(windows[0].prefill, windows[0].decode)
    assert policy.decide(Observation(time_s=60.0, window_s=60.0)) == Desired(windows[1].prefill, windows[1].decode)
    early = OraclePolicy(tuple(windows), lead_s=150.0)
    assert early.decide(Observation(time_s=30.0, window_s=60.0)).prefill == windows[1].prefill
    assert policy.initial == Desired(windows[0].prefill, windows[0].decode)
    assert OracleWindow(0.0, 60.0, 1, 1, 0) != windows[0]


# --- registry and end to end --------------------------------------------------------------------------

def test_registry_holds_every_policy() -> None:
    assert {"static", "xpyd", "static-peak", "static-mean", "queue-threshold", "dynamo-sla", "oracle"} <= set(POLICIES)
    context = PolicyContext(Desired(1, 1), SLO, PERF, 30.0, 120.0, steady_trace(20.0, 120.0))
    assert isinstance(build_policy("xpyd", context), XpydPolicy)
    ramp = steady_trace(5.0, 60.0) + [TraceRequest(60 + i / 80, 1000, 100) for i in range(4800)]
    peak, mean = static_sizes(MODEL, ramp, peak=True), static_sizes(MODEL, ramp, peak=False)
    assert peak.prefill >= mean.prefill and peak.decode >= mean.decode
    with pytest.raises(ValueError, match="trace"):
        build_policy("static-peak", PolicyContext(Desired(1, 1), SLO, PERF, 30.0, 120.0))


def batched_trace() -> list[TraceRequest]:
    """15 req/s on average, arriving as one batch of 150 every 10 s (240 s)."""
    return [TraceRequest(10.0 * (i // 150) + 0.001 * (i % 150), 2000, 50) for i in range(150 * 24)]


def test_static_peak_sizes_the_busiest_window_for_its_bursts_as_well() -> None:
    trace = batched_trace()
    poisson_view = size_for(MODEL, trace[:1500], 60.0, bursts=False)
    bursts = size_for(MODEL, trace[:1500], 60.0)
    # The rate (25 req/s x 2000 tokens) fits two replicas; 300k tokens arriving at once do not.
    assert poisson_view.prefill == 2 and bursts.prefill > 4
    assert static_sizes(MODEL, trace, peak=True).prefill == bursts.prefill
    assert static_sizes(MODEL, trace, peak=False).prefill == size_for(MODEL, trace, trace[-1].arrival_s,
                                                                      bursts=False).prefill
    # Spread evenly the same load queues nothing: the burst term adds no replica.
    even = steady_trace(25.0, 60.0, isl=2000, osl=50)
    assert size_for(MODEL, even, 60.0) == size_for(MODEL, even, 60.0, bursts=False)


def test_queued_work_is_the_work_ahead_on_arrival() -> None:
    batch = [TraceRequest(0.0, 1000, 10) for _ in range(10)]
    work = queued_work(MODEL, batch, 2)
    assert (work.work_p50, work.work_p90, work.work_p99) == (5000.0, 9000.0, 9000.0)
    spaced = [TraceRequest(float(i), 1000, 10) for i in range(10)]
    assert queued_work(MODEL, spaced, 1).work_p99 == 0.0


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
