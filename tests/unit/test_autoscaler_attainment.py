"""The target attainment (issue 30): measured from the histograms' buckets, the headroom learnt from it,
the API field, the collector's bucket queries, and what the operator reports."""

from __future__ import annotations

import dataclasses
import math

import pytest
from pydantic import ValidationError

from tests.unit.test_autoscaler_decide import CONFIG, PERF, observation
from xpyd.api.models import AutoscalingSpec
from xpyd.autoscaler import collect
from xpyd.autoscaler.attainment import (
    BUCKET_S,
    GAIN,
    HOUR_S,
    MAX_ERROR,
    MAX_HEADROOM,
    MIN_HEADROOM,
    AttainmentState,
    learn,
    share_within,
    window_attainment,
)
from xpyd.autoscaler.config import AutoscalerConfig, Pace, state_max_age_s
from xpyd.autoscaler.decide import NO_TRAFFIC, AutoscalerState, RoleState, decide, headroom, served_share
from xpyd.autoscaler.observation import Observation
from xpyd.autoscaler.state import decode, encode

pytestmark = pytest.mark.unit

INF = math.inf
# 100 requests: 50 under 0.1 s, 30 more under 0.5 s, 15 more under 1 s, 5 beyond.
TTFT = ((0.1, 50.0), (0.5, 80.0), (1.0, 95.0), (INF, 100.0))
TPOT = ((0.01, 60.0), (0.025, 100.0), (INF, 100.0))


@pytest.mark.parametrize(("target", "share"), [
    (0.05, 0.25),            # half of the first bucket (from 0)
    (0.1, 0.5), (0.3, 0.65),  # a bound; linear within (0.1, 0.5]
    (0.75, 0.875), (1.0, 0.95),
    (5.0, 0.95),             # past the last finite bound: those under it
])
def test_share_within_reads_the_buckets_as_histogram_quantile(target: float, share: float) -> None:
    assert share_within(TTFT, target) == pytest.approx(share)


def test_no_observations_is_no_share() -> None:
    assert math.isnan(share_within((), 0.5))
    assert math.isnan(share_within(((0.1, 0.0), (INF, 0.0)), 0.5))


def test_window_attainment_meets_both_targets() -> None:
    assert window_attainment(TTFT, TPOT, 0.5, 0.025) == pytest.approx(0.8 * 1.0)
    assert window_attainment(TTFT, TPOT, 1.0, 0.01) == pytest.approx(0.95 * 0.6)
    assert window_attainment((), TPOT, 0.5, 0.01) == pytest.approx(0.6)   # no client TTFT (no proxy scraped)
    assert math.isnan(window_attainment((), (), 0.5, 0.025))


@pytest.mark.parametrize(("attainment", "step"), [
    (0.95, 0.0),                   # on target: stays
    (1.0, -GAIN),                  # nothing missed: down by the most a window moves it
    (0.975, -0.5 * GAIN),          # half the misses allowed
    (0.90, GAIN),                  # twice the misses allowed
    (0.80, 3 * GAIN),              # four times
    (0.70, MAX_ERROR * GAIN),      # six times: taught as five (the cap)
    (0.0, MAX_ERROR * GAIN),
])
def test_the_headroom_moves_linearly_in_the_misses_up_to_a_cap(attainment: float, step: float) -> None:
    assert learn(AttainmentState(headroom=0.2), 1000.0, attainment, 100.0, 0.95, 30).headroom == \
        pytest.approx(0.2 + step)


