"""Scaling to zero and back, the pure cores: `decide()`'s wake-up rule (held requests at a pool that
cannot serve) and idle rule (idle window, at zero, arrivals nobody held), the held-requests condition
the proxies write and the operator reads, what the operator renders and validates, and the proxy's
waiting room on its own."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import pytest

from tests.unit.test_autoscaler_decide import CONFIG, observation, role, settled
from xpyd.api.conditions import IDLE_AT_ZERO, REQUESTS_WAITING_POD_CONDITION
from xpyd.api.load import SpecError, load_servings
from xpyd.api.models import AutoscalingSpec
from xpyd.api.waiting import Held, held_by_pod, held_condition, held_of
from xpyd.autoscaler.collect import held_requests
from xpyd.autoscaler.decide import (
    DEFAULT_WAKE_OSL,
    METRICS_UNAVAILABLE,
    SCALE_FROM_ZERO,
    SCALE_TO_ZERO,
    AutoscalerConfig,
    AutoscalerState,
    Pace,
    RoleBounds,
    decide,
    drain_budget_s,
    waking,
)
from xpyd.autoscaler.observation import Observation, RoleObservation
from xpyd.autoscaler.sizing import PromptMix
from xpyd.autoscaler.state import decode as decode_state
from xpyd.autoscaler.state import encode as encode_state
from xpyd.controller.watches import held_signal
from xpyd.proxy.waiting import WaitExpired, WaitingRoom, WaitingRoomFull
from xpyd.render.proxy import proxy_args

pytestmark = pytest.mark.unit

ZERO = AutoscalerConfig(model=CONFIG.model, prefill=RoleBounds(0, 8), decode=RoleBounds(0, 8), idle_s=300.0)
EMPTY = RoleObservation()


def at_zero(held: float = 0.0, tokens: float = 0.0, rate: float = 0.0, time_s: float = 600.0,
            **roles: RoleObservation) -> Observation:
    """A pool at zero: no pods, no engine metrics, what the proxies hold."""
    return Observation(time_s=time_s, window_s=60.0, request_rate=rate, held_requests=held,
                       held_prompt_tokens=tokens, prefill=roles.get("prefill", EMPTY),
                       decode=roles.get("decode", EMPTY))


def idle(prefill: int = 1, decode: int = 1, time_s: float = 600.0, **overrides: Any) -> Observation:
    """A serving pool with nothing arriving, running or waiting."""
    quiet = {"num_requests_running": 0.0, "num_requests_waiting": 0.0, "requests_per_s": 0.0,
             "prompt_tokens_per_s": 0.0, "generation_tokens_per_s": 0.0}
    base = observation(rate=0.0, prefill=prefill, decode=decode, time_s=time_s)
    return dataclasses.replace(base, **{"prefill": role(prefill, **quiet), "decode": role(decode, **quiet),
                                        **overrides})


# --- waking up: requests held at a pool that cannot serve ----------------------------------------------


def wake_sizes(held: float, isl: float, config: AutoscalerConfig = ZERO) -> tuple[int, int]:
    """What the wake-up rule should ask for, computed here from the model's own terms."""
    model = config.model
    per_replica = model.mix_tokens_per_s(PromptMix.from_quantiles(isl, None, config.default_isl_cs2))
    drain_s = drain_budget_s(config)
    decode = model.size_decode(held / drain_s, isl, DEFAULT_WAKE_OSL)
    step = config.scale_up.max_step  # from zero, at most one step up per decision
    return (min(step, max(1, math.ceil(held * isl / (per_replica * drain_s) - 1e-9))), min(step, decode.replicas))


