"""The status the reconciler computes: `merge_conditions` (metav1.Condition bookkeeping) and
`compute_status` (Ready, Progressing, Degraded and ScalingActive from what exists)."""

from __future__ import annotations

import copy

import pytest

from tests.servings import serving
from xpyd.api.conditions import ConditionType
from xpyd.api.load import parse_serving
from xpyd.common.jsontypes import JSON
from xpyd.controller.status import ConditionValue, Observed, compute_status, merge_conditions, status_changed

pytestmark = pytest.mark.unit

THEN = "2026-01-01T00:00:00Z"
NOW = "2026-01-02T00:00:00Z"

READY, PROGRESSING = ConditionType.READY, ConditionType.PROGRESSING
DEGRADED, SCALING = ConditionType.DEGRADED, ConditionType.SCALING_ACTIVE


def old(kind: str, status: str, reason: str = "Before", since: str | None = THEN, generation: int = 1) -> JSON:
    """A condition as a previous reconcile wrote it."""
    condition = {"type": kind, "status": status, "reason": reason, "message": "before",
                 "observedGeneration": generation}
    if since is not None:
        condition["lastTransitionTime"] = since
    return condition


# ---- merge_conditions ------------------------------------------------------------------------------

# (case, old conditions, new conditions, generation,
#  expected (type, status, reason, lastTransitionTime, observedGeneration) in order)
MERGES: list[tuple[str, list[JSON], list[ConditionValue], int | None, list[tuple[str, str, str, str, int | None]]]] = [
    ("no previous conditions: they start now", [],
     [ConditionValue(READY, True, "AllReplicasReady"), ConditionValue(PROGRESSING, False, "Converged")], 3,
     [("Ready", "True", "AllReplicasReady", NOW, 3), ("Progressing", "False", "Converged", NOW, 3)]),
    ("status unchanged: lastTransitionTime kept", [old("Ready", "True")],
     [ConditionValue(READY, True, "AllReplicasReady")], 1,
     [("Ready", "True", "AllReplicasReady", THEN, 1)]),
    ("status unchanged, reason changed: still kept", [old("Ready", "True", "AllReplicasReady")],
     [ConditionValue(READY, True, "PartiallyReady")], 1,
     [("Ready", "True", "PartiallyReady", THEN, 1)]),
    ("status flips True to False: now", [old("Ready", "True")],
     [ConditionValue(READY, False, "DecodeUnavailable")], 1,
     [("Ready", "False", "DecodeUnavailable", NOW, 1)]),
    ("status flips False to True: now", [old("Ready", "False")],
     [ConditionValue(READY, True, "AllReplicasReady")], 1,
     [("Ready", "True", "AllReplicasReady", NOW, 1)]),
    ("None is Unknown", [],
     [ConditionValue(SCALING, None, "AutoscalerNotRunning")], 1,
     [("ScalingActive", "Unknown", "AutoscalerNotRunning", NOW, 1)]),
    ("Unknown unchanged: kept", [old("ScalingActive", "Unknown")],
     [ConditionValue(SCALING, None, "AutoscalerNotRunning")], 1,
     [("ScalingActive", "Unknown", "AutoscalerNotRunning", THEN, 1)]),
    ("Unknown to True: now", [old("ScalingActive", "Unknown")],
     [ConditionValue(SCALING, True, "ValidMetrics")], 1,
     [("ScalingActive", "True", "ValidMetrics", NOW, 1)]),
    ("status unchanged but no lastTransitionTime before: now", [old("Ready", "True", since=None)],
     [ConditionValue(READY, True, "AllReplicasReady")], 1,
     [("Ready", "True", "AllReplicasReady", NOW, 1)]),
    ("observedGeneration follows the new generation, the time stays", [old("Ready", "True", generation=1)],
     [ConditionValue(READY, True, "AllReplicasReady")], 5,
     [("Ready", "True", "AllReplicasReady", THEN, 5)]),
    ("no generation", [], [ConditionValue(READY, True, "AllReplicasReady")], None,
     [("Ready", "True", "AllReplicasReady", NOW, None)]),
    ("each type keeps its own time", [old("Ready", "True"), old("Progressing", "True", since="2025-06-01T00:00:00Z")],
     [ConditionValue(READY, True, "AllReplicasReady"), ConditionValue(PROGRESSING, False, "Converged")], 1,
     [("Ready", "True", "AllReplicasReady", THEN, 1), ("Progressing", "False", "Converged", NOW, 1)]),
    ("the order is the new conditions' order, not the old",
     [old("Progressing", "True"), old("Ready", "True")],
     [ConditionValue(READY, True, "AllReplicasReady"), ConditionValue(PROGRESSING, True, "RollingOut")], 1,
     [("Ready", "True", "AllReplicasReady", THEN, 1), ("Progressing", "True", "RollingOut", THEN, 1)]),
    # Only the conditions given come back: a caller that keeps others (the autoscaler's
    # `with_condition`) adds them itself.
    ("old conditions not given are not in the result", [old("Ready", "True"), old("Degraded", "True")],
     [ConditionValue(READY, True, "AllReplicasReady")], 1,
     [("Ready", "True", "AllReplicasReady", THEN, 1)]),
    ("a type the old list lacks starts now, the others are matched by type",
     [old("Degraded", "False")],
     [ConditionValue(READY, False, "ScaledToZero"), ConditionValue(DEGRADED, False, "AsExpected")], 1,
     [("Ready", "False", "ScaledToZero", NOW, 1), ("Degraded", "False", "AsExpected", THEN, 1)]),
]