def test_the_headroom_comes_to_rest_where_the_windows_miss_what_the_target_allows_on_average() -> None:
    """Clumped misses, asked 95%: one window in five misses 25%, four miss nothing (5% on average). The
    steps cancel out (+4 x GAIN, then 4 x -GAIN): the headroom does not drift while the target is met
    on average. At 6% on average it rises, at 4% it falls, by GAIN each five windows."""
    for cycle, drift in (((0.25, 0.0, 0.0, 0.0, 0.0), 0.0), ((0.25, 0.05, 0.0, 0.0, 0.0), 1.0),
                         ((0.20, 0.0, 0.0, 0.0, 0.0), -1.0)):
        state = AttainmentState(headroom=0.5)
        for _ in range(10):
            for miss in cycle:
                state = learn(state, 1000.0, 1.0 - miss, 100.0, 0.95, 30)
        assert state.headroom == pytest.approx(0.5 + drift * 10 * GAIN, abs=1e-9), cycle


def test_the_headroom_stays_within_its_bounds() -> None:
    missed = met = AttainmentState()
    for _ in range(500):
        missed = learn(missed, 1000.0, 0.0, 100.0, 0.95, 30)
        met = learn(met, 1000.0, 1.0, 100.0, 0.95, 30)
    assert (missed.headroom, met.headroom) == (MAX_HEADROOM, MIN_HEADROOM)


@pytest.mark.parametrize("kwargs", [
    {"requests": 10.0},                          # too few requests to judge
    {"target": None},                            # no target: measured, never learnt
    {"teach": False},                            # a cold start's release, or every role at its maximum
])
def test_windows_that_teach_nothing(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"requests": 100.0, "target": 0.95, "teach": True, **kwargs}
    state = learn(AttainmentState(), 1000.0, 0.5, args["requests"], args["target"], 30,  # type: ignore[arg-type]
                  teach=args["teach"])  # type: ignore[arg-type]
    assert state.headroom == 0.0 and state.updates == 0
    assert state.last_hour(1000.0) == pytest.approx(0.5)   # but the hour counts them


@pytest.mark.parametrize(("served", "share"), [(1.0, 1.0), (0.25, 0.25), (0.0, 0.0), (1.5, 1.0), (-1.0, 0.0)])
def test_an_upward_step_is_scaled_by_the_share_of_the_pool_that_served(served: float, share: float) -> None:
    full = learn(AttainmentState(), 1000.0, 0.5, 100.0, 0.95, 30)
    scaled = learn(AttainmentState(), 1000.0, 0.5, 100.0, 0.95, 30, served=served)
    assert scaled.headroom == pytest.approx(share * full.headroom)
    # A window that met the target moves it down whatever served: a smaller pool did not miss.
    met = learn(AttainmentState(headroom=0.5), 1000.0, 1.0, 100.0, 0.95, 30, served=served)
    assert met.headroom == pytest.approx(0.5 - GAIN)


@pytest.mark.parametrize(("excused", "taught", "step"), [
    (0.0, 0.85, 2 * GAIN), (0.05, 0.90, GAIN), (0.10, 0.95, 0.0), (0.15, 1.0, -GAIN), (0.5, 1.0, -GAIN),
    (-0.1, 0.85, 2 * GAIN)])
def test_excused_misses_are_taught_as_met_and_reported_as_they_were(excused: float, taught: float,
                                                                     step: float) -> None:
    """Misses no headroom could have prevented (requests served from a queue one engine holds) teach as
    if they had met (at most the window's misses; none for a negative share); the hour still reports
    the window as measured."""
    state = learn(AttainmentState(), 1000.0, 0.85, 100.0, 0.95, 30, excused=excused)
    assert state.headroom == pytest.approx(learn(AttainmentState(), 1000.0, taught, 100.0, 0.95, 30).headroom)
    assert state.headroom == pytest.approx(step)
    assert state.last_hour(1000.0) == pytest.approx(0.85)


def test_unknown_shares_teach_as_none_given() -> None:
    """A NaN `excused` excuses nothing and a NaN `served` scales nothing: the headroom stays a number."""
    plain = learn(AttainmentState(), 1000.0, 0.5, 100.0, 0.95, 30).headroom
    assert learn(AttainmentState(), 1000.0, 0.5, 100.0, 0.95, 30, excused=math.nan).headroom == pytest.approx(plain)
    assert learn(AttainmentState(), 1000.0, 0.5, 100.0, 0.95, 30, served=math.nan).headroom == pytest.approx(plain)