@pytest.mark.parametrize(("held", "isl", "roles", "expected"), [
    # One request at zero: one of each, together.
    (1, 1000, {}, (1, 1)),
    # Bursts big enough to need more than one of decode as a backlog admitted within the horizon
    # (and, at long prompts, more prefill than one step up gives).
    (10000, 1000, {}, "model"),
    (20000, 8000, {}, "model"),
    # Replicas already starting (a second signal, more held): never fewer than in force.
    (1, 1000, {"prefill": RoleObservation(replicas=2, starting=2), "decode": RoleObservation(replicas=1, starting=1)},
     (2, 1)),
    # One role ready, the other still starting: still cold, still sized for what is held.
    (5, 1000, {"prefill": RoleObservation(replicas=1, ready=1), "decode": RoleObservation(replicas=1, starting=1)},
     (1, 1)),
])
def test_held_requests_at_a_cold_pool_bring_both_roles_up(held: float, isl: float, roles: dict[str, RoleObservation],
                                                          expected: Any) -> None:
    obs = at_zero(held=held, tokens=held * isl, **roles)
    assert waking(obs)
    decision = decide(obs, ZERO, AutoscalerState())
    want = wake_sizes(held, isl) if expected == "model" else expected
    assert (decision.prefill.replicas, decision.decode.replicas) == want
    assert decision.reason == SCALE_FROM_ZERO and decision.scaling_active
    assert f"{held:.0f} request(s) held" in decision.message
    if expected == "model":
        assert want[1] > 1  # the case is there to need more than one of decode
    if held == 20000:
        assert want == (4, 4)  # one step up (4) caps both
    grew = [name for name, d in (("prefill", decision.prefill), ("decode", decision.decode)) if d.replicas > d.current]
    for name in ("prefill", "decode"):  # a role that grew starts its grace period (no scale-down on its heels)
        assert (decision.state.role(name).last_scale_up_s == 600.0) == (name in grew)


def test_waking_needs_no_metrics_and_keeps_the_decision_clock() -> None:
    """At zero there are no engine metrics (an Observation from the pods alone: no window, no rate):
    the wake-up still decides, and leaves the metrics' decision time alone."""
    state = AutoscalerState(time_s=590.0)
    bare = Observation(time_s=600.0, window_s=0.0, request_rate=math.nan, held_requests=3, held_prompt_tokens=900)
    decision = decide(bare, ZERO, state)
    assert decision.reason == SCALE_FROM_ZERO and (decision.prefill.replicas, decision.decode.replicas) == (1, 1)
    assert decision.state.time_s == 590.0
    # Without anything held the same observation is a metrics problem: it holds (at zero).
    held_nothing = decide(Observation(time_s=600.0, window_s=0.0, request_rate=math.nan), ZERO, state)
    assert held_nothing.reason == METRICS_UNAVAILABLE
    assert (held_nothing.prefill.replicas, held_nothing.decode.replicas) == (0, 0)


@pytest.mark.parametrize(("config", "expected"), [
    (AutoscalerConfig(model=CONFIG.model, prefill=RoleBounds(0, 1), decode=RoleBounds(0, 2), idle_s=300.0), (1, 2)),
    (AutoscalerConfig(model=CONFIG.model, prefill=RoleBounds(0, 8), decode=RoleBounds(0, 8), idle_s=300.0,
                      scale_up=Pace(0.0, 2)), (2, 2)),
    (AutoscalerConfig(model=CONFIG.model, prefill=RoleBounds(0, 8), decode=RoleBounds(0, 8), idle_s=300.0,
                      gpu_budget=3), "budget"),
])
def test_the_wake_up_keeps_the_bounds_the_pace_and_the_budget(config: AutoscalerConfig, expected: Any) -> None:
    held, isl = 20000.0, 8000.0
    unbounded = wake_sizes(held, isl, AutoscalerConfig(model=CONFIG.model, scale_up=Pace(0.0, 64)))
    assert unbounded[0] > 2 and unbounded[1] > 2  # the burst needs more than any bound here allows
    decision = decide(at_zero(held=held, tokens=held * isl), config, AutoscalerState())
    sizes = (decision.prefill.replicas, decision.decode.replicas)
    if expected == "budget":
        assert sum(sizes) == 3 and min(sizes) >= 1
    else:
        assert sizes == expected


def test_a_pool_that_serves_is_not_woken() -> None:
    serving = idle(held_requests=4.0, held_prompt_tokens=4000.0)
    assert not waking(serving)
    assert decide(serving, ZERO, settled(1, 1)).reason != SCALE_FROM_ZERO


# --- going to zero: the idle window --------------------------------------------------------------------


