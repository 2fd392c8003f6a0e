"""The Helm chart and the plain install in manifests/install, read as files (no helm binary): the
CRD copies, the values and their schema and documentation, the dashboard, and the reviewed RBAC.

tests/integration/test_chart_helm.py renders the chart with helm and checks the same install; the
reviewed RBAC and the helpers both read it with are in tests/chart.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.chart import (
    CHART,
    CRD_FILE,
    DASHBOARD,
    IMAGE,
    INSTALL,
    LEASE_RULES,
    OPERATOR_ARGS,
    POD_NAME_ENV,
    assert_least_privilege,
    install_objects,
    one,
)
from tests.paths import ROOT
from xpyd import __version__
from xpyd.controller.autoscale import AutoscalerMetrics

pytestmark = pytest.mark.unit

# ---- the CRD copies --------------------------------------------------------------------------------


@pytest.mark.parametrize("copy", [CHART / "crds" / CRD_FILE, INSTALL / CRD_FILE],
                         ids=["chart", "manifests-install"])
def test_crd_copy_is_identical_to_crds(copy: Path) -> None:
    assert copy.read_bytes() == (ROOT / "crds" / CRD_FILE).read_bytes(), (
        f"{copy.relative_to(ROOT)} is stale: cp crds/{CRD_FILE} {copy.parent.relative_to(ROOT)}/")


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "xpyd-operator"
    assert chart["version"] == "0.1.0"
    assert chart["appVersion"] == __version__, "the default image tag is the operator's release"
    assert chart["kubeVersion"] == ">=1.28.0-0"


# ---- values, schema, documentation -----------------------------------------------------------------


def schema() -> dict[str, Any]:
    result: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
    return result


def values() -> dict[str, Any]:
    result: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return result


def test_values_schema_is_valid_draft_07() -> None:
    assert schema()["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema())


def test_values_validate_against_schema() -> None:
    jsonschema.Draft7Validator(schema()).validate(values())


def test_values_defaults() -> None:
    v = values()
    assert v["image"] == {"repository": "ghcr.io/xpyd-operator/xpyd-operator", "tag": "", "pullPolicy": "IfNotPresent"}
    assert v["watchNamespaces"] == []
    assert v["replicas"] == 1
    assert v["resources"]["requests"] == {"cpu": "100m", "memory": "256Mi"}
    assert "memory" in v["resources"]["limits"]
    assert v["monitoring"]["dashboard"]["labels"] == {"grafana_dashboard": "1"}
    # manifests/install has exactly the operator: nothing optional is on by default.
    assert not any(section["enabled"] for section in v["monitoring"].values())


@pytest.mark.parametrize(("path", "value"), [
    ("unknownValue", True),
    ("image.registry", "ghcr.io"),
    ("image.pullPolicy", "Sometimes"),
    ("watchNamespaces", ["Team_A"]),
    ("watchNamespaces", ["a", "a"]),
    ("watchNamespaces", "a"),
    ("resyncSeconds", 0),
    ("replicas", 0),
    ("replicas", 1.5),
    ("workers", 0),
    ("workers", 2.5),
    ("verbose", "yes"),
    ("monitoring.podMonitor.roles", ["router"]),
    ("monitoring.podMonitor.interval", "15"),
    ("monitoring.prometheusRule.ttftP90Ms", 0),
    ("monitoring.prometheusRule.ttftP90Ms", 0.5),
    ("monitoring.grafana", {}),
])
def test_schema_rejects(path: str, value: Any) -> None:
    bad = values()
    *parents, leaf = path.split(".")
    node = bad
    for key in parents:
        node = node[key]
    node[leaf] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema()).validate(bad)


def structured_paths(node: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of the values the schema spells out (the properties of closed objects): these
    are the values users set, each documented; free-form maps (resources, labels) are not."""
    paths = []
    for name, child in node.get("properties", {}).items():
        if name == "global":  # set by Helm for dependencies, never in values.yaml
            continue
        path = f"{prefix}{name}"
        paths.append(path)
        if child.get("additionalProperties") is False:
            paths += structured_paths(child, f"{path}.")
    return paths


