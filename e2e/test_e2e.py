"""What users do, against a real API server: helm install, kubectl apply of every sample, updates,
drift, GPU shortage, invalid input, deletion, operator restarts, a standby operator taking over, and
the plain manifests."""

from __future__ import annotations

import copy
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import (
    OPERATOR_NAMESPACE,
    RELEASE,
    ROOT,
    Cluster,
    condition,
    eventually,
    pods_of,
    provide_prerequisites,
    serving_of,
    wait_ready,
)
from tests.servings import INVALID, SCHEMA_INVALID, TRANSITIONS, serving
from xpyd.api.load import load_servings
from xpyd.cluster.controlplane import ControlPlane
from xpyd.common.netguard import NonLoopbackAddress, require_loopback, require_loopback_url
from xpyd.controller.leader import Timing
from xpyd.controller.main import LEASE_NAME

pytestmark = pytest.mark.e2e

SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))
#: The GPU samples; the CPU one runs as real vLLM in e2e/test_real_vllm.py (its engines are heavy here).
GPU_SAMPLES = [s for s in SAMPLES if not any(obj.spec.on_cpu for obj in load_servings(s.read_text(), str(s)))]
OPERATOR_SA = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{RELEASE}"

# The reviewed RBAC of the operator: resource -> verbs (kubectl auth can-i --list, cluster-wide).
OPERATOR_RBAC = {
    "disaggregatedservings.xpyd.io": {"get", "list", "watch"},
    "disaggregatedservings.xpyd.io/status": {"get", "patch"},
    "deployments.apps": {"get", "list", "watch", "create", "patch", "delete"},  # a role turning multi-node
    "services": {"get", "list", "watch", "create", "patch"},
    "serviceaccounts": {"get", "list", "watch", "create", "patch"},
    "poddisruptionbudgets.policy": {"get", "list", "watch", "create", "patch"},
    "roles.rbac.authorization.k8s.io": {"get", "list", "watch", "create", "patch"},
    "rolebindings.rbac.authorization.k8s.io": {"get", "list", "watch", "create", "patch"},
    "pods": {"get", "list", "watch"},
    "pods/status": {"patch"},  # only to grant it to the proxies (their KV-transfer health condition)
    "events": {"create"},
    "configmaps": {"get"},
    "secrets": {"get"},   # by name only: the autoscaler's Prometheus token and CA
    # rbac.leaderWorkerSet=auto: the local cluster serves LeaderWorkerSets
    "leaderworkersets.leaderworkerset.x-k8s.io": {"get", "list", "watch", "create", "patch", "delete"},
}


def manifest(obj: dict[str, Any]) -> str:
    """YAML of a unit-test object, without its namespace (kubectl puts it in the test's own)."""
    obj = copy.deepcopy(obj)
    obj["metadata"].pop("namespace", None)
    return yaml.safe_dump(obj)


# ------------------------------------------------------------------------------------------------
# Install