def run(config: AutoscalerConfig, observations: list[Observation],
        state: AutoscalerState | None = None) -> list[tuple[str, int, int]]:
    state = state or settled(1, 1, now=observations[0].time_s - 30.0)
    out = []
    for obs in observations:
        decision = decide(obs, config, state)
        state = decision.state
        out.append((decision.reason, decision.prefill.replicas, decision.decode.replicas))
    return out


def test_an_idle_pool_goes_to_zero_only_after_the_idle_window() -> None:
    times = [600.0 + 30.0 * i for i in range(12)]
    decisions = run(ZERO, [idle(time_s=t) for t in times])
    zero_at = next(i for i, (reason, _, _) in enumerate(decisions) if reason == SCALE_TO_ZERO)
    assert times[zero_at] - times[0] >= ZERO.idle_s > times[zero_at - 1] - times[0]
    assert decisions[zero_at][1:] == (0, 0)
    assert all(p == d == 1 for _, p, d in decisions[:zero_at])


@pytest.mark.parametrize("busy", [
    {"rate": 0.2},                                                 # a request arrived within the window
    {"held_requests": 1.0, "held_prompt_tokens": 100.0},           # one is held (the pool is cold elsewhere)
    {"prefill": role(1, num_requests_running=0.0, num_requests_waiting=1.0)},   # one waits on an engine
    {"decode": role(1, num_requests_running=1.0)},                 # a long answer still streams
])
def test_any_work_restarts_the_idle_count(busy: dict[str, Any]) -> None:
    """Never to zero while anything arrives, is held, waits or runs: each restarts the count."""
    times = [600.0 + 30.0 * i for i in range(24)]
    observations = [idle(time_s=t) for t in times]
    observations[8] = dataclasses.replace(idle(time_s=times[8]), **busy) if "rate" not in busy \
        else observation(rate=busy["rate"], prefill=1, decode=1, time_s=times[8])
    decisions = run(ZERO, observations)
    zero_at = next(i for i, (reason, _, _) in enumerate(decisions) if reason == SCALE_TO_ZERO)
    assert times[zero_at] - times[9] >= ZERO.idle_s, decisions


def test_without_minreplicas_zero_nothing_goes_to_zero() -> None:
    bounded = AutoscalerConfig(model=CONFIG.model, prefill=RoleBounds(1, 8), decode=RoleBounds(1, 8))
    decisions = run(bounded, [idle(time_s=600.0 + 30.0 * i) for i in range(40)])
    assert all(reason != SCALE_TO_ZERO and p >= 1 and d >= 1 for reason, p, d in decisions)


def test_missing_metrics_never_take_a_pool_to_zero() -> None:
    stale = idle(time_s=600.0, window_s=0.0)  # no scrape in range
    state = settled(1, 1, now=570.0, )
    state = AutoscalerState(time_s=state.time_s, idle_since_s=0.0, prefill=state.prefill, decode=state.decode)
    decision = decide(stale, ZERO, state)
    assert decision.reason == METRICS_UNAVAILABLE and (decision.prefill.replicas, decision.decode.replicas) == (1, 1)


def test_the_idle_count_is_in_the_message_and_survives_a_restart() -> None:
    state = settled(1, 1, now=570.0)
    first = decide(idle(time_s=600.0), ZERO, state)
    second = decide(idle(time_s=720.0), ZERO, decode_state(encode_state(first.state)))
    assert first.state.idle_since_s == 600.0
    assert "idle 120s of the 300s before scaling to zero" in second.message


@pytest.mark.parametrize(("obs", "expected"), [
    (at_zero(), (IDLE_AT_ZERO, 0, 0)),                          # nothing: stays at zero
    (at_zero(rate=0.5), (SCALE_FROM_ZERO, 1, 1)),               # arrivals nobody held: back to one of each
])
def test_at_zero(obs: Observation, expected: tuple[str, int, int]) -> None:
    decision = decide(obs, ZERO, AutoscalerState(time_s=570.0))
    assert (decision.reason, decision.prefill.replicas, decision.decode.replicas) == expected
    assert decision.scaling_active


# --- the held-requests condition -------------------------------------------------------------------------


