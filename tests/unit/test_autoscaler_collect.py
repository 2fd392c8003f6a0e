"""The autoscaler's collector: PromQL per signal, answers -> Observation, pods by state, the
Prometheus client's error handling."""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import json
import math
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import urllib3

from xpyd.autoscaler import collect
from xpyd.autoscaler.collect import (
    Access,
    MetricsError,
    PodCounts,
    Prometheus,
    Scope,
    count_pods,
    gauge_queries,
    gauges,
    observation,
    parse_result,
    parse_vector,
)
from xpyd.autoscaler.observation import Quantiles
from xpyd.cluster import pki
from xpyd.cluster.controlplane import free_port
from xpyd.common.netguard import LOOPBACK_ONLY_ENV

pytestmark = pytest.mark.unit

SCOPE = Scope("team-a", "llama", 60)
SELECT = 'namespace="team-a",xpyd_io_serving="llama"'


def pod(role: str, *, ready: bool = False, scheduled: bool = True, deleting: bool = False,
        phase: str = "Running", ready_since: str = "2026-12-01T00:00:00Z",
        group: tuple[str, int, int] | None = None) -> dict[str, Any]:
    """A pod of `role`; `group` (key, worker index, size) makes it a pod of a LeaderWorkerSet group."""
    conditions = [{"type": "PodScheduled", "status": "True" if scheduled else "False",
                   **({} if scheduled else {"reason": "Unschedulable"})},
                  {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": ready_since}]
    meta: dict[str, Any] = {"name": f"{role}-x", "labels": {"xpyd.io/role": role, "xpyd.io/serving": "llama"}}
    if group is not None:
        key, index, size = group
        meta["labels"].update({"leaderworkerset.sigs.k8s.io/group-key": key,
                               "leaderworkerset.sigs.k8s.io/worker-index": str(index)})
        meta["annotations"] = {"leaderworkerset.sigs.k8s.io/size": str(size)}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"metadata": meta, "spec": {}, "status": {"phase": phase, "conditions": conditions}}


def group(key: str, *, leader_ready: bool = False, scheduled: tuple[bool, bool] = (True, True),
          deleting: bool = False, workers: int = 1) -> list[dict[str, Any]]:
    """A two-node group (leader and `workers` of its one worker; 0: not created yet)."""
    pods = [pod("prefill", ready=leader_ready, scheduled=scheduled[0], deleting=deleting, group=(key, 0, 2))]
    if workers:
        pods.append(pod("prefill", ready=True, scheduled=scheduled[1], deleting=deleting, group=(key, 1, 2)))
    return pods


# --- queries ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "expected"), [
    ("up", f'count by (xpyd_io_role) (up{{{SELECT},xpyd_io_role=~"prefill|decode"}} == 1)'),
    ("waiting", f'sum by (xpyd_io_role) (vllm:num_requests_waiting{{{SELECT},xpyd_io_role=~"prefill|decode"}})'),
    ("kv_max", f'max by (xpyd_io_role) (vllm:kv_cache_usage_perc{{{SELECT},xpyd_io_role=~"prefill|decode"}})'),
    ("prompt_tps", f'sum by (xpyd_io_role) (rate(vllm:prompt_tokens_total{{{SELECT},'
                   'xpyd_io_role=~"prefill|decode"}[60s]))'),
    ("cache_hits", f'sum by (xpyd_io_role) (rate(vllm:prefix_cache_hits_total{{{SELECT},'
                   'xpyd_io_role=~"prefill|decode"}[60s]))'),
    ("cache_queries", f'sum by (xpyd_io_role) (rate(vllm:prefix_cache_queries_total{{{SELECT},'
                      'xpyd_io_role=~"prefill|decode"}[60s]))'),
    ("success_rps", f'sum by (xpyd_io_role) (rate(vllm:request_success_total{{{SELECT},'
                    'xpyd_io_role=~"prefill|decode",finished_reason=~"stop|length|repetition"}[60s]))'),
    ("proxy_rps", f'sum(rate(xpyd_proxy_requests_total{{{SELECT},xpyd_io_role=~"proxy",'
                  'outcome!="unauthorized"}[60s]))'),
    ("isl.p90", f'histogram_quantile(0.9, sum by (le) (rate(vllm:request_prompt_tokens_bucket{{{SELECT},'
                'xpyd_io_role=~"prefill"}[60s])))'),
    ("isl.mean", f'sum (rate(vllm:request_prompt_tokens_sum{{{SELECT},xpyd_io_role=~"prefill"}}[60s])) / '
                 f'sum (rate(vllm:request_prompt_tokens_count{{{SELECT},xpyd_io_role=~"prefill"}}[60s]))'),
    ("tpot.p99", 'histogram_quantile(0.99, sum by (le) (rate(vllm:request_time_per_output_token_seconds_bucket'
                 f'{{{SELECT},xpyd_io_role=~"decode"}}[60s])))'),
    ("inter_token_latency_seconds.p50", 'histogram_quantile(0.5, sum by (xpyd_io_role, le) (rate('
                                        f'vllm:inter_token_latency_seconds_bucket{{{SELECT},'
                                        'xpyd_io_role=~"prefill|decode"}[60s])))'),
    ("ttft.p90", 'histogram_quantile(0.9, sum by (le) (rate(xpyd_proxy_time_to_first_token_seconds_bucket'
                 f'{{{SELECT},xpyd_io_role=~"proxy"}}[60s])))'),
])
def test_queries_select_the_pool_by_namespace_serving_and_role(name: str, expected: str) -> None:
    assert collect.queries(SCOPE)[name] == expected


