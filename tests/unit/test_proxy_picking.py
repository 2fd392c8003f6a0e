"""Routing policies, instance eligibility, the circuit breaker, metrics exposition, Kubernetes
pod endpoints and P2pNccl registrations: the proxy's pure parts."""

from __future__ import annotations

import datetime
import json
import random
from collections import Counter
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest

from xpyd.api.models import RoutingPolicy
from xpyd.common import exposition
from xpyd.kube.pods import pod_ready
from xpyd.proxy.breaker import Breaker, BreakerState
from xpyd.proxy.discovery import pod_endpoints
from xpyd.proxy.metrics import Counter as MetricCounter
from xpyd.proxy.metrics import Gauge, Histogram
from xpyd.proxy.p2pnccl import EXPIRY_SECONDS, RegistrationTable
from xpyd.proxy.picking import pick
from xpyd.proxy.pool import Endpoint, Pool
from xpyd.proxy.server import Proxy, ProxyConfig

pytestmark = pytest.mark.unit

LEAST, TWO, ROUND = RoutingPolicy.LEAST_LOADED, RoutingPolicy.POWER_OF_TWO, RoutingPolicy.ROUND_ROBIN


def _pick_many(policy: RoutingPolicy, loads: dict[str, float], times: int = 2000, seed: int = 1) -> Counter[str]:
    rng = random.Random(seed)
    names = list(loads)
    return Counter(pick(policy, names, load=loads.__getitem__, name=str, rng=rng, turn=turn)
                   for turn in range(times))


@pytest.mark.parametrize(("policy", "loads", "allowed"), [
    (LEAST, {"a": 3, "b": 1, "c": 2}, {"b"}),
    (LEAST, {"a": 0, "b": 0, "c": 5}, {"a", "b"}),
    (LEAST, {"only": 9}, {"only"}),
    (TWO, {"a": 0, "b": 100}, {"a"}),                 # of two, the less loaded: b never wins
    (TWO, {"a": 0, "b": 1, "c": 100}, {"a", "b"}),    # the most loaded of three never wins
    (ROUND, {"a": 0, "b": 100, "c": 0}, {"a", "b", "c"}),
])
def test_policies_pick_only_what_they_may(policy: RoutingPolicy, loads: dict[str, float], allowed: set[str]) -> None:
    assert set(_pick_many(policy, loads)) == allowed


def test_least_loaded_breaks_ties_uniformly() -> None:
    counts = _pick_many(LEAST, {"a": 1, "b": 1, "c": 1, "d": 2}, times=4000)
    assert set(counts) == {"a", "b", "c"}
    assert all(1100 < counts[name] < 1560 for name in "abc"), counts


def test_round_robin_cycles_in_name_order() -> None:
    rng = random.Random(0)
    picked = [pick(ROUND, ["c", "a", "b"], load=lambda _: 0.0, name=str, rng=rng, turn=t) for t in range(6)]
    assert picked == ["a", "b", "c", "a", "b", "c"]


def test_power_of_two_prefers_light_instances() -> None:
    counts = _pick_many(TWO, {"a": 0, "b": 1, "c": 2, "d": 3}, times=6000)
    assert counts["a"] > counts["b"] > counts["c"] and "d" not in counts


def test_pick_refuses_no_candidates() -> None:
    with pytest.raises(ValueError, match="no candidates"):
        pick(LEAST, [], load=lambda _: 0.0, name=str, rng=random.Random(), turn=0)


# -- the pool ----------------------------------------------------------------------------------


def _pool(role: Any = "decode", urls: tuple[str, ...] = ("http://a", "http://b")) -> Pool:
    pool = Pool(role, LEAST, random.Random(0))
    for instance in pool.update([Endpoint(url) for url in urls], 0.0, 0.0):
        instance.healthy = True
    return pool


def test_prefill_load_is_prompt_tokens_and_decode_load_is_requests() -> None:
    prefill = _pool("prefill")
    prefill.instances["http://a"].acquire(tokens=1000)
    prefill.instances["http://b"].acquire(tokens=10)
    prefill.instances["http://b"].acquire(tokens=10)
    assert prefill.pick(0.0).url == "http://b"      # fewer tokens, more requests
    decode = _pool("decode")
    decode.instances["http://a"].acquire(tokens=1000)
    decode.instances["http://b"].acquire()
    decode.instances["http://b"].acquire()
    assert decode.pick(0.0).url == "http://a"       # fewer requests


