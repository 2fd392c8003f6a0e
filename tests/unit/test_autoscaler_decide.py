"""`xpyd.autoscaler.decide`: one table per rule (metrics check, demand, attribution, pace, reality, budget)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import pytest

from tests.paths import H200_PROFILE
from xpyd.api.conditions import INSUFFICIENT_GPUS
from xpyd.api.models import AutoscalingSpec
from xpyd.autoscaler.attainment import AttainmentState, learn
from xpyd.autoscaler.decide import (
    DECODE_ADMISSION,
    GPU_BUDGET,
    METRICS_UNAVAILABLE,
    MIN_COMPUTED_SHARE,
    PREFILL_DEMAND,
    PREFILL_QUEUEING,
    SCALE_DOWN,
    SCALE_DOWN_DEFERRED,
    SCALE_DOWN_GRACE,
    SCALE_DOWN_UNSAFE,
    TPOT_OVER_TARGET,
    WITHIN_TARGETS,
    AutoscalerConfig,
    AutoscalerState,
    RoleBounds,
    RoleState,
    computed_share,
    decide,
    drain_budget_s,
    fullest_queue,
    metrics_problem,
    pd_ratio,
    pinned_limit,
    pinned_queue,
    quantile_at,
    queue_drain_s,
)
from xpyd.autoscaler.observation import Observation, Quantiles, RoleObservation
from xpyd.autoscaler.sizing import PoolModel, PromptMix
from xpyd.perf.model import PerfModel

pytestmark = pytest.mark.unit

PROFILE = H200_PROFILE
PERF = PerfModel.from_profile(PROFILE).with_kv_transfer(2 * 32 * 8 * 128 * 2, 100.0)
MODEL = PoolModel(PERF, ttft_target_s=0.5, tpot_target_s=0.025, quantile=0.95)
CONFIG = AutoscalerConfig(model=MODEL, prefill=RoleBounds(1, 64), decode=RoleBounds(1, 64))
FAST_TTFT = Quantiles(0.08, 0.12, 0.2, 0.09)
FAST_TPOT = Quantiles(0.012, 0.015, 0.018, 0.013)


def role(replicas: int, **overrides: Any) -> RoleObservation:
    fields: dict[str, Any] = {"replicas": replicas, "ready": replicas, "num_requests_running": 10.0,
                              "kv_cache_usage_perc": 0.1, "kv_cache_usage_perc_max": 0.12,
                              "requests_per_s": 10.0, "prompt_tokens_per_s": 10_000.0,
                              "generation_tokens_per_s": 2_000.0}
    fields.update(overrides)
    return RoleObservation(**fields)


def observation(rate: float = 20.0, isl: float = 1000.0, osl: float = 200.0, prefill: int = 2, decode: int = 3,
                time_s: float = 600.0, **overrides: Any) -> Observation:
    fields: dict[str, Any] = {
        "time_s": time_s, "window_s": 60.0, "request_rate": rate, "isl_mean": isl, "osl_mean": osl,
        "isl_quantiles": Quantiles(900.0, 2000.0, 4000.0, isl), "ttft_seconds": FAST_TTFT, "tpot_seconds": FAST_TPOT,
        "prefill": role(prefill), "decode": role(decode)}
    fields.update(overrides)
    return Observation(**fields)


def settled(prefill: int, decode: int, now: float = 600.0, **role_fields: Any) -> AutoscalerState:
    """A state after a long steady run whose recommendations were the current sizes."""
    history = tuple((now - 30.0 * i, 0) for i in range(12, 0, -1))
    return AutoscalerState(
        time_s=now - 30.0,
        prefill=RoleState(recommendations=tuple((t, prefill) for t, _ in history), **role_fields),
        decode=RoleState(recommendations=tuple((t, decode) for t, _ in history), **role_fields))


def rate_where(predicate: Any, low: float = 0.1, high: float = 400.0) -> float:
    """The smallest rate (to 0.1 req/s) where `predicate(rate)` becomes true (it must be monotone)."""
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (low, middle) if predicate(middle) else (middle, high)
    return high


# --- metrics check ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("change", "why"), [
    ({"request_rate": math.nan}, "request rate missing"),
    ({"request_rate": -1.0}, "request rate missing"),
    ({"window_s": 0.0}, "no metrics window"),
    ({"time_s": 570.0}, "not newer"),
    ({"prefill": role(2, num_requests_waiting=-1.0)}, "gauges missing or negative"),
    ({"prefill": role(2, num_requests_waiting_max=math.nan)}, "gauges missing or negative"),
    ({"decode": role(3, kv_cache_usage_perc=1.7)}, "KV-cache usage outside 0-1"),
    ({"decode": role(3, ready=4)}, "4 ready of 3 replicas"),
])
def test_missing_stale_or_contradictory_metrics_hold_every_role(change: dict[str, Any], why: str) -> None:
    state = settled(2, 3)
    obs = dataclasses.replace(observation(), **change)
    assert why in (metrics_problem(obs, state) or "")
    decision = decide(obs, CONFIG, state)
    assert (decision.prefill.replicas, decision.decode.replicas) == (2, 3)
    assert decision.reason == METRICS_UNAVAILABLE and not decision.scaling_active
    assert decision.state == state     # nothing learnt from bad data


def test_hold_still_honours_changed_bounds_at_once() -> None:
    config = dataclasses.replace(CONFIG, prefill=RoleBounds(1, 1), decode=RoleBounds(4, 8))
    decision = decide(observation(request_rate=math.nan), config, settled(2, 3))
    assert (decision.prefill.replicas, decision.decode.replicas) == (1, 4)
    assert not decision.scaling_active


def test_healthy_metrics_pass_the_check() -> None:
    assert metrics_problem(observation(), settled(2, 3)) is None
    assert metrics_problem(observation(rate=0.0, isl=math.nan, osl=math.nan), settled(2, 3)) is None


def test_an_idle_window_after_traffic_decides_from_what_was_seen() -> None:
    """No request finished in the window (traffic stopped, or Prometheus just came back): ISL/OSL are
    NaN, the forecasts' last values stand in, and nothing breaks (this crashed once, in the e2e)."""
    busy = decide(observation(time_s=600.0), CONFIG, settled(2, 3))
    idle = dataclasses.replace(
        observation(rate=0.0, isl=math.nan, osl=math.nan, time_s=630.0, ttft_seconds=Quantiles(),
                    tpot_seconds=Quantiles(), isl_quantiles=Quantiles()),
        prefill=role(2, num_requests_running=0.0, requests_per_s=0.0, prompt_tokens_per_s=0.0),
        decode=role(3, num_requests_running=0.0, requests_per_s=0.0, generation_tokens_per_s=0.0))
    decision = decide(idle, CONFIG, busy.state)
    assert decision.scaling_active
    assert decision.prefill.replicas <= 2 and decision.decode.replicas <= 3   # never up on an idle pool
    only_prompts = observation(osl=math.nan, time_s=660.0)                    # long answers still in flight
    assert decide(only_prompts, CONFIG, decision.state).scaling_active