def test_the_last_hour_weighs_requests_and_forgets_older_ones() -> None:
    state = AttainmentState()
    state = learn(state, 0.0, 0.5, 100.0, None, 30)
    state = learn(state, 60.0, 1.0, 300.0, None, 30)            # same bucket
    assert len(state.history) == 1 and state.last_hour(60.0) == pytest.approx(0.875)
    state = learn(state, BUCKET_S * 3, 1.0, 100.0, None, 30)
    assert state.last_hour(BUCKET_S * 3) == pytest.approx(450 / 500)
    state = learn(state, HOUR_S + BUCKET_S * 2, math.nan, 0.0, None, 30)  # an hour on: the first bucket goes
    assert state.last_hour(HOUR_S + BUCKET_S * 2) == pytest.approx(1.0)
    assert math.isnan(AttainmentState().last_hour(0.0))


TARGETED = dataclasses.replace(CONFIG, attainment=0.95)


def missing(share: float, time_s: float = 600.0) -> dict[str, object]:
    """An observation whose client histograms say `share` of the window's requests met TTFT (all met TPOT)."""
    ttft = ((0.5, 100.0 * share), (INF, 100.0))
    return {"time_s": time_s, "ttft_buckets": ttft, "tpot_buckets": ((0.025, 100.0), (INF, 100.0))}


def test_decide_learns_the_headroom_and_sizes_for_it() -> None:
    state = AutoscalerState()
    plain = decide(observation(**missing(0.7)), CONFIG, state)            # type: ignore[arg-type]
    targeted = decide(observation(**missing(0.7)), TARGETED, state)       # type: ignore[arg-type]
    assert plain.state.attainment.headroom == 0.0 and headroom(CONFIG, plain.state) == 0.0
    assert targeted.state.attainment.headroom > 0 and "target 95.0%" in targeted.message
    assert "attainment 70.0% over the last hour" in targeted.message
    # A large headroom sizes more than none, on the same observation.
    held = dataclasses.replace(state, attainment=AttainmentState(headroom=0.8))
    more = decide(observation(rate=50.0, **missing(0.95)), TARGETED, held)  # type: ignore[arg-type]
    less = decide(observation(rate=50.0, **missing(0.95)), CONFIG, held)    # type: ignore[arg-type]
    assert more.prefill.recommended > less.prefill.recommended
    assert more.decode.recommended >= less.decode.recommended
    # The state keeps it across decisions and through the status encoding.
    assert decode(encode(more.state)).attainment == more.state.attainment


def test_a_start_from_zero_teaches_no_headroom() -> None:
    woken = AutoscalerState(woken_s=550.0)
    decision = decide(observation(**missing(0.2)), TARGETED, woken)  # type: ignore[arg-type]
    assert decision.state.attainment.headroom == 0.0
    assert decision.state.attainment.last_hour(600.0) == pytest.approx(0.2)


def growing(ready: int = 1, ordered: int = 4, pending: int = 0, time_s: float = 600.0) -> Observation:
    """Prefill with `ready` of `ordered` replicas serving (the rest starting, or `pending` not placed),
    90% of the window's requests missing TTFT."""
    base = observation(prefill=ordered - pending, **missing(0.1, time_s))  # type: ignore[arg-type]
    prefill = dataclasses.replace(base.prefill, ready=ready, starting=ordered - pending - ready, pending=pending)
    return dataclasses.replace(base, prefill=prefill)


def test_served_share_is_ready_over_ordered_for_the_smaller_role() -> None:
    assert served_share(observation()) == 1.0
    assert served_share(growing(1, 4)) == pytest.approx(0.25)
    assert served_share(growing(2, 8, pending=4)) == pytest.approx(0.25)   # Pending replicas are ordered too
    nothing = observation(prefill=0)
    assert served_share(dataclasses.replace(nothing, prefill=dataclasses.replace(nothing.prefill, ready=0))) == 1.0


