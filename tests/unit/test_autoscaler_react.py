"""`xpyd.autoscaler.react`: scale-up between decisions on the gauges, as a table of present states."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from tests.unit.test_autoscaler_decide import CONFIG, MODEL, observation, role, settled
from xpyd.autoscaler.decide import (
    DECODE_ADMISSION,
    METRICS_UNAVAILABLE,
    PREFILL_QUEUEING,
    AutoscalerState,
    ScaleUpBasis,
    decide,
    drain_budget_s,
)
from xpyd.autoscaler.observation import Observation, Quantiles, RoleObservation
from xpyd.autoscaler.react import MIN_GROWTH_SPAN_S, react
from xpyd.autoscaler.sizing import PromptMix

pytestmark = pytest.mark.unit

NOW = 610.0
PER_REPLICA = MODEL.saturated_tokens_per_s()
BASIS = ScaleUpBasis(time_s=600.0, isl=1000.0, osl=200.0, rate=20.0, rate_now=20.0,
                     prefill_tokens_per_s=PER_REPLICA, k_decode=1.0,
                     decode_replicas=MODEL.size_decode(20.0, 1000.0, 200.0).replicas)


def state(waiting: float = 0.0, basis: ScaleUpBasis | None = BASIS) -> AutoscalerState:
    """After a sizing decision at t=600 that saw `waiting` requests in prefill's queue."""
    base = settled(2, 3, now=600.0)
    return dataclasses.replace(base, time_s=600.0, basis=basis,
                               prefill=dataclasses.replace(base.prefill, waiting=waiting))


def gauges(prefill: RoleObservation | None = None, decode: RoleObservation | None = None,
           time_s: float = NOW) -> Observation:
    """What react sees: gauges and replica counts only."""
    return Observation(time_s=time_s, window_s=0.0, prefill=prefill or role(2), decode=decode or role(3))


def prefill_need(waiting: float, grown_per_s: float = 0.0, ready: int = 2) -> int:
    """The replicas the docstring's prefill rule asks for (no replica starting: a full start-up ahead)."""
    queued = waiting * BASIS.isl
    offered = BASIS.rate * BASIS.isl
    offered = max(offered, min(offered, ready * PER_REPLICA) + grown_per_s * BASIS.isl)
    building = max(0.0, offered - ready * PER_REPLICA) * CONFIG.startup_s
    return math.ceil((offered + (queued + building) / drain_budget_s(CONFIG)) / PER_REPLICA - 1e-9)


def test_a_prefill_backlog_grows_prefill_at_once_between_decisions() -> None:
    waiting = 20_000.0
    decision = react(gauges(role(2, num_requests_waiting=waiting)), CONFIG, state(waiting))
    assert decision is not None
    need = prefill_need(waiting)
    assert need > 2
    assert decision.prefill.replicas == min(need, 2 + CONFIG.scale_up.max_step)
    assert decision.prefill.recommended == need
    assert decision.prefill.reason == decision.reason == PREFILL_QUEUEING
    assert decision.decode.replicas == decision.decode.current == 3
    assert "P 2->" in decision.message and "between decisions" in decision.message
    assert decision.state.prefill.last_scale_up_s == NOW
    assert decision.state.prefill.starting_since_s == NOW
    assert decision.state.basis == BASIS                  # only a sizing decision moves the basis


def test_a_growing_queue_reads_as_arrivals_past_capacity() -> None:
    """The same queue, grown since the last decision: the growth is load the window's rate lags on."""
    waiting = 20_000.0
    span = NOW - 600.0
    assert span >= MIN_GROWTH_SPAN_S
    steady = react(gauges(role(2, num_requests_waiting=waiting)), CONFIG, state(waiting))
    grown = react(gauges(role(2, num_requests_waiting=waiting)), CONFIG, state(waiting - 500.0))
    assert steady is not None and grown is not None
    assert grown.prefill.recommended == prefill_need(waiting, 500.0 / span) > steady.prefill.recommended
    assert "queue grew 50.00 req/s over 10s" in grown.message


@pytest.mark.parametrize("case, observed, before, why", [
    ("no basis", gauges(role(2, num_requests_waiting=20_000.0)), state(20_000.0, basis=None),
     "before the first sizing decision there is nothing to judge with"),
    ("stale basis", gauges(role(2, num_requests_waiting=20_000.0), time_s=600.0 + 1.6 * CONFIG.interval_s),
     state(20_000.0), "decide() has not sized for over 1.5 intervals (holding on missing metrics)"),
    ("short queue", gauges(role(2, num_requests_waiting=2.0)), state(2.0),
     "what waits drains within the share of TTFT decide() tolerates"),
    ("queue foreseen", gauges(role(12, ready=2, starting=10, num_requests_waiting=20_000.0)), state(20_000.0),
     "replicas starting already cover it"),
    ("pending pods", gauges(role(2, pending=1, num_requests_waiting=20_000.0)), state(20_000.0),
     "Pending pods are not capacity: decide() reports InsufficientGPUs"),
    ("at the maximum", gauges(role(64, num_requests_waiting=2e6)), state(2e6), "bounds apply"),
    ("decode waits for hand-offs only", gauges(decode=role(3, num_requests_waiting=2.0)), state(),
     "requests whose KV is in flight are no backlog"),
])
def test_nothing_to_add(case: str, observed: Observation, before: AutoscalerState, why: str) -> None:
    assert react(observed, CONFIG, before) is None, why