def test_helm_install_runs_the_operator_as_a_pod(operator: Cluster) -> None:
    assert operator.get("crd", "disaggregatedservings.xpyd.io") is not None
    (pod,) = operator.get("pods", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/name=xpyd-operator")["items"]
    assert pod["spec"]["nodeName"] == "cpu-0"  # not on a tainted GPU node
    ip = pod["status"]["podIP"]
    require_loopback(ip)
    # The operator is a real process at its pod IP: its liveness endpoint answers.
    with urllib.request.urlopen(require_loopback_url(f"http://{ip}:8080/healthz"), timeout=5) as response:
        assert response.status == 200


def test_operator_rbac_is_exactly_what_it_needs(operator: Cluster) -> None:
    listing = operator.kubectl("auth", "can-i", "--list", f"--as={OPERATOR_SA}").stdout
    granted: dict[str, set[str]] = {}
    for line in listing.splitlines()[1:]:
        resource = line.split()[0]
        verbs = line[line.rindex("[") + 1:line.rindex("]")].split()  # the last column: "[get list ...]"
        if resource in OPERATOR_RBAC:
            granted[resource] = set(verbs)
    assert granted == OPERATOR_RBAC
    for forbidden in ("delete services", "list secrets", "watch secrets", "create pods", "delete pods",
                      "create clusterroles", "list configmaps"):
        verb, resource = forbidden.split()
        assert operator.kubectl("auth", "can-i", verb, resource, f"--as={OPERATOR_SA}",
                                check=False).stdout.strip() == "no", forbidden


# ------------------------------------------------------------------------------------------------
# Samples


@pytest.mark.parametrize("sample", GPU_SAMPLES, ids=[s.stem for s in GPU_SAMPLES])
def test_sample_becomes_ready_on_matching_gpu_nodes(operator: Cluster, namespace: str, sample: Path) -> None:
    (spec_obj,) = load_servings(sample.read_text())
    name = spec_obj.metadata.name
    provide_prerequisites(operator, namespace, spec_obj)
    operator.apply(sample, namespace)
    obj = wait_ready(operator, namespace, name)
    spec = spec_obj.spec
    assert obj["status"]["prefill"]["ready"] == f"{spec.prefill.replicas}/{spec.prefill.replicas}"
    assert obj["status"]["decode"]["ready"] == f"{spec.decode.replicas}/{spec.decode.replicas}"
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]

    nodes = {n["metadata"]["name"]: n for n in operator.get("nodes")["items"]}
    for role in ("prefill", "decode"):
        role_spec = getattr(spec, role)
        pods = pods_of(operator, namespace, name, role)
        assert len(pods) == role_spec.replicas * role_spec.nodes_per_replica
        for pod in pods:
            node = nodes[pod["spec"]["nodeName"]]
            assert node["metadata"]["labels"].get("nvidia.com/gpu.product") == role_spec.gpu.product
            assert int(node["status"]["allocatable"]["nvidia.com/gpu"]) >= role_spec.gpus
            require_loopback(pod["status"]["podIP"])

    table = operator.kubectl("get", "xpyd", "-n", namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "PREFILL", "DECODE", "READY", "SCALING", "AGE"]
    row = table[1].split()
    assert row[:4] == [name, f"{spec.prefill.replicas}/{spec.prefill.replicas}",
                       f"{spec.decode.replicas}/{spec.decode.replicas}", "True"]
    wide = operator.kubectl("get", "xpyd", "-n", namespace, "-o", "wide").stdout.splitlines()[0].split()
    assert {"CONNECTOR", "TTFT-MS", "TPOT-MS", "ENDPOINT"} <= set(wide)


# ------------------------------------------------------------------------------------------------
# Lifecycle


NIXL = ROOT / "manifests" / "samples" / "nixl.yaml"


def test_update_rolls_out_and_status_follows(operator: Cluster, namespace: str) -> None:
    operator.apply(NIXL, namespace)
    before = wait_ready(operator, namespace, "llama-8b")
    operator.kubectl("patch", "xpyd", "llama-8b", "-n", namespace, "--type=merge", "-p", json.dumps({"spec": {
        "engine": {"image": "vllm/vllm-openai:v0.33.1", "extraArgs": ["--enable-prefix-caching"]},
        "decode": {"replicas": 3}}}))
    after = eventually(lambda: (lambda o: o if o["status"]["decode"]["ready"] == "3/3"
                                and o["status"]["observedGeneration"] == o["metadata"]["generation"]
                                and condition(o, "Progressing").get("status") == "False" else None)(
        serving_of(operator, namespace, "llama-8b")), timeout=90, what="rollout")
    assert after["metadata"]["generation"] == before["metadata"]["generation"] + 1
    for role in ("prefill", "decode"):
        for pod in pods_of(operator, namespace, "llama-8b", role):
            container = pod["spec"]["containers"][0]
            assert container["image"] == "vllm/vllm-openai:v0.33.1"
            assert "--enable-prefix-caching" in container["args"]


def test_drift_is_restored(operator: Cluster, namespace: str) -> None:
    operator.apply(NIXL, namespace)
    wait_ready(operator, namespace, "llama-8b")
    operator.kubectl("delete", "deployment", "llama-8b-decode", "-n", namespace)
    operator.kubectl("scale", "deployment", "llama-8b-prefill", "-n", namespace, "--replicas=4")
    operator.kubectl("delete", "service", "llama-8b-proxy", "-n", namespace)
    eventually(lambda: operator.get("deployment", "-n", namespace, "llama-8b-decode"), what="decode back")
    eventually(lambda: operator.get("service", "-n", namespace, "llama-8b-proxy"), what="proxy Service back")
    eventually(lambda: (operator.get("deployment", "-n", namespace, "llama-8b-prefill") or {})
               .get("spec", {}).get("replicas") == 1, what="prefill replicas restored")
    wait_ready(operator, namespace, "llama-8b")