def test_engines_idle_while_the_proxy_counts_requests_settle_then_hold() -> None:
    """Newly scraped engines lag the proxy's counters for a window (rate() needs two samples): hold
    quietly; two windows of it is a metrics problem."""
    idle_prefill = role(2, requests_per_s=0.0, num_requests_running=0.0, num_requests_waiting=0.0)
    state = settled(2, 3)
    seen = []
    for t in (600.0, 630.0, 660.0, 690.0, 720.0):
        decision = decide(dataclasses.replace(observation(time_s=t), prefill=idle_prefill), CONFIG, state)
        state = decision.state
        seen.append((decision.reason, decision.scaling_active, decision.prefill.replicas, decision.decode.replicas))
    assert seen == [("MetricsSettling", True, 2, 3)] * 4 + [(METRICS_UNAVAILABLE, False, 2, 3)]
    assert "prefill engines report no work" in decision.message
    recovered = decide(observation(time_s=750.0), CONFIG, state)
    assert recovered.scaling_active and math.isnan(recovered.state.suspect_since_s)


def test_requests_without_any_isl_osl_hold_first_as_no_traffic_then_as_missing_metrics() -> None:
    """The first window of traffic may show the proxy's count before the engines' histograms (scrapes
    are not aligned): that is not a metrics problem. Two windows of it are."""
    state = AutoscalerState()
    reasons = []
    for t in (600.0, 630.0, 660.0, 690.0, 720.0):     # windows of 60 s
        decision = decide(observation(isl=math.nan, osl=math.nan, time_s=t), CONFIG, state)
        state = decision.state
        reasons.append((decision.reason, decision.scaling_active))
    assert reasons == [("NoTraffic", True)] * 4 + [(METRICS_UNAVAILABLE, False)]
    assert "no ISL/OSL reported" in decision.message
    recovered = decide(observation(time_s=750.0), CONFIG, state)
    assert recovered.scaling_active


# --- demand and attribution --------------------------------------------------------------------------

def test_steady_load_that_fits_keeps_the_sizes() -> None:
    sizes = (MODEL.size_prefill(20.0, PromptMix.from_quantiles(1000.0, Quantiles(900.0, 2000.0)),
                                0.02).replicas, MODEL.size_decode(20.0, 1000.0, 200.0).replicas)
    decision = decide(observation(prefill=sizes[0], decode=sizes[1]), CONFIG, settled(*sizes))
    assert (decision.prefill.replicas, decision.decode.replicas) == sizes
    assert decision.reason == WITHIN_TARGETS and not decision.changed
    assert decision.recommended_ratio == pd_ratio(*sizes)


def test_more_demand_scales_prefill_up_at_once_by_at_most_max_step() -> None:
    decision = decide(observation(rate=200.0, prefill=1, decode=20), CONFIG, settled(1, 20))
    assert decision.prefill.reason == PREFILL_DEMAND
    assert decision.prefill.recommended > 5
    assert decision.prefill.replicas == 1 + CONFIG.scale_up.max_step
    assert "lambda 200.0 req/s" in decision.prefill.message and "needs P" in decision.prefill.message


@pytest.mark.parametrize(("changes", "guilty", "reason", "evidence"), [
    # TTFT over target with a prefill backlog: prefill's fault.
    ({"ttft_seconds": Quantiles(0.3, 0.9, 1.5, 0.5), "prefill": role(2, num_requests_waiting=60.0)},
     "prefill", PREFILL_QUEUEING, "prefill waiting 60"),
    # TTFT over target, prefill queue short, decode KV full: decode's fault.
    ({"ttft_seconds": Quantiles(0.3, 0.9, 1.5, 0.5), "decode": role(3, kv_cache_usage_perc_max=0.99)},
     "decode", DECODE_ADMISSION, "KV max 0.99"),
    # TPOT over target: decode's fault.
    ({"tpot_seconds": Quantiles(0.02, 0.027, 0.03, 0.022)}, "decode", TPOT_OVER_TARGET, "TPOT p95"),
])
def test_breaches_scale_only_the_guilty_role(changes: dict[str, Any], guilty: str, reason: str,
                                             evidence: str) -> None:
    decision = decide(dataclasses.replace(observation(prefill=2, decode=3), **changes), CONFIG, settled(2, 3))
    blamed, other = (decision.prefill, decision.decode) if guilty == "prefill" else (decision.decode, decision.prefill)
    assert blamed.reason == reason and blamed.replicas == blamed.current + 1
    assert evidence in blamed.message
    assert other.replicas <= other.current
    assert decision.reason == reason
    assert decision.message.startswith(blamed.message)   # the role that leads the decision speaks first


