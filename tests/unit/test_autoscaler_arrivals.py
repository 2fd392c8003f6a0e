"""Arrival bunching (`autoscaler.arrivals`): the slot-work rule, how `decide()` sizes prefill and
checks a scale-down by it, how `collect` turns the proxies' histograms into the engines' tokens, and
what the simulator's proxy measures. `ArrivalSlots` itself and the proxy's metrics:
tests/unit/test_proxy_arrivals.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.test_autoscaler_decide import CONFIG, MODEL, observation, settled
from xpyd.autoscaler import collect
from xpyd.autoscaler.arrivals import ArrivalNeed, replicas_for
from xpyd.autoscaler.attainment import AttainmentState
from xpyd.autoscaler.decide import decide
from xpyd.autoscaler.observation import Desired, Quantiles, Slo
from xpyd.common import exposition
from xpyd.common.bunching import BUCKETS, WINDOWS_S, window_label
from xpyd.controller.autoscale import observed_load
from xpyd.perf.model import PerfModel
from xpyd.proxy.metrics import ProxyMetrics
from xpyd.sim.policy import StaticPolicy
from xpyd.sim.simulator import SimConfig, Simulator
from xpyd.traces import TraceRequest


@pytest.mark.parametrize(("work", "rate", "budget", "cap", "need"), [
    ({}, 48_000.0, 0.4, 64, ArrivalNeed()),                                   # nothing known
    ({0.25: math.nan, 1.0: 0.0}, 48_000.0, 0.4, 64, ArrivalNeed()),           # unknown and empty slots
    ({0.25: 69_000.0}, 48_000.0, 0.44, 64, ArrivalNeed(3, 0.25, 69_000.0)),   # 69k / (48k x 0.69 s) = 2.08
    ({0.25: 33_000.0}, 48_000.0, 0.44, 64, ArrivalNeed(1, 0.25, 33_000.0)),   # 0.996 of one replica
    # Each window bounds from below; the one needing the most replicas binds (the shortest on a tie).
    ({0.25: 10_000.0, 1.0: 200_000.0, 4.0: 300_000.0}, 10_000.0, 0.0, 64, ArrivalNeed(20, 1.0, 200_000.0)),
    ({0.25: 10_000.0, 1.0: 40_000.0}, 10_000.0, 0.0, 64, ArrivalNeed(4, 0.25, 10_000.0)),
    ({1.0: 200_000.0}, 10_000.0, -3.0, 8, ArrivalNeed(8, 1.0, 200_000.0)),    # a negative budget is none; capped
    ({1.0: 200_000.0}, 0.0, 0.5, 64, ArrivalNeed()),                          # no capacity known
])
def test_replicas_for(work: dict[float, float], rate: float, budget: float, cap: int, need: ArrivalNeed) -> None:
    assert replicas_for(work, rate, budget, max_replicas=cap) == need


def bunched(tokens: float, windows: tuple[float, ...] = WINDOWS_S) -> tuple[tuple[float, Quantiles], ...]:
    """Arrival quantiles with `tokens` at every quantile of each window (the SLO percentile reads it)."""
    return tuple((window, Quantiles(tokens, tokens, tokens, tokens)) for window in windows)


def test_bunched_arrivals_size_prefill_beyond_the_steady_model() -> None:
    """The steady load needs 1-2 prefill replicas; a quarter-second slot of 120k prompt tokens at the
    SLO percentile needs enough of them to drain it within the queue budget plus the slot."""
    plain = decide(observation(), CONFIG, settled(2, 3))
    obs = observation(arrival_prompt_tokens=bunched(120_000.0, (0.25,)))
    decision = decide(obs, CONFIG, settled(2, 3))
    rate = MODEL.saturated_tokens_per_s()
    assert plain.prefill.recommended <= 2
    expected = replicas_for({0.25: 120_000.0}, rate, 0.4, max_replicas=64).replicas
    assert expected > 2 and decision.prefill.recommended == decision.prefill.replicas == expected   # up at once
    assert "arrivals bunch: sized for 120.0k prompt tokens sharing the p95 request's 0.25s slot" in decision.message


def test_bunched_arrivals_hold_a_scale_down_the_n_minus_one_check_refuses() -> None:
    """A pool of 4 prefill replicas whose steady load needs 1: slot work that 3 replicas drain, but not
    with the N-1 check's 10% more, keeps the 4 (the recommendation alone would allow 3)."""
    state = settled(1, 3, now=600.0)   # the window has recommended 1 prefill replica throughout

    def recommended(tokens: float) -> int:
        return decide(observation(prefill=4, arrival_prompt_tokens=bunched(tokens, (1.0,))), CONFIG,
                      state).prefill.recommended

    quiet = decide(observation(prefill=4), CONFIG, state)
    assert (quiet.prefill.replicas, quiet.prefill.reason) == (3, "DemandFell")
    low, high = 1.0, 1e7            # the largest slot work 3 replicas drain, to 0.1%
    while high - low > low * 1e-3:
        middle = (low + high) / 2
        low, high = (middle, high) if recommended(middle) <= 3 else (low, middle)
    assert recommended(low) == 3 and recommended(1.1 * low) == 4
    held = decide(observation(prefill=4, arrival_prompt_tokens=bunched(low, (1.0,))), CONFIG, state)
    assert held.prefill.recommended == 3 and held.prefill.replicas == 4
    assert "N-1 check fails" in held.message and "bunched arrivals 4" in held.message


