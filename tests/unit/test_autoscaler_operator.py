"""The autoscaler's shell in the operator: what one decision writes (status, condition, Events,
metrics) per mode, holding on missing metrics, the profile sources, and how the reconcile reads
the decision."""

from __future__ import annotations

import base64
import copy
import json
import math
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from xpyd.api.load import parse_serving
from xpyd.api.models import AutoscalingMode
from xpyd.autoscaler.collect import Access, MetricsError, Samples, Scope, gauge_queries
from xpyd.autoscaler.decide import AutoscalerState
from xpyd.autoscaler.profile import ProfileError, perf_model
from xpyd.common import exposition
from xpyd.common.jsontypes import JSON
from xpyd.controller.autoscale import ASKED_POD_LAG_S, Autoscaler, _asked, config_for
from xpyd.controller.reconcile import desired_replicas
from xpyd.controller.runtime import OperatorRuntime
from xpyd.controller.status import Observed, compute_status
from xpyd.kube import Kube, KubeError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PROFILE_DIR = REPO / "operator" / "xpyd" / "perf" / "profiles"


class FakeKube:
    """The Kube calls the autoscaler makes, in memory, with a log of writes."""

    def __init__(self, pods: list[JSON], config_maps: dict[str, JSON] | None = None,
                 secrets: dict[str, JSON] | None = None) -> None:
        self.pods = pods
        self.objects = {"ConfigMap": config_maps or {}, "Secret": secrets or {}}
        self.reads: list[tuple[str, str | None, str]] = []
        self.status_patches: list[JSON] = []
        self.events: list[tuple[str, str, str]] = []

    def list_objects(self, api_version: str, kind: str, namespace: str | None, selector: str = "") -> list[JSON]:
        assert (kind, selector) == ("Pod", "xpyd.io/serving=llama")
        return self.pods

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> JSON | None:
        self.reads.append((kind, namespace, name))
        if kind == "Secret" and name == "forbidden":
            raise KubeError(403, f'GET /api/v1/namespaces/{namespace}/secrets/{name}: secrets "{name}" is '
                                 'forbidden')
        return self.objects[kind].get(name)

    def patch_status(self, namespace: str, name: str, status: JSON) -> None:
        self.status_patches.append(copy.deepcopy(status))

    def event(self, owner: JSON, event_type: str, reason: str, message: str) -> None:
        self.events.append((event_type, reason, message))


class FakePrometheus:
    """Answers `collect` with fixed results, or raises like an unreachable server."""

    def __init__(self, results: dict[str, Samples] | None) -> None:
        self.results = results
        self.scopes: list[Scope] = []
        self.gauge_reads = 0
        self.connections: list[tuple[str, Access]] = []

    def connect(self, url: str, access: Access) -> FakePrometheus:
        self.connections.append((url, access))
        return self

    def collect(self, scope: Scope, at: float, only_gauges: bool = False) -> dict[str, Samples]:
        self.scopes.append(scope)
        self.gauge_reads += only_gauges
        if self.results is None:
            raise MetricsError("Prometheus at http://prom:9090 cannot be read: connection refused")
        return {name: value for name, value in self.results.items() if name in GAUGES} if only_gauges \
            else self.results


#: The names of the gauges' queries (what a look between decisions reads).
GAUGES = frozenset(gauge_queries(Scope("team-a", "llama")))


def pod(role: str, n: int) -> JSON:
    return {"metadata": {"name": f"llama-{role}-{n}", "labels": {"xpyd.io/role": role, "xpyd.io/serving": "llama"}},
            "spec": {"nodeName": "gpu-0"},
            "status": {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"},
                                                          {"type": "Ready", "status": "True"}]}}


PODS = [pod("prefill", 0), pod("decode", 0), pod("decode", 1)]


def busy_results() -> dict[str, Samples]:
    """A pool whose single prefill engine is far behind: 30 req/s of 2,000-token prompts."""
    return {
        "up": {"prefill": 1, "decode": 2}, "age": {"prefill": 3, "decode": 3},
        "running": {"prefill": 8, "decode": 60}, "waiting": {"prefill": 120, "decode": 0},
        "kv_mean": {"prefill": 0.3, "decode": 0.4}, "kv_max": {"prefill": 0.3, "decode": 0.5},
        "prompt_tps": {"prefill": 30000.0}, "generation_tps": {"decode": 3000.0},
        "success_rps": {"prefill": 15.0, "decode": 15.0},
        "proxy_up": {"": 1}, "proxy_rps": {"": 30.0},
        "isl.mean": {"": 2000.0}, "isl.p50": {"": 1800.0}, "isl.p90": {"": 3000.0}, "isl.p99": {"": 4000.0},
        "osl.mean": {"": 100.0}, "osl.p50": {"": 100.0},
        "ttft.p50": {"": 3.0}, "ttft.p90": {"": 6.0}, "ttft.p99": {"": 8.0}, "ttft.mean": {"": 3.5},
        "tpot.p50": {"": 0.008}, "tpot.p90": {"": 0.01}, "tpot.p99": {"": 0.012}, "tpot.mean": {"": 0.008},
        "request_queue_time_seconds.p90": {"prefill": 5.0, "decode": 0.001},
        "request_queue_time_seconds.p99": {"prefill": 7.0, "decode": 0.001},
        "request_queue_time_seconds.mean": {"prefill": 3.0, "decode": 0.001},
        "inter_token_latency_seconds.p90": {"decode": 0.01}, "inter_token_latency_seconds.mean": {"decode": 0.008},
    }