def test_pace_and_the_gpu_budget_bound_the_growth() -> None:
    waiting = 200_000.0
    observed = gauges(role(2, num_requests_waiting=waiting))
    busy = state(waiting, basis=dataclasses.replace(BASIS, rate=200.0, rate_now=200.0))   # the load needs 5
    paced = react(observed, dataclasses.replace(CONFIG, scale_up=dataclasses.replace(CONFIG.scale_up, max_step=2)),
                  busy)
    assert paced is not None and paced.prefill.replicas == 4
    budget = react(observed, dataclasses.replace(CONFIG, gpu_budget=8), busy)   # 2 P + 3 D hold 5 GPUs
    assert budget is not None and budget.prefill.replicas == 5


def test_a_backlog_orders_no_more_than_the_load_needs_plus_the_replicas_holding_it() -> None:
    """Queued work stays on the engine that holds it: 200,000 requests on 2 replicas at a load one replica
    serves order 3 (`decide.pinned_limit`), for prefill as for decode."""
    waiting = 200_000.0
    prefill = react(gauges(role(2, num_requests_waiting=waiting)), CONFIG, state(waiting))
    assert prefill is not None and prefill.prefill.recommended == prefill.prefill.replicas == 3
    assert "at most the load's 1 plus the 2 ready that hold the queue" in prefill.message
    stored = dataclasses.replace(BASIS, prefill_replicas=4)       # what the last decision sized the load for
    assert react(gauges(role(2, num_requests_waiting=waiting)), CONFIG,
                 state(waiting, basis=stored)).prefill.recommended == 4 + 2  # type: ignore[union-attr]
    blocked = gauges(decode=role(3, num_requests_waiting=waiting, kv_cache_usage_perc_max=0.97))
    decode = react(blocked, CONFIG, state())
    assert decode is not None and decode.decode.recommended == BASIS.decode_replicas + 3
    planned = dataclasses.replace(BASIS, decode_replicas=BASIS.decode_replicas + 2)   # as the last decision sized it
    assert react(blocked, CONFIG, state(basis=planned)).decode.recommended == BASIS.decode_replicas + 5  # type: ignore[union-attr]


def test_a_queue_one_engine_holds_beside_idle_ones_orders_nothing() -> None:
    """The same queue on 4 prefill replicas: shared, a backlog; on one engine beside three idle, none
    (`decide.queue_drain_s`: more replicas would take none of it)."""
    waiting = 200_000.0
    shared = react(gauges(role(4, num_requests_waiting=waiting, num_requests_waiting_max=waiting / 4)), CONFIG,
                   state(waiting))
    assert shared is not None and shared.prefill.replicas > 4
    assert react(gauges(role(4, num_requests_waiting=waiting, num_requests_waiting_max=waiting)), CONFIG,
                 state(waiting)) is None


def test_a_queue_one_engine_holds_orders_nothing_while_it_grows() -> None:
    """One engine's queue grew since the last decision while the other three share one that drains
    within the tolerance, though not within half of it: decide's attribution blames no prefill
    (`decide.pinned_queue`), so the growth (all that engine's) orders nothing here either. Were the
    other engines' queue that long with no engine holding the rest, the growth would order replicas."""
    tolerated = CONFIG.queue_drain_share * MODEL.ttft_target_s
    others = 3 * 0.75 * tolerated * PER_REPLICA / BASIS.isl    # three engines' queue: 3/4 of the tolerance each
    pinned_queue = 100.0 * MODEL.ttft_target_s * PER_REPLICA / BASIS.isl
    busy = dataclasses.replace(BASIS, rate=192.0, rate_now=192.0)   # just under 4 replicas' capacity
    held = role(4, num_requests_waiting=others + pinned_queue, num_requests_waiting_max=pinned_queue)
    assert react(gauges(held), CONFIG, state(others + pinned_queue / 2, basis=busy)) is None
    spread = role(4, num_requests_waiting=4 * others / 3, num_requests_waiting_max=others / 3)
    assert react(gauges(spread), CONFIG, state(4 * others / 3, basis=busy)) is None   # not growing: none
    grown = react(gauges(spread), CONFIG, state(0.0, basis=busy))
    assert grown is not None and grown.prefill.replicas == 5 and "queue grew" in grown.message


@pytest.mark.parametrize("blocked", [
    {"kv_cache_usage_perc_max": 0.97},
    {"num_requests_running": 0.96 * MODEL.max_num_seqs * 3},
    {},                                   # more waiting than the hand-offs in flight explain
])
def test_blocked_decode_admission_grows_decode(blocked: dict[str, Any]) -> None:
    decode = role(3, num_requests_waiting=20_000.0, **blocked)
    decision = react(gauges(decode=decode), CONFIG, state())
    assert decision is not None
    assert decision.decode.reason == decision.reason == DECODE_ADMISSION
    assert decision.decode.replicas > 3 and decision.prefill.replicas == 2
    assert "waiting for decode admission" in decision.message


def test_a_hold_leaves_no_basis() -> None:
    """Held on missing metrics, decide() sized nothing: react has nothing to judge with until it does."""
    held = decide(observation(ttft_seconds=Quantiles()), CONFIG, state(20_000.0))
    assert held.reason == METRICS_UNAVAILABLE and held.state.basis is None
    assert react(gauges(role(2, num_requests_waiting=20_000.0)), CONFIG, held.state) is None


def test_a_sizing_decision_leaves_the_basis_react_reads() -> None:
    decided = decide(observation(), CONFIG, settled(2, 3))
    basis = decided.state.basis
    assert basis is not None
    assert (basis.time_s, basis.isl, basis.osl, basis.rate_now) == (600.0, 1000.0, 200.0, 20.0)
    mix = PromptMix.from_quantiles(1000.0, observation().isl_quantiles, CONFIG.default_isl_cs2)
    assert basis.prefill_tokens_per_s == pytest.approx(MODEL.mix_tokens_per_s(mix, 1.0), rel=0.05)
