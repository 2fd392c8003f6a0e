"""The SLO-driven autoscaler on the local control plane: real Prometheus scraping emulated engines
and proxies, load from `xpyd bench` through a proxy pod, the operator (installed by Helm) deciding.

- a prefill-heavy slice of the code trace grows prefill more than decode; a decode-heavy slice of
  the conv trace the reverse (each with the decision's Event and the operator's metrics);
- steady load: replicas settle and then stay put;
- Recommend reports and never scales;
- Prometheus stopped: replicas hold and ScalingActive=False says why; back: scaling resumes.

Every load is bounded (duration, request count) and goes to a proxy pod's loopback IP.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from e2e.cluster import OPERATOR_NAMESPACE, ROOT, Cluster, condition, eventually, serving_of, wait_ready
from xpyd.autoscaler.state import decode as decode_state
from xpyd.cluster.controlplane import ControlPlane
from xpyd.common.netguard import LOOPBACK_ONLY_ENV, require_loopback, require_loopback_url

pytestmark = pytest.mark.e2e

TRACES = ROOT / "tests" / "fixtures" / "traces"  # slices of data/traces (see its README)
MODEL = "llama-8b"


def autoscaled(name: str, prometheus: str, mode: str = "Auto", tpot_ms: int = 15) -> str:
    """An autoscaled pool sized by the bundled H200 profile the emulated engines run, deciding every
    5 s over 20 s windows (Prometheus scrapes every 5 s here) and looking at the gauges every 2 s
    between decisions (reactSeconds must be under intervalSeconds), with a short start-up (engine-sim
    serves at once)."""
    return yaml.safe_dump({
        "apiVersion": "xpyd.io/v1alpha1", "kind": "DisaggregatedServing", "metadata": {"name": name},
        "spec": {
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "servedModelName": MODEL},
            "prefill": {"gpu": {"product": "NVIDIA-H200"}},
            "decode": {"gpu": {"product": "NVIDIA-H200"}},
            "autoscaling": {
                "mode": mode, "prometheus": {"url": prometheus, "windowSeconds": 20},
                "slo": {"ttftMs": 500, "tpotMs": tpot_ms, "percentile": 90},
                "prefill": {"minReplicas": 1, "maxReplicas": 4}, "decode": {"minReplicas": 1, "maxReplicas": 4},
                "intervalSeconds": 5, "reactSeconds": 2, "startupSeconds": 10,
                "profile": {"name": "h200_llama31_8b_fp8_tp1"},
            },
        },
    })


def prometheus_url(cluster: Cluster) -> str:
    url = cluster.state.prometheus_url
    assert url is not None, "Prometheus did not start (run e2e/build/prometheus.sh)"
    return require_loopback_url(url)


def proxy_address(cluster: Cluster, namespace: str, name: str) -> str:
    """A ready proxy pod's address (pod IPs are loopback here; Service ClusterIPs are never dialled)."""
    pods = cluster.get("pods", "-n", namespace, "-l", f"xpyd.io/serving={name},xpyd.io/role=proxy")["items"]
    for pod in pods:
        if any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", [])):
            port = pod["spec"]["containers"][0]["ports"][0]["containerPort"]
            return f"http://{require_loopback(pod['status']['podIP'])}:{port}"
    raise AssertionError(f"no ready proxy pod of {name}")


def bench(url: str, *args: str, wall_s: float) -> subprocess.Popen[str]:
    """`xpyd bench` against `url`, loopback only, in the background (bounded by its own arguments
    and by `timeout` here)."""
    return subprocess.Popen(
        ["timeout", str(int(wall_s + 60)), sys.executable, "-m", "xpyd.cli", "bench", "--url", url, "--model", MODEL,
         "--max-concurrency", "256", "--timeout", "60", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, LOOPBACK_ONLY_ENV: "1"})


def finish(process: subprocess.Popen[str]) -> str:
    output, _ = process.communicate(timeout=180)
    assert process.returncode == 0, output
    return output