@pytest.mark.parametrize("held", [Held(), Held(1, 10, 3), Held(4096, 1 << 30, 10_000_000)])
def test_the_condition_round_trips(held: Held) -> None:
    condition = held_condition(held)
    assert condition["type"] == REQUESTS_WAITING_POD_CONDITION
    assert condition["status"] == ("True" if held.requests else "False")
    assert held_of(condition) == held


@pytest.mark.parametrize("condition", [
    None, {}, {"type": "Ready", "status": "True", "message": "requests=3 bytes=1 promptTokens=1"},
    {"type": REQUESTS_WAITING_POD_CONDITION, "status": "False", "message": "requests=3 bytes=1 promptTokens=1"},
    {"type": REQUESTS_WAITING_POD_CONDITION, "status": "True", "message": "three requests"},
    {"type": REQUESTS_WAITING_POD_CONDITION, "status": "True"},
])
def test_anything_else_holds_nothing(condition: Any) -> None:
    assert held_of(condition) == Held()


def _pod(role_name: str, held: Held | None, name: str = "p") -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True"}] + ([held_condition(held)] if held is not None else [])
    return {"metadata": {"name": name, "labels": {"xpyd.io/serving": "llama", "xpyd.io/role": role_name}},
            "status": {"conditions": conditions}}


def test_the_operator_sums_what_the_proxies_hold() -> None:
    pods = [_pod("proxy", Held(2, 100, 50), "a"), _pod("proxy", Held(3, 10, 5), "b"), _pod("proxy", None, "c"),
            _pod("prefill", Held(7, 7, 7), "e")]  # only proxies' conditions count
    assert held_requests(pods) == Held(5, 110, 55)
    assert held_by_pod(pods[0]) == Held(2, 100, 50)
    assert held_signal(pods[0]) == Held(2, 100, 50) and held_signal(pods[3]) == Held() and held_signal(None) == Held()


# --- the API and the rendered flags ----------------------------------------------------------------------


def _serving(autoscaling: str) -> str:
    return f"""
apiVersion: xpyd.io/v1alpha1
kind: DisaggregatedServing
metadata: {{name: llama}}
spec:
  model: {{name: meta-llama/Llama-3.1-8B-Instruct}}
  autoscaling: {autoscaling}
"""


ZERO_SPEC = ("{mode: Auto, prometheus: {url: 'http://p:9090'}, startupSeconds: 100, prefill: {minReplicas: 0}, "
             "decode: {minReplicas: 0}")


def test_a_pool_at_zero_renders_the_waiting_room() -> None:
    (serving,) = load_servings(_serving(ZERO_SPEC + ", scaleToZero: {maxWaitingRequests: 32}}"))
    args = proxy_args("llama", "ns", serving.spec)
    assert ["--wait-timeout=260", "--wait-max-requests=32", f"--wait-max-bytes={64 << 20}"] == \
        [a for a in args if a.startswith("--wait-")]
    (explicit,) = load_servings(_serving(ZERO_SPEC + ", scaleToZero: {waitSeconds: 150}}"))
    assert "--wait-timeout=150" in proxy_args("llama", "ns", explicit.spec)
    for other in ("{mode: Auto, prometheus: {url: 'http://p:9090'}}",
                  "{mode: Recommend, prometheus: {url: 'http://p:9090'}, prefill: {minReplicas: 0}, "
                  "decode: {minReplicas: 0}}"):
        (serving,) = load_servings(_serving(other))
        assert not [a for a in proxy_args("llama", "ns", serving.spec) if a.startswith("--wait-")]