def test_label_values_are_quoted() -> None:
    query = collect.queries(Scope('we"ird\\ns', "x"))["running"]
    assert 'namespace="we\\"ird\\\\ns"' in query


# --- answers ------------------------------------------------------------------------------------------


def vector(*samples: tuple[str, str]) -> dict[str, Any]:
    return {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"xpyd_io_role": role} if role else {}, "value": [1.0, value]} for role, value in samples]}}


def test_parse_vector_by_role_keeps_nan() -> None:
    samples = parse_vector(vector(("prefill", "3"), ("decode", "NaN")))
    assert samples["prefill"] == 3.0 and math.isnan(samples["decode"])
    assert parse_vector(vector(("", "0.25"))) == {"": 0.25}
    assert parse_vector({"status": "success", "data": {"resultType": "vector", "result": []}}) == {}


def test_parse_result_reads_what_custom_query_returns() -> None:
    assert parse_result(vector(("prefill", "3"), ("decode", "4"))["data"]["result"]) == {"prefill": 3.0,
                                                                                          "decode": 4.0}
    assert parse_result([1.0, "0.5"]) == {"": 0.5}     # a scalar
    assert parse_result([]) == {}


def test_parse_vector_error_says_why() -> None:
    with pytest.raises(MetricsError, match="bad_data: parse error"):
        parse_vector({"status": "error", "errorType": "bad_data", "error": "parse error"})


@pytest.mark.parametrize(("pods", "expected"), [
    ([], PodCounts()),
    ([pod("prefill", ready=True), pod("prefill", ready=True)], PodCounts(ready=2)),
    ([pod("prefill"), pod("prefill", scheduled=False)], PodCounts(starting=1, pending=1)),
    ([pod("prefill", ready=True, deleting=True), pod("prefill", deleting=True)], PodCounts(draining=1)),
    ([pod("decode", ready=True), pod("prefill", phase="Failed")], PodCounts()),
    # Multi-node replicas: a group is one replica, counted by its leader, Pending while any pod is.
    ([*group("a", leader_ready=True), *group("b", leader_ready=True)], PodCounts(ready=2)),
    ([*group("a", leader_ready=True), *group("b")], PodCounts(ready=1, starting=1)),
    (group("a", scheduled=(True, False)), PodCounts(pending=1)),        # a worker without a node
    (group("a", leader_ready=True, scheduled=(True, False)), PodCounts(pending=1)),
    (group("a", workers=0), PodCounts(pending=1)),                      # its worker not created yet
    (group("a", leader_ready=True, deleting=True), PodCounts(draining=1)),
    (group("a", leader_ready=True)[1:], PodCounts()),                  # workers of a leader being replaced
    ([*group("a", leader_ready=True), pod("prefill", ready=True)], PodCounts(ready=2)),
])
def test_count_pods(pods: list[dict[str, Any]], expected: PodCounts) -> None:
    counted = count_pods(pods, "prefill")
    assert (counted.ready, counted.starting, counted.pending, counted.draining) == (
        expected.ready, expected.starting, expected.pending, expected.draining)