@dataclass
class Recorder:
    """Samples of the replicas the operator asks for (the Deployments' spec.replicas) while load runs."""

    cluster: Cluster
    namespace: str
    name: str
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def replicas(self) -> tuple[int, int]:
        sizes = []
        for role in ("prefill", "decode"):
            deployment = self.cluster.get("deployment", "-n", self.namespace, f"{self.name}-{role}") or {}
            sizes.append(int(deployment.get("spec", {}).get("replicas", 0)))
        return sizes[0], sizes[1]

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), *self.replicas()))
            self._stop.wait(2.0)

    def __enter__(self) -> Recorder:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def changes(self, since: float = 0.0) -> int:
        sizes = [(p, d) for t, p, d in self.samples if t >= since]
        return sum(1 for a, b in itertools.pairwise(sizes) if a != b)

    def peak(self) -> tuple[int, int]:
        return max(p for _, p, _ in self.samples), max(d for _, _, d in self.samples)


def events(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    items = cluster.get("events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")["items"]
    return sorted(items, key=lambda e: e.get("metadata", {}).get("creationTimestamp", ""))


def operator_metrics(cluster: Cluster) -> list[tuple[str, dict[str, str]]]:
    """The operator's /metrics: (sample name, labels) of every sample."""
    (pod,) = [p for p in cluster.get("pods", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/name=xpyd-operator")[
        "items"] if not p["metadata"].get("deletionTimestamp")]  # a replica of an earlier test may still be going
    url = require_loopback_url(f"http://{require_loopback(pod['status']['podIP'])}:8081/metrics")
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return [(sample.name, sample.labels) for family in text_string_to_metric_families(text)
            for sample in family.samples]


def start(cluster: Cluster, namespace: str, name: str, mode: str = "Auto") -> str:
    cluster.apply(autoscaled(name, prometheus_url(cluster), mode), namespace)
    wait_ready(cluster, namespace, name)
    return proxy_address(cluster, namespace, name)


# ------------------------------------------------------------------------------------------------


def replay_slice(cluster: Cluster, namespace: str, name: str, trace: str, speedup: str) -> tuple[int, int, set[str]]:
    """A minute of a trace slice through a fresh pool (TPOT target 15 ms, so decode sizing binds):
    the peak (prefill, decode) replicas and the reasons of the Normal Events."""
    url = start(cluster, namespace, name)
    load = bench(url, "--trace", str(TRACES / trace), "--speedup", speedup, "--slo-tpot-ms", "15", wall_s=60)
    with Recorder(cluster, namespace, name) as recorder:
        output = finish(load)
    prefill, decode = recorder.peak()
    reasons = {e["reason"] for e in events(cluster, namespace, name) if e["type"] == "Normal"}
    print(f"{name}: peak prefill {prefill}, decode {decode}; samples {recorder.samples}; reasons {reasons}\n{output}")
    return prefill, decode, reasons


def test_prefill_heavy_code_slice_grows_prefill_more_than_decode(operator: Cluster, namespace: str) -> None:
    # 12 trace-minutes of the code trace at x12: ~2,000-token prompts, ~28-token answers.
    prefill, decode, reasons = replay_slice(operator, namespace, "code", "azure_code_2023_600s_720s.csv", "12")
    assert prefill - 1 > decode - 1, (prefill, decode)
    assert reasons & {"PrefillQueueing", "PrefillDemand"}, reasons
    grew = [e["message"] for e in events(operator, namespace, "code") if e["reason"] in ("PrefillQueueing",
                                                                                      "PrefillDemand")]
    assert grew and grew[0].startswith("prefill 1->"), grew
    obj = serving_of(operator, namespace, "code")
    assert condition(obj, "ScalingActive")["status"] == "True"
    decision = obj["status"]["autoscaler"]["lastDecision"]
    assert decision["reason"] and decision["message"]
    assert obj["status"]["autoscaler"]["observed"]["isl"] > 1000
    # The proxy's arrival histogram reached the decision through Prometheus, per slot length, in the
    # engines' tokens: a request's slot holds at least its own prompt, a 4 s slot more than a 0.25 s one.
    arrivals = obj["status"]["autoscaler"]["observed"]["arrivalPromptTokens"]
    assert set(arrivals) == {"0.25", "1", "4"} and arrivals["4"] >= arrivals["0.25"] > 1000, arrivals
    # The API server keeps the decision state a restarted operator resumes from, and it decodes.
    state = decode_state(obj["status"]["autoscaler"]["state"])
    assert state.rate.samples >= 1
    metrics = operator_metrics(operator)
    code = {"namespace": namespace, "name": "code"}
    assert ("xpyd_autoscaler_desired_replicas", {**code, "role": "prefill"}) in metrics
    assert ("xpyd_autoscaler_decisions_total", {**code, "reason": "PrefillDemand"}) in metrics \
        or ("xpyd_autoscaler_decisions_total", {**code, "reason": "PrefillQueueing"}) in metrics


def test_decode_heavy_conv_slice_grows_decode_more_than_prefill(operator: Cluster, namespace: str) -> None:
    # 4 trace-minutes of the conv trace at x4: ~1,100-token prompts, ~220-token answers.
    prefill, decode, reasons = replay_slice(operator, namespace, "conv", "azure_conv_2023_600s_240s.csv", "4")
    assert decode - 1 > prefill - 1, (prefill, decode)
    assert reasons & {"TpotOverTarget", "DecodeDemand", "DecodeAdmission"}, reasons


def test_steady_load_settles_and_stays(operator: Cluster, namespace: str) -> None:
    url = start(operator, namespace, "steady")
    load = bench(url, "--rate", "8", "--isl", "4096", "--osl", "16", "--duration", "100", "--slo-tpot-ms", "15",
                 wall_s=100)
    started = time.monotonic()
    with Recorder(operator, namespace, "steady") as recorder:
        finish(load)
    # After 40 s of settling, at most one more change in the remaining minute of unchanged load
    # (scale-down needs a full 300 s stabilisation window, so none can come from noise).
    assert recorder.changes(since=started + 40) <= 1, recorder.samples
    assert recorder.peak()[0] >= 1


def test_recommend_mode_never_scales(operator: Cluster, namespace: str) -> None:
    url = start(operator, namespace, "advice", mode="Recommend")
    load = bench(url, "--rate", "12", "--isl", "4096", "--osl", "16", "--duration", "40", "--slo-tpot-ms", "15",
                 wall_s=40)
    with Recorder(operator, namespace, "advice") as recorder:
        finish(load)
        recommended = eventually(lambda: (lambda o: o if o["status"]["autoscaler"]["lastDecision"]["prefill"] > 1
                                          else None)(serving_of(operator, namespace, "advice")),
                                 timeout=30, what="a recommendation of more prefill")
    assert recorder.peak() == (1, 1) and recorder.changes() == 0, recorder.samples
    assert recommended["status"]["prefill"]["desiredReplicas"] == 1
    scaling = condition(recommended, "ScalingActive")
    assert (scaling["status"], scaling["reason"]) == ("False", "RecommendOnly")
    assert any(e["message"].startswith("recommends prefill") for e in events(operator, namespace, "advice"))


@pytest.fixture
def prometheus_control(operator: Cluster) -> Iterator[ControlPlane]:
    plane = ControlPlane(Path(operator.state.state_dir), operator.binaries)
    try:
        yield plane
    finally:
        plane.start_prometheus()  # the other tests need it back


def test_without_prometheus_replicas_hold_and_the_condition_says_why(
        operator: Cluster, namespace: str, prometheus_control: ControlPlane) -> None:
    url = start(operator, namespace, "blind")
    finish(bench(url, "--rate", "4", "--isl", "1024", "--osl", "16", "--duration", "15", wall_s=15))
    eventually(lambda: condition(serving_of(operator, namespace, "blind"), "ScalingActive").get("status") == "True",
               timeout=30, what="ScalingActive=True with metrics")
    before = Recorder(operator, namespace, "blind").replicas()

    prometheus_control.stop_prometheus()
    held = eventually(lambda: (lambda c: c if c.get("reason") == "MetricsUnavailable" else None)(
        condition(serving_of(operator, namespace, "blind"), "ScalingActive")), timeout=30, what="MetricsUnavailable")
    assert held["status"] == "False" and "cannot be read" in held["message"], held
    time.sleep(12)  # two more decisions without metrics: nothing moves
    assert Recorder(operator, namespace, "blind").replicas() == before
    warnings = [e for e in events(operator, namespace, "blind") if e["reason"] == "MetricsUnavailable"]
    assert len(warnings) == 1 and warnings[0]["type"] == "Warning", "\n".join(
        f'{e["firstTimestamp"]} {e["reason"]}: {e["message"]}' for e in events(operator, namespace, "blind"))

    prometheus_control.start_prometheus()
    deadline = time.monotonic() + 60
    while (scaling := condition(serving_of(operator, namespace, "blind"), "ScalingActive"))["status"] != "True":
        assert time.monotonic() < deadline, f"ScalingActive not True 60 s after Prometheus came back: {scaling}"
        time.sleep(1)
    assert any(e["reason"] == "MetricsAvailable" for e in events(operator, namespace, "blind"))