def test_until_the_pool_settles_a_miss_teaches_in_proportion_to_what_served() -> None:
    """A cold start: one prefill replica of four ordered serves, every request misses. Before any decision
    found the pool settled, the headroom moves a quarter of a full step; once one has (a decision after an
    earlier one with no role's window reaching back before its last scale-up), the full step, and the
    time it settled is kept through the status encoding. A start from zero begins it again."""
    full = decide(observation(**missing(0.1)), TARGETED, AutoscalerState())  # type: ignore[arg-type]
    step = full.state.attainment.headroom
    assert step > 0
    first = decide(growing(), TARGETED, AutoscalerState())                 # no decision before: not settled
    assert first.state.attainment.headroom == pytest.approx(step / 4)
    assert math.isnan(first.state.attainment.settled_s)
    grew = AutoscalerState(time_s=570.0, prefill=RoleState(last_scale_up_s=540.0))
    unsettled = decide(growing(), TARGETED, grew)                          # its scale-up's replicas still start
    assert unsettled.state.attainment.headroom == pytest.approx(step / 4)
    later = decide(growing(time_s=900.0), TARGETED, unsettled.state)       # 360 s on: settled, full step
    assert later.state.attainment.settled_s == 900.0
    assert later.state.attainment.headroom == pytest.approx(step / 4 + step)
    again = decide(growing(time_s=930.0), TARGETED,
                   dataclasses.replace(later.state, prefill=RoleState(last_scale_up_s=920.0)))
    assert again.state.attainment.settled_s == 900.0                       # once settled, it stays
    assert again.state.attainment.headroom == pytest.approx(step / 4 + 2 * step)
    assert decode(encode(again.state)).attainment == again.state.attainment
    assert math.isnan(decode(encode(first.state)).attainment.settled_s)
    basis = again.state.basis
    assert basis is not None and decode(encode(again.state)).basis == basis   # react's basis round-trips too
    woke = dataclasses.replace(again.state, woken_s=1000.0, prefill=RoleState(last_scale_up_s=1000.0))
    rewoken = decide(growing(time_s=1100.0), TARGETED, woke)               # woke at 1000: not settled since
    assert math.isnan(rewoken.state.attainment.settled_s)


def test_a_pool_that_held_before_its_traffic_came_has_not_settled_at_its_first_sizing() -> None:
    """A pool created before its traffic: its decisions hold (NoTraffic: nothing to size) and set their
    time. The first sizing decision once traffic comes follows no sizing decision, so it does not find
    the pool settled, and its miss teaches in proportion to what served."""
    idle = decide(observation(rate=0.0, isl=math.nan, osl=math.nan, time_s=570.0), TARGETED, AutoscalerState())
    assert idle.reason == NO_TRAFFIC and idle.state.time_s == 570.0 and idle.state.basis is None
    first = decide(growing(), TARGETED, idle.state)
    assert math.isnan(first.state.attainment.settled_s)
    full = decide(observation(**missing(0.1)), TARGETED, idle.state)  # type: ignore[arg-type]
    assert 0 < first.state.attainment.headroom == pytest.approx(full.state.attainment.headroom / 4)


def test_the_spec_sets_the_target_and_the_sizing_quantile() -> None:
    """With a target, each SLO is sized at the target's share, whatever the percentile says (the
    target is the goal); without one, at the percentile."""
    spec = AutoscalingSpec.model_validate({"slo": {"percentile": 90, "attainment": 0.95}})
    config = AutoscalerConfig.from_spec(spec, PERF)
    assert config.attainment == 0.95 and config.model.quantile == 0.95
    for percentile, target in ((99, 0.9), (90, 0.8)):
        spec = AutoscalingSpec.model_validate({"slo": {"percentile": percentile, "attainment": target}})
        assert AutoscalerConfig.from_spec(spec, PERF).model.quantile == target
    untargeted = AutoscalerConfig.from_spec(AutoscalingSpec.model_validate({"slo": {"percentile": 99}}), PERF)
    assert untargeted.attainment is None and untargeted.model.quantile == 0.99