def test_not_enough_gpus_degrades_without_flapping(operator: Cluster, namespace: str) -> None:
    big = serving({"prefill": {"tensorParallelSize": 8, "gpu": {"product": "NVIDIA-H200"}},
                   "decode": {"replicas": 3, "tensorParallelSize": 8, "gpu": {"product": "NVIDIA-H200"}}},
                  name="too-big")
    operator.apply(manifest(big), namespace)
    degraded = eventually(lambda: condition(serving_of(operator, namespace, "too-big"), "Degraded")
                          if condition(serving_of(operator, namespace, "too-big"), "Degraded").get("status") == "True"
                          else None, what="Degraded=True")
    assert degraded["reason"] == "InsufficientGPUs" and "Insufficient nvidia.com/gpu" in degraded["message"]
    pending = [p for role in ("prefill", "decode") for p in pods_of(operator, namespace, "too-big", role)
               if p["status"].get("phase") == "Pending"]
    assert len(pending) >= 1
    # Stable: the condition does not flip back and forth while nothing changes.
    time.sleep(10)
    again = condition(serving_of(operator, namespace, "too-big"), "Degraded")
    assert again["status"] == "True" and again["lastTransitionTime"] == degraded["lastTransitionTime"]
    events = operator.get("events", "-n", namespace, "--field-selector", "reason=InsufficientGPUs")["items"]
    assert len(events) == 1


# ------------------------------------------------------------------------------------------------
# Bad input: the API server itself refuses, with the rule's message


# Every CEL rule (the error names the rule's message) and every schema rule (it names the field).
REJECTED = INVALID + SCHEMA_INVALID


@pytest.fixture(scope="module")
def rejections_namespace(operator: Cluster) -> Iterator[str]:
    """One namespace for all rejection cases: nothing is ever created in it."""
    operator.kubectl("create", "namespace", "e2e-rejections")
    yield "e2e-rejections"
    operator.kubectl("delete", "namespace", "e2e-rejections", "--wait=false")


@pytest.mark.parametrize(("obj", "expected"), [(o, e) for _, o, e in REJECTED], ids=[c for c, _, _ in REJECTED])
def test_api_server_rejects_invalid_input(operator: Cluster, rejections_namespace: str, obj: dict[str, Any],
                                          expected: str) -> None:
    result = operator.kubectl("apply", "-n", rejections_namespace, "-f", "-", stdin=manifest(obj), check=False)
    assert result.returncode != 0 and expected in result.stderr, result.stderr
    assert operator.get("xpyd", "-n", rejections_namespace)["items"] == []


@pytest.mark.parametrize(("change", "message"), [(c, m) for _, c, m in TRANSITIONS],
                         ids=[c for c, _, _ in TRANSITIONS])
