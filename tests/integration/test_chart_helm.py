"""The Helm chart rendered by the helm binary: lint, every object valid against the Kubernetes 1.37
schemas, the operator Deployment, RBAC per watch scope, the monitoring objects only where the
Prometheus Operator's API exists, and manifests/install identical to `helm template`.

helm (and kubectl, for kustomize) come from e2e/build/build.sh, which writes their paths to
${XPYD_CACHE:-$HOME/.cache/xpyd}/bin/current.env.
"""

from __future__ import annotations

import json
import os
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.chart import (
    CHART,
    DASHBOARD,
    IMAGE,
    INSTALL,
    LEASE_RULES,
    OPERATOR_ARGS,
    POD_NAME_ENV,
    assert_least_privilege,
    install_objects,
    load_docs,
    one,
    rule_table,
)

pytestmark = pytest.mark.integration

K8S_VERSION = "1.37"
RELEASE = "xpyd-operator"
NAMESPACE = "xpyd-system"
MONITORING_API = ("--api-versions", "monitoring.coreos.com/v1")
MONITORING_ON = ("--set", "monitoring.podMonitor.enabled=true", "--set", "monitoring.prometheusRule.enabled=true")
Objects = list[dict[str, Any]]


@cache
def tool(name: str) -> str:
    """Path of a binary built by e2e/build/build.sh (HELM, KUBECTL); fails when it is missing."""
    env_file = Path(os.environ.get("XPYD_CACHE") or Path.home() / ".cache" / "xpyd") / "bin" / "current.env"
    how = "run `bash e2e/build/build.sh` (builds helm, kubectl and the control plane, ~20 min cold)"
    if not env_file.is_file():
        pytest.fail(f"{env_file} is missing: {how}")
    paths = dict(line.split("=", 1) for line in env_file.read_text().splitlines()
                 if "=" in line and not line.startswith("#"))
    path = paths.get(name)
    if not path or not os.access(path, os.X_OK):
        pytest.fail(f"{name} ({path or f'not in {env_file}'}) is not an executable: {how}")
    return path


def run(*args: str) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stderr}"
    return result.stdout


@cache
def _template(args: tuple[str, ...]) -> str:
    return run(tool("HELM"), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)


def template(*args: str) -> Objects:
    """`helm template` of the chart, parsed (each call gets fresh objects)."""
    return [doc for doc in yaml.safe_load_all(_template(args)) if doc]


def kinds(objects: Objects) -> list[tuple[str, str, str | None]]:
    return sorted((o["kind"], o["metadata"]["name"], o["metadata"].get("namespace")) for o in objects)


def operator_container(objects: Objects) -> dict[str, Any]:
    container: dict[str, Any] = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return container


SCENARIOS: dict[str, tuple[str, ...]] = {
    "defaults": (),
    "crds": ("--include-crds",),
    "watch-namespaces": ("--set", "watchNamespaces={a,b}"),
    "monitoring": (*MONITORING_ON, *MONITORING_API, "--set", "monitoring.dashboard.enabled=true"),
    "monitoring-namespaced": (*MONITORING_ON, *MONITORING_API, "--set", "watchNamespaces={a}"),
    "everything-set": ("--set", "verbose=true", "--set", "priorityClassName=system-cluster-critical",
                       "--set", "nodeSelector.role=ops", "--set", "podAnnotations.a=b", "--set", "podLabels.c=d",
                       "--set", "imagePullSecrets[0].name=regcred", "--set", "serviceAccount.annotations.e=f",
                       "--set", "tolerations[0].operator=Exists"),
}


def test_lint_strict() -> None:
    run(tool("HELM"), "lint", "--strict", str(CHART))
    run(tool("HELM"), "lint", "--strict", str(CHART), "--set", "watchNamespaces={a,b}", *MONITORING_ON)