@pytest.mark.parametrize(("change", "eligible"), [
    (lambda i: None, True),
    (lambda i: setattr(i, "healthy", None), False),    # never probed
    (lambda i: setattr(i, "healthy", False), False),   # /health answered 503 (loading) or nothing
    (lambda i: setattr(i, "ready", False), False),     # pod NotReady
    (lambda i: setattr(i, "listed", False), False),    # gone from discovery
    (lambda i: [i.breaker.failure(0.0) for _ in range(3)], False),
])
def test_eligibility(change: Any, eligible: bool) -> None:
    pool = _pool(urls=("http://a",))
    change(pool.instances["http://a"])
    assert (pool.pick(0.0) is not None) == eligible


def test_an_unlisted_instance_stays_until_its_last_leg_ends() -> None:
    pool = _pool()
    busy = pool.instances["http://a"]
    busy.acquire()
    added = pool.update([Endpoint("http://b"), Endpoint("http://c")], 0.0, 0.0)
    assert [i.url for i in added] == ["http://c"]
    assert set(pool.instances) == {"http://a", "http://b", "http://c"}
    assert pool.pick(0.0, exclude={"http://b", "http://c"}) is None   # a gets nothing new
    busy.release()
    pool.forget_if_done(busy)
    assert set(pool.instances) == {"http://b", "http://c"}
    assert pool.counts() == {"eligible": 1, "unhealthy": 1, "open": 0, "not_ready": 0, "terminating": 0}


POD = Endpoint("http://a", ready=True, checked=True)
NOT_READY = Endpoint("http://a", ready=False, checked=True)


@pytest.mark.parametrize(("history", "healthy", "probed"), [
    ([POD], True, True),                                 # appears Ready: healthy at once, and probed
    ([NOT_READY], None, True),                           # appears NotReady: waits for its probe
    ([NOT_READY, POD], True, True),                      # turns Ready: healthy at once, probed again
    ([POD, POD], False, False),                          # still Ready: the proxy's failed probe stands
    ([Endpoint("http://a")], None, True),                # a fixed URL vouches for nothing
    ([Endpoint("http://a"), Endpoint("http://a")], False, False),
])
def test_a_pods_readiness_is_evidence_of_health(history: list[Endpoint], healthy: bool | None,
                                                  probed: bool) -> None:
    pool = Pool("prefill", LEAST, random.Random(0))
    for endpoint in history[:-1]:
        for instance in pool.update([endpoint], 0.0, 0.0):
            instance.healthy = False               # its probe failed (nothing listened yet)
    to_probe = pool.update(history[-1:], 0.0, 0.0)
    instance = pool.instances["http://a"]
    assert instance.healthy == healthy
    assert (to_probe == [instance]) == probed


def test_readiness_evidence_overrides_a_failed_probe_and_restarts_learning() -> None:
    pool = Pool("prefill", LEAST, random.Random(0))
    pool.update([NOT_READY], 0.0, 0.0)
    instance = pool.instances["http://a"]
    instance.healthy = False
    instance.mooncake_engines = {0: "old"}
    assert pool.pick(0.0) is None
    evidence = instance.evidence
    assert pool.update([POD], 0.0, 0.0) == [instance]
    assert pool.pick(0.0) is instance and instance.mooncake_engines is None and instance.evidence == evidence + 1