def body(mode: str = "Auto", **autoscaling: Any) -> JSON:
    obj = yaml.safe_load((REPO / "manifests/samples/autoscaling-auto.yaml").read_text())
    obj["metadata"].update(name="llama", namespace="team-a", uid="u-1", generation=3)
    obj["spec"]["autoscaling"].update(mode=mode, **autoscaling)
    obj["status"] = {"prefill": {"desiredReplicas": 1}, "decode": {"desiredReplicas": 2}, "conditions": [
        {"type": "ScalingActive", "status": "Unknown", "reason": "AutoscalerNotRunning", "message": "",
         "lastTransitionTime": "2026-12-01T00:00:00Z"}]}
    return obj


def autoscaler(kube: FakeKube, prometheus: FakePrometheus, now: list[float]) -> Autoscaler:
    return Autoscaler(kube, prometheus=prometheus.connect, clock=lambda: now[0])  # type: ignore[arg-type]


Series = dict[tuple[str, frozenset[tuple[str, str]]], float]

#: The operator's series families: the name Prometheus stores, the type and the label names.
OPERATOR_FAMILIES = {
    "xpyd_autoscaler_desired_replicas": ("gauge", {"namespace", "name", "role"}),
    "xpyd_autoscaler_decisions_total": ("counter", {"namespace", "name", "reason"}),
    "xpyd_autoscaler_metrics_unavailable_total": ("counter", {"namespace", "name"}),
    "xpyd_autoscaler_attainment": ("gauge", {"namespace", "name"}),
    "xpyd_autoscaler_headroom": ("gauge", {"namespace", "name"}),
}