@pytest.mark.parametrize(("ready", "waiting", "fullest", "per_engine"), [
    (4, 40.0, 10.0, 10.0),      # spread evenly: the mean
    (4, 40.0, 40.0, 0.0),       # one engine holds it all: the others share none
    (4, 40.0, 19.0, 7.0),       # the queue outside the fullest engine, over the other three
    (1, 40.0, 40.0, 40.0),      # one ready replica: the whole queue
    (4, 40.0, 0.0, 10.0),       # no per-engine maximum (an older collector): the mean
    (4, 40.0, 50.0, 10.0),      # a maximum over the sum contradicts it: unknown, the mean
    (4, 40.0, 5.0, 10.0),       # so does one below the mean
    (0, 40.0, 40.0, 40.0),      # none ready: as one
])
def test_a_queue_drains_on_the_replicas_that_share_it(ready: int, waiting: float, fullest: float,
                                                      per_engine: float) -> None:
    queue = role(max(ready, 1), ready=ready, num_requests_waiting=waiting, num_requests_waiting_max=fullest)
    assert queue_drain_s(queue, 1000.0, 2000.0) == pytest.approx(per_engine / 2)


def test_a_draining_engines_queue_is_one_of_the_engines_the_sum_covers() -> None:
    """4 ready engines with 10 waiting each beside a draining one with 60: the queue outside the
    fullest spreads over the 4 others scraped, not over 3."""
    queue = role(4, draining=1, num_requests_waiting=100.0, num_requests_waiting_max=60.0)
    assert queue_drain_s(queue, 1000.0, 2000.0) == pytest.approx(10.0 / 2)


@pytest.mark.parametrize(("waiting", "fullest", "expected"),
                         [(60.0, 15.0, 15.0), (60.0, 60.0, 60.0), (60.0, 90.0, 0.0), (60.0, 10.0, 0.0),
                          (60.0, -1.0, 0.0), (0.0, 0.0, 0.0)])
def test_the_fullest_queue_is_unknown_where_the_sum_contradicts_it(waiting: float, fullest: float,
                                                                   expected: float) -> None:
    assert fullest_queue(role(4, num_requests_waiting=waiting, num_requests_waiting_max=fullest)) == expected


def test_a_queue_one_engine_holds_beside_idle_ones_is_no_prefill_shortage() -> None:
    """A TTFT breach (40% met) with 60 requests waiting on 4 prefill replicas: prefill's fault when they
    share the queue; none when one engine holds it (queued work stays there: more replicas would take
    none of it). The requests that engine serves from its queue over the span (at its saturated rate,
    at most those it holds) teach as met, though the hour still counts the window as measured."""
    targeted = dataclasses.replace(CONFIG, attainment=0.95)
    per_replica = MODEL.saturated_tokens_per_s()

    def breach(fullest: float) -> Observation:
        return dataclasses.replace(
            observation(prefill=4, decode=3), ttft_seconds=Quantiles(0.3, 0.9, 1.5, 0.5),
            ttft_buckets=((0.5, 40.0), (math.inf, 100.0)), tpot_buckets=((0.025, 100.0), (math.inf, 100.0)),
            prefill=role(4, num_requests_waiting=60.0, num_requests_waiting_max=fullest))

    shared, pinned = breach(15.0), breach(60.0)
    assert not pinned_queue(shared.prefill, 1000.0, per_replica, CONFIG)
    assert pinned_queue(pinned.prefill, 1000.0, per_replica, CONFIG)
    # 40 of 100 requests on one of 10 engines: long for that engine, little for the others, but not most
    # of the queue: routing's unevenness, not a queue one engine holds.
    uneven = role(10, num_requests_waiting=100.0, num_requests_waiting_max=40.0)
    assert 40.0 * 1000.0 / per_replica > 0.5 and queue_drain_s(uneven, 1000.0, per_replica) <= 0.25
    assert not pinned_queue(uneven, 1000.0, per_replica, CONFIG)
    assert pinned_queue(dataclasses.replace(uneven, num_requests_waiting_max=50.0), 1000.0, per_replica,
                        CONFIG)
    short = decide(shared, targeted, settled(4, 3))
    assert short.prefill.reason == PREFILL_QUEUEING and short.prefill.replicas == 5
    assert short.state.attainment.headroom > 0
    held = decide(pinned, targeted, settled(4, 3))
    assert held.prefill.reason != PREFILL_QUEUEING and held.prefill.recommended < 4
    assert "one prefill engine holds 60 of the 60 requests waiting" in held.message
    assert "teach the headroom as met" in held.message
    assert "teach the headroom" not in decide(pinned, CONFIG, settled(4, 3)).message   # no target: nothing taught
    assert held.state.attainment.headroom == pytest.approx(   # its 60 requests of the span's 600 excused
        learn(AttainmentState(), 600.0, 0.5, 600.0, 0.95, CONFIG.min_requests).headroom)
    # Both windows miss past the largest error one window teaches (50% and 60% against 5% allowed).
    assert 0 < held.state.attainment.headroom <= short.state.attainment.headroom
    assert held.state.attainment.last_hour(600.0) == pytest.approx(0.4)
    # At a rate where that engine serves 30% of the span's requests from a long enough queue, the other
    # 30% missed teach; from its 60 requests, only those are excused.
    rate = per_replica / 1000.0 / 0.3
    long_queue = role(4, num_requests_waiting=6000.0, num_requests_waiting_max=6000.0)
    for queue, excused in ((long_queue, 0.3), (pinned.prefill, 60.0 / (rate * 30.0))):
        busy = decide(dataclasses.replace(pinned, request_rate=rate, prefill=queue), targeted, settled(4, 3))
        assert busy.state.attainment.headroom == pytest.approx(
            learn(AttainmentState(), 600.0, 0.4 + excused, 1000.0, 0.95, CONFIG.min_requests).headroom)


