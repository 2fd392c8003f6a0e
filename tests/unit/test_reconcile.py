"""One reconcile against an in-memory API: what it renders, applies (in which waves) and writes, and
when its memory of the last reconcile (`Verified`) lets it skip rendering and comparing."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest

import xpyd.controller.reconcile as reconcile_module
from xpyd.api import models
from xpyd.api.load import parse_serving
from xpyd.api.naming import KV_COMPAT_LABEL, ROLE_LABEL, SERVING_LABEL
from xpyd.common.jsontypes import JSON
from xpyd.controller.reconcile import Verified, fingerprint, reconcile
from xpyd.render.engine import rollout_hold_seconds

pytestmark = pytest.mark.unit

NS = "inference"
SERVING: JSON = {
    "apiVersion": models.API_VERSION, "kind": models.KIND,
    "metadata": {"name": "llama", "namespace": NS, "uid": "u-1", "generation": 1, "resourceVersion": "1"},
    "spec": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "decode": {"replicas": 2}},
}


class MemoryKube:
    """get / apply_all / patch_status / event / list_objects over a dict, like the API server: an
    apply stores the object with a new resourceVersion (and a generation moving with its spec)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], JSON] = {}
        self.waves: list[list[str]] = []
        self.status_writes: list[JSON] = []
        self.events: list[str] = []
        self.pods: list[JSON] = []
        self._versions = itertools.count(100)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> JSON | None:
        return self.objects.get((kind, name))

    def store(self, obj: JSON) -> JSON:
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]
        old = self.objects.get((obj["kind"], meta["name"]))
        meta["resourceVersion"] = str(next(self._versions))
        meta.setdefault("uid", f"uid-{meta['name']}")
        generation = (old or {}).get("metadata", {}).get("generation", 0)
        meta["generation"] = generation + 1 if old is None or old.get("spec") != obj.get("spec") else generation
        if old is not None and "status" in old:
            obj.setdefault("status", old["status"])  # an apply leaves the status to its controller
        self.objects[(obj["kind"], meta["name"])] = obj
        return obj

    def apply_all(self, objects: list[JSON]) -> list[JSON]:
        if objects:
            self.waves.append([f"{o['kind']}/{o['metadata']['name']}" for o in objects])
        return [self.store(o) for o in objects]

    def patch_status(self, namespace: str, name: str, status: JSON) -> JSON:
        self.status_writes.append(status)
        return {}

    def event(self, owner: JSON, event_type: str, reason: str, message: str) -> None:
        self.events.append(reason)

    def list_objects(self, api_version: str, kind: str, *args: Any, **kwargs: Any) -> list[JSON]:
        return list(self.pods) if kind == "Pod" else []


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def renders(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times rendering ran."""
    calls: list[int] = []
    original = reconcile_module.render

    def counting(*args: Any, **kwargs: Any) -> list[JSON]:
        calls.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(reconcile_module, "render", counting)
    return calls


def run(kube: MemoryKube, verified: Verified, body: JSON | None = None, clock: Clock | None = None,
        interval: float = 0.0) -> reconcile_module.Outcome:
    body = copy.deepcopy(body or SERVING)
    if kube.status_writes:
        body["status"] = kube.status_writes[-1]
    return reconcile(kube, body, "example/xpyd:test", now=lambda: "2026-12-01T00:00:00Z",  # type: ignore[arg-type]
                     verified=verified, status_interval=interval, clock=clock or Clock())


def test_the_first_reconcile_applies_in_two_waves_and_remembers_its_children(renders: list[int]) -> None:
    kube, verified = MemoryKube(), Verified()
    outcome = run(kube, verified)
    assert len(outcome.created) == 12 and outcome.status_written
    first, second = kube.waves
    assert not any(c.startswith(("Deployment/", "RoleBinding/")) for c in first)
    assert "Role/llama-proxy" in first and "ServiceAccount/llama-proxy" in first
    assert sorted(second) == ["Deployment/llama-decode", "Deployment/llama-prefill", "Deployment/llama-proxy",
                              "RoleBinding/llama-proxy"]
    assert len(verified.children) == 12 and renders == [1]
    # Nothing changed: no render, no compare, no write.
    outcome = run(kube, verified)
    assert outcome.writes == 0 and renders == [1] and len(kube.waves) == 2


def status_of(kube: MemoryKube, name: str, **status: Any) -> None:
    """What the Deployment controller does: a new status (a new resourceVersion, same generation)."""
    obj = copy.deepcopy(kube.objects[("Deployment", name)])
    obj["status"] = status
    obj["metadata"]["resourceVersion"] = str(next(kube._versions))
    kube.objects[("Deployment", name)] = obj


def test_status_churn_and_foreign_metadata_skip_the_render(renders: list[int]) -> None:
    kube, verified = MemoryKube(), Verified()
    run(kube, verified)
    status_of(kube, "llama-decode", replicas=2, readyReplicas=1)
    prefill = kube.objects[("Deployment", "llama-prefill")]["metadata"]
    prefill["annotations"] = {**(prefill.get("annotations") or {}),
                              "deployment.kubernetes.io/revision": "1"}   # the Deployment controller's own
    outcome = run(kube, verified)
    assert renders == [1] and not outcome.created and not outcome.updated
    assert outcome.status_written  # the status follows the Deployments
    assert kube.status_writes[-1]["decode"]["readyReplicas"] == 1


@pytest.mark.parametrize(("edit", "child"), [
    (lambda o: o["spec"].update(replicas=9), "Deployment/llama-decode"),           # kubectl scale
    (lambda o: o["metadata"]["labels"].update({"xpyd.io/role": "x"}), "Deployment/llama-decode"),
])
def test_an_edited_child_is_rendered_compared_and_applied_again(renders: list[int], edit: Any, child: str) -> None:
    kube, verified = MemoryKube(), Verified()
    run(kube, verified)
    obj = copy.deepcopy(kube.objects[("Deployment", "llama-decode")])
    edit(obj)
    kube.store(obj)
    outcome = run(kube, verified)
    assert renders == [1, 1] and outcome.updated == [child]
    assert kube.objects[("Deployment", "llama-decode")]["spec"]["replicas"] == 2


def test_a_changed_kind_without_generation_is_compared_but_not_applied_when_still_equal(renders: list[int]) -> None:
    kube, verified = MemoryKube(), Verified()
    run(kube, verified)
    service = copy.deepcopy(kube.objects[("Service", "llama-proxy")])
    service["status"] = {"loadBalancer": {}}
    service["metadata"]["resourceVersion"] = "999"
    kube.objects[("Service", "llama-proxy")] = service
    outcome = run(kube, verified)
    assert renders == [1, 1] and outcome.writes == 0


def test_a_deleted_child_or_a_new_spec_renders_again(renders: list[int]) -> None:
    kube, verified = MemoryKube(), Verified()
    run(kube, verified)
    del kube.objects[("PodDisruptionBudget", "llama-decode")]
    assert run(kube, verified).created == ["PodDisruptionBudget/llama-decode"]
    changed = copy.deepcopy(SERVING)
    changed["metadata"]["generation"] = 2
    changed["spec"]["decode"]["replicas"] = 3
    assert run(kube, verified, changed).updated == ["Deployment/llama-decode"]
    assert renders == [1, 1, 1]


def test_progress_only_status_is_written_at_most_once_per_interval() -> None:
    kube, verified, clock = MemoryKube(), Verified(), Clock()
    run(kube, verified, clock=clock, interval=2.0)          # created: status written at once
    assert len(kube.status_writes) == 1
    clock.now += 0.5
    status_of(kube, "llama-decode", replicas=2, readyReplicas=1)
    outcome = run(kube, verified, clock=clock, interval=2.0)
    assert not outcome.status_written and outcome.status_deferred == pytest.approx(1.5)
    clock.now += 1.5
    outcome = run(kube, verified, clock=clock, interval=2.0)
    assert outcome.status_written and outcome.status_deferred == 0
    # A new generation is reported at once, whatever the interval.
    clock.now += 0.1
    changed = copy.deepcopy(SERVING)
    changed["metadata"]["generation"] = 2
    changed["spec"]["decode"]["replicas"] = 3
    assert run(kube, verified, changed, clock=clock, interval=2.0).status_written


def engine_pod(role: str, revision: str, ready: bool = True) -> JSON:
    return {"metadata": {"name": f"llama-{role}-{revision[:4]}-{ready}",
                         "labels": {SERVING_LABEL: "llama", ROLE_LABEL: role, KV_COMPAT_LABEL: revision}},
            "status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}


def min_ready(kube: MemoryKube, role: str) -> int:
    return int(kube.objects[("Deployment", f"llama-{role}")]["spec"]["minReadySeconds"])


def test_a_new_kv_revision_holds_both_deployments_until_each_role_has_a_ready_new_pod(renders: list[int]) -> None:
    kube, verified = MemoryKube(), Verified()
    run(kube, verified)
    old = kube.objects[("Deployment", "llama-prefill")]["spec"]["template"]["metadata"]["labels"][KV_COMPAT_LABEL]
    assert (min_ready(kube, "prefill"), min_ready(kube, "decode")) == (0, 0)
    changed = copy.deepcopy(SERVING)
    changed["metadata"]["generation"] = 2
    changed["spec"]["engine"] = {"image": "vllm/vllm-openai:v0.33.1"}
    run(kube, verified, changed)
    new = kube.objects[("Deployment", "llama-prefill")]["spec"]["template"]["metadata"]["labels"][KV_COMPAT_LABEL]
    assert new != old
    # The new prefill pod is Ready, decode's is still starting: both Deployments keep their old pods.
    kube.pods = [engine_pod("prefill", old), engine_pod("prefill", new), engine_pod("decode", old),
                 engine_pod("decode", old), engine_pod("decode", new, ready=False)]
    status_of(kube, "llama-decode", replicas=3, updatedReplicas=1, readyReplicas=2)
    status_of(kube, "llama-prefill", replicas=2, updatedReplicas=1, readyReplicas=2)
    outcome = run(kube, verified, changed)
    hold = rollout_hold_seconds(parse_serving(changed).spec)
    assert hold == 1800 + 600  # the default start-up budget and the scheduling margin
    assert sorted(outcome.updated) == ["Deployment/llama-decode", "Deployment/llama-prefill"]
    assert (min_ready(kube, "prefill"), min_ready(kube, "decode")) == (hold, hold)
    progressing = next(c for c in kube.status_writes[-1]["conditions"] if c["type"] == "Progressing")
    assert progressing["reason"] == "KVRevisionRollingOut"
    assert progressing["message"].endswith("prefill and decode keep their old pods until both roles have a ready "
                                           "pod of the new revision")
    # The same pods again: nothing to render or apply.
    renders.clear()
    assert not run(kube, verified, changed).updated and renders == []
    # The new decode pod turns Ready: the hold ends on both.
    kube.pods[-1] = engine_pod("decode", new)
    outcome = run(kube, verified, changed)
    assert sorted(outcome.updated) == ["Deployment/llama-decode", "Deployment/llama-prefill"]
    assert (min_ready(kube, "prefill"), min_ready(kube, "decode")) == (0, 0)
    spec = kube.objects[("Deployment", "llama-decode")]["spec"]
    assert spec["progressDeadlineSeconds"] > hold  # the API refuses minReadySeconds >= the deadline


def test_fingerprint_follows_generation_and_rendered_metadata_only() -> None:
    rendered = {"metadata": {"labels": {"a": "1"}, "annotations": {"b": "2"}}}
    live = {"kind": "Deployment", "metadata": {"uid": "u", "generation": 3, "resourceVersion": "7",
                                               "labels": {"a": "1", "other": "x"}, "annotations": {"b": "2"}}}
    base = fingerprint(live, rendered)
    assert fingerprint({**live, "metadata": {**live["metadata"], "resourceVersion": "8"}}, rendered) == base
    assert fingerprint({**live, "metadata": {**live["metadata"], "labels": {"a": "1"}}}, rendered) == base
    assert fingerprint({**live, "metadata": {**live["metadata"], "generation": 4}}, rendered) != base
    assert fingerprint({**live, "metadata": {**live["metadata"], "labels": {"a": "2"}}}, rendered) != base
    assert fingerprint({**live, "metadata": {**live["metadata"], "uid": "v"}}, rendered) != base
    service = {"kind": "Service", "metadata": {"uid": "u", "resourceVersion": "7"}}
    assert fingerprint(service, rendered) != fingerprint({**service, "metadata": {"uid": "u", "resourceVersion": "8"}},
                                                         rendered)


# ---- multi-node roles (LeaderWorkerSet) ----------------------------------------------------------------

class Deleting(MemoryKube):
    """MemoryKube that also deletes (by uid, as the API server's precondition does)."""

    def __init__(self) -> None:
        super().__init__()
        self.deleted: list[str] = []

    def delete(self, api_version: str, kind: str, namespace: str, name: str, grace_seconds: int | None = None,
               uid: str | None = None) -> None:
        obj = self.objects.get((kind, name))
        if obj is not None and (uid is None or obj["metadata"]["uid"] == uid):
            del self.objects[(kind, name)]
            self.deleted.append(f"{kind}/{name}")


class Check:
    def __init__(self, problem: Any = None, available: bool = True) -> None:
        self.problem, self.available, self.calls = problem, available, 0

    def __call__(self) -> Any:
        self.calls += 1
        return self.problem


MULTI_NODE = {**SERVING, "metadata": {**SERVING["metadata"], "generation": 2},
              "spec": {**SERVING["spec"], "kvTransfer": {"connector": "NixlConnector"},
                       "decode": {"replicas": 2, "nodesPerReplica": 2, "tensorParallelSize": 2}}}


def test_a_role_turning_multi_node_swaps_its_deployment_for_a_leaderworkerset() -> None:
    kube, verified = Deleting(), Verified()
    run(kube, verified)
    assert ("Deployment", "llama-decode") in kube.objects
    for obj in kube.objects.values():  # adopted, as the API server stores it
        obj["metadata"].setdefault("ownerReferences", [{"uid": "u-1"}])
    outcome = reconcile(kube, copy.deepcopy(MULTI_NODE), "example/xpyd:test",  # type: ignore[arg-type]
                        now=lambda: "2026-12-01T00:00:00Z", verified=verified, lws=Check())
    assert outcome.deleted == ["Deployment/llama-decode"] and kube.deleted == ["Deployment/llama-decode"]
    assert ("LeaderWorkerSet", "llama-decode") in kube.objects and "LeaderWorkerSet/llama-decode" in kube.waves[-1]
    assert "Deleted" in kube.events
    # And back: the LeaderWorkerSet goes, a Deployment comes.
    kube.objects[("LeaderWorkerSet", "llama-decode")]["metadata"]["ownerReferences"] = [{"uid": "u-1"}]
    back = {**SERVING, "metadata": {**SERVING["metadata"], "generation": 3}}
    outcome = reconcile(kube, copy.deepcopy(back), "example/xpyd:test",  # type: ignore[arg-type]
                        now=lambda: "2026-12-01T00:00:00Z", verified=verified, lws=Check())
    assert outcome.deleted == ["LeaderWorkerSet/llama-decode"] and ("Deployment", "llama-decode") in kube.objects


def test_a_workload_not_ours_is_never_deleted() -> None:
    kube = Deleting()
    kube.store({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "llama-decode", "labels": {}},
                "spec": {}})
    reconcile(kube, copy.deepcopy(MULTI_NODE), "example/xpyd:test",  # type: ignore[arg-type]
              now=lambda: "2026-12-01T00:00:00Z", verified=Verified(), lws=Check())
    assert kube.deleted == []


def test_without_leaderworkersets_the_rest_converges_and_the_pool_says_why() -> None:
    from xpyd.api.conditions import ConditionType
    from xpyd.controller.status import ConditionValue

    missing = ConditionValue(ConditionType.DEGRADED, True, "LeaderWorkerSetMissing", "install LeaderWorkerSet")
    kube, verified, check = Deleting(), Verified(), Check(missing, available=False)
    run(kube, Verified())  # the pool as it was, single-node
    for obj in kube.objects.values():
        obj["metadata"].setdefault("ownerReferences", [{"uid": "u-1"}])
    kube.objects.pop(("LeaderWorkerSet", "llama-decode"), None)
    outcome = reconcile(kube, copy.deepcopy(MULTI_NODE), "example/xpyd:test",  # type: ignore[arg-type]
                        now=lambda: "2026-12-01T00:00:00Z", verified=verified, lws=check)
    assert outcome.blocked == missing and check.calls == 1
    assert ("LeaderWorkerSet", "llama-decode") not in kube.objects
    assert ("Deployment", "llama-prefill") in kube.objects and ("Deployment", "llama-proxy") in kube.objects
    degraded = next(c for c in kube.status_writes[-1]["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "LeaderWorkerSetMissing")
    assert "LeaderWorkerSetMissing" in kube.events
    assert verified.key == ()  # not remembered: the next reconcile looks again
    assert kube.deleted == [] and ("Deployment", "llama-decode") in kube.objects  # nothing torn down for it