@pytest.mark.parametrize(("target", "window_s", "margin"), [
    (None, 300.0, 0.1),      # no target: the CRD's former default and the N-1 check's 10%
    (0.5, 60.0, 0.0), (0.8, 60.0, 0.0),          # a loose target: no caution kept
    (0.85, 140.0, 0.1 / 3), (0.9, 220.0, 0.2 / 3),  # linear between 80% and 95%
    (0.95, 300.0, 0.1), (0.99, 300.0, 0.1),      # a tight one: all of it
])
def test_the_target_paces_scale_down_unless_the_spec_sets_the_window(target: float | None, window_s: float,
                                                                     margin: float) -> None:
    slo = {} if target is None else {"attainment": target}
    config = AutoscalerConfig.from_spec(AutoscalingSpec.model_validate({"slo": slo}), PERF)
    assert config.scale_down.window_s == pytest.approx(window_s)
    assert config.down_margin == pytest.approx(margin)
    assert config.scale_down.max_step == 1 and config.scale_up.window_s == 0.0
    # A window the user sets wins; the N-1 margin still follows the target (it is not in the API).
    spec = AutoscalingSpec.model_validate({"slo": slo, "behavior": {"scaleDown": {"stabilizationWindowSeconds": 450,
                                                                                  "maxStep": 2}}})
    explicit = AutoscalerConfig.from_spec(spec, PERF)
    assert (explicit.scale_down.window_s, explicit.scale_down.max_step) == (450.0, 2)
    assert explicit.down_margin == pytest.approx(margin)
    # A restored decision state is used while it is younger than that window plus two intervals.
    assert state_max_age_s(AutoscalingSpec.model_validate({"slo": slo})) == pytest.approx(window_s + 60.0)
    assert state_max_age_s(spec) == 450.0 + 60.0


def test_an_unset_scale_down_window_is_not_written_into_the_spec() -> None:
    """The CRD leaves the window out of its default, so the API server stores none and the target
    decides it; a scale-up rule without a window keeps the old default of 0."""
    spec = AutoscalingSpec.model_validate({"behavior": {"scaleUp": {"maxStep": 2}}})
    assert spec.behavior.scale_down.stabilization_window_seconds is None
    dumped = spec.model_dump(by_alias=True, exclude_none=True)["behavior"]
    assert dumped["scaleDown"] == {"maxStep": 1}
    assert AutoscalerConfig.from_spec(spec, PERF).scale_up == Pace(0.0, 2)


@pytest.mark.parametrize("value", [0.3, 1.0, 1.5])
def test_the_api_refuses_an_attainment_out_of_range(value: float) -> None:
    with pytest.raises(ValidationError) as error:
        AutoscalingSpec.model_validate({"slo": {"attainment": value}})
    assert ("slo", "attainment") in [e["loc"] for e in error.value.errors()]


def test_the_collector_reads_the_buckets_by_le() -> None:
    named = collect.queries(collect.Scope("ns", "pool"))
    assert named["ttft.buckets"].startswith("sum by (le) (rate(xpyd_proxy_time_to_first_token_seconds_bucket{")
    assert "vllm:request_time_per_output_token_seconds_bucket" in named["tpot.buckets"]
    answer = [{"metric": {"le": le}, "value": [0, value]} for le, value in (("+Inf", "4"), ("0.5", "3"), ("0.1", "1"))]
    samples = collect.parse_result(answer, "le")
    assert collect.buckets({"ttft.buckets": samples}, "ttft") == ((0.1, 1.0), (0.5, 3.0), (INF, 4.0))
    assert collect.buckets({"ttft.buckets": {"0.5": 3.0}}, "ttft") == ()     # no +Inf bucket: unknown
    assert collect.buckets({}, "ttft") == ()