@pytest.mark.parametrize(("autoscaling", "message"), [
    ("{prefill: {minReplicas: 0}}", "takes both roles"),
    ("{decode: {minReplicas: 0}}", "takes both roles"),
    ("{intervalSeconds: 60, scaleToZero: {idleSeconds: 30}}", "at least intervalSeconds"),
    ("{startupSeconds: 100, scaleToZero: {waitSeconds: 100}}", "must exceed startupSeconds"),
])
def test_the_api_refuses_what_cannot_work(autoscaling: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        load_servings(_serving(autoscaling))


def test_the_idle_window_reaches_the_decision_config() -> None:
    from tests.unit.test_autoscaler_decide import PERF
    spec = AutoscalingSpec.model_validate({"prefill": {"minReplicas": 0}, "decode": {"minReplicas": 0},
                                           "scaleToZero": {"idleSeconds": 900}})
    assert AutoscalerConfig.from_spec(spec, PERF).idle_s == 900.0
    assert AutoscalerConfig.from_spec(AutoscalingSpec(), PERF).idle_s is None
    assert spec.wait_seconds == 2 * spec.startup_seconds + 60 and not spec.scales_to_zero  # mode Off


# --- the proxy's waiting room on its own ------------------------------------------------------------------


class Switch:
    """A pool that cannot serve until switched on."""

    def __init__(self) -> None:
        self.on = False

    def __call__(self) -> bool:
        return self.on


async def test_held_requests_go_when_a_pair_exists_and_the_room_counts_them() -> None:
    room, pool = WaitingRoom(max_requests=3, max_bytes=100, timeout_s=5.0, poll_s=60.0), Switch()
    waiters = [asyncio.ensure_future(room.hold(10, 7, pool)) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert (room.requests, room.bytes, room.prompt_tokens) == (3, 30, 21) and room.changed.is_set()
    with pytest.raises(WaitingRoomFull, match="3 of 3 requests") as full:
        await room.hold(10, 7, pool)
    assert full.value.status == 429 and full.value.headers["Retry-After"] == "5"
    pool.on = True
    room.poke()  # discovery's event wakes them (the poll is a minute away)
    waited = await asyncio.wait_for(asyncio.gather(*waiters), 1.0)
    assert all(w > 0 for w in waited)   # held until the poke (wait_for's second bounds them)
    assert (room.requests, room.bytes, room.prompt_tokens) == (0, 0, 0)
    assert [room.outcomes.value(r) for r in ("held", "released", "overflow", "expired")] == [3, 3, 1, 0]
    assert await room.hold(10, 7, pool) == 0.0  # a pair exists: nothing is held
    assert room.outcomes.value("held") == 3


async def test_the_byte_bound_the_timeout_and_a_client_that_leaves() -> None:
    room, pool = WaitingRoom(max_requests=10, max_bytes=100, timeout_s=0.2, poll_s=0.05), Switch()
    with pytest.raises(WaitingRoomFull, match="bytes"):
        await room.hold(101, 1, pool)
    with pytest.raises(WaitExpired) as expired:
        await room.hold(50, 1, pool)
    assert expired.value.status == 503 and expired.value.headers["Retry-After"] == "30"
    leaving = asyncio.ensure_future(room.hold(60, 1, pool))
    await asyncio.sleep(0.02)
    assert room.bytes == 60
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert (room.requests, room.bytes) == (0, 0)
    assert [room.outcomes.value(r) for r in ("held", "overflow", "expired", "cancelled")] == [2, 1, 1, 1]


def test_the_room_refuses_bounds_that_cannot_work() -> None:
    with pytest.raises(ValueError):
        WaitingRoom(max_requests=0, max_bytes=1, timeout_s=1.0)
    assert not WaitingRoom(max_requests=1, max_bytes=1, timeout_s=0.0).enabled


# --- the operator: a wake-up from the proxies' pods, and the idle window's end -----------------------------


def _zero_body(**autoscaling: Any) -> dict[str, Any]:
    from tests.unit.test_autoscaler_operator import body
    obj = body(**autoscaling)
    obj["spec"]["autoscaling"]["prefill"]["minReplicas"] = 0
    obj["spec"]["autoscaling"]["decode"]["minReplicas"] = 0
    obj["spec"]["autoscaling"]["scaleToZero"] = {"idleSeconds": 60}
    return obj


def _proxy(held: Held | None, n: int = 0) -> dict[str, Any]:
    found = _pod("proxy", held, f"llama-proxy-{n}")
    found["metadata"]["namespace"] = "team-a"
    return found


def test_a_wake_up_decides_from_the_pods_alone_and_brings_both_roles_up() -> None:
    from tests.unit.test_autoscaler_operator import FakeKube, FakePrometheus, autoscaler
    kube = FakeKube([_proxy(Held(5, 500, 5000)), _proxy(Held(1, 100, 1000), 1)])
    prometheus = FakePrometheus(None)  # unreachable: the wake-up does not need it
    obj = _zero_body()
    obj["status"].update(prefill={"desiredReplicas": 0}, decode={"desiredReplicas": 0})
    assert autoscaler(kube, prometheus, [1000.0]).step(obj, wake=True) is True
    assert prometheus.scopes == []
    (patch,) = kube.status_patches
    assert (patch["prefill"], patch["decode"]) == ({"desiredReplicas": 1}, {"desiredReplicas": 1})
    assert patch["autoscaler"]["lastDecision"]["reason"] == SCALE_FROM_ZERO
    assert patch["autoscaler"]["observed"]["heldRequests"] == 6
    assert [(t, r) for t, r, _ in kube.events] == [("Normal", SCALE_FROM_ZERO)]
    assert kube.events[0][2].startswith("prefill 0->1, decode 0->1: 6 request(s) held by the proxies")


def test_a_wake_up_leaves_a_pool_that_serves_to_the_regular_decisions() -> None:
    from tests.unit.test_autoscaler_operator import PODS, FakeKube, FakePrometheus, autoscaler
    kube = FakeKube([*PODS, _proxy(Held(2, 10, 10))])  # held, but a pair is ready: about to be released
    assert autoscaler(kube, FakePrometheus(None), [1000.0]).step(_zero_body(), wake=True) is False
    assert kube.status_patches == [] and kube.events == []


def test_the_operator_takes_an_idle_pool_to_zero_and_says_so() -> None:
    from tests.unit.test_autoscaler_operator import PODS, FakeKube, FakePrometheus, autoscaler, body
    quiet = {"up": {"prefill": 1, "decode": 2}, "age": {"prefill": 3, "decode": 3}, "proxy_up": {"": 1},
             "proxy_rps": {"": 0.0}}
    kube, now = FakeKube([*PODS, _proxy(Held())]), [1000.0]
    scaler = autoscaler(kube, FakePrometheus(quiet), now)
    obj = _zero_body(intervalSeconds=30)
    actuated = []
    for _ in range(3):  # decisions 30 s apart: idle from the first, for 60 s at the third
        actuated.append(scaler.step(obj))
        obj["status"] = {**obj["status"], **kube.status_patches[-1]}
        now[0] += 30.0
    reasons = [p["autoscaler"]["lastDecision"]["reason"] for p in kube.status_patches]
    assert reasons[-1] == SCALE_TO_ZERO and actuated == [False, False, True]
    assert (obj["status"]["prefill"]["desiredReplicas"], obj["status"]["decode"]["desiredReplicas"]) == (0, 0)
    (event,) = [e for e in kube.events if e[1] == SCALE_TO_ZERO]
    assert event[2].startswith("prefill 1->0, decode 2->0: idle for 60s (at least 60s)"), event
    kube.pods = [_proxy(Held())]  # the engine pods gone: at zero it stays, and says so
    assert scaler.step(obj) is False
    assert kube.status_patches[-1]["autoscaler"]["lastDecision"]["reason"] == IDLE_AT_ZERO
    assert len(kube.events) == 1
    # The reconcile applies the zero, and the pool reads Ready (IdleAtZero) while its proxies are.
    from xpyd.api.load import parse_serving
    from xpyd.controller.reconcile import desired_replicas
    from xpyd.controller.status import Observed, compute_status
    serving = parse_serving(obj)
    desired = desired_replicas(serving)
    assert (desired["prefill"], desired["decode"]) == (0, 0)
    proxy = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": 2,
                                                       "updatedReplicas": 2}}
    status = compute_status(serving.spec, Observed(workloads={"proxy": proxy}, desired=desired), obj["status"], 3,
                            "http://x", "RDMA", "2026-12-01T00:01:00Z")
    (ready,) = [c for c in status["conditions"] if c["type"] == "Ready"]
    assert (ready["status"], ready["reason"]) == ("True", "IdleAtZero")
    assert "hold requests for up to 300 s" in ready["message"]
    # Not so for a pool without minReplicas 0, whose zero the user asked for by hand.
    manual = parse_serving({**body(mode="Off"), "spec": {**body()["spec"], "prefill": {"replicas": 0},
                                                         "decode": {"replicas": 0}}})
    status = compute_status(manual.spec, Observed(workloads={"proxy": proxy}, desired=desired_replicas(manual)),
                            {}, 3, "http://x", "RDMA", "2026-12-01T00:01:00Z")
    (ready,) = [c for c in status["conditions"] if c["type"] == "Ready"]
    assert ready["reason"] != "IdleAtZero"