def test_count_pods_knows_how_long_pods_have_been_ready() -> None:
    midnight = 1796083200.0  # 2026-12-01T00:00:00Z
    pods = [pod("prefill", ready=True), pod("prefill", ready=True, ready_since="2026-12-01T00:00:50Z")]
    assert count_pods(pods, "prefill", midnight + 60).ready_for_s == 60.0
    assert count_pods(pods, "prefill", midnight - 10).ready_for_s == 0.0


def healthy_results(**overrides: dict[str, float]) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {
        "up": {"prefill": 2, "decode": 1}, "age": {"prefill": 4, "decode": 3},
        "running": {"prefill": 3, "decode": 40}, "waiting": {"prefill": 5, "decode": 0},
        "waiting_max": {"prefill": 4, "decode": 0},
        "kv_mean": {"prefill": 0.1, "decode": 0.5}, "kv_max": {"prefill": 0.2, "decode": 0.5},
        "prompt_tps": {"prefill": 9000.0}, "generation_tps": {"decode": 2500.0},
        "success_rps": {"prefill": 7.0, "decode": 7.0},
        "proxy_up": {"": 1}, "proxy_rps": {"": 7.5}, "prefill_rps": {"": 7.0},
        "isl.mean": {"": 1200.0}, "isl.p50": {"": 900.0}, "isl.p90": {"": 3000.0}, "isl.p99": {"": 7000.0},
        "osl.mean": {"": 350.0}, "tpot.p90": {"": 0.012}, "ttft.p90": {"": 0.31}, "ttft.mean": {"": 0.2},
        "request_queue_time_seconds.p90": {"prefill": 0.4, "decode": math.nan},
    }
    results.update(overrides)
    return results


PODS = [pod("prefill", ready=True), pod("prefill", ready=True), pod("prefill"), pod("decode", ready=True),
        pod("decode", scheduled=False), pod("decode", ready=True, deleting=True)]


def test_observation_from_answers_and_pods() -> None:
    obs = observation(healthy_results(), PODS, 1000.0, SCOPE)
    assert (obs.time_s, obs.window_s, obs.request_rate) == (1000.0, 60.0, 7.5)
    assert (obs.isl_mean, obs.osl_mean, obs.isl_quantiles.p90) == (1200.0, 350.0, 3000.0)
    assert (obs.ttft_seconds.p90, obs.tpot_seconds.p90) == (0.31, 0.012)
    p, d = obs.prefill, obs.decode
    assert (p.replicas, p.ready, p.starting, p.pending, p.draining) == (3, 2, 1, 0, 0)
    assert (d.replicas, d.ready, d.starting, d.pending, d.draining) == (1, 1, 0, 1, 1)
    assert (p.num_requests_waiting, d.num_requests_running, d.kv_cache_usage_perc) == (5, 40, 0.5)
    assert (p.num_requests_waiting_max, d.num_requests_waiting_max) == (4, 0)
    assert (p.prompt_tokens_per_s, d.generation_tokens_per_s, p.requests_per_s) == (9000.0, 2500.0, 7.0)
    assert p.request_queue_time_seconds.p90 == 0.4 and math.isnan(d.request_queue_time_seconds.p90)


@pytest.mark.parametrize(("hits", "queries", "rate"), [
    ({"prefill": 4500.0}, {"prefill": 9000.0}, 0.5),
    ({}, {"prefill": 9000.0}, 0.0),                   # no hits series: nothing found cached
    ({"prefill": 0.0}, {"prefill": 0.0}, 0.0),        # nothing looked up in the window
    ({}, {}, 0.0),                                    # prefix caching off: neither series
    ({"prefill": math.nan}, {"prefill": 9000.0}, 0.0),
])
def test_the_prefill_hit_rate_is_hits_over_queries(hits: dict[str, float], queries: dict[str, float],
                                                   rate: float) -> None:
    obs = observation(healthy_results(cache_hits=hits, cache_queries=queries), PODS, 1000.0, SCOPE)
    assert (obs.prefill.prefix_cache_hit_rate, obs.decode.prefix_cache_hit_rate) == (rate, 0.0)