def test_a_queue_one_engine_holds_is_no_backlog_even_while_it_grows() -> None:
    """6,000 requests on one of 4 prefill engines, more than the last decision saw: no PrefillQueueing
    and no backlog replica (that engine drains them; the other three serve the load). Spread over the
    four, the same queue is a backlog."""
    def queued(fullest: float) -> Observation:
        return dataclasses.replace(observation(prefill=4, decode=3), ttft_seconds=Quantiles(0.3, 0.9, 1.5, 0.5),
                                   prefill=role(4, num_requests_waiting=6000.0, num_requests_waiting_max=fullest))

    growing = settled(4, 3, waiting=5000.0)
    held = decide(queued(6000.0), CONFIG, growing)
    assert held.prefill.reason != PREFILL_QUEUEING and "backlog" not in held.message
    assert held.prefill.recommended < 4 and "one prefill engine holds 6000 of the 6000" in held.message
    spread = decide(queued(1500.0), CONFIG, growing)
    assert spread.prefill.reason == PREFILL_QUEUEING and spread.prefill.replicas > 4


def test_breach_with_replicas_already_starting_adds_none_for_that_symptom() -> None:
    obs = dataclasses.replace(observation(prefill=3, decode=3), ttft_seconds=Quantiles(0.3, 0.9, 1.5, 0.5),
                              prefill=role(3, ready=2, starting=1, num_requests_waiting=60.0))
    decision = decide(obs, CONFIG, settled(3, 3))
    assert decision.prefill.replicas == 3 and "already starting" in decision.prefill.message


def test_a_growing_prefill_queue_scales_prefill_before_ttft_breaches() -> None:
    state = settled(2, 3, waiting=10.0)
    obs = dataclasses.replace(observation(prefill=2, decode=3), prefill=role(2, num_requests_waiting=40.0))
    decision = decide(obs, CONFIG, state)
    assert decision.prefill.reason == PREFILL_QUEUEING and "prefill queue growing" in decision.prefill.message
    assert decision.prefill.replicas == 3


def test_forecast_sizes_for_the_load_after_the_startup_delay() -> None:
    state = AutoscalerState()
    for step, rate in enumerate((20.0, 30.0, 40.0, 50.0)):
        decision = decide(observation(rate=rate, time_s=30.0 * (step + 1), prefill=1, decode=6), CONFIG, state)
        state = decision.state
    assert decision.state.rate.trend_per_s > 0
    assert "(forecast; now 50.0)" in decision.prefill.message


def test_prompts_are_sized_as_seen_while_rate_and_answers_follow_their_trends() -> None:
    """Prompts and answers growing window by window at a steady rate: ISL is sized at the larger of the
    window's mean and its smoothed level (here the window's), not carried up its trend over the horizon
    (prefill's demand is its product with the rate, whose own trend is); OSL is carried up its trend."""
    state = AutoscalerState()
    for step in range(4):
        obs = observation(rate=20.0, isl=1000.0 + 500.0 * step, osl=200.0 + 100.0 * step, time_s=30.0 * (step + 1),
                          prefill=1, decode=1)
        decision = decide(obs, CONFIG, state)
        state = decision.state
    assert state.isl.trend_per_s > 0 and state.osl.trend_per_s > 0 and state.isl.level < 2500.0
    assert "lambda 20.0 req/s x ISL 2500 =" in decision.prefill.message, decision.prefill.message
    found = re.search(r"lambda\*OSL ([\d.]+)k tok/s", decision.decode.message)
    assert found and float(found[1]) > 20.0 * 500.0 / 1000.0, decision.decode.message


# --- backlog --------------------------------------------------------------------------------------------

def backlog_observation(waiting: float, prefill: int = 2, rate: float = 20.0, pool: RoleObservation | None = None,
                        **overrides: Any) -> Observation:
    fields: dict[str, Any] = {"ttft_seconds": Quantiles(4.0, 6.0, 8.0, 4.5)} | overrides
    obs = observation(rate=rate, prefill=prefill, **fields)
    return dataclasses.replace(obs, prefill=pool or role(prefill, num_requests_waiting=waiting))


def test_queued_prompt_work_is_drained_within_the_horizon_on_top_of_the_load() -> None:
    """10,000 prompts of 1,000 tokens queued on 2 replicas at 100 req/s: what serves the load and drains
    10M tokens within the sizing horizon, in one step."""
    assert drain_budget_s(CONFIG) == CONFIG.horizon_s == 180.0
    config = dataclasses.replace(CONFIG, scale_up=dataclasses.replace(CONFIG.scale_up, max_step=64))
    decision = decide(backlog_observation(10_000.0, rate=100.0), config, settled(2, 3))
    per_replica = MODEL.saturated_tokens_per_s()
    expected = math.ceil((100.0 * 1000.0 + 10_000 * 1000.0 / drain_budget_s(CONFIG)) / per_replica)
    assert expected > 3                                  # more than one step
    assert decision.prefill.replicas == expected
    assert decision.prefill.reason == PREFILL_QUEUEING
    assert "backlog 10000.0k prompt tokens queued" in decision.prefill.message
    assert "hold the queue" not in decision.prefill.message
    # The stabilisation window remembers the load's size, not the queue's.
    assert decision.state.prefill.recommendations[-1][1] < expected


