"""The simulator's pool at zero (issue 31): zero replicas, the proxy's waiting room (hold, release,
timeout, overflow) and the demand signal that brings a decision forward; and `decide()` replayed
through it, to zero after the idle window and back on the next burst."""

from __future__ import annotations

import math

import pytest

from tests.unit.test_simulator import Recorder, real_perf
from xpyd.autoscaler.observation import Desired, Observation, Slo
from xpyd.sim.policies import XpydPolicy, simulate_policy, xpyd_config
from xpyd.sim.policy import PolicyContext
from xpyd.sim.report import build_report
from xpyd.sim.simulator import SimConfig, Simulator
from xpyd.traces import TraceRequest

pytestmark = pytest.mark.unit

STARTUP_S = 60.0


def burst(at: float, count: int = 20, isl: int = 1000, osl: int = 50, spacing: float = 0.05) -> list[TraceRequest]:
    return [TraceRequest(at + spacing * n, isl, osl) for n in range(count)]


class Wake:
    """Asks for one of each while anything is held, else the sizes it is given (zero by default)."""

    def __init__(self, otherwise: Desired | None = None) -> None:
        self.otherwise = otherwise or Desired(0, 0)
        self.seen: list[Observation] = []

    def desired_sizes(self, observation: Observation) -> Desired:
        self.seen.append(observation)
        return Desired(1, 1) if observation.held_requests > 0 else self.otherwise


def config(**fields: object) -> SimConfig:
    base: dict[str, object] = {"prefill": 0, "decode": 0, "min_replicas": 0, "startup_delay_s": STARTUP_S,
                               "interval_s": 30.0, "slo": Slo(ttft_s=0.5, tpot_s=0.05)}
    return SimConfig(**{**base, **fields})  # type: ignore[arg-type]


def test_a_pool_at_zero_holds_requests_and_serves_them_once_a_pair_starts() -> None:
    policy = Wake(Desired(1, 1))
    result = Simulator(burst(5.0), real_perf(), policy, config(signal_delay_s=1.0)).run()
    assert all(result.held) and result.dropped == {"overflow": 0, "expired": 0}
    # The signal decided at 6 s (the first request at 5 s plus the 1 s delay), not at the 30 s tick.
    assert result.decisions[0].time_s == pytest.approx(6.0) and result.decisions[0].prefill == 1
    assert policy.seen[0].held_requests == 20 and policy.seen[0].held_prompt_tokens == 20 * 1000
    served = 6.0 + STARTUP_S
    assert min(result.ttft_s) >= served - 5.0 - 0.05 * 19 and max(result.ttft_s) < served + 5.0
    assert all(math.isfinite(t) for t in result.e2e_s)


def test_without_the_signal_the_pool_waits_for_the_tick() -> None:
    result = Simulator(burst(5.0), real_perf(), Wake(Desired(1, 1)), config()).run()
    assert result.decisions[0].time_s == pytest.approx(30.0)
    assert min(result.ttft_s) >= 30.0 + STARTUP_S - 6.0


def test_held_requests_time_out_and_a_full_room_drops_them() -> None:
    expired = Simulator(burst(5.0), real_perf(), Wake(), config(wait_timeout_s=20.0, signal_delay_s=1.0)).run()
    assert expired.dropped == {"overflow": 0, "expired": 20}
    assert all(math.isnan(t) for t in expired.ttft_s) and expired.decisions[-1].time_s >= 5.0
    room = config(wait_max_requests=8, signal_delay_s=1.0)
    full = Simulator(burst(5.0), real_perf(), Wake(Desired(1, 1)), room).run()
    assert full.dropped == {"overflow": 12, "expired": 0}
    assert sum(math.isfinite(t) for t in full.ttft_s) == 8
    report = build_report(full)["held"]
    assert (report["requests"], report["overflow"], report["served"]) == (20, 12, 0.4)


def test_the_pool_still_needs_a_pair_when_one_role_is_up() -> None:
    """Prefill alone is no pair: held requests wait for decode too (the real proxy's rule)."""
    policy = Recorder([(0.0, Desired(1, 0)), (100.0, Desired(1, 1))])
    result = Simulator(burst(5.0), real_perf(), policy, config(interval_s=10.0)).run()
    assert min(t + a for t, a in zip(result.ttft_s, result.arrival_s, strict=True)) >= 100.0 + STARTUP_S


def test_min_replicas_one_is_unchanged() -> None:
    """The default config never holds: the same replay as before (the golden replays pin it too)."""
    with pytest.raises(ValueError, match="at least 1"):
        SimConfig(prefill=0, decode=1)
    result = Simulator(burst(5.0), real_perf(), Recorder([(0.0, Desired(1, 1))]), SimConfig()).run()
    assert not any(result.held) and result.dropped == {"overflow": 0, "expired": 0}


def test_decide_takes_an_idle_pool_to_zero_and_wakes_it_for_the_next_burst() -> None:
    """`decide()` with a 300 s idle window over two bursts 1,800 s apart: to zero in the gap, the
    second burst held and served after the start-up, and fewer GPU-seconds than at minReplicas 1."""
    trace = burst(0.0, count=200, spacing=0.5) + burst(1800.0, count=200, spacing=0.5)
    zero = simulate_policy("xpyd", trace, real_perf(), config(prefill=1, decode=1, signal_delay_s=1.0,
                                                              wait_timeout_s=2 * STARTUP_S + 60), idle_s=300.0)
    one = simulate_policy("xpyd", trace, real_perf(), SimConfig(startup_delay_s=STARTUP_S, interval_s=30.0,
                                                                slo=Slo(ttft_s=0.5, tpot_s=0.05)))
    at_zero = [d for d in zero.decisions if (d.prefill, d.decode) == (0, 0)]
    assert at_zero and 100.0 + 300.0 <= at_zero[0].time_s <= 100.0 + 300.0 + 60.0 + 2 * 30.0
    assert not any(zero.held[:200]) and zero.held[200]  # the first burst found the pool up, the second at zero
    assert all(math.isfinite(t) for t in zero.ttft_s) and zero.dropped == {"overflow": 0, "expired": 0}
    woken = next(d for d in zero.decisions if d.time_s > 1800.0)
    assert woken.time_s == pytest.approx(1801.0) and (woken.prefill, woken.decode) >= (1, 1)
    assert sum(zero.gpu_seconds.values()) < sum(one.gpu_seconds.values()) - 1000.0
    report = build_report(zero)["held"]
    assert report["requests"] >= 100 and report["served"] == 1.0


def test_the_policy_adapter_opts_in() -> None:
    context = PolicyContext(initial=Desired(1, 1), slo=Slo(), perf=real_perf(), interval_s=30.0,
                            startup_delay_s=STARTUP_S, idle_s=120.0)
    policy = XpydPolicy(xpyd_config(context))
    assert policy.config.idle_s == 120.0 and policy.config.prefill.min_replicas == 0
    assert xpyd_config(PolicyContext(initial=Desired(1, 1), slo=Slo(), perf=real_perf(), interval_s=30.0,
                                     startup_delay_s=STARTUP_S)).prefill.min_replicas == 1
    with pytest.raises(ValueError, match="min_replicas 0"):
        simulate_policy("xpyd", burst(0.0), real_perf(), SimConfig(), idle_s=60.0)
