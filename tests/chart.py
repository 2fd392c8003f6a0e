"""The Helm chart and the plain install as files, for the chart tests (tests/unit/test_chart.py reads
them, tests/integration/test_chart_helm.py renders them with helm): where they are, the operator's
expected image and arguments, the reviewed RBAC, and helpers to read manifests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.paths import ROOT
from xpyd import __version__

CHART = ROOT / "charts" / "xpyd-operator"
INSTALL = ROOT / "manifests" / "install"
CRD_FILE = "xpyd.io_disaggregatedservings.yaml"
DASHBOARD = CHART / "dashboards" / "xpyd-overview.json"
IMAGE = f"ghcr.io/xpyd-operator/xpyd-operator:{__version__}"

Rule = tuple[str, str]  # (apiGroup, resource)

#: The reviewed RBAC of the operator, in every namespace it serves: what `reconcile` and kopf do,
#: no more. No wildcards. Children are garbage-collected through ownerReferences; delete only of the
#: workload kinds, whose kind changes with a role's shape (a Deployment, or a LeaderWorkerSet).
#: Secrets: get only (the autoscaler's Prometheus token and CA), never list or watch. Pods are read
#: for the status, and because the operator creates Roles granting pods get/list/watch and pods/status
#: patch to its proxies, which RBAC allows only to holders of those permissions.
OPERATOR_RULES: dict[Rule, set[str]] = {
    ("xpyd.io", "disaggregatedservings"): {"get", "list", "watch"},
    ("xpyd.io", "disaggregatedservings/status"): {"get", "patch"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "services"): {"get", "list", "watch", "create", "patch"},
    ("", "serviceaccounts"): {"get", "list", "watch", "create", "patch"},
    ("", "pods"): {"get", "list", "watch"},
    ("", "pods/status"): {"patch"},
    ("", "events"): {"create"},
    ("", "configmaps"): {"get"},
    ("", "secrets"): {"get"},
    ("policy", "poddisruptionbudgets"): {"get", "list", "watch", "create", "patch"},
    ("rbac.authorization.k8s.io", "roles"): {"get", "list", "watch", "create", "patch"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"get", "list", "watch", "create", "patch"},
}
#: With `rbac.leaderWorkerSet` (or `auto` on a cluster serving the API).
LEADER_WORKER_SET_RULES: dict[Rule, set[str]] = {
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): {"get", "list", "watch", "create", "patch", "delete"},
}
#: The only resources the operator may delete.
DELETABLE: frozenset[Rule] = frozenset({("apps", "deployments"), ("leaderworkerset.x-k8s.io", "leaderworkersets")})

#: Verbs the operator must never hold (delete: only on DELETABLE).
FORBIDDEN_VERBS = {"*", "deletecollection", "escalate", "bind", "impersonate"}

OPERATOR_ARGS = ["-A", "--liveness=http://0.0.0.0:8080/healthz", "--metrics=http://0.0.0.0:8081/metrics",
                 f"--operator-image={IMAGE}", "--resync-seconds=600", "--workers=8", "--leader-elect",
                 "--leader-election-namespace=xpyd-system"]

#: The leader election's Role, in the release namespace: create of leases (RBAC cannot restrict a
#: create by name), get and update of the operator's own Lease only.
LEASE_RULES = [
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["xpyd-operator"],
     "verbs": ["get", "update"]},
]
POD_NAME_ENV = {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}


def rule_table(rules: list[dict[str, Any]]) -> dict[Rule, set[str]]:
    """RBAC rules as (apiGroup, resource) -> verbs, failing on anything the table cannot express."""
    table: dict[Rule, set[str]] = {}
    for rule in rules:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, f"unexpected rule fields: {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                table.setdefault((group, resource), set()).update(rule["verbs"])
    return table


def assert_least_privilege(rules: list[dict[str, Any]], leader_worker_set: bool = False) -> None:
    """No wildcard anywhere, no forbidden verb, delete only of workloads, secrets get only, and
    exactly the reviewed table (with the LeaderWorkerSet rules when `leader_worker_set`)."""
    for rule in rules:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule.get(field, []), f"wildcard in {field}: {rule}"
        assert not FORBIDDEN_VERBS & set(rule["verbs"]), f"forbidden verb: {rule}"
        if "secrets" in rule["resources"]:
            assert rule["verbs"] == ["get"], f"the operator only gets secrets by name: {rule}"
    table = rule_table(rules)
    assert {key for key, verbs in table.items() if "delete" in verbs} <= DELETABLE
    assert table == (OPERATOR_RULES | LEADER_WORKER_SET_RULES if leader_worker_set else OPERATOR_RULES)


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def install_objects() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((INSTALL / "kustomization.yaml").read_text())
    return [obj for resource in kustomization["resources"] for obj in load_docs(INSTALL / resource)]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [obj for obj in objects if obj["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]