def test_a_backlog_orders_no_more_than_the_load_needs_plus_the_replicas_holding_it() -> None:
    """Three times that queue: queued work stays on the engine that holds it, so replicas ordered now take
    only later arrivals; the load's replicas plus the 2 holding the queue, not the 6 that would drain it
    within the horizon if they could take any of it."""
    config = dataclasses.replace(CONFIG, scale_up=dataclasses.replace(CONFIG.scale_up, max_step=64))
    decision = decide(backlog_observation(30_000.0, rate=100.0), config, settled(2, 3))
    per_replica = MODEL.saturated_tokens_per_s()
    drained = math.ceil((100.0 * 1000.0 + 30_000 * 1000.0 / drain_budget_s(CONFIG)) / per_replica)
    load = decide(observation(rate=100.0), config, settled(2, 3)).prefill.recommended   # the load alone
    assert drained > decision.prefill.recommended == decision.prefill.replicas == load + 2
    assert f"at most the load's {load} plus the 2 ready that hold the queue" in decision.prefill.message
    assert pinned_limit(4, 1, 2) == (3, " (at most the load's 1 plus the 2 ready that hold the queue: queued work "
                                        "stays on its engine)")
    assert pinned_limit(3, 1, 2) == (3, "")
    # Decode: requests waiting for admission on 3 replicas, the load needing 1.
    obs = dataclasses.replace(observation(), decode=role(3, num_requests_waiting=60_000.0))
    decode = decide(obs, config, settled(2, 3)).decode
    load = MODEL.size_decode(20.0, 1000.0, 200.0).replicas
    assert decode.recommended == load + 3 and "plus the 3 ready that hold the queue" in decode.message


def test_a_cold_pool_orders_what_the_load_and_the_queue_building_over_start_up_need_at_once() -> None:
    """1 prefill replica at three times its capacity: the queue keeps building for the start-up delay, and
    one decision orders what drains it, not one replica after another."""
    per_replica = MODEL.saturated_tokens_per_s()
    rate = 3 * per_replica / 1000.0
    obs = backlog_observation(50.0, prefill=1, rate=rate)
    config = dataclasses.replace(CONFIG, scale_up=dataclasses.replace(CONFIG.scale_up, max_step=64))
    decision = decide(obs, config, settled(1, 3))
    building = (rate * 1000.0 - per_replica) * config.startup_s
    expected = math.ceil((rate * 1000.0 + (50 * 1000.0 + building) / drain_budget_s(config)) / per_replica - 1e-9)
    assert decision.prefill.replicas == expected > 3
    assert f"building over {config.startup_s:.0f}s of start-up" in decision.prefill.message
    # Half-way through their start-up the same queue, grown as foreseen, orders nothing more.
    started = dataclasses.replace(decision.state, prefill=dataclasses.replace(
        decision.state.prefill, starting_since_s=600.0))
    grown = 50.0 + (rate - per_replica / 1000.0) * 60.0
    later = backlog_observation(grown, rate=rate, time_s=660.0,
                                pool=role(expected, ready=1, starting=expected - 1, num_requests_waiting=grown))
    assert decide(later, config, started).prefill.replicas == expected


def test_a_pool_keeps_the_replicas_its_queue_needs_while_the_queue_lasts() -> None:
    state = settled(6, 3)
    state = dataclasses.replace(state, prefill=dataclasses.replace(
        state.prefill, recommendations=tuple((t, 2) for t, _ in state.prefill.recommendations)))
    quiet = decide(observation(prefill=6), CONFIG, state)
    assert quiet.prefill.reason == SCALE_DOWN and quiet.prefill.replicas == 5
    # A queue that 5.5 replicas drain within the budget besides serving the load.
    waiting = (5.5 * MODEL.saturated_tokens_per_s() - 20.0 * 1000.0) * drain_budget_s(CONFIG) / 1000.0
    queued = decide(backlog_observation(waiting, prefill=6, ttft_seconds=FAST_TTFT), CONFIG, state)
    assert queued.prefill.replicas == 6 and queued.prefill.recommended == 6
    assert queued.prefill.reason == PREFILL_QUEUEING and "backlog" in queued.prefill.message


def test_requests_waiting_for_decode_admission_order_decode_within_the_horizon() -> None:
    obs = dataclasses.replace(observation(), decode=role(3, num_requests_waiting=15_000.0))
    decision = decide(obs, CONFIG, settled(2, 3))
    waiting = 15_000.0 - 20.0 * PERF.kv_transfer_seconds(1000)
    expected = min(MODEL.size_decode(20.0 + waiting / drain_budget_s(CONFIG), 1000.0, 200.0).replicas,
                   MODEL.size_decode(20.0, 1000.0, 200.0).replicas + 3)
    assert decision.decode.replicas == min(expected, 3 + CONFIG.scale_up.max_step) > 3
    assert decision.decode.reason == DECODE_ADMISSION
    assert "requests waiting for decode admission" in decision.decode.message
    # Requests whose KV is in flight are no backlog.
    in_flight = dataclasses.replace(observation(),
                                    decode=role(3, num_requests_waiting=20.0 * PERF.kv_transfer_seconds(1000)))
    assert decide(in_flight, CONFIG, settled(2, 3)).decode.replicas == 3


def test_a_tpot_breach_adds_no_decode_while_the_window_still_shows_the_smaller_pool() -> None:
    slow = {"tpot_seconds": Quantiles(0.02, 0.027, 0.03, 0.022)}
    fresh = settled(2, 3, last_scale_up_s=600.0 - CONFIG.startup_s - 30.0)
    held = decide(observation(**slow), CONFIG, fresh)
    assert held.decode.replicas == 3 and "still holds the pool before its last scale-up" in held.decode.message
    old = settled(2, 3, last_scale_up_s=600.0 - CONFIG.startup_s - CONFIG.window_s)
    assert decide(observation(**slow), CONFIG, old).decode.replicas == 4


# --- pace: fast up, slow down ------------------------------------------------------------------------