def test_api_server_guards_immutable_fields(operator: Cluster, namespace: str, change: dict[str, Any],
                                            message: str) -> None:
    operator.apply(manifest(serving()), namespace)
    result = operator.kubectl("apply", "-n", namespace, "-f", "-", stdin=manifest(serving(change)), check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


# ------------------------------------------------------------------------------------------------
# Deletion and restarts


def test_delete_garbage_collects_children(operator: Cluster, namespace: str) -> None:
    operator.apply(NIXL, namespace)
    wait_ready(operator, namespace, "llama-8b")
    operator.kubectl("delete", "xpyd", "llama-8b", "-n", namespace, "--wait=true", timeout=60)
    selector = "xpyd.io/serving=llama-8b"
    for kind in ("deployments", "services", "poddisruptionbudgets", "serviceaccounts", "roles", "rolebindings"):
        eventually(lambda kind=kind: operator.get(kind, "-n", namespace, "-l", selector)["items"] == [],
                   what=f"{kind} garbage-collected")


def test_operator_restart_mid_reconcile_converges_without_duplicates(operator: Cluster, namespace: str) -> None:
    operator.apply(NIXL, namespace)
    operator.kubectl("delete", "pod", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/name=xpyd-operator",
                     "--wait=false")
    wait_ready(operator, namespace, "llama-8b", timeout=120)
    deployments = operator.get("deployments", "-n", namespace)["items"]
    assert sorted(d["metadata"]["name"] for d in deployments) == [
        "llama-8b-decode", "llama-8b-prefill", "llama-8b-proxy"]
    replica_sets = operator.get("replicasets", "-n", namespace)["items"]
    assert len(replica_sets) == 3  # one template each: nothing was rolled twice


def test_a_standby_replica_takes_over_when_the_leader_dies(operator: Cluster, namespace: str) -> None:
    """replicas=2: the Lease names one pod. Its process killed (no release), another candidate
    takes the Lease within the takeover bound and repairs a deleted child."""
    chart = str(ROOT / "charts" / "xpyd-operator")
    def scale(replicas: int) -> None:
        operator.run("helm", "upgrade", RELEASE, chart, "--namespace", OPERATOR_NAMESPACE, "--reuse-values",
                     "--set", f"replicas={replicas}", "--wait", "--timeout", "120s", timeout=180)
        eventually(lambda: (operator.get("deployment", "-n", OPERATOR_NAMESPACE, RELEASE) or {})
                   .get("status", {}).get("readyReplicas") == replicas, timeout=120, what=f"{replicas} replicas ready")

    def holder() -> str:
        lease = operator.get("lease", "-n", OPERATOR_NAMESPACE, LEASE_NAME) or {}
        return str(lease.get("spec", {}).get("holderIdentity") or "")

    scale(2)
    try:
        operator.apply(NIXL, namespace)
        wait_ready(operator, namespace, "llama-8b", timeout=120)
        leader = eventually(holder, what="a leader")
        pods = {p["metadata"]["name"]: p for p in operator.get(
            "pods", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/name=xpyd-operator")["items"]
            if not p["metadata"].get("deletionTimestamp")}
        assert len(pods) == 2
        (pod,) = [p for name, p in pods.items() if leader.startswith(f"{name}_")]
        pid = int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("xpyd://"))
        os.killpg(pid, signal.SIGKILL)  # a crash: the Lease is not released
        killed = time.monotonic()
        eventually(lambda: holder() not in ("", leader), timeout=60, interval=0.2, what="another holder")
        took = time.monotonic() - killed
        print(f"\ntakeover after the leader's death: {took:.1f} s (bound {Timing().takeover_bound:.0f} s)")
        assert took <= Timing().takeover_bound + 2  # + kubectl's polling
        operator.kubectl("delete", "deployment", "llama-8b-decode", "-n", namespace)
        eventually(lambda: operator.get("deployment", "-n", namespace, "llama-8b-decode"), timeout=30,
                   what="decode repaired by the new leader")
    finally:
        scale(1)


# ------------------------------------------------------------------------------------------------
# The plain manifests, on a cluster of their own


def test_plain_manifests_install_the_same_operator(tmp_path: Path, cluster: Cluster) -> None:
    plane = ControlPlane(tmp_path / "manifests-cluster", cluster.binaries)
    state = plane.up(progress=lambda message: None)
    try:
        other = Cluster(state, cluster.binaries)
        other.kubectl("apply", "-k", str(ROOT / "manifests" / "install"))
        eventually(lambda: (other.get("deployment", "-n", OPERATOR_NAMESPACE, RELEASE) or {})
                   .get("status", {}).get("readyReplicas") == 1, what="operator ready", timeout=90)
        other.apply(NIXL, "default")
        wait_ready(other, "default", "llama-8b")
    finally:
        plane.down(progress=lambda message: None)


# ------------------------------------------------------------------------------------------------
# Loopback only


def test_harness_refuses_non_loopback_addresses(cluster: Cluster) -> None:
    for address in ("10.0.0.1", "192.168.1.10", "8.8.8.8", "kubernetes.default.svc"):
        with pytest.raises(NonLoopbackAddress):
            require_loopback(address)
    service_ip = (cluster.get("service", "kubernetes", "-n", "default") or {})["spec"]["clusterIP"]
    with pytest.raises(NonLoopbackAddress):
        require_loopback_url(f"https://{service_ip}:443/")
    for pod in cluster.get("pods", "-A")["items"]:
        if pod["status"].get("podIP"):
            require_loopback(pod["status"]["podIP"])


# ------------------------------------------------------------------------------------------------
# Prometheus


def test_prometheus_scrapes_itself_and_the_runtime_targets(cluster: Cluster) -> None:
    url = cluster.state.prometheus_url
    assert url is not None, "Prometheus did not start (run e2e/build/prometheus.sh)"
    require_loopback_url(url)

    def query(path: str) -> Any:
        with urllib.request.urlopen(f"{url}{path}", timeout=5) as response:
            return json.loads(response.read())

    def self_scraped() -> bool:
        result = query("/api/v1/query?query=up%7Bjob%3D%22prometheus%22%7D")["data"]["result"]
        return bool(result) and result[0]["value"][1] == "1"

    eventually(self_scraped, timeout=30, what="Prometheus scraping itself")
    listed = json.loads((Path(cluster.state.state_dir) / "prometheus" / "targets.json").read_text())
    discovered = [t for t in query("/api/v1/targets")["data"]["activeTargets"] if t["scrapePool"] == "pods"]
    assert len(discovered) == sum(len(group["targets"]) for group in listed)