def documented_paths() -> dict[str, int]:
    """`# path -- ...` comments of values.yaml -> the line of the key they document."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    found: dict[str, int] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing mappings
    for number, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z_][\w]*):", line)
        if not match:
            continue
        indent, key = len(match.group(1)), match.group(2)
        stack = [(i, k) for i, k in stack if i < indent]
        path = ".".join([k for _, k in stack] + [key])
        stack.append((indent, key))
        # The comment block right above the key.
        above = number - 1
        while above >= 0 and lines[above].strip().startswith("#"):
            above -= 1
        comments = [c.strip() for c in lines[above + 1:number]]
        if any(c.startswith(f"# {path} -- ") for c in comments):
            found[path] = number + 1
    return found


def test_every_value_is_documented_name_first() -> None:
    present = set(values())
    documented = documented_paths()
    for path in structured_paths(schema()):
        top = path.split(".")[0]
        if top not in present:
            continue
        assert path in documented, f"values.yaml: `{path}` needs a comment `# {path} -- ...` right above it"
    assert set(values()) <= set(documented), "every top-level value is documented"


def test_chart_readme_lists_every_value() -> None:
    readme = (CHART / "README.md").read_text()
    closed = {p for p in structured_paths(schema()) if _closed(p)}
    for path in set(documented_paths()) - closed:
        assert f"| `{path}` |" in readme, f"charts/xpyd-operator/README.md: no row for `{path}`"


def _closed(path: str) -> bool:
    node = schema()
    for key in path.split("."):
        node = node["properties"][key]
    return node.get("additionalProperties") is False


# ---- RBAC and the operator Deployment ----------------------------------------------------------


def chart_rules(name: str = "xpyd-operator.rules") -> list[dict[str, Any]]:
    """Rules the chart defines (one definition, used by its ClusterRole and its Roles)."""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    match = re.search(r'\{\{- define "' + re.escape(name) + r'" -\}\}\n(.*?)\{\{- end \}\}', helpers, re.S)
    assert match, f"_helpers.tpl defines {name}"
    assert "{{" not in match.group(1), "the rules are plain YAML, the same in every install"
    rules: list[dict[str, Any]] = yaml.safe_load(match.group(1))
    return rules


def test_chart_rules_are_the_reviewed_rbac() -> None:
    assert_least_privilege(chart_rules())
    assert_least_privilege(chart_rules() + chart_rules("xpyd-operator.leaderWorkerSetRules"), leader_worker_set=True)


def test_install_cluster_role_is_the_reviewed_rbac() -> None:
    assert_least_privilege(one(install_objects(), "ClusterRole")["rules"])


def test_install_has_exactly_the_operator() -> None:
    kustomization = yaml.safe_load((INSTALL / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == "xpyd-system"
    assert CRD_FILE in kustomization["resources"]
    objects = install_objects()
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == [
        ("ClusterRole", "xpyd-operator"),
        ("ClusterRoleBinding", "xpyd-operator"),
        ("CustomResourceDefinition", "disaggregatedservings.xpyd.io"),
        ("Deployment", "xpyd-operator"),
        ("Namespace", "xpyd-system"),
        ("Role", "xpyd-operator-leader-election"),
        ("RoleBinding", "xpyd-operator-leader-election"),
        ("ServiceAccount", "xpyd-operator"),
    ]
    for obj in objects:
        if obj["kind"] in ("ServiceAccount", "Deployment", "Role", "RoleBinding"):
            assert obj["metadata"]["namespace"] == "xpyd-system"
    binding = one(objects, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": "xpyd-operator"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "xpyd-operator", "namespace": "xpyd-system"}]
    assert one(objects, "Namespace")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert one(objects, "Role")["rules"] == LEASE_RULES
    assert one(objects, "RoleBinding")["subjects"] == binding["subjects"]


def test_install_deployment() -> None:
    deployment = one(install_objects(), "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "xpyd-operator"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    assert container["image"] == IMAGE
    assert container["command"] == ["xpyd", "operator"]
    assert container["args"] == OPERATOR_ARGS
    assert container["env"] == [POD_NAME_ENV]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": 8080}
    assert container["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


# ---- the dashboard -----------------------------------------------------------------------------


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


@pytest.mark.parametrize("needle", [
    "kube_deployment_status_replicas_ready",
    "kube_deployment_spec_replicas",
    "count by (xpyd_io_serving, xpyd_io_role) (vllm:num_requests_running",
    "histogram_quantile(0.5, sum by (xpyd_io_serving, xpyd_io_role, le) (rate(vllm:time_to_first_token_seconds_bucket",
    "histogram_quantile(0.9, sum by (xpyd_io_serving, xpyd_io_role, le) (rate(vllm:time_to_first_token_seconds_bucket",
    "histogram_quantile(0.99, sum by (xpyd_io_serving, xpyd_io_role, le) (rate(vllm:time_to_first_token_seconds_bucket",
    "histogram_quantile(0.9, sum by (xpyd_io_serving, xpyd_io_role, le) (rate(vllm:inter_token_latency_seconds_bucket",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "xpyd_autoscaler_desired_replicas",
    "sum by (reason) (rate(xpyd_autoscaler_decisions_total",
])
def test_dashboard_has_panel(needle: str) -> None:
    assert any(needle in expr for expr in dashboard_exprs()), f"no panel queries {needle}"


def test_dashboard_queries_are_well_formed() -> None:
    pairs = {")": "(", "}": "{", "]": "["}
    for expr in dashboard_exprs():
        open_brackets: list[str] = []
        for char in expr:
            if char in "({[":
                open_brackets.append(char)
            elif char in pairs:
                assert open_brackets and open_brackets.pop() == pairs[char], f"unbalanced: {expr}"
        assert not open_brackets, f"unbalanced: {expr}"
        if "vllm:" in expr:
            # Engines are told apart by the labels the PodMonitor relabels from the pod labels.
            assert "xpyd_io_serving=~\"$serving\"" in expr and "xpyd_io_role" in expr, expr


def test_dashboard_selects_the_operators_series_by_the_labels_it_exports() -> None:
    """The autoscaler's series carry namespace/name of the DisaggregatedServing (kept by the operator
    PodMonitor's honorLabels), not the engines' relabelled xpyd_io_* labels."""
    exported = {family.name: set(family.samples[0].labels) if family.samples else set()
                for family in AutoscalerMetrics(lambda: [(("ns", "pool", "prefill"), 1.0)]).collect()}
    exported["xpyd_autoscaler_decisions"] = {"namespace", "name", "reason"}   # counters have no sample yet
    queried = [expr for expr in dashboard_exprs() if "xpyd_autoscaler_" in expr]
    assert queried
    for expr in queried:
        assert 'name=~"$serving"' in expr and 'namespace=~"$namespace"' in expr, expr
        grouped = re.findall(r"by \(([^)]*)\)", expr)
        family = next(name for name in exported if name in expr)
        for labels in grouped:
            assert {label.strip() for label in labels.split(",")} <= exported[family], expr


def test_dashboard_identity() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "xpyd-overview"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "namespace", "serving"}
    assert all(panel["datasource"]["uid"] == "${datasource}" for panel in dashboard["panels"])