def results_with(estimated_mean: float, proxies: float) -> dict[str, collect.Samples]:
    results: dict[str, collect.Samples] = {"arrival_proxies": {"": proxies}, "proxy_up": {"": 3.0},
                                              "arrival_prompt": {"": estimated_mean}}
    for index, window in enumerate(WINDOWS_S):
        label = window_label(window)
        for part, value in (("p50", 1000.0), ("p90", 2000.0), ("p99", 4000.0), ("mean", 1500.0)):
            results.setdefault(f"arrival.{part}", {})[label] = value * (index + 1)
    return results


def test_collect_turns_the_proxies_estimates_into_the_engines_tokens_over_the_pool() -> None:
    """Two proxies (of three scraped) counted arrivals, their estimates 25% under the engines' mean
    prompt: each value x 2 x 1.25."""
    work = collect.arrival_prompt_tokens(results_with(800.0, 2.0), isl_mean=1000.0)
    assert [window for window, _ in work] == list(WINDOWS_S)
    assert work[0][1] == Quantiles(2500.0, 5000.0, 10_000.0, 3750.0)
    assert work[2][1] == Quantiles(7500.0, 15_000.0, 30_000.0, 11_250.0)


@pytest.mark.parametrize(("estimated", "proxies", "isl"), [
    (math.nan, 1.0, 1000.0), (0.0, 1.0, 1000.0), (800.0, 0.0, 1000.0), (800.0, 1.0, math.nan)])
def test_collect_gives_no_arrival_work_without_both_means_and_a_proxy(estimated: float, proxies: float,
                                                                      isl: float) -> None:
    assert collect.arrival_prompt_tokens(results_with(estimated, proxies), isl_mean=isl) == ()


def test_the_queries_read_the_arrival_histogram_by_window() -> None:
    queries = collect.queries(collect.Scope("ns", "llm"))
    assert 'by (window, le)' in queries["arrival.p90"] and "xpyd_proxy_arrival_prompt_tokens_bucket" in queries[
        "arrival.p90"]
    assert queries["arrival_prompt"].startswith("sum(rate(xpyd_proxy_prompt_tokens_total{")
    assert 'window="0.25"' in queries["arrival_prompt"]
    assert collect.answer_label("arrival.p50") == "window" and collect.answer_label("arrival_prompt") == "xpyd_io_role"