@pytest.mark.parametrize("args", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_every_object_is_valid(args: tuple[str, ...]) -> None:
    objects = template(*args)
    assert objects
    for obj in objects:
        labels = obj["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/name") == "xpyd-operator", obj["metadata"]
        if obj["apiVersion"] == "monitoring.coreos.com/v1":
            # No schema for CRD-based kinds: their structure is checked below.
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        if obj["kind"] == "CustomResourceDefinition":
            continue  # crds/ is copied as is, not templated
        assert labels.get("app.kubernetes.io/instance") == RELEASE
        assert labels.get("app.kubernetes.io/managed-by") == "Helm"
        assert labels.get("helm.sh/chart") == "xpyd-operator-0.1.0"


def test_schema_is_enforced() -> None:
    result = subprocess.run([tool("HELM"), "template", RELEASE, str(CHART), "--set", "unknownValue=1"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0
    assert "unknownValue" in result.stderr


# ---- the operator Deployment -------------------------------------------------------------------


def test_default_install() -> None:
    objects = template()
    assert kinds(objects) == [
        ("ClusterRole", RELEASE, None),
        ("ClusterRoleBinding", RELEASE, None),
        ("Deployment", RELEASE, NAMESPACE),
        ("Role", f"{RELEASE}-leader-election", NAMESPACE),
        ("RoleBinding", f"{RELEASE}-leader-election", NAMESPACE),
        ("ServiceAccount", RELEASE, NAMESPACE),
    ]
    assert_least_privilege(one(objects, "ClusterRole")["rules"])
    assert one(objects, "Role")["rules"] == LEASE_RULES
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    container = operator_container(objects)
    assert container["image"] == IMAGE
    assert container["command"] == ["xpyd", "operator"]
    assert container["args"] == OPERATOR_ARGS
    assert container["env"] == [POD_NAME_ENV]


@pytest.mark.parametrize(("replicas", "strategy"), [
    (1, {"type": "Recreate"}),
    (2, {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}),
    (3, {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}),
])
def test_replicas_and_their_update_strategy(replicas: int, strategy: dict[str, Any]) -> None:
    objects = template("--set", f"replicas={replicas}")
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == replicas
    assert deployment["spec"]["strategy"] == strategy
    # Every replica takes part in the election, whatever their number: a change of the number never
    # runs an unelected replica beside an elected one.
    assert operator_container(objects)["args"] == OPERATOR_ARGS


def test_operator_is_non_root_and_read_only() -> None:
    pod = one(template(), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == 65532
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": 8080}
    assert container["resources"]["requests"] == {"cpu": "100m", "memory": "256Mi"}
    assert "memory" in container["resources"]["limits"]
    # The read-only root filesystem leaves /tmp as the only scratch space.
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}} in pod["volumes"]


def test_operator_args_follow_values() -> None:
    container = operator_container(template(
        "--set", "image.repository=registry.local/xpyd", "--set", "image.tag=dev", "--set", "verbose=true",
        "--set", "resyncSeconds=15", "--set", "workers=3", "--set", "watchNamespaces={a,b}"))
    assert container["image"] == "registry.local/xpyd:dev"
    assert container["args"] == ["-n", "a", "-n", "b", "--liveness=http://0.0.0.0:8080/healthz",
                                 "--metrics=http://0.0.0.0:8081/metrics", "--operator-image=registry.local/xpyd:dev",
                                 "--resync-seconds=15", "--workers=3", "--leader-elect",
                                 "--leader-election-namespace=xpyd-system", "-v"]


def test_pod_placement_values() -> None:
    pod = one(template(*SCENARIOS["everything-set"]), "Deployment")["spec"]["template"]
    assert pod["metadata"]["annotations"] == {"a": "b"}
    assert pod["metadata"]["labels"]["c"] == "d"
    spec = pod["spec"]
    assert spec["priorityClassName"] == "system-cluster-critical"
    assert spec["nodeSelector"] == {"role": "ops"}
    assert spec["tolerations"] == [{"operator": "Exists"}]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]


def test_existing_service_account() -> None:
    objects = template("--set", "serviceAccount.create=false", "--set", "serviceAccount.name=ops")
    assert not [o for o in objects if o["kind"] == "ServiceAccount"]
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
    assert one(objects, "ClusterRoleBinding")["subjects"][0]["name"] == "ops"


# ---- RBAC per watch scope ------------------------------------------------------------------------


def test_watch_namespaces_grant_roles_in_those_namespaces_only() -> None:
    objects = template("--set", "watchNamespaces={a,b}")
    assert kinds(objects) == [
        ("ClusterRole", f"{RELEASE}-namespaces", None),
        ("ClusterRoleBinding", f"{RELEASE}-namespaces", None),
        ("Deployment", RELEASE, NAMESPACE),
        ("Role", RELEASE, "a"),
        ("Role", RELEASE, "b"),
        ("Role", f"{RELEASE}-leader-election", NAMESPACE),
        ("RoleBinding", RELEASE, "a"),
        ("RoleBinding", RELEASE, "b"),
        ("RoleBinding", f"{RELEASE}-leader-election", NAMESPACE),
        ("ServiceAccount", RELEASE, NAMESPACE),
    ]
    # Cluster-wide, only what kopf needs to notice watched namespaces come and go.
    assert rule_table(one(objects, "ClusterRole")["rules"]) == {("", "namespaces"): {"list", "watch"}}
    subject = {"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}
    for obj in objects:
        if obj["kind"] == "Role" and obj["metadata"]["namespace"] == NAMESPACE:
            assert obj["rules"] == LEASE_RULES
        elif obj["kind"] == "Role":
            assert_least_privilege(obj["rules"])
        if obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            assert obj["subjects"] == [subject]
            assert obj["roleRef"]["name"] == obj["metadata"]["name"]
    assert operator_container(objects)["args"][:4] == ["-n", "a", "-n", "b"]


def test_rbac_can_be_left_out() -> None:
    objects = template("--set", "rbac.create=false")
    assert {o["kind"] for o in objects} == {"ServiceAccount", "Deployment"}
    assert "--leader-elect" in operator_container(objects)["args"]  # the rules granted another way


# ---- monitoring ----------------------------------------------------------------------------------


@pytest.mark.parametrize("api", [True, False], ids=["prometheus-operator", "no-prometheus-operator"])
def test_monitoring_objects_only_with_the_prometheus_operator_api(api: bool) -> None:
    objects = template(*MONITORING_ON, *(MONITORING_API if api else ()))
    monitoring = sorted(o["kind"] for o in objects if o["apiVersion"] == "monitoring.coreos.com/v1")
    assert monitoring == (["PodMonitor", "PodMonitor", "PrometheusRule"] if api else [])


def test_monitoring_is_off_by_default() -> None:
    objects = template(*MONITORING_API)
    assert not [o for o in objects if o["kind"] in ("PodMonitor", "PrometheusRule", "ConfigMap")]


def pod_monitor(objects: list[dict[str, Any]], suffix: str) -> dict[str, Any]:
    (monitor,) = [o for o in objects if o["kind"] == "PodMonitor" and o["metadata"]["name"].endswith(suffix)]
    return monitor


def test_pod_monitor() -> None:
    monitor = pod_monitor(template(*MONITORING_ON, *MONITORING_API), "-engines")
    assert monitor["metadata"]["namespace"] == NAMESPACE
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"any": True}
    assert spec["selector"]["matchLabels"]["app.kubernetes.io/part-of"] == "xpyd"
    assert spec["selector"]["matchExpressions"] == [
        {"key": "xpyd.io/role", "operator": "In", "values": ["prefill", "decode", "proxy"]}]
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["port"] == "http"
    assert endpoint["path"] == "/metrics"
    relabel = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert relabel == {"xpyd_io_role": ["__meta_kubernetes_pod_label_xpyd_io_role"],
                       "xpyd_io_serving": ["__meta_kubernetes_pod_label_xpyd_io_serving"]}


def test_operator_pod_monitor_scrapes_the_autoscaler_metrics() -> None:
    objects = template(*MONITORING_ON, *MONITORING_API)
    monitor = pod_monitor(objects, "-operator")
    deployment = one(objects, "Deployment")
    selected = monitor["spec"]["selector"]["matchLabels"].items()
    assert selected <= deployment["spec"]["template"]["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert endpoint["port"] == "metrics" and ports["metrics"] == 8081
    assert "--metrics=http://0.0.0.0:8081/metrics" in container["args"]
    assert endpoint["honorLabels"] is True   # the series' namespace/name are the pool's, not the operator pod's


def test_pod_monitor_follows_the_watched_namespaces() -> None:
    monitor = pod_monitor(template(*MONITORING_ON, *MONITORING_API, "--set", "watchNamespaces={a,b}",
                                   "--set", "monitoring.podMonitor.labels.release=prom"), "-engines")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}
    assert monitor["metadata"]["labels"]["release"] == "prom"


def test_prometheus_rule() -> None:
    rule = one(template(*MONITORING_ON, *MONITORING_API, "--set", "monitoring.prometheusRule.queueDepthThreshold=3",
                        "--set", "monitoring.prometheusRule.ttftP90Ms=500"), "PrometheusRule")
    (group,) = rule["spec"]["groups"]
    alerts = {r["alert"]: r for r in group["rules"]}
    assert set(alerts) == {"XpydQueueDepthHigh", "XpydTimeToFirstTokenHigh", "XpydNoDecodeServing"}
    queue = alerts["XpydQueueDepthHigh"]["expr"]
    assert "vllm:num_requests_waiting" in queue and queue.rstrip().endswith("> 3")
    ttft = alerts["XpydTimeToFirstTokenHigh"]["expr"]
    assert "histogram_quantile(0.9," in ttft and "vllm:time_to_first_token_seconds_bucket" in ttft
    assert ttft.rstrip().endswith("> 0.5")
    for alert in alerts.values():
        assert alert["labels"]["severity"] in ("warning", "critical")
        assert alert["for"]
        # Prometheus templates survive Helm's templating.
        assert "{{ $labels.xpyd_io_serving }}" in alert["annotations"]["description"]


def test_dashboard_config_map() -> None:
    objects = template("--set", "monitoring.dashboard.enabled=true", "--set", "monitoring.dashboard.namespace=grafana")
    config_map = one(objects, "ConfigMap")
    assert config_map["metadata"]["namespace"] == "grafana"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["xpyd-overview.json"]) == json.loads(DASHBOARD.read_text())


# ---- manifests/install ------------------------------------------------------------------------------


def test_install_manifests_are_helm_template() -> None:
    """operator.yaml is `helm template` with the defaults: regenerate it when this fails."""
    rendered = template()
    generated = load_docs(INSTALL / "operator.yaml")
    installed = install_objects()
    assert kinds(generated) == kinds(rendered)
    assert one(installed, "ClusterRole")["rules"] == one(rendered, "ClusterRole")["rules"]
    assert operator_container(installed)["args"] == operator_container(rendered)["args"]
    assert generated == rendered, (
        f"manifests/install/operator.yaml is stale: helm template {RELEASE} charts/xpyd-operator "
        f"--namespace {NAMESPACE} > manifests/install/operator.yaml")


def test_install_builds_with_kustomize() -> None:
    built = [doc for doc in yaml.safe_load_all(run(tool("KUBECTL"), "kustomize", str(INSTALL))) if doc]
    assert kinds(built) == kinds(install_objects())
    for obj in built:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