def test_a_proxy_pod_reporting_held_requests_starts_a_decision_at_once() -> None:
    import time
    from typing import cast

    from tests.unit.test_autoscaler_operator import FakeKube, FakePrometheus, autoscaler
    from xpyd.controller.runtime import OperatorRuntime
    from xpyd.controller.watches import cache_kinds
    from xpyd.kube import Kube

    obj = _zero_body()
    obj["status"].update(prefill={"desiredReplicas": 0}, decode={"desiredReplicas": 0})
    before, after = _proxy(Held()), _proxy(Held(3, 30, 300))
    kube = FakeKube([after])
    kube.objects["DisaggregatedServing"] = {"llama": obj}
    state = OperatorRuntime(kube=cast(Kube, kube), operator_image="x", resync_seconds=60, namespaces=[],
                            autoscaler=autoscaler(kube, FakePrometheus(None), [1000.0]))
    (pods,) = [kind for kind in cache_kinds() if kind.kind == "Pod"]
    state.changed(pods, before, before)   # nothing held: nothing to decide
    assert state.wakes == 0
    state.changed(pods, before, after)    # three held: a decision starts now, not at the loop's tick
    assert state.wakes == 1
    deadline = time.monotonic() + 10
    while (not kube.status_patches or state._deciding) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kube.status_patches[0]["autoscaler"]["lastDecision"]["reason"] == SCALE_FROM_ZERO
    assert len(state.queue) == 1  # the reconcile that applies it, queued
    state.changed(pods, after, after)     # the same report again: no second wake-up
    assert state.wakes == 1
    state.stop()