def test_scale_down_follows_the_window_maximum_one_step_at_a_time_after_the_n_minus_1_check() -> None:
    decision = decide(observation(rate=1.0, prefill=4, decode=6), CONFIG, settled(1, 1))
    assert decision.prefill.reason == SCALE_DOWN and decision.prefill.replicas == 3
    assert decision.decode.reason == SCALE_DOWN and decision.decode.replicas == 5
    assert "1.1x load" in decision.prefill.message


@pytest.mark.parametrize(("state", "reason", "text"), [
    (settled(4, 6), SCALE_DOWN_DEFERRED, "stabilisation window's maximum is 4"),
    (AutoscalerState(), SCALE_DOWN_DEFERRED, "only 0s of the 300s"),
    (settled(1, 1, last_scale_up_s=500.0), SCALE_DOWN_GRACE, "grace"),
])
def test_scale_down_waits(state: AutoscalerState, reason: str, text: str) -> None:
    decision = decide(observation(rate=1.0, prefill=4, decode=6), CONFIG, state)
    assert decision.prefill.replicas == 4 and decision.prefill.reason == reason
    assert text in decision.prefill.message


def test_n_minus_one_check_blocks_a_scale_down_without_margin() -> None:
    mix = PromptMix.from_quantiles(1000.0, Quantiles(900.0, 2000.0))

    def needs(rate: float) -> int:
        itl = MODEL.size_decode(rate, 1000.0, 200.0).itl_s
        return MODEL.size_prefill(rate, mix, itl).replicas

    # The largest rate that 2 prefill replicas carry: with 10% more load they no longer do.
    rate = rate_where(lambda r: needs(r) > 2) - 0.05
    assert needs(rate) == 2 and needs(rate * 1.1) > 2
    decision = decide(observation(rate=rate, prefill=3, decode=40), CONFIG, settled(2, 40))
    assert decision.prefill.reason == SCALE_DOWN_UNSAFE and decision.prefill.replicas == 3
    assert "N-1 check fails" in decision.prefill.message


# --- reality: Pending pods, bounds, budget -------------------------------------------------------------

def test_pending_pods_block_scale_up_of_their_role_only() -> None:
    obs = dataclasses.replace(observation(rate=200.0), prefill=role(1, pending=1), decode=role(2))
    decision = decide(obs, CONFIG, settled(2, 2))
    assert decision.prefill.replicas == 2 and decision.prefill.reason == INSUFFICIENT_GPUS
    assert decision.degraded_reason == INSUFFICIENT_GPUS
    assert decision.decode.replicas > 2


def test_pending_pods_do_not_block_scale_down() -> None:
    obs = dataclasses.replace(observation(rate=1.0), prefill=role(3, pending=1), decode=role(2))
    decision = decide(obs, CONFIG, settled(1, 1))
    assert decision.prefill.current == 4 and decision.prefill.replicas == 3


@pytest.mark.parametrize(("bounds", "expected"), [(RoleBounds(5, 8), 5), (RoleBounds(1, 1), 1)])
def test_bounds_apply_at_once(bounds: RoleBounds, expected: int) -> None:
    config = dataclasses.replace(CONFIG, prefill=bounds)
    decision = decide(observation(prefill=3, decode=3), config, settled(3, 3))
    assert decision.prefill.replicas == expected


def test_gpu_budget_goes_to_the_role_it_helps_most() -> None:
    config = dataclasses.replace(CONFIG, gpu_budget=8)
    decision = decide(observation(rate=150.0, prefill=2, decode=2), config, settled(2, 2))
    assert decision.prefill.replicas + decision.decode.replicas == 8
    assert decision.budget_binding and decision.reason == GPU_BUDGET
    assert decision.prefill.replicas >= 1 and decision.decode.replicas >= 1


# --- state and helpers -----------------------------------------------------------------------------------

def test_decide_is_pure() -> None:
    state = settled(2, 3)
    before = dataclasses.replace(state)
    first = decide(observation(rate=80.0), CONFIG, state)
    second = decide(observation(rate=80.0), CONFIG, state)
    assert first == second and state == before
    assert first.state.time_s == 600.0 and first.state.prefill.recommendations[-1] == (600.0, first.prefill.recommended)


SATURATED = MODEL.saturated_tokens_per_s()


def prefill_window(tokens_per_replica: float, waiting: float, queue_median: float, **overrides: Any) -> Observation:
    """A window on 4 prefill replicas delivering `tokens_per_replica` prompt tokens/s each."""
    fields: dict[str, Any] = {"requests_per_s": 80.0, "prompt_tokens_per_s": 4 * tokens_per_replica,
                              "num_requests_waiting": waiting,
                              "request_queue_time_seconds": Quantiles(queue_median, 2.0, 3.0, queue_median)}
    fields.update(overrides)
    return dataclasses.replace(observation(rate=80.0, prefill=4, decode=3), prefill=role(4, **fields))


@pytest.mark.parametrize(("window", "waiting_before", "observed"), [
    # Saturated all window (queue at both ends, median request queued): the delivered rate is capacity.
    (prefill_window(0.6 * SATURATED, 40.0, 0.9), 40.0, 0.6),
    # Far below the modelled capacity: clamped to correction_min.
    (prefill_window(0.2 * SATURATED, 40.0, 0.9), 40.0, CONFIG.correction_min),
    # Not saturated but delivering more than k assumes: a lower bound that raises k.
    (prefill_window(1.2 * SATURATED, 0.0, 0.0), math.nan, 1.2),
])
def test_prefill_correction_learns_the_delivered_rate_when_it_measures_capacity(
        window: Observation, waiting_before: float, observed: float) -> None:
    learnt = decide(window, CONFIG, settled(4, 3, waiting=waiting_before)).state.prefill
    assert learnt.correction == pytest.approx(1.0 + CONFIG.correction_alpha * (observed - 1.0))
    assert learnt.correction_updates == 1