@pytest.mark.parametrize(("others", "timeout_at", "now", "answered", "picked"), [
    ([], None, 0.0, None, "http://old"),                  # the only instance: fallback
    ([], None, 3.9, None, "http://old"),                  # within fallback_seconds (4) of its termination
    ([], None, 4.0, None, None),                          # past them: its engine may have stopped taking requests
    ([], None, 6.0, 2.5, "http://old"),                   # ... counted from the end of its last answer
    ([], None, 6.5, 2.5, None),
    ([], 1000.0 + 3.5, 2.4, 2.0, "http://old"),           # its drain's timeout (wall clock) less a second
    ([], 1000.0 + 3.5, 2.5, 2.0, None),
    ([], 1000.0 - 20, 0.0, None, None),                   # a grace period too short for any drain
    ([Endpoint("http://new", checked=True)], None, 0.0, None, "http://new"),        # a ready replacement wins
    ([Endpoint("http://new", ready=False, checked=True)], None, 0.0, None, "http://old"),  # not ready yet
])
def test_a_terminating_instance_is_a_fallback(others: list[Endpoint], timeout_at: float | None, now: float,
                                              answered: float | None, picked: str | None) -> None:
    pool = Pool("decode", LEAST, random.Random(0))
    old = Endpoint("http://old", ready=True, checked=True)
    pool.update([old, *others], 0.0, 1000.0)
    pool.update([Endpoint("http://old", ready=True, checked=True, terminating=True, drain_timeout_at=timeout_at),
                 *others], 0.0, 1000.0)
    if answered is not None:
        pool.instances["http://old"].answered(answered)
    assert pool.fallback_seconds == 4.0
    chosen = pool.pick(now)
    assert (chosen.url if chosen else None) == picked
    assert pool.counts()["terminating"] == 1


def test_a_terminating_instance_is_no_fallback_when_it_does_not_serve() -> None:
    pool = Pool("decode", LEAST, random.Random(0))
    pool.update([Endpoint("http://old", ready=True, checked=True, terminating=True)], 0.0, 0.0)
    pool.instances["http://old"].healthy = False          # its probe failed
    assert pool.pick(0.0) is None
    pool.update([Endpoint("http://old", ready=False, checked=True, terminating=True)], 0.0, 0.0)
    assert pool.pick(0.0) is None and pool.counts()["not_ready"] == 1


# -- the circuit breaker ------------------------------------------------------------------------


def test_breaker_opens_after_consecutive_failures_and_recovers_by_probe() -> None:
    breaker = Breaker(threshold=3, base_cooldown=2.0, max_cooldown=5.0)
    assert [breaker.failure(0.0) for _ in range(2)] == [False, False]
    breaker.success()                                  # not consecutive: reset
    assert [breaker.failure(t) for t in (1.0, 1.0, 1.0)] == [False, False, True]
    assert (breaker.allows(), breaker.state(2.0)) == (False, BreakerState.OPEN)
    breaker.probe(True, 2.0)                           # before the cooldown: ignored
    assert breaker.state(2.0) == BreakerState.OPEN
    assert breaker.state(3.0) == BreakerState.HALF_OPEN
    breaker.probe(False, 3.0)                          # failed recovery probe: doubled cooldown
    assert (breaker.state(6.9), breaker.state(7.0)) == (BreakerState.OPEN, BreakerState.HALF_OPEN)
    breaker.probe(False, 7.0)
    assert breaker.cooldown == 5.0                     # capped
    breaker.probe(True, 12.0)
    assert (breaker.allows(), breaker.state(12.0), breaker.failures) == (True, BreakerState.CLOSED, 0)


# -- metrics exposition -------------------------------------------------------------------------


def test_exposition_format() -> None:
    requests = MetricCounter("x_requests_total", "Requests.", ("outcome",))
    requests.inc("success")
    requests.inc("success", amount=2)
    latency = Histogram("x_seconds", "Latency.", ("role",), buckets=(0.1, 1.0))
    latency.observe(0.05, "p")
    latency.observe(0.5, "p")
    latency.observe(5.0, "p")
    gauge = Gauge("x_in_flight", "In flight.", ("upstream",), lambda: [(('http://a"b',), 2.0)])
    # prometheus_client's text format 0.0.4: sorted label names, Go float numbers, no `_created`.
    assert generate_latest(exposition.registry([requests, latency, gauge])).decode().splitlines() == [
        "# HELP x_requests_total Requests.", "# TYPE x_requests_total counter",
        'x_requests_total{outcome="success"} 3.0',
        "# HELP x_seconds Latency.", "# TYPE x_seconds histogram",
        'x_seconds_bucket{le="0.1",role="p"} 1.0', 'x_seconds_bucket{le="1.0",role="p"} 2.0',
        'x_seconds_bucket{le="+Inf",role="p"} 3.0', 'x_seconds_count{role="p"} 3.0', 'x_seconds_sum{role="p"} 5.55',
        "# HELP x_in_flight In flight.", "# TYPE x_in_flight gauge", 'x_in_flight{upstream="http://a\\"b"} 2.0']
    assert latency.count("p") == 3 and requests.value("success") == 3
    assert latency.count("q") == 0 and requests.value("failure") == 0