@pytest.mark.parametrize(("woken_ago", "learnt"), [
    (math.inf, True),      # never woken: a burst as usual
    (100.0, False),        # the window holds the release of the requests held while the pool started
    (CONFIG.startup_s + 60.0 + 2 * CONFIG.interval_s, True),  # long after: bursts count again
])
def test_the_release_after_a_start_from_zero_teaches_no_burst(woken_ago: float, learnt: bool) -> None:
    from tests.unit.test_autoscaler_decide import bursty
    state = dataclasses.replace(settled(2, 3), woken_s=600.0 - woken_ago)
    assert bool(decide(bursty(), CONFIG, state).state.prefill.bursts) == learnt


def test_a_wake_up_that_changes_nothing_writes_nothing() -> None:
    """The proxies report held requests up to twice a second while they pile up: a wake-up that
    orders nothing new (the replicas already starting) writes no status and no Event."""
    from tests.unit.test_autoscaler_operator import FakeKube, FakePrometheus, autoscaler
    kube, now = FakeKube([_proxy(Held(2, 20, 200))]), [1000.0]
    scaler = autoscaler(kube, FakePrometheus(None), now)
    obj = _zero_body()
    obj["status"].update(prefill={"desiredReplicas": 0}, decode={"desiredReplicas": 0})
    assert scaler.step(obj, wake=True) is True
    obj["status"] = {**obj["status"], **kube.status_patches[-1]}
    starting = {"metadata": {"name": "p", "labels": {"xpyd.io/serving": "llama", "xpyd.io/role": "prefill"}},
                "spec": {"nodeName": "gpu-0"}, "status": {"phase": "Pending", "conditions": [
                    {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "False"}]}}
    decoding = {**starting, "metadata": {"name": "d", "labels": {"xpyd.io/serving": "llama", "xpyd.io/role": "decode"}}}
    kube.pods = [_proxy(Held(9, 90, 900)), starting, decoding]
    now[0] += 1.0
    assert scaler.step(obj, wake=True) is False
    assert len(kube.status_patches) == 1 and len(kube.events) == 1