def test_prefill_correction_measures_long_prompts_against_their_own_modelled_cost() -> None:
    """A saturated pool of 24k-token prompts delivers fewer tokens/s than the token budget's rate
    (each prompt costs its own p(L)); the model knows that, so delivering what it predicts is k = 1."""
    isl = 24_000.0
    mix = PromptMix.from_quantiles(isl, Quantiles(22_000.0, 30_000.0, 32_000.0, isl))
    modelled = MODEL.mix_tokens_per_s(mix)
    assert modelled < 0.97 * SATURATED
    long_window = dataclasses.replace(prefill_window(modelled, 40.0, 0.9), isl_mean=isl,
                                      isl_quantiles=Quantiles(22_000.0, 30_000.0, 32_000.0, isl))
    learnt = decide(long_window, CONFIG, settled(4, 3, waiting=40.0)).state.prefill
    assert learnt.correction_updates == 1 and learnt.correction == pytest.approx(1.0)


@pytest.mark.parametrize(("window", "waiting_before"), [
    # Moderate load, no queue: the engines deliver what they are asked for, which says nothing about
    # capacity (and slow small-batch TTFTs must not read as lost capacity).
    (prefill_window(0.6 * SATURATED, 0.0, 0.0, time_to_first_token_seconds=Quantiles(0.3, 0.6, 0.9, 0.4)), 0.0),
    # A queue now but none at the window's start: not saturated all window.
    (prefill_window(0.6 * SATURATED, 40.0, 0.9), 0.0),
    # Queued at both ends but the median request did not wait: not saturated.
    (prefill_window(0.6 * SATURATED, 40.0, 0.1), 40.0),
    # Too few requests.
    (prefill_window(0.6 * SATURATED, 40.0, 0.9, requests_per_s=0.2), 40.0),
    # A replica starting: the pool is not steady.
    (prefill_window(0.6 * SATURATED, 40.0, 0.9, starting=1), 40.0),
])
def test_prefill_correction_is_frozen_when_the_window_does_not_measure_capacity(
        window: Observation, waiting_before: float) -> None:
    learnt = decide(window, CONFIG, settled(4, 3, waiting=waiting_before)).state.prefill
    assert learnt.correction == 1.0 and learnt.correction_updates == 0


def test_decode_correction_is_learnt_from_itl() -> None:
    decode = dataclasses.replace(observation(), decode=role(3, generation_tokens_per_s=6000.0,
                                                            inter_token_latency_seconds=Quantiles(mean=0.02)))
    assert decide(decode, CONFIG, settled(2, 3)).state.decode.correction_updates == 1
    thin = dataclasses.replace(decode, decode=dataclasses.replace(decode.decode, generation_tokens_per_s=10.0))
    assert decide(thin, CONFIG, settled(2, 3)).state.decode.correction_updates == 0


BURSTY_WAITS = Quantiles(0.1, 1.0, 2.5, 0.4)


def bursty(rate: float = 20.0, prefill: int = 2, time_s: float = 600.0, **role_fields: Any) -> Observation:
    """A window whose TTFT breached because its prompts queued in a burst (load well under capacity)."""
    return dataclasses.replace(
        observation(rate=rate, prefill=prefill, decode=3, time_s=time_s), ttft_seconds=Quantiles(0.2, 1.5, 3.0, 0.6),
        prefill=role(prefill, request_queue_time_seconds=BURSTY_WAITS, **role_fields))


def test_bursts_are_learnt_from_the_queue_time_tail_with_the_requests_they_covered() -> None:
    decision = decide(bursty(), CONFIG, settled(2, 3))
    (burst,) = decision.state.prefill.bursts
    pool = 2 * MODEL.saturated_tokens_per_s()
    assert (burst.work_p50, burst.work_p90, burst.work_p99) == pytest.approx((0.1 * pool, 1.0 * pool, 2.5 * pool))
    assert burst.requests == pytest.approx(20.0 * 30.0) and burst.replicas == 2 and burst.time_s == 600.0
    assert decision.state.prefill.requests_seen == pytest.approx(20.0 * 30.0)


@pytest.mark.parametrize(("window", "why"), [
    (observation(prefill=2, decode=3), "no TTFT breach"),
    (bursty(starting=1, ready=1), "pool not steady"),
    (bursty(rate=200.0), "overloaded, not bursty"),
    (dataclasses.replace(bursty(), prefill=role(2, request_queue_time_seconds=Quantiles(0.1, 0.2, 0.29))),
     "tail under the histogram's first bucket"),
])
def test_windows_that_are_not_bursts_teach_none(window: Observation, why: str) -> None:
    assert decide(window, CONFIG, settled(2, 3)).state.prefill.bursts == (), why


def test_a_wait_more_replicas_did_not_cut_is_not_learnt() -> None:
    first = decide(bursty(prefill=2), CONFIG, settled(2, 3)).state
    again = decide(bursty(prefill=4, time_s=630.0), CONFIG, replace_recommendations(first, 4))
    assert len(again.state.prefill.bursts) == 1


def replace_recommendations(state: AutoscalerState, prefill: int) -> AutoscalerState:
    return dataclasses.replace(state, prefill=dataclasses.replace(
        state.prefill, recommendations=tuple((t, prefill) for t, _ in state.prefill.recommendations)))


def test_a_burst_sizes_prefill_by_the_share_of_requests_it_would_make_miss() -> None:
    # A burst seen in one window among a long calm history (10 min at the same rate) would make few
    # of the requests miss: the steady size stands. The same burst in every remembered window would
    # make many miss: prefill grows until the burst's misses fit the error budget.
    calm = settled(2, 3, requests_seen=20.0 * CONFIG.burst_memory_s, seen_since_s=0.0)
    once = decide(bursty(), CONFIG, calm)
    steady = decide(observation(prefill=2, decode=3), CONFIG, calm).prefill.recommended
    assert once.prefill.recommended == steady and len(once.state.prefill.bursts) == 1
    state = settled(2, 3)
    for step in range(10):
        decision = decide(bursty(time_s=600.0 + 30.0 * step), CONFIG, replace_recommendations(state, 2))
        state = decision.state
    assert decision.prefill.recommended > 2 and decision.prefill.reason == PREFILL_DEMAND
    assert "remembered burst" in decision.prefill.message