def test_without_a_scraped_proxy_arrivals_come_from_prefill_and_ttft_is_unknown() -> None:
    obs = observation(healthy_results(proxy_up={}), PODS, 1000.0, SCOPE)
    assert obs.request_rate == 7.0
    assert math.isnan(obs.ttft_seconds.p90)


def test_pods_ready_for_less_than_a_discovery_period_may_be_unscraped() -> None:
    midnight = 1796083200.0
    fresh = [pod("prefill", ready=True), pod("decode", ready=True, ready_since="2026-12-01T00:00:50Z")]
    obs = observation(healthy_results(up={"prefill": 1}), fresh, midnight + 60, SCOPE)
    assert obs.decode.ready == 1
    with pytest.raises(MetricsError, match="scrapes none of them"):
        observation(healthy_results(up={"prefill": 1}), fresh, midnight + 200, SCOPE)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"up": {"prefill": 2}}, r"1 decode pod\(s\) ready but Prometheus scrapes none of them"),
    ({"age": {"prefill": 4}}, "no vllm:num_requests_running series from the decode engines"),
    ({"age": {"prefill": 400, "decode": 3}}, "the prefill engines' metrics are stale"),
])
def test_missing_or_stale_series_are_an_error(overrides: dict[str, dict[str, float]], message: str) -> None:
    with pytest.raises(MetricsError, match=message):
        observation(healthy_results(**overrides), PODS, 1796083200.0 + 1000, SCOPE)  # pods ready 1000 s


def test_a_pool_without_ready_pods_needs_no_series() -> None:
    obs = observation({}, [pod("prefill"), pod("decode", scheduled=False)], 5.0, SCOPE)
    assert (obs.prefill.starting, obs.decode.pending, obs.request_rate) == (1, 1, 0.0)


def test_the_gauge_queries_are_the_decisions_own() -> None:
    """The gauges (what a look between decisions reads) are a part of a decision's queries, the same
    PromQL: per role, the scrape and its age, running and waiting requests (summed, and the fullest
    engine's), KV usage mean and max."""
    gauge = gauge_queries(SCOPE)
    assert set(gauge) == {"up", "age", "running", "waiting", "waiting_max", "kv_mean", "kv_max"}
    assert gauge.items() <= collect.queries(SCOPE).items()
    engines = f'{{{SELECT},xpyd_io_role=~"prefill|decode"}}'
    assert gauge["waiting"] == f"sum by (xpyd_io_role) (vllm:num_requests_waiting{engines})"
    assert gauge["waiting_max"] == \
        f"max by (xpyd_io_role) (sum by (xpyd_io_role, instance) (vllm:num_requests_waiting{engines}))"
    assert gauge["kv_max"] == f"max by (xpyd_io_role) (vllm:kv_cache_usage_perc{engines})"
    assert not any("rate(" in promql or "[" in promql for promql in gauge.values())  # instant: no window


def test_the_gauges_observation_has_the_pods_and_the_gauges_only() -> None:
    answers = {name: value for name, value in healthy_results().items() if name in gauge_queries(SCOPE)}
    obs = gauges(answers, PODS, 1000.0, SCOPE)
    window = observation(healthy_results(), PODS, 1000.0, SCOPE)
    assert (obs.time_s, obs.window_s, obs.request_rate) == (1000.0, 0.0, 0.0)
    assert math.isnan(obs.isl_mean) and math.isnan(obs.ttft_seconds.p90) and obs.ttft_buckets == ()
    for role in ("prefill", "decode"):   # the counts and gauges a decision reads, nothing of its window
        assert getattr(obs, role) == dataclasses.replace(
            getattr(window, role), time_to_first_token_seconds=Quantiles(), inter_token_latency_seconds=Quantiles(),
            request_queue_time_seconds=Quantiles(), prompt_tokens_per_s=0.0, generation_tokens_per_s=0.0,
            requests_per_s=0.0, prefix_cache_hit_rate=0.0)
    assert (obs.prefill.replicas, obs.prefill.ready, obs.decode.pending, obs.decode.draining) == (3, 2, 1, 1)
    assert (obs.prefill.num_requests_waiting, obs.decode.num_requests_running) == (5, 40)
    assert (obs.decode.kv_cache_usage_perc, obs.prefill.kv_cache_usage_perc_max) == (0.5, 0.2)