def scrape(scaler: Autoscaler) -> Series:
    """What the operator's /metrics answers, parsed by prometheus_client's own parser and checked
    against OPERATOR_FAMILIES: (sample name, labels) -> value."""
    response = exposition.response(scaler.registry)
    assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert isinstance(response.body, bytes)
    families = list(text_string_to_metric_families(response.body.decode()))
    assert {f"{family.name}_total" if family.type == "counter" else family.name: family.type
            for family in families} == {name: kind for name, (kind, _) in OPERATOR_FAMILIES.items()}
    series: Series = {}
    for family in families:
        for sample in family.samples:
            assert set(sample.labels) == OPERATOR_FAMILIES[sample.name][1], sample   # no _created series either
            series[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return series


def key(metric: str, /, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return metric, frozenset(labels.items())


def condition(patch: JSON) -> JSON:
    (scaling,) = [c for c in patch["conditions"] if c["type"] == "ScalingActive"]
    return scaling


def test_auto_mode_scales_the_guilty_role_and_records_why() -> None:
    kube, prom, now = FakeKube(PODS), FakePrometheus(busy_results()), [1000.0]
    scaler = autoscaler(kube, prom, now)
    assert scaler.step(body(profile={"name": "h200_llama31_8b_fp8_tp1"})) is True  # the reconcile must act
    (patch,) = kube.status_patches
    decision = patch["autoscaler"]["lastDecision"]
    assert patch["prefill"]["desiredReplicas"] == decision["prefill"] > 1
    assert patch["decode"]["desiredReplicas"] == decision["decode"]
    assert decision["reason"] in ("PrefillQueueing", "PrefillDemand") and decision["message"]
    assert condition(patch)["status"] == "True" and condition(patch)["reason"] == "ValidMetrics"
    assert patch["autoscaler"]["observed"]["requestRate"] == 30.0
    assert patch["autoscaler"]["observed"]["ttftMs"] == 6000.0     # at the SLO percentile (90)
    assert patch["autoscaler"]["profile"] == "profile h200_llama31_8b_fp8_tp1"
    ((kind, reason, message),) = kube.events
    assert (kind, reason) == ("Normal", decision["reason"]) and message.startswith("prefill 1->")
    assert prom.scopes == [Scope("team-a", "llama", 60)]
    series = scrape(scaler)
    llama = {"namespace": "team-a", "name": "llama"}
    assert series[key("xpyd_autoscaler_desired_replicas", **llama, role="prefill")] == decision["prefill"]
    assert series[key("xpyd_autoscaler_desired_replicas", **llama, role="decode")] == decision["decode"]
    assert series[key("xpyd_autoscaler_decisions_total", **llama, reason=decision["reason"])] == 1
    assert series[key("xpyd_autoscaler_headroom", **llama)] == 0.0      # no target attainment
    assert patch["autoscaler"]["attainment"] == {"target": None, "lastHour": None, "headroom": 0.0}


def test_the_attainment_and_headroom_are_reported() -> None:
    results = busy_results()
    # The proxy's TTFT buckets: 60 of 100 requests within 500 ms; every TPOT within 50 ms.
    results["ttft.buckets"] = {"0.25": 0.5, "0.5": 0.6, "1.0": 0.8, "+Inf": 1.0}
    results["tpot.buckets"] = {"0.05": 1.0, "+Inf": 1.0}
    kube, prom, now = FakeKube(PODS), FakePrometheus(results), [1000.0]
    scaler = autoscaler(kube, prom, now)
    obj = body(profile={"name": "h200_llama31_8b_fp8_tp1"})
    obj["spec"]["autoscaling"]["slo"] = {"ttftMs": 500, "tpotMs": 50, "percentile": 90, "attainment": 0.95}
    scaler.step(obj)
    (patch,) = kube.status_patches
    reported = patch["autoscaler"]["attainment"]
    assert reported["target"] == 0.95 and reported["lastHour"] == pytest.approx(0.6) and reported["headroom"] > 0
    assert "over the last hour (target 95.0%)" in patch["autoscaler"]["lastDecision"]["message"]
    series = scrape(scaler)
    llama = {"namespace": "team-a", "name": "llama"}
    assert series[key("xpyd_autoscaler_attainment", **llama)] == pytest.approx(0.6)
    assert series[key("xpyd_autoscaler_headroom", **llama)] == pytest.approx(reported["headroom"], abs=1e-4)


def test_missing_metrics_hold_replicas_and_say_so_once() -> None:
    kube, prom, now = FakeKube(PODS), FakePrometheus(None), [1000.0]
    scaler = autoscaler(kube, prom, now)
    obj = body()
    assert scaler.step(obj) is False
    (patch,) = kube.status_patches
    assert (patch["prefill"]["desiredReplicas"], patch["decode"]["desiredReplicas"]) == (1, 2)
    assert condition(patch)["status"] == "False" and condition(patch)["reason"] == "MetricsUnavailable"
    assert "connection refused" in condition(patch)["message"]
    assert kube.events == [("Warning", "MetricsUnavailable", patch["autoscaler"]["lastDecision"]["message"])]
    # The next interval, still down: nothing new to write or announce.
    obj["status"] = {**obj["status"], **{k: v for k, v in patch.items() if k not in ("prefill", "decode")}}
    now[0] += 30
    scaler.step(obj)
    assert len(kube.events) == 1 and len(kube.status_patches) == 1
    series = scrape(scaler)
    assert series[key("xpyd_autoscaler_metrics_unavailable_total", namespace="team-a", name="llama")] == 2
    assert series[key("xpyd_autoscaler_decisions_total", namespace="team-a", name="llama",
                      reason="MetricsUnavailable")] == 2
    # Metrics come back: an Event says so.
    prom.results = busy_results()
    now[0] += 30
    scaler.step(obj)
    assert kube.events[-1][1] in ("PrefillQueueing", "PrefillDemand", "MetricsAvailable")


def test_recommend_mode_reports_and_never_scales() -> None:
    kube, prom, now = FakeKube(PODS), FakePrometheus(busy_results()), [1000.0]
    scaler = autoscaler(kube, prom, now)
    assert scaler.step(body("Recommend")) is False
    (patch,) = kube.status_patches
    assert "prefill" not in patch and "decode" not in patch
    assert patch["autoscaler"]["lastDecision"]["prefill"] > 1
    assert condition(patch)["status"] == "False" and condition(patch)["reason"] == "RecommendOnly"
    ((kind, _, message),) = kube.events
    assert kind == "Normal" and message.startswith("recommends prefill")


def test_off_mode_does_nothing_and_forgets() -> None:
    kube, prom, now = FakeKube(PODS), FakePrometheus(busy_results()), [1000.0]
    scaler = autoscaler(kube, prom, now)
    scaler.step(body())
    assert scaler.step(body("Off")) is False
    assert not scaler.due(body("Off"), now[0])
    assert not [name for name, _ in scrape(scaler) if name == "xpyd_autoscaler_desired_replicas"]
    assert len(kube.status_patches) == 1 and prom.scopes == [Scope("team-a", "llama", 60)]


def test_due_after_the_interval_or_a_spec_change() -> None:
    kube, prom, now = FakeKube(PODS), FakePrometheus(busy_results()), [1000.0]
    scaler = autoscaler(kube, prom, now)
    obj = body(intervalSeconds=30)
    assert scaler.due(obj, now[0])
    scaler.step(obj)
    assert not scaler.due(obj, now[0] + 10)
    assert scaler.due(obj, now[0] + 30)
    changed = copy.deepcopy(obj)
    changed["metadata"]["generation"] = 4    # e.g. the user raised maxReplicas: decide at once
    assert scaler.due(changed, now[0] + 1)


def test_a_new_process_waits_out_the_interval_since_the_recorded_decision() -> None:
    # Another replica (the last leader) decided at t=1000: its decision is in the status.
    kube, prom, now = FakeKube(PODS), FakePrometheus(busy_results()), [1000.0]
    obj = body(intervalSeconds=30)
    autoscaler(kube, prom, now).step(obj)
    (patch,) = kube.status_patches
    obj["status"] = patch
    successor = autoscaler(kube, prom, now)
    assert not successor.due(obj, now[0] + 10)
    assert successor.due(obj, now[0] + 30)
    assert successor.due(body(intervalSeconds=30), now[0])  # never decided: at once


def test_unknown_profile_is_reported() -> None:
    kube, prom, now = FakeKube(PODS), FakePrometheus(busy_results()), [1000.0]
    obj = body()
    obj["spec"]["model"]["name"] = "acme/secret-model"
    autoscaler(kube, prom, now).step(obj)
    (patch,) = kube.status_patches
    assert condition(patch)["reason"] == "ProfileUnavailable"
    assert "unknown model 'acme/secret-model'" in condition(patch)["message"]
    assert kube.events[0][:2] == ("Warning", "ProfileUnavailable")
    assert prom.scopes == []


def test_profile_sources() -> None:
    serving = parse_serving(body())
    assert perf_model(serving.spec).description.startswith("roofline Llama-3.1-8B")
    named = parse_serving(body(profile={"name": "h200_llama31_8b_fp8_tp1"}))
    assert perf_model(named.spec).description == "profile h200_llama31_8b_fp8_tp1"
    with pytest.raises(ProfileError, match="not a bundled profile"):
        perf_model(parse_serving(body(profile={"name": "b300"})).spec)
    from_map = parse_serving(body(profile={"configMap": "measured"}))
    data = {"prefill.csv": (PROFILE_DIR / "h200_llama31_8b_fp8_tp1_prefill.csv").read_text(),
            "decode.csv": (PROFILE_DIR / "h200_llama31_8b_fp8_tp1_decode.csv").read_text()}
    model = perf_model(from_map.spec, {"data": data})
    assert model.description == "profile measured"
    assert math.isclose(model.prefill_seconds(4096), perf_model(named.spec).prefill_seconds(4096))
    with pytest.raises(ProfileError, match=r"ConfigMap measured .* not found"):
        perf_model(from_map.spec, None)
    with pytest.raises(ProfileError, match="ConfigMap measured lacks key"):
        perf_model(from_map.spec, {"data": {"prefill.csv": data["prefill.csv"]}})
    with pytest.raises(ProfileError, match=r"ConfigMap measured: .*decode\.csv"):
        perf_model(from_map.spec, {"data": {**data, "decode.csv": "nonsense\n1\n"}})


def test_config_map_profile_through_the_shell() -> None:
    data = {"prefill.csv": (PROFILE_DIR / "h200_llama31_8b_fp8_tp1_prefill.csv").read_text(),
            "decode.csv": (PROFILE_DIR / "h200_llama31_8b_fp8_tp1_decode.csv").read_text()}
    kube = FakeKube(PODS, {"measured": {"metadata": {"resourceVersion": "7"}, "data": data}})
    autoscaler(kube, FakePrometheus(busy_results()), [1000.0]).step(body(profile={"configMap": "measured"}))
    assert kube.status_patches[0]["autoscaler"]["profile"] == "profile measured"


CA = "-----BEGIN CERTIFICATE-----\nMIIB...\n-----END CERTIFICATE-----\n"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_the_token_and_ca_are_read_from_the_namespace_and_passed_to_the_client() -> None:
    kube = FakeKube(PODS, config_maps={"prom-ca": {"data": {"service-ca.crt": CA}}},
                    secrets={"prom-reader": {"data": {"token": b64("tok-123\n")}},
                             "prom-tls": {"data": {"ca.crt": b64(CA)}}})
    prom, now = FakePrometheus(busy_results()), [1000.0]
    scaler = autoscaler(kube, prom, now)
    https = {"url": "https://thanos.monitoring:9091", "bearerTokenSecretRef": {"name": "prom-reader"}}
    for prometheus, access in [
        ({**https, "tls": {"caSecretRef": {"name": "prom-tls"}}}, Access("tok-123", CA, False)),
        ({**https, "tls": {"caConfigMapRef": {"name": "prom-ca", "key": "service-ca.crt"}}},
         Access("tok-123", CA, False)),
        ({"url": "https://p:9091", "tls": {"insecureSkipVerify": True}}, Access(None, None, True)),
        ({"url": "http://prometheus.monitoring:9090"}, Access()),
    ]:
        now[0] += 30
        scaler.step(body(prometheus=prometheus))
        assert prom.connections[-1] == (prometheus["url"], access)
        assert condition(kube.status_patches[-1])["reason"] == "ValidMetrics"
    assert kube.reads == [("Secret", "team-a", "prom-reader"), ("Secret", "team-a", "prom-tls"),
                          ("Secret", "team-a", "prom-reader"), ("ConfigMap", "team-a", "prom-ca")]


@pytest.mark.parametrize(("prometheus", "message"), [
    ({"bearerTokenSecretRef": {"name": "absent"}},
     "Secret absent (autoscaling.prometheus.bearerTokenSecretRef) not found"),
    ({"bearerTokenSecretRef": {"name": "prom-reader", "key": "password"}},
     "Secret prom-reader (autoscaling.prometheus.bearerTokenSecretRef) has no key password"),
    ({"bearerTokenSecretRef": {"name": "blank"}},
     "Secret blank (autoscaling.prometheus.bearerTokenSecretRef): key token is empty"),
    ({"bearerTokenSecretRef": {"name": "forbidden"}},
     'Secret forbidden cannot be read: HTTP 403: GET /api/v1/namespaces/team-a/secrets/forbidden: secrets '
     '"forbidden" is forbidden'),
    ({"tls": {"caSecretRef": {"name": "prom-reader"}}},
     "Secret prom-reader (autoscaling.prometheus.tls.caSecretRef) has no key ca.crt"),
    ({"tls": {"caSecretRef": {"name": "prom-reader", "key": "token"}}},
     "Secret prom-reader (autoscaling.prometheus.tls.caSecretRef): key token holds no PEM certificate"),
    ({"tls": {"caConfigMapRef": {"name": "absent"}}},
     "ConfigMap absent (autoscaling.prometheus.tls.caConfigMapRef) not found"),
    ({"tls": {"caSecretRef": {"name": "garbled"}}},
     "Secret garbled (autoscaling.prometheus.tls.caSecretRef): key ca.crt is not UTF-8 text"),
])
def test_missing_credentials_hold_and_say_why(prometheus: JSON, message: str) -> None:
    kube = FakeKube(PODS, secrets={"prom-reader": {"data": {"token": b64("tok")}},
                                   "blank": {"data": {"token": b64(" \n")}},
                                   "garbled": {"data": {"ca.crt": "not base64!"}}})
    prom = FakePrometheus(busy_results())
    assert autoscaler(kube, prom, [1000.0]).step(body(prometheus={"url": "https://p:9091", **prometheus})) is False
    (patch,) = kube.status_patches
    assert (patch["prefill"]["desiredReplicas"], patch["decode"]["desiredReplicas"]) == (1, 2)
    assert condition(patch)["status"] == "False" and condition(patch)["reason"] == "MetricsUnavailable"
    assert condition(patch)["message"] == patch["autoscaler"]["lastDecision"]["message"]
    assert condition(patch)["message"].endswith(f": {message}")
    assert kube.events == [("Warning", "MetricsUnavailable", condition(patch)["message"])]
    assert prom.connections == []      # nothing was sent without the credentials


def test_engine_limits_come_from_the_engine_args() -> None:
    obj = body()
    obj["spec"]["engine"] = {"extraArgs": ["--max-num-seqs=128"]}
    obj["spec"]["decode"]["extraArgs"] = ["--max-num-batched-tokens", "4096"]
    serving = parse_serving(obj)
    config = config_for(serving, perf_model(serving.spec))
    assert (config.model.max_num_seqs, config.model.max_num_batched_tokens) == (128, 4096)


def test_reconcile_follows_the_decision_and_keeps_the_condition() -> None:
    obj = body()
    obj["status"]["prefill"]["desiredReplicas"] = 0
    serving = parse_serving(obj)
    assert desired_replicas(serving)["prefill"] == 1   # no decision yet: the spec, clamped to min 1
    obj["spec"]["autoscaling"]["prefill"]["minReplicas"] = 0   # (minReplicas 0 takes both roles)
    obj["spec"]["autoscaling"]["decode"]["minReplicas"] = 0
    obj["status"]["autoscaler"] = {"lastDecision": {"time": "2026-12-01T00:00:00Z", "prefill": 0, "decode": 2,
                                                    "reason": "DemandFell"}}
    obj["status"]["conditions"] = [{"type": "ScalingActive", "status": "True", "reason": "ValidMetrics",
                                    "message": "m", "lastTransitionTime": "2026-12-01T00:00:00Z"}]
    serving = parse_serving(obj)
    assert desired_replicas(serving)["prefill"] == 0   # a decided zero is kept
    status = compute_status(serving.spec, Observed(workloads={}, desired=desired_replicas(serving)),
                            obj["status"], 3, "http://x", "RDMA", "2026-12-01T00:01:00Z")
    (scaling,) = [c for c in status["conditions"] if c["type"] == "ScalingActive"]
    assert (scaling["status"], scaling["reason"], scaling["lastTransitionTime"]) == (
        "True", "ValidMetrics", "2026-12-01T00:00:00Z")


def test_an_idle_pool_is_not_a_metrics_problem() -> None:
    kube, now = FakeKube(PODS), [1000.0]
    idle = {"up": {"prefill": 1, "decode": 2}, "age": {"prefill": 3, "decode": 3}, "proxy_up": {"": 1},
            "proxy_rps": {"": 0.0}}
    assert autoscaler(kube, FakePrometheus(idle), now).step(body()) is False
    (patch,) = kube.status_patches
    assert patch["autoscaler"]["lastDecision"]["reason"] == "NoTraffic"
    assert condition(patch)["status"] == "True"
    assert kube.events == []



def test_a_new_process_resumes_from_the_decision_state_in_the_status(caplog: pytest.LogCaptureFixture) -> None:
    """The decision state goes into the status with each decision, and a process without its own
    (a restart, a hand-over) starts from it rather than empty."""
    kube, prom, now = FakeKube(PODS), FakePrometheus(busy_results()), [1000.0]
    obj = body(intervalSeconds=30)
    first = autoscaler(kube, prom, now)
    for _ in range(3):
        first.step(obj)
        obj["status"] = {**obj["status"], **kube.status_patches[-1]}
        now[0] += 30
    recorded = obj["status"]["autoscaler"]["state"]
    json.dumps(recorded, allow_nan=False)   # strict JSON, as the API server stores it
    assert recorded["rate"]["samples"] == 3 and recorded["time_s"] == 1060.0
    autoscaler(kube, prom, now).step(obj)
    assert kube.status_patches[-1]["autoscaler"]["state"]["rate"]["samples"] == 4   # continued, not restarted
    # A state it cannot use (another version): an empty start, said in the log.
    obj["status"]["autoscaler"]["state"] = {**recorded, "version": 99}
    with caplog.at_level("WARNING"):
        autoscaler(kube, prom, now).step(obj)
    assert kube.status_patches[-1]["autoscaler"]["state"]["rate"]["samples"] == 1
    assert "starting from an empty state" in caplog.text and "version 99" in caplog.text
    # A state older than the scale-down window and two intervals (300 + 60 s) is not used either.
    obj["status"]["autoscaler"]["state"] = recorded
    now[0] = recorded["time_s"] + 361
    autoscaler(kube, prom, now).step(obj)
    assert kube.status_patches[-1]["autoscaler"]["state"]["rate"]["samples"] == 1
    now[0] = recorded["time_s"] + 359
    autoscaler(kube, prom, now).step(obj)
    assert kube.status_patches[-1]["autoscaler"]["state"]["rate"]["samples"] == 4


def test_the_state_alone_is_no_reason_to_write_the_status() -> None:
    kube, prom, now = FakeKube(PODS), FakePrometheus(busy_results()), [1000.0]
    scaler = autoscaler(kube, prom, now)
    obj = body()
    patch = {"autoscaler": {"lastDecision": {"time": "t", "prefill": 1, "decode": 2, "reason": "WithinTargets"}}}
    scaler._write(obj, patch, AutoscalerState(time_s=1000.0))
    assert kube.status_patches[-1]["autoscaler"]["state"]["time_s"] == 1000.0
    obj["status"] = {**obj["status"], **kube.status_patches[-1]}
    scaler._write(obj, patch, AutoscalerState(time_s=1030.0))   # its clock moved; nothing else did
    assert len(kube.status_patches) == 1
    changed = {"autoscaler": {**patch["autoscaler"], "recommendedRatio": "1:2"}}
    scaler._write(obj, changed, AutoscalerState(time_s=1060.0))
    assert kube.status_patches[-1]["autoscaler"]["state"]["time_s"] == 1060.0


# --- looks at the gauges between decisions (autoscaling.reactSeconds) ---------------------------------


def calm_results() -> dict[str, Samples]:
    """busy_results' pool, served: 2 req/s of 2,000-token prompts, nothing waiting."""
    results = busy_results()
    results.update({
        "running": {"prefill": 1, "decode": 20}, "waiting": {"prefill": 0, "decode": 0},
        "prompt_tps": {"prefill": 4000.0}, "generation_tps": {"decode": 200.0},
        "success_rps": {"prefill": 2.0, "decode": 2.0}, "proxy_rps": {"": 2.0},
        "ttft.p50": {"": 0.1}, "ttft.p90": {"": 0.2}, "ttft.p99": {"": 0.3}, "ttft.mean": {"": 0.12},
        "request_queue_time_seconds.p90": {"prefill": 0.01, "decode": 0.001},
        "request_queue_time_seconds.p99": {"prefill": 0.02, "decode": 0.001},
        "request_queue_time_seconds.mean": {"prefill": 0.005, "decode": 0.001},
    })
    return results


def backlog(results: dict[str, Samples]) -> dict[str, Samples]:
    """The same pool 12 s later: 600 requests queued at prefill (1.2M prompt tokens, 100k tok/s of
    growth: a burst far past what its one replica serves)."""
    return {**results, "waiting": {"prefill": 600, "decode": 0}, "running": {"prefill": 8, "decode": 20}}


def applied(obj: JSON, patch: JSON) -> JSON:
    """`obj` with a status patch of the autoscaler applied as the API server merges it."""
    obj = copy.deepcopy(obj)
    status = obj.setdefault("status", {})
    for name, value in patch.items():
        status[name] = {**(status.get(name) or {}), **value} if name in ("prefill", "decode") else value
    return obj


def decided(mode: str, **autoscaling: Any) -> tuple[FakeKube, FakePrometheus, Autoscaler, list[float], JSON]:
    """A pool decided once on calm metrics (the decision's status applied), 12 s before a backlog."""
    kube, prom, now = FakeKube(PODS), FakePrometheus(calm_results()), [1000.0]
    scaler = autoscaler(kube, prom, now)
    obj = body(mode, profile={"name": "h200_llama31_8b_fp8_tp1"}, **autoscaling)
    scaler.step(obj)
    (patch,) = kube.status_patches
    assert patch["autoscaler"]["lastDecision"]["prefill"] == 1      # calm: nothing to add
    kube.status_patches.clear()
    kube.events.clear()
    prom.results = backlog(calm_results())
    now[0] += 12.0
    return kube, prom, scaler, now, applied(obj, patch)


def test_a_backlog_between_decisions_grows_the_role_at_once_in_auto_mode() -> None:
    kube, prom, scaler, now, obj = decided("Auto")
    assert scaler.look_due(obj, now[0]) and not scaler.due(obj, now[0])
    assert scaler.look(obj) is True                                   # the reconcile must act
    assert prom.gauge_reads == 1                                      # one batch of gauge queries
    (patch,) = kube.status_patches
    decision = patch["autoscaler"]["lastDecision"]
    assert decision["reason"] == "PrefillQueueing" and "between decisions" in decision["message"]
    assert patch["prefill"]["desiredReplicas"] == decision["prefill"] > 1
    assert patch["decode"]["desiredReplicas"] == decision["decode"] == 2  # never down, decode untouched
    # The window's figures stay the decision's; the gauges' are the look's.
    assert patch["autoscaler"]["observed"]["requestRate"] == 2.0
    assert patch["autoscaler"]["observed"]["prefillQueue"] == 600.0
    assert patch["autoscaler"]["state"]                               # kept for a hand-over
    ((kind, reason, message),) = kube.events
    assert (kind, reason) == ("Normal", "PrefillQueueing") and message.startswith(f"prefill 1->{decision['prefill']}")
    llama = {"namespace": "team-a", "name": "llama"}
    series = scrape(scaler)
    assert series[key("xpyd_autoscaler_decisions_total", **llama, reason="PrefillQueueing")] == 1
    assert series[key("xpyd_autoscaler_desired_replicas", **llama, role="prefill")] == decision["prefill"]
    # Looks every reactSeconds, not before; the replicas ordered (their pods not in the cache yet)
    # are not ordered again.
    assert not scaler.look_due(obj, now[0] + 4.0)
    now[0] += 5.0
    assert scaler.look(applied(obj, patch)) is False and len(kube.status_patches) == 1 and len(kube.events) == 1


def test_recommend_mode_never_looks() -> None:
    """A recommendation comes at decisions only: a look sized from pods that never follow it would
    raise what the next decision lowers again, an Event each way, for as long as a backlog lasts."""
    kube, prom, scaler, now, obj = decided("Recommend")
    assert not scaler.look_due(obj, now[0]) and scaler.look(obj) is False
    assert (prom.gauge_reads, kube.status_patches, kube.events) == (0, [], [])


def test_off_mode_never_looks() -> None:
    kube, prom, scaler, now, obj = decided("Auto")
    obj["spec"]["autoscaling"]["mode"] = "Off"
    obj["metadata"]["generation"] = 4
    assert not scaler.look_due(obj, now[0]) and scaler.look(obj) is False
    assert scaler.step(obj) is False                                  # forgets the object
    assert scaler.look(obj) is False
    assert (prom.gauge_reads, kube.status_patches, kube.events) == (0, [], [])


@pytest.mark.parametrize("react_seconds", [0, 30, 45])
def test_react_seconds_zero_or_at_least_the_interval_never_looks(react_seconds: int) -> None:
    """0 turns the looks off; at or above intervalSeconds (30 here) the next decision comes first."""
    kube, prom, scaler, now, obj = decided("Auto", reactSeconds=react_seconds)
    assert obj["spec"]["autoscaling"].get("intervalSeconds", 30) == 30
    assert not scaler.look_due(obj, now[0] + 29) and scaler.look(obj) is False
    assert (prom.gauge_reads, kube.status_patches) == (0, [])


def test_no_look_before_a_decision_of_this_process_or_after_a_spec_change() -> None:
    kube, prom, now = FakeKube(PODS), FakePrometheus(backlog(calm_results())), [1000.0]
    scaler = autoscaler(kube, prom, now)
    obj = body(profile={"name": "h200_llama31_8b_fp8_tp1"})
    assert not scaler.look_due(obj, now[0]) and scaler.look(obj) is False   # nothing to react from yet
    kube, prom, scaler, now, obj = decided("Auto")
    obj["metadata"]["generation"] = 4                                 # a decision is due instead
    assert scaler.due(obj, now[0]) and not scaler.look_due(obj, now[0]) and scaler.look(obj) is False
    assert prom.gauge_reads == 0


def test_without_prometheus_a_look_does_nothing() -> None:
    kube, prom, scaler, now, obj = decided("Auto")
    prom.results = None
    assert scaler.look(obj) is False
    assert (prom.gauge_reads, kube.status_patches, kube.events) == (1, [], [])
    assert scaler.look_due(obj, now[0] + 5.0)                         # tried again at the next look


def test_calm_gauges_change_nothing() -> None:
    kube, prom, scaler, _, obj = decided("Auto")
    prom.results = calm_results()
    assert scaler.look(obj) is False
    assert (prom.gauge_reads, kube.status_patches, kube.events) == (1, [], [])


def test_the_operator_loop_starts_a_look_between_decisions_and_queues_the_reconcile() -> None:
    kube, prom, scaler, _, obj = decided("Auto")
    kube.objects["DisaggregatedServing"] = {"llama": obj}
    kube.list_servings = lambda scope: [obj]  # type: ignore[attr-defined]
    runtime = OperatorRuntime(kube=cast(Kube, kube), operator_image="x", resync_seconds=60, namespaces=["team-a"],
                              autoscaler=scaler, use_cache=False)
    runtime.autoscale_due()
    assert runtime._decisions is not None
    runtime._decisions.shutdown(wait=True)
    assert prom.gauge_reads == 1 and len(prom.scopes) == 2           # the first decision, then one look
    assert kube.status_patches[0]["autoscaler"]["lastDecision"]["reason"] == "PrefillQueueing"
    assert runtime.queue.get(timeout=0) == ("team-a", "llama")       # the reconcile applies it
    assert not runtime._deciding


def test_a_look_keeps_what_the_last_decision_asks_of_the_roles_it_does_not_grow() -> None:
    kube, _, scaler, _, obj = decided("Auto")
    obj["status"]["decode"]["desiredReplicas"] = 1     # a scale-down ordered; the cache still has 2 decode pods
    obj["status"]["prefill"]["desiredReplicas"] = 2    # and a scale-up whose pod is not there yet
    assert scaler.look(obj) is True
    (patch,) = kube.status_patches
    assert patch["decode"]["desiredReplicas"] == 1                    # not undone
    assert patch["prefill"]["desiredReplicas"] == patch["autoscaler"]["lastDecision"]["prefill"] > 2
    assert patch["autoscaler"]["lastDecision"]["decode"] == 1
    ((_, _, message),) = kube.events
    # The prefill pod asked for but not in the cache yet counts as starting (collect.with_asked).
    assert message.startswith("prefill 2->") and "decode" not in message.split(":")[0]


def test_a_decision_right_after_a_look_keeps_the_replicas_the_look_asked_for() -> None:
    """The look's new pods are not in the cache yet when the decision comes: they count as starting,
    so the decision neither orders them back nor sizes from the one pod it sees."""
    kube, _, scaler, now, obj = decided("Auto")
    assert scaler.look(obj) is True
    (patch,) = kube.status_patches
    grown = patch["prefill"]["desiredReplicas"]
    assert grown > 1
    obj = applied(obj, patch)
    now[0] += 18.0                                                    # the interval is up; still 1 prefill pod
    assert scaler.due(obj, now[0])
    scaler.step(obj)
    decision = kube.status_patches[-1]
    assert decision["prefill"]["desiredReplicas"] >= grown
    now[0] += ASKED_POD_LAG_S + 1.0                                  # long after: the pods seen are the pool
    assert _asked(applied(obj, decision), AutoscalingMode.AUTO, now[0]) == {}