def test_each_proxy_has_a_registry_of_its_own() -> None:
    first, second = Proxy(ProxyConfig()), Proxy(ProxyConfig())     # no clash of names between them
    first.metrics.requests.inc("NixlConnector", "completions", "success")
    labels = {"connector": "NixlConnector", "endpoint": "completions", "outcome": "success"}
    assert first.registry.get_sample_value("xpyd_proxy_requests_total", labels) == 1
    assert second.registry.get_sample_value("xpyd_proxy_requests_total", labels) is None
    assert REGISTRY.get_sample_value("xpyd_proxy_requests_total", labels) is None  # the global one stays empty


# -- Kubernetes pods ------------------------------------------------------------------------------


#: The drain timeout of _pod's deleting pods: 30 s (the engines' shutdown margin) before their deletionTimestamp.
DRAIN_TIMEOUT_AT = datetime.datetime(2026, 1, 1, 0, 1, tzinfo=datetime.UTC).timestamp()


def _pod(name: str, ip: str | None, ready: bool = True, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"xpyd.io/role": "decode"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:01:30Z"
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_pod_endpoints() -> None:
    pods = [_pod("a", "10.0.0.1"), _pod("b", None), _pod("c", "10.0.0.3", ready=False),
            _pod("d", "10.0.0.4", deleting=True), _pod("e", "fd00::5")]
    assert pod_endpoints(pods, 8000) == [
        Endpoint("http://10.0.0.1:8000", ready=True, checked=True, name="a"),
        Endpoint("http://10.0.0.3:8000", ready=False, checked=True, name="c"),
        # Still Ready while it drains, which reaches its timeout 30 s before the deletionTimestamp.
        Endpoint("http://10.0.0.4:8000", ready=True, checked=True, terminating=True,
                 drain_timeout_at=DRAIN_TIMEOUT_AT, name="d"),
        Endpoint("http://[fd00::5]:8000", ready=True, checked=True, name="e")]
    assert not pod_ready({"metadata": {}, "status": {}})


@pytest.mark.parametrize("selector", ["a!=b", "xpyd.io/role in (decode)", "!a"])
def test_a_set_based_selector_is_left_to_the_server(selector: str) -> None:
    from xpyd.proxy.discovery import PodWatcher

    published: list[list[Endpoint]] = []
    kube = _ScriptedKube(_Streamed({"metadata": {"resourceVersion": "1"}, "items": [_pod("a", "10.0.0.1")]}))
    watcher = PodWatcher(kube, "ns", selector, 8000, published.append)  # type: ignore[arg-type]
    watcher.reflector.relist()
    assert published == [[Endpoint("http://10.0.0.1:8000", checked=True, name="a")]]  # not filtered again here
    assert kube.queries == [[("labelSelector", selector)]]


# -- P2pNccl registrations ------------------------------------------------------------------------


def test_registration_table() -> None:
    table = RegistrationTable()
    assert table.register({"type": "P", "http_address": "10.0.0.1:8000", "zmq_address": "10.0.0.1:14579"}, 0.0) \
        == "prefill"
    assert table.register({"type": "P", "http_address": "10.0.0.1:8000", "zmq_address": "10.0.0.1:14579"}, 3.0) \
        is None                                                    # a heartbeat: nothing changed
    assert table.register({b"type": b"D", b"http_address": b"10.0.0.2:8000", b"zmq_address": b"10.0.0.2:14579"},
                          3.0) == "decode"
    for junk in ({"type": "X", "http_address": "a", "zmq_address": "b"}, {"type": "P"}, [1], None):
        assert table.register(junk, 3.0) is None
    assert table.endpoints("prefill") == [Endpoint("http://10.0.0.1:8000", zmq_address="10.0.0.1:14579")]
    assert table.expire(3.0 + EXPIRY_SECONDS) == []
    assert table.expire(3.0 + EXPIRY_SECONDS + 0.1) == ["prefill", "decode"]
    assert table.endpoints("prefill") == table.endpoints("decode") == []


class _Streamed:
    """What `Kube.open` returns: a LIST's body, or a watch's stream of JSON lines."""

    def __init__(self, body: Any = None, events: list[Any] | None = None) -> None:
        self.body, self.events = body, events or []
        self.response = self

    def read(self) -> bytes:
        return json.dumps(self.body).encode()

    def stream(self, amt: Any = None, decode_content: bool = False) -> Any:
        return iter([json.dumps(event).encode() + b"\n" for event in self.events])

    def release_conn(self) -> None:
        pass


class _ScriptedKube:
    """A `Kube` whose every `open` answers the next scripted response."""

    def __init__(self, *responses: _Streamed) -> None:
        self.responses = list(responses)
        self.queries: list[list[tuple[str, str]]] = []

    def open(self, method: str, path: str, query: list[tuple[str, str]], timeout: Any) -> _Streamed:
        self.queries.append(query)
        return self.responses.pop(0)


def test_pod_watcher_applies_list_and_watch_events() -> None:
    from xpyd.proxy.discovery import PodWatcher

    ready_b = _pod("b", "10.0.0.2")
    ready_b["metadata"]["resourceVersion"] = "12"
    deleting_a = _pod("a", "10.0.0.1", deleting=True)
    deleting_a["metadata"]["resourceVersion"] = "14"
    events = [{"type": "ADDED", "object": ready_b},
              {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "13"}}},
              {"type": "MODIFIED", "object": deleting_a},
              {"type": "MODIFIED", "object": {**_pod("c", "10.0.0.3"), "metadata": {"name": "c", "labels": {}}}},
              {"type": "DELETED", "object": _pod("b", "10.0.0.2")}]
    kube = _ScriptedKube(_Streamed({"metadata": {"resourceVersion": "10"}, "items": [_pod("a", "10.0.0.1")]}),
                         _Streamed(events=events),
                         _Streamed(events=[{"type": "ERROR", "object": {"code": 410, "message": "too old"}}]))
    published: list[list[Endpoint]] = []
    watcher = PodWatcher(kube, "ns", "xpyd.io/role=decode", 8000, published.append)  # type: ignore[arg-type]
    assert watcher.reflector.relist() == "10"
    assert watcher.reflector._watch("10") == "14"
    a = Endpoint("http://10.0.0.1:8000", checked=True, name="a")
    b = Endpoint("http://10.0.0.2:8000", checked=True, name="b")
    deleting = Endpoint("http://10.0.0.1:8000", checked=True, terminating=True,
                        drain_timeout_at=DRAIN_TIMEOUT_AT, name="a")
    assert published == [[a], [a, b], [deleting, b], [deleting]]
    assert watcher.reflector._watch("14") == ""                  # 410 Gone: list again
    assert ("labelSelector", "xpyd.io/role=decode") in kube.queries[1]
    assert ("resourceVersion", "10") in kube.queries[1] and ("allowWatchBookmarks", "true") in kube.queries[1]


@pytest.mark.parametrize(("usable", "fallback", "missing"), [
    ((), False, ["prefill", "decode"]),
    (("prefill",), False, ["decode"]),
    (("decode",), False, ["prefill"]),
    (("prefill", "decode"), False, []),
    (("decode",), True, []),                 # --decode-only-fallback: decode alone answers
    ((), True, ["decode"]),
])
def test_readiness_needs_an_instance_of_every_role_a_request_needs(usable: tuple[str, ...], fallback: bool,
                                                                    missing: list[str]) -> None:
    proxy = Proxy(ProxyConfig(decode_only_fallback=fallback))
    for role, pool in proxy.pools.items():
        for instance in pool.update([Endpoint(f"http://{role}")], 0.0, 0.0):
            instance.healthy = role in usable
    assert proxy.missing_roles() == missing