def test_stale_gauges_are_an_error_as_for_a_decision() -> None:
    with pytest.raises(MetricsError, match="the prefill engines' metrics are stale"):
        gauges(healthy_results(age={"prefill": 400, "decode": 3}), PODS, 1796083200.0 + 1000, SCOPE)


# --- the HTTP client ------------------------------------------------------------------------------------


#: Requests the fake Prometheus is answering now, and the most it answered at once.
IN_FLIGHT: dict[str, int] = {}


@dataclass
class Seen:
    """What the fake Prometheus received: each request's query parameters and Authorization header."""

    queries: list[dict[str, list[str]]] = field(default_factory=list)
    authorization: list[str | None] = field(default_factory=list)


@contextlib.contextmanager
def serve_prometheus(tls: ssl.SSLContext | None = None, token: str | None = None) -> Iterator[tuple[str, Seen]]:
    """A loopback HTTP(S) server answering /api/v1/query like Prometheus: queries containing "bad" get
    a 400 with Prometheus' error body; requests without `Bearer <token>` (when `token` is set) a 401
    from "an authenticating proxy"; the others one sample, after a short wait (so that queries
    sent at once are in flight together: the most at once is `IN_FLIGHT["max"]`)."""
    seen = Seen()
    lock = threading.Lock()
    IN_FLIGHT.update(now=0, max=0)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            form = urllib.parse.parse_qs(url.query)
            with lock:
                seen.queries.append(form)
                seen.authorization.append(self.headers.get("Authorization"))
                IN_FLIGHT["now"] += 1
                IN_FLIGHT["max"] = max(IN_FLIGHT["max"], IN_FLIGHT["now"])
            time.sleep(0.02)
            with lock:
                IN_FLIGHT["now"] -= 1
            if token is not None and self.headers.get("Authorization") != f"Bearer {token}":
                self.answer(b"Unauthorized\n", 401, "text/plain")
            elif url.path != "/api/v1/query":
                self.answer(b"404 page not found\n", 404, "text/plain")
            elif "bad" in form["query"][0]:
                self.answer({"status": "error", "errorType": "bad_data", "error": "unexpected identifier"}, 400)
            else:
                self.answer(vector(("prefill", "2")), 200)

        def answer(self, body: dict[str, Any] | bytes, code: int, content_type: str = "application/json") -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]}/", seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def fake_prometheus() -> Iterator[tuple[str, Seen]]:
    with serve_prometheus() as served:
        yield served


def test_client_sends_the_query_at_the_decision_time(fake_prometheus: tuple[str, Seen]) -> None:
    url, seen = fake_prometheus
    assert Prometheus(url).query("up", 1234.5) == {"prefill": 2.0}
    assert seen.queries[-1] == {"query": ["up"], "time": ["1234.500"]}
    assert seen.authorization == [None]
    results = Prometheus(url).collect(SCOPE, 10.0)
    assert set(results) == set(collect.queries(SCOPE))
    # The fake answers every query with one sample labelled xpyd_io_role; the bucket queries key by le,
    # the arrival histogram's by window: neither label is on the fake's sample.
    assert all(samples == ({"prefill": 2.0} if collect.answer_label(name) == "xpyd_io_role" else {"": 2.0})
               for name, samples in results.items())
    assert {collect.answer_label(name) for name in results} == {"le", "window", "xpyd_io_role"}
    assert {form["query"][0] for form in seen.queries[1:]} == set(collect.queries(SCOPE).values())
    assert 1 < IN_FLIGHT["max"] <= collect.PARALLEL_QUERIES     # queries run side by side, bounded


def test_only_the_gauges_are_read_between_decisions(fake_prometheus: tuple[str, Seen]) -> None:
    url, seen = fake_prometheus
    results = Prometheus(url).collect(SCOPE, 10.0, only_gauges=True)
    assert set(results) == set(gauge_queries(SCOPE))
    assert sorted(form["query"][0] for form in seen.queries) == sorted(gauge_queries(SCOPE).values())