@pytest.mark.parametrize(("previous", "new", "generation", "expected"), [(o, n, g, e) for _, o, n, g, e in MERGES],
                         ids=[c for c, _, _, _, _ in MERGES])
def test_merge_conditions(previous: list[JSON], new: list[ConditionValue], generation: int | None,
                          expected: list[tuple[str, str, str, str, int | None]]) -> None:
    before = copy.deepcopy(previous)
    merged = merge_conditions(previous, new, generation, NOW)
    assert [(c["type"], c["status"], c["reason"], c["lastTransitionTime"], c["observedGeneration"])
            for c in merged] == expected
    assert [c["message"] for c in merged] == [c.message for c in new]
    assert all(set(c) == {"type", "status", "reason", "message", "observedGeneration", "lastTransitionTime"}
               for c in merged)
    assert previous == before                     # the old conditions are left as they were


# ---- compute_status --------------------------------------------------------------------------------

def deployment(replicas: int, ready: int | None = None, updated: int | None = None, stale: bool = False) -> JSON:
    """A Deployment at generation 2: its status has seen it (or not, when `stale`), with `replicas`
    pods of which `ready` are ready and `updated` run the current template (both default to all)."""
    return {"metadata": {"generation": 2},
            "status": {"observedGeneration": 1 if stale else 2, "replicas": replicas,
                       "readyReplicas": replicas if ready is None else ready,
                       "updatedReplicas": replicas if updated is None else updated}}


def observed(prefill: JSON | None = None, decode: JSON | None = None, proxy: JSON | None = None,
             desired: tuple[int, int, int] = (1, 1, 1), pods: tuple[JSON, ...] = (),
             gone: tuple[str, ...] = ()) -> Observed:
    """The pools (`desired` replicas each, all ready and rolled out, unless given), `gone` naming any
    whose Deployment does not exist."""
    def pool(component: str, given: JSON | None, replicas: int) -> JSON | None:
        return None if component in gone else given if given is not None else deployment(replicas)

    (p, d, x) = desired
    return Observed(workloads={"prefill": pool("prefill", prefill, p), "decode": pool("decode", decode, d),
                               "proxy": pool("proxy", proxy, x)},
                    desired={"prefill": p, "decode": d, "proxy": x}, pods=pods)