def test_a_burst_counts_against_the_memory_not_only_the_minute_seen() -> None:
    # Right after start-up (no history) a burst is judged against the requests the memory's span
    # brings at the current rate (a prior: no bursts before any evidence), so a one-off burst that
    # made a third of one window wait long does not size prefill as if every window were like it.
    decision = decide(bursty(), CONFIG, AutoscalerState())
    weighted = ((1.0, decision.state.prefill.bursts[0]),)
    mix = PromptMix.from_quantiles(1000.0, Quantiles(900.0, 2000.0, 4000.0))
    own_window = MODEL.burst_replicas(weighted, 20.0 * 60.0, mix, 0.02, rate=20.0)
    assert 2 < decision.prefill.recommended < own_window


def test_from_spec_reads_the_crd() -> None:
    spec = AutoscalingSpec.model_validate({
        "mode": "Auto", "prometheus": {"url": "http://p:9090"}, "slo": {"ttftMs": 300, "tpotMs": 30, "percentile": 99},
        "prefill": {"minReplicas": 2, "maxReplicas": 6}, "gpuBudget": 20, "intervalSeconds": 15, "startupSeconds": 240,
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600, "maxStep": 2},
                     "scaleUp": {"stabilizationWindowSeconds": 0, "maxStep": 3}}})
    config = AutoscalerConfig.from_spec(spec, PERF, prefill_gpus=2)
    assert config.model.ttft_target_s == 0.3 and config.model.tpot_target_s == 0.03 and config.model.quantile == 0.99
    assert config.prefill == RoleBounds(2, 6) and config.gpu_budget == 20 and config.prefill_gpus == 2
    assert (config.interval_s, config.startup_s) == (15.0, 240.0)
    assert (config.scale_down.window_s, config.scale_down.max_step, config.scale_up.max_step) == (600.0, 2, 3)
    assert config.horizon_s == 240.0 + 15.0 + 30.0
    assert config.react_s == 5.0     # reactSeconds' default: the gauges every 5 s between decisions


@pytest.mark.parametrize(("react_seconds", "react_s"), [(0, None), (3, 3.0), (29, 29.0), (30, None), (45, None)])
def test_from_spec_reads_react_seconds(react_seconds: int, react_s: float | None) -> None:
    """0, or the interval and more (the next decision comes first), turn the looks off."""
    spec = AutoscalingSpec.model_validate({"mode": "Auto", "prometheus": {"url": "http://p:9090"},
                                           "reactSeconds": react_seconds, "intervalSeconds": 30})
    assert spec.react_seconds == react_seconds
    assert AutoscalerConfig.from_spec(spec, PERF).react_s == react_s


@pytest.mark.parametrize(("percentile", "expected"), [(50, 1.0), (90, 2.0), (95, 2.0 + 8.0 * 5 / 9), (99, 10.0)])
def test_quantile_at(percentile: float, expected: float) -> None:
    assert quantile_at(Quantiles(1.0, 2.0, 10.0), percentile) == pytest.approx(expected)


@pytest.mark.parametrize(("p", "d", "ratio"), [(2, 6, "1:3"), (3, 5, "3:5"), (4, 4, "1:1")])
def test_pd_ratio(p: int, d: int, ratio: str) -> None:
    assert pd_ratio(p, d) == ratio



@pytest.mark.parametrize("hit_rate", [0.0, 0.5, 0.75])
def test_prefill_is_sized_on_the_prompt_tokens_it_computes(hit_rate: float) -> None:
    """The same demand with half (three quarters) of the prompt tokens found cached needs about half (a
    quarter of) the prefill replicas; decode, which holds every prompt token, is sized alike."""
    busy = dataclasses.replace(observation(rate=200.0, prefill=1, decode=20),
                               prefill=role(1, prefix_cache_hit_rate=hit_rate))
    decision = decide(busy, CONFIG, settled(1, 20))
    plain = decide(observation(rate=200.0, prefill=1, decode=20), CONFIG, settled(1, 20))
    assert decision.decode.recommended == plain.decode.recommended
    computed = 1.0 - hit_rate
    assert decision.prefill.recommended == pytest.approx(plain.prefill.recommended * computed, abs=1.5)
    assert computed_share(busy, CONFIG) == computed


def test_the_computed_share_has_a_floor_and_a_quiet_window_teaches_nothing() -> None:
    cached = dataclasses.replace(observation(), prefill=role(2, prefix_cache_hit_rate=1.0))
    assert computed_share(cached, CONFIG) == MIN_COMPUTED_SHARE
    quiet = dataclasses.replace(observation(), prefill=role(2, prefix_cache_hit_rate=0.9, requests_per_s=0.2))
    assert computed_share(quiet, CONFIG) == 1.0      # a few requests (health checks) teach nothing


def test_prefill_correction_is_learnt_on_computed_tokens() -> None:
    """A saturated pool delivering twice the modelled prompt tokens while half of them hit is at the
    modelled capacity: k stays 1 rather than reading the cache as faster engines."""
    window = prefill_window(2.0 * SATURATED, 40.0, 0.9)
    cached = dataclasses.replace(window, prefill=dataclasses.replace(window.prefill, prefix_cache_hit_rate=0.5))
    learnt = decide(cached, CONFIG, settled(4, 3, waiting=40.0)).state.prefill
    assert learnt.correction_updates == 1 and learnt.correction == pytest.approx(1.0)