def test_one_failed_query_fails_the_collection(fake_prometheus: tuple[str, Seen],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = fake_prometheus
    monkeypatch.setattr(collect, "queries", lambda scope: {f"q{n}": "up" for n in range(20)} | {"broken": "bad("})
    with pytest.raises(MetricsError, match="bad_data"):
        Prometheus(url).collect(SCOPE, 1.0)


def test_client_errors_are_metrics_errors(fake_prometheus: tuple[str, Seen]) -> None:
    url, seen = fake_prometheus
    with pytest.raises(MetricsError, match="bad_data: unexpected identifier"):
        Prometheus(url).query("bad(", 1.0)
    with pytest.raises(MetricsError, match=r"answered HTTP 404 Not Found$"):
        Prometheus(url + "not-prometheus").query("up", 1.0)
    with pytest.raises(MetricsError, match="cannot be read"):
        Prometheus(f"http://127.0.0.1:{free_port()}", timeout_s=2).query("up", 1.0)
    assert len(seen.queries) == 2      # no retries


def test_the_loopback_guard_refuses_other_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOOPBACK_ONLY_ENV, "1")
    with pytest.raises(MetricsError, match=r"refusing URL http://10\.0\.0\.1:9090"):
        Prometheus("http://10.0.0.1:9090").collect(SCOPE, 1.0)


def test_the_bearer_token_is_sent() -> None:
    with serve_prometheus(token="s3cret") as (url, seen):
        assert Prometheus(url, Access(bearer_token="s3cret")).query("up", 1.0) == {"prefill": 2.0}
        assert seen.authorization == ["Bearer s3cret"]
        with pytest.raises(MetricsError, match=r"answered HTTP 401 Unauthorized \(check autoscaling\.prometheus\."
                                               r"bearerTokenSecretRef\)"):
            Prometheus(url).query("up", 1.0)
    assert "s3cret" not in repr(Access(bearer_token="s3cret"))


@pytest.fixture(scope="module")
def pki_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[pki.Files, pki.Files]:
    """The server's CA and certificate (for 127.0.0.1), and another CA."""
    return pki.generate(tmp_path_factory.mktemp("ca")), pki.generate(tmp_path_factory.mktemp("other-ca"))


@pytest.fixture
def https_prometheus(pki_dirs: tuple[pki.Files, pki.Files]) -> Iterator[tuple[str, Seen]]:
    files, _ = pki_dirs
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(files.server_cert, files.server_key)
    with serve_prometheus(context) as served:
        yield served


def test_https_is_verified_against_the_given_ca(https_prometheus: tuple[str, Seen],
                                                pki_dirs: tuple[pki.Files, pki.Files]) -> None:
    url, seen = https_prometheus
    ours, other = (files.ca_cert.read_text() for files in pki_dirs)
    results = Prometheus(url, Access(bearer_token="t", ca_pem=ours)).collect(SCOPE, 1.0)
    # The fake answers every query with one sample labelled xpyd_io_role; the bucket queries key by le,
    # the arrival histogram's by window: neither label is on the fake's sample.
    assert all(samples == ({"prefill": 2.0} if collect.answer_label(name) == "xpyd_io_role" else {"": 2.0})
               for name, samples in results.items())
    assert {collect.answer_label(name) for name in results} == {"le", "window", "xpyd_io_role"}
    assert set(seen.authorization) == {"Bearer t"}
    with pytest.raises(MetricsError, match=r"TLS verification failed \(autoscaling\.prometheus\.tls\).*"
                                           r"CERTIFICATE_VERIFY_FAILED"):
        Prometheus(url, Access(ca_pem=other)).collect(SCOPE, 1.0)
    with pytest.raises(MetricsError, match="CERTIFICATE_VERIFY_FAILED"):
        Prometheus(url).query("up", 1.0)      # the public CAs do not know the test's CA
    with pytest.warns(urllib3.exceptions.InsecureRequestWarning):
        assert Prometheus(url, Access(insecure_skip_verify=True)).query("up", 1.0) == {"prefill": 2.0}
    assert len(seen.queries) == len(collect.queries(SCOPE)) + 1    # failed handshakes send nothing