def pending(name: str, message: str, deleting: bool = False) -> JSON:
    """A pod the scheduler cannot place."""
    pod: JSON = {"metadata": {"name": name},
                 "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                            "message": message}]}}
    if deleting:
        pod["metadata"]["deletionTimestamp"] = THEN
    return pod


def crashing(name: str) -> JSON:
    """A pod whose engine container is in CrashLoopBackOff."""
    return {"metadata": {"name": name},
            "status": {"containerStatuses": [{"name": "vllm", "state": {"waiting": {
                "reason": "CrashLoopBackOff", "message": "back-off 5m0s restarting failed container"}}}]}}


NO_GPU = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available."
AUTO = {"autoscaling": {"mode": "Auto", "prometheus": {"url": "http://prometheus:9090"}}}
RECOMMEND = {"autoscaling": {"mode": "Recommend", "prometheus": {"url": "http://prometheus:9090"}}}
ALL_GOOD = [("True", "AllReplicasReady"), ("False", "Converged"), ("False", "AsExpected"), ("False", "AutoscalingOff")]

# (case, spec over serving(), what exists, old conditions,
#  expected (status, reason) of Ready, Progressing, Degraded, ScalingActive)
STATUSES: list[tuple[str, JSON, Observed, list[JSON], list[tuple[str, str]]]] = [
    ("every pool ready and rolled out", {}, observed(), [], ALL_GOOD),
    ("one pod of a pool not ready yet: partially ready", {},
     observed(decode=deployment(2, ready=1), desired=(1, 2, 1)), [],
     [("True", "PartiallyReady"), ("True", "RollingOut"), ("False", "AsExpected"), ("False", "AutoscalingOff")]),
    ("no prefill pod ready", {}, observed(prefill=deployment(1, ready=0)), [],
     [("False", "PrefillUnavailable"), ("True", "RollingOut"), ("False", "AsExpected"), ("False", "AutoscalingOff")]),
    ("no decode pod ready", {}, observed(decode=deployment(2, ready=0), desired=(1, 2, 1)), [],
     [("False", "DecodeUnavailable"), ("True", "RollingOut"), ("False", "AsExpected"), ("False", "AutoscalingOff")]),
    ("decode and proxy unavailable: the first one is the reason", {},
     observed(decode=deployment(1, ready=0), proxy=deployment(1, ready=0)), [],
     [("False", "DecodeUnavailable"), ("True", "RollingOut"), ("False", "AsExpected"), ("False", "AutoscalingOff")]),
    ("the proxy Deployment is missing", {}, observed(gone=("proxy",)), [],
     [("False", "ProxyUnavailable"), ("True", "RollingOut"), ("False", "AsExpected"), ("False", "AutoscalingOff")]),
    ("nothing created yet", {}, Observed(workloads={}, desired={"prefill": 1, "decode": 1, "proxy": 1}), [],
     [("False", "PrefillUnavailable"), ("True", "RollingOut"), ("False", "AsExpected"), ("False", "AutoscalingOff")]),
    ("prefill scaled to zero while decode serves", {},
     observed(prefill=deployment(0), desired=(0, 1, 1)), [],
     [("False", "PrefillUnavailable"), ("False", "Converged"), ("False", "AsExpected"), ("False", "AutoscalingOff")]),
    ("every pool scaled to zero", {},
     observed(prefill=deployment(0), decode=deployment(0), proxy=deployment(0), desired=(0, 0, 0)), [],
     [("False", "ScaledToZero"), ("False", "Converged"), ("False", "AsExpected"), ("False", "AutoscalingOff")]),
    ("scaled to zero with no Deployments at all", {},
     Observed(workloads={}, desired={"prefill": 0, "decode": 0, "proxy": 0}), [],
     [("False", "ScaledToZero"), ("False", "Converged"), ("False", "AsExpected"), ("False", "AutoscalingOff")]),
    ("a Deployment's status has not seen its latest generation", {},
     observed(prefill=deployment(1, stale=True)), [],
     [("True", "AllReplicasReady"), ("True", "RollingOut"), ("False", "AsExpected"), ("False", "AutoscalingOff")]),
    ("scaling down: more pods than desired", {}, observed(decode=deployment(3), desired=(1, 2, 1)), [],
     [("True", "AllReplicasReady"), ("True", "RollingOut"), ("False", "AsExpected"), ("False", "AutoscalingOff")]),
    ("a pod still runs the old template", {}, observed(decode=deployment(2, updated=1), desired=(1, 2, 1)), [],
     [("True", "AllReplicasReady"), ("True", "RollingOut"), ("False", "AsExpected"), ("False", "AutoscalingOff")]),
    ("both engine roles roll a new template: a new KV revision", {},
     observed(prefill=deployment(2, updated=1), decode=deployment(3, updated=1), desired=(1, 2, 1)), [],
     [("True", "AllReplicasReady"), ("True", "KVRevisionRollingOut"), ("False", "AsExpected"),
      ("False", "AutoscalingOff")]),
    ("both roles scale up, their new pods not created yet: not a new revision", {},
     observed(prefill=deployment(1, updated=1), decode=deployment(2, updated=2), desired=(2, 3, 1)), [],
     [("True", "PartiallyReady"), ("True", "RollingOut"), ("False", "AsExpected"), ("False", "AutoscalingOff")]),
    ("a proxy reports a pair whose KV hand-offs keep failing", {},
     observed(pods=({"metadata": {"name": "llama-proxy-a", "labels": {"xpyd.io/role": "proxy"}},
                     "status": {"conditions": [{"type": "xpyd.io/KVTransferHealthy", "status": "False",
                                                "reason": "KVTransferFailing", "message": "p -> d"}]}},)), [],
     [("True", "AllReplicasReady"), ("False", "Converged"), ("True", "KVTransferFailing"),
      ("False", "AutoscalingOff")]),
    ("a pod pending for lack of GPUs", {},
     observed(decode=deployment(2, ready=1), desired=(1, 2, 1), pods=(pending("llama-decode-b", NO_GPU),)), [],
     [("True", "PartiallyReady"), ("True", "RollingOut"), ("True", "InsufficientGPUs"), ("False", "AutoscalingOff")]),
    ("a pod pending for lack of the pool's own GPU resource", {"decode": {"gpu": {"resourceName": "amd.com/gpu"}}},
     observed(pods=(pending("llama-decode-b", "0/1 nodes are available: 1 Insufficient amd.com/gpu."),)), [],
     [("True", "AllReplicasReady"), ("False", "Converged"), ("True", "InsufficientGPUs"), ("False", "AutoscalingOff")]),
    ("a pod pending for lack of RDMA devices, when the transfer uses RDMA", {"kvTransfer": {"rdma": {}}},
     observed(pods=(pending("llama-prefill-b", "0/1 nodes are available: 1 Insufficient rdma/ib."),)), [],
     [("True", "AllReplicasReady"), ("False", "Converged"), ("True", "InsufficientGPUs"), ("False", "AutoscalingOff")]),
    ("the same message without RDMA in the spec is only unschedulable", {},
     observed(pods=(pending("llama-prefill-b", "0/1 nodes are available: 1 Insufficient rdma/ib."),)), [],
     [("True", "AllReplicasReady"), ("False", "Converged"), ("True", "Unschedulable"), ("False", "AutoscalingOff")]),
    ("a pod pending for another reason", {},
     observed(pods=(pending("llama-decode-b", "0/3 nodes are available: 3 node(s) didn't match Pod's node "
                                              "affinity/selector."),)), [],
     [("True", "AllReplicasReady"), ("False", "Converged"), ("True", "Unschedulable"), ("False", "AutoscalingOff")]),
    ("a pending pod being deleted does not count", {},
     observed(pods=(pending("llama-decode-b", NO_GPU, deleting=True),)), [], ALL_GOOD),
    ("an engine in CrashLoopBackOff", {},
     observed(decode=deployment(1, ready=0), pods=(crashing("llama-decode-a"),)), [],
     [("False", "DecodeUnavailable"), ("True", "RollingOut"), ("True", "EngineCrashLoop"),
      ("False", "AutoscalingOff")]),
    ("pending for GPUs is reported before a crash loop", {},
     observed(pods=(crashing("llama-decode-a"), pending("llama-decode-b", NO_GPU))), [],
     [("True", "AllReplicasReady"), ("False", "Converged"), ("True", "InsufficientGPUs"), ("False", "AutoscalingOff")]),
    ("Auto before the autoscaler decided anything", AUTO, observed(), [],
     [("True", "AllReplicasReady"), ("False", "Converged"), ("False", "AsExpected"),
      ("Unknown", "AutoscalerNotRunning")]),
    ("Recommend before the autoscaler decided anything", RECOMMEND, observed(), [],
     [("True", "AllReplicasReady"), ("False", "Converged"), ("False", "AsExpected"),
      ("Unknown", "AutoscalerNotRunning")]),
    ("Auto keeps the autoscaler's condition", AUTO, observed(), [old("ScalingActive", "True", "ValidMetrics")],
     [("True", "AllReplicasReady"), ("False", "Converged"), ("False", "AsExpected"), ("True", "ValidMetrics")]),
    ("Auto keeps the autoscaler's False", AUTO, observed(), [old("ScalingActive", "False", "MetricsUnavailable")],
     [("True", "AllReplicasReady"), ("False", "Converged"), ("False", "AsExpected"), ("False", "MetricsUnavailable")]),
    ("Auto after Off: the reconcile's own condition is not the autoscaler's", AUTO, observed(),
     [old("ScalingActive", "False", "AutoscalingOff")],
     [("True", "AllReplicasReady"), ("False", "Converged"), ("False", "AsExpected"),
      ("Unknown", "AutoscalerNotRunning")]),
    ("Off overrides what the autoscaler wrote", {}, observed(), [old("ScalingActive", "True", "ValidMetrics")],
     ALL_GOOD),
    ("old Ready and Degraded conditions are recomputed", {}, observed(),
     [old("Ready", "False", "DecodeUnavailable"), old("Degraded", "True", "InsufficientGPUs")], ALL_GOOD),
]


@pytest.mark.parametrize(("spec", "seen", "conditions", "expected"), [(s, o, c, e) for _, s, o, c, e in STATUSES],
                         ids=[c for c, _, _, _, _ in STATUSES])
def test_compute_status_conditions(spec: JSON, seen: Observed, conditions: list[JSON],
                                   expected: list[tuple[str, str]]) -> None:
    parsed = parse_serving(serving(spec)).spec
    status = compute_status(parsed, seen, {"conditions": conditions}, 2, "http://llama:8000", "TCP", NOW)
    assert [c["type"] for c in status["conditions"]] == ["Ready", "Progressing", "Degraded", "ScalingActive"]
    assert [(c["status"], c["reason"]) for c in status["conditions"]] == expected


def test_compute_status_fields_and_a_converged_pool_computes_the_status_it_has() -> None:
    spec = parse_serving(serving()).spec
    seen = observed(decode=deployment(3, ready=2, updated=2), proxy=deployment(2, ready=1), desired=(1, 3, 2))
    status = compute_status(spec, seen, {}, 4, "http://llama:8000", "RDMA", NOW)
    assert {key: value for key, value in status.items() if key != "conditions"} == {
        "observedGeneration": 4,
        "prefill": {"replicas": 1, "readyReplicas": 1, "desiredReplicas": 1, "updatedReplicas": 1, "ready": "1/1",
                    "nodesPerReplica": 1, "gpus": 1},
        "decode": {"replicas": 3, "readyReplicas": 2, "desiredReplicas": 3, "updatedReplicas": 2, "ready": "2/3",
                   "nodesPerReplica": 1, "gpus": 3},
        "proxy": {"replicas": 2, "readyReplicas": 1},
        "endpoint": "http://llama:8000",
        "kvTransport": "RDMA",
    }
    ready = status["conditions"][0]
    assert (ready["reason"], ready["message"]) == ("PartiallyReady", "prefill 1, decode 2, proxy 1 ready")
    assert all(c["observedGeneration"] == 4 and c["lastTransitionTime"] == NOW for c in status["conditions"])
    # Later, nothing changed: the same status, so nothing to write.
    again = compute_status(spec, seen, status, 4, "http://llama:8000", "RDMA", "2026-01-03T00:00:00Z")
    assert again == status and not status_changed(status, again)
    # A pool that recovers: Ready's reason changes, its status (True) and time do not; Progressing flips.
    recovered = compute_status(spec, observed(desired=(1, 3, 2), decode=deployment(3), proxy=deployment(2)), status,
                               4, "http://llama:8000", "RDMA", "2026-01-03T00:00:00Z")
    by_type = {c["type"]: c for c in recovered["conditions"]}
    assert (by_type["Ready"]["reason"], by_type["Ready"]["lastTransitionTime"]) == ("AllReplicasReady", NOW)
    assert (by_type["Progressing"]["status"], by_type["Progressing"]["lastTransitionTime"]) == (
        "False", "2026-01-03T00:00:00Z")
    assert status_changed(status, recovered)


def test_multi_node_replicas_count_groups_and_their_gpus() -> None:
    spec = parse_serving(serving({"kvTransfer": {"connector": "NixlConnector"},
                                  "decode": {"nodesPerReplica": 2, "dataParallelSize": 16}})).spec
    status = compute_status(spec, observed(decode=deployment(3, ready=3), desired=(1, 3, 2)), {}, 1,
                            "http://llama:8000", "TCP", NOW)
    assert status["decode"] | {} == {"replicas": 3, "readyReplicas": 3, "desiredReplicas": 3, "updatedReplicas": 3,
                                     "ready": "3/3", "nodesPerReplica": 2, "gpus": 48}  # 3 groups of 2 x 8
    assert status["prefill"]["gpus"] == 1


def test_a_problem_of_the_reconcile_wins_over_what_pods_say() -> None:
    spec = parse_serving(serving()).spec
    missing = ConditionValue(ConditionType.DEGRADED, True, "LeaderWorkerSetMissing", "install LeaderWorkerSet")
    seen = Observed(workloads={"prefill": None, "decode": None, "proxy": None},
                    desired={"prefill": 1, "decode": 1, "proxy": 2},
                    pods=(pending("llama-decode-b", NO_GPU),), problem=missing)
    degraded = compute_status(spec, seen, {}, 1, "http://llama:8000", "TCP", NOW)["conditions"][2]
    assert (degraded["status"], degraded["reason"], degraded["message"]) == (
        "True", "LeaderWorkerSetMissing", "install LeaderWorkerSet")


def test_degraded_message_names_the_count_and_the_first_pod() -> None:
    spec = parse_serving(serving()).spec
    seen = observed(pods=(pending("llama-decode-b", NO_GPU), pending("llama-decode-c", NO_GPU)))
    status = compute_status(spec, seen, {}, 1, "http://llama:8000", "TCP", NOW)
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["message"] == f"2 pod(s) cannot be scheduled; llama-decode-b: {NO_GPU}"