@pytest.mark.parametrize(("decided", "ready", "expected"), [
    ("ScaleFromZero", {"prefill": 0, "decode": 0}, ("True", "StartingFromZero")),   # requests held meanwhile
    ("ScaleFromZero", {"prefill": 1, "decode": 0}, ("True", "StartingFromZero")),
    ("ScaleFromZero", {"prefill": 1, "decode": 1}, ("True", "AllReplicasReady")),
    ("PrefillDemand", {"prefill": 0, "decode": 1}, ("False", "PrefillUnavailable")),  # not a start from zero
    ("IdleAtZero", "no proxy", ("False", "ProxyUnavailable")),   # at zero only the proxies must be up
])
def test_a_pool_starting_from_zero_is_ready_while_its_proxies_hold(decided: str, ready: Any,
                                                                    expected: tuple[str, str]) -> None:
    from xpyd.api.load import parse_serving
    from xpyd.controller.status import Observed, compute_status

    obj = _zero_body()
    serving = parse_serving(obj)

    def deployment(replicas: int, ready_replicas: int) -> dict[str, Any]:
        return {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "replicas": replicas,
                                                          "readyReplicas": ready_replicas,
                                                          "updatedReplicas": replicas}}

    if ready == "no proxy":  # a pool created at zero, its proxy not ready yet
        deployments = {"prefill": deployment(0, 0), "decode": deployment(0, 0), "proxy": deployment(2, 0)}
        desired = {"prefill": 0, "decode": 0, "proxy": 2}
    else:
        deployments = {"prefill": deployment(1, ready["prefill"]), "decode": deployment(1, ready["decode"]),
                       "proxy": deployment(2, 2)}
        desired = {"prefill": 1, "decode": 1, "proxy": 2}
    old = {"autoscaler": {"lastDecision": {"reason": decided}}}
    status = compute_status(serving.spec, Observed(workloads=deployments, desired=desired),
                            old, 3, "http://x", "RDMA", "2026-12-01T00:01:00Z")
    (found,) = [c for c in status["conditions"] if c["type"] == "Ready"]
    assert (found["status"], found["reason"]) == expected


@pytest.mark.parametrize(("argv", "problem"), [
    ((), None),
    (("--wait-timeout", "260", "--wait-max-requests", "32", "--wait-max-bytes", "1024"), None),
    (("--wait-timeout", "-1"), "--wait-timeout"),
    (("--wait-timeout", "nan"), "--wait-timeout"),
    (("--wait-timeout", "86401"), "--wait-timeout"),
    (("--wait-max-requests", "0"), "--wait-max-requests"),
    (("--wait-max-bytes", "0"), "--wait-max-bytes"),
])
def test_the_room_s_flags_are_bounded(argv: tuple[str, ...], problem: str | None) -> None:
    from tests.unit.test_proxy_lifecycle import _parse
    from xpyd.proxy.main import _check, config_from_args
    args = _parse(*argv)
    message = _check(args)
    assert (message is None) if problem is None else (message is not None and problem in message)
    if problem is None:
        config = config_from_args(args)
        assert (config.wait_timeout, config.wait_max_requests, config.wait_max_bytes) == \
            ((260.0, 32, 1024) if argv else (0.0, 256, 64 << 20))


def test_waking_under_a_binding_gpu_budget_makes_room_for_the_role_without_replicas() -> None:
    """Prefill holds the whole budget while decode has nothing: held requests need both, so prefill
    gives one back for decode's first replica (the one way rule 0 scales a role down)."""
    config = dataclasses.replace(CONFIG, gpu_budget=3)
    observed = dataclasses.replace(observation(prefill=3, decode=0), held_requests=40.0,
                                   held_prompt_tokens=40_000.0, decode=RoleObservation(replicas=0, ready=0))
    decision = decide(observed, config, AutoscalerState())
    assert decision.reason == SCALE_FROM_ZERO
    assert (decision.prefill.replicas, decision.decode.replicas) == (2, 1)