def test_the_simulators_proxy_measures_the_slots_of_its_arrivals() -> None:
    """Three requests in one quarter-second slot and one alone, replayed on a fixed pool: the window's
    arrival histogram holds each request's slot work (3 x 600 tokens, 1 x 400), as the proxy's does."""
    perf = PerfModel.from_profile("h200_llama31_8b_fp8_tp1")
    trace = [TraceRequest(1.0, 100, 10), TraceRequest(1.05, 200, 10), TraceRequest(1.2, 300, 10),
             TraceRequest(2.6, 400, 10), TraceRequest(9.0, 100, 10)]   # the last after the first decision
    seen: list[tuple[tuple[float, Quantiles], ...]] = []

    class Recording(StaticPolicy):
        def desired_sizes(self, observation):  # type: ignore[no-untyped-def]
            seen.append(observation.arrival_prompt_tokens)
            return super().desired_sizes(observation)

    config = SimConfig(prefill=1, decode=1, slo=Slo(), startup_delay_s=0.0, interval_s=5.0)
    Simulator(trace, perf, Recording(Desired(1, 1)), config, "static").run()
    first = dict(seen[0])
    assert list(first) == list(WINDOWS_S)
    quarter = first[0.25]
    assert quarter.mean == pytest.approx((3 * 600 + 400) / 4)
    # Buckets of sqrt(2): 400 and 600 fall in different ones; the median interpolates in 600's.
    assert BUCKETS[3] < 400 <= BUCKETS[4] < 600 <= BUCKETS[5]
    assert BUCKETS[4] < quarter.p50 <= BUCKETS[5]
    assert dict(seen[0])[4.0].mean == pytest.approx(1000.0)   # one 4 s slot [0, 4): all four, 1000 tokens


def test_slot_work_a_smaller_pool_drains_changes_nothing() -> None:
    """Arrivals that bunch less than the steady model allows for leave the decision as it is."""
    state = settled(2, 3)
    light = decide(observation(arrival_prompt_tokens=bunched(2000.0)), CONFIG, state)
    plain = decide(observation(), CONFIG, state)
    assert (light.prefill, light.decode) == (plain.prefill, plain.decode)


def test_the_learnt_headroom_scales_the_slot_work_as_it_scales_the_demand() -> None:
    targeted = dataclasses.replace(CONFIG, attainment=0.95)
    tokens = 120_000.0
    obs = observation(arrival_prompt_tokens=bunched(tokens, (0.25,)))
    state = settled(2, 3)
    plain = decide(obs, targeted, state)
    raised = decide(obs, targeted, dataclasses.replace(state, attainment=AttainmentState(headroom=0.5)))
    assert plain.prefill.recommended < raised.prefill.recommended
    assert "sized for 180.0k prompt tokens" in raised.message


def test_the_status_shows_the_slot_work_per_window_at_the_slo_percentile() -> None:
    obs = observation(arrival_prompt_tokens=((0.25, Quantiles(1000.0, 2000.0, 4000.0, 1500.0)),
                                             (1.0, Quantiles(3000.0, 6000.4, 9000.0, 4000.0)),
                                             (4.0, Quantiles(math.nan, math.nan, math.nan, math.nan))))
    # At the decision's own percentile, as decide reads it; an unknown window is None (a merge patch
    # then removes the value an earlier decision wrote).
    assert observed_load(obs, 90.0)["arrivalPromptTokens"] == {"0.25": 2000.0, "1": 6000.0, "4": None}
    assert observed_load(obs, 95.0)["arrivalPromptTokens"]["0.25"] == pytest.approx(2000.0 + 2000.0 * 5 / 9, abs=1)
    assert observed_load(observation(), 90.0)["arrivalPromptTokens"] is None


def test_the_collectors_names_are_what_the_proxy_exports() -> None:
    """collect's PromQL names the series, the label and its values the proxy's /metrics carries."""
    now = [10.0]
    metrics = ProxyMetrics(clock=lambda: now[0])
    metrics.arrival(300)
    now[0] = 20.0
    metrics.flush_arrivals()
    text = generate_latest(exposition.registry([metrics.arrival_tokens, metrics.prompt_tokens])).decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    arrivals = families[collect.PROXY_ARRIVALS]
    assert arrivals.type == "histogram"
    assert {s.labels["window"] for s in arrivals.samples} == {window_label(w) for w in WINDOWS_S}
    assert {s.name for s in arrivals.samples} >= {f"{collect.PROXY_ARRIVALS}_{part}" for part in ("bucket", "count")}
    (counted,) = [s for s in families[collect.PROXY_PROMPT_TOKENS.removesuffix("_total")].samples
                  if s.name == collect.PROXY_PROMPT_TOKENS]
    assert counted.value == 300.0
    queries = collect.queries(collect.Scope("ns", "llm"))
    assert f"{collect.PROXY_ARRIVALS}_bucket" in queries["arrival.p90"]
    assert f'{collect.PROXY_ARRIVALS}_count{{' in queries["arrival_proxies"]
