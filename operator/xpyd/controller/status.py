"""Status of a DisaggregatedServing, computed from what exists. Pure: no I/O.

Conditions follow metav1.Condition: `lastTransitionTime` moves only when `status` changes, so
a converged pool computes exactly the status it already has and nothing is written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from xpyd.api import conditions as reasons
from xpyd.api.conditions import ConditionType
from xpyd.api.models import AutoscalingMode, DisaggregatedServingSpec, RoleSpec
from xpyd.api.naming import ROLE_LABEL, ROLES, Component, Role
from xpyd.autoscaler.decide import SCALE_FROM_ZERO
from xpyd.common.jsontypes import JSON


@dataclass(frozen=True)
class ConditionValue:
    type: ConditionType
    status: bool | None  # None: Unknown
    reason: str
    message: str = ""


def merge_conditions(old: Sequence[JSON], new: Sequence[ConditionValue], generation: int | None,
                     now: str) -> list[JSON]:
    """New conditions in the metav1.Condition shape, keeping each one's lastTransitionTime
    when its status did not change."""
    previous = {c.get("type"): c for c in old}
    result = []
    for condition in new:
        status = "Unknown" if condition.status is None else ("True" if condition.status else "False")
        before = previous.get(condition.type.value, {})
        since = before.get("lastTransitionTime") if before.get("status") == status else None
        result.append({
            "type": condition.type.value,
            "status": status,
            "reason": condition.reason,
            "message": condition.message,
            "observedGeneration": generation,
            "lastTransitionTime": since or now,
        })
    return result


def role_status(deployment: JSON | None, desired: int, role: RoleSpec | None = None, on_cpu: bool = False) -> JSON:
    """A pool's replicas from its workload's status (a Deployment's pods, a LeaderWorkerSet's groups:
    the same fields), with the shape of a replica (a CPU pool's replicas hold no GPUs)."""
    st = (deployment or {}).get("status", {})
    ready = st.get("readyReplicas", 0)
    role = role or RoleSpec()
    return {
        "replicas": st.get("replicas", 0),
        "readyReplicas": ready,
        "desiredReplicas": desired,
        "updatedReplicas": st.get("updatedReplicas", 0),
        "ready": f"{ready}/{desired}",
        "nodesPerReplica": role.nodes_per_replica,
        "gpus": 0 if on_cpu else desired * role.gpus_per_replica,
    }


def _rolled_out(deployment: JSON | None, desired: int) -> bool:
    if deployment is None:
        return desired == 0
    st = deployment.get("status", {})
    return bool(st.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
                and st.get("updatedReplicas", 0) >= desired
                and st.get("readyReplicas", 0) >= desired
                and st.get("replicas", 0) == desired)


def _outdated(workload: JSON | None) -> int:
    """Pods (or groups) of a workload that still run an earlier template."""
    st = (workload or {}).get("status", {})
    return max(0, int(st.get("replicas", 0)) - int(st.get("updatedReplicas", 0)))


def pending_problem(pods: Sequence[JSON], gpu_resources: set[str]) -> ConditionValue | None:
    """Degraded when pods cannot be scheduled (for lack of GPUs, or otherwise) or crash-loop."""
    unschedulable = []
    for pod in pods:
        if pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        for condition in pod.get("status", {}).get("conditions", []):
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False" \
                    and condition.get("reason") == "Unschedulable":
                unschedulable.append((pod["metadata"]["name"], condition.get("message", "")))
    if unschedulable:
        name, message = unschedulable[0]
        gpus = any(f"Insufficient {resource}" in msg for _, msg in unschedulable for resource in gpu_resources)
        return ConditionValue(
            ConditionType.DEGRADED, True, reasons.INSUFFICIENT_GPUS if gpus else reasons.UNSCHEDULABLE,
            f"{len(unschedulable)} pod(s) cannot be scheduled; {name}: {message}",
        )
    for pod in pods:
        for status in pod.get("status", {}).get("containerStatuses", []):
            waiting = status.get("state", {}).get("waiting", {})
            if waiting.get("reason") == "CrashLoopBackOff":
                return ConditionValue(ConditionType.DEGRADED, True, reasons.ENGINE_CRASH_LOOP,
                                      f"{pod['metadata']['name']}: {waiting.get('message', 'CrashLoopBackOff')}")
    return None


def kv_transfer_problem(pods: Sequence[JSON]) -> ConditionValue | None:
    """Degraded while a proxy pod reports prefill/decode pairs whose KV hand-offs keep failing (its
    `xpyd.io/KVTransferHealthy` condition False): the reports of every such proxy, by pod."""
    reports = []
    for pod in pods:
        meta = pod.get("metadata", {})
        if meta.get("deletionTimestamp") or (meta.get("labels") or {}).get(ROLE_LABEL) != "proxy":
            continue
        for condition in pod.get("status", {}).get("conditions", []):
            if condition.get("type") == reasons.KV_TRANSFER_POD_CONDITION and condition.get("status") == "False":
                reports.append(f"proxy {meta.get('name')}: {condition.get('message', '')}")
    if not reports:
        return None
    return ConditionValue(ConditionType.DEGRADED, True, reasons.KV_TRANSFER_FAILING, "; ".join(sorted(reports)))


@dataclass(frozen=True)
class Observed:
    """What exists in the cluster for one DisaggregatedServing."""

    #: Each component's workload: a Deployment, or a LeaderWorkerSet for a multi-node role.
    workloads: Mapping[Component, JSON | None]
    desired: Mapping[Component, int]
    pods: Sequence[JSON] = ()
    #: A problem the reconcile met that explains more than the pods do (LeaderWorkerSet missing).
    problem: ConditionValue | None = None
    #: Roles whose Deployment keeps its old pods until the other role has a new one Ready.
    held: frozenset[Role] = frozenset()


def compute_status(spec: DisaggregatedServingSpec, observed: Observed, old_status: JSON,
                   generation: int | None, endpoint: str, transport: str, now: str) -> JSON:
    """The status fields the reconciler owns (the autoscaler block is written elsewhere)."""
    roles = {c: role_status(observed.workloads.get(c), observed.desired[c], getattr(spec, c), spec.on_cpu)
             for c in ("prefill", "decode")}
    proxy = observed.workloads.get("proxy")
    proxy_status = {"replicas": (proxy or {}).get("status", {}).get("replicas", 0),
                    "readyReplicas": (proxy or {}).get("status", {}).get("readyReplicas", 0)}

    ready_counts: dict[Component, int] = {
        "prefill": roles["prefill"]["readyReplicas"],
        "decode": roles["decode"]["readyReplicas"],
        "proxy": proxy_status["readyReplicas"],
    }
    missing = [c for c, n in ready_counts.items() if n == 0]
    at_zero = spec.autoscaling.scales_to_zero and observed.desired["prefill"] == observed.desired["decode"] == 0
    decided = ((old_status.get("autoscaler") or {}).get("lastDecision") or {}).get("reason")
    starting = (spec.autoscaling.scales_to_zero and decided == SCALE_FROM_ZERO and missing
                and set(missing) <= {"prefill", "decode"})
    if at_zero and ready_counts["proxy"] > 0:
        ready = ConditionValue(ConditionType.READY, True, reasons.IDLE_AT_ZERO,
                               f"prefill and decode are scaled to zero (idle); {ready_counts['proxy']} proxy pod(s) "
                               f"ready hold requests for up to {spec.autoscaling.wait_seconds} s while both start")
    elif at_zero and observed.desired["proxy"] > 0:  # at zero only the proxies must be up
        ready = ConditionValue(ConditionType.READY, False, reasons.role_unavailable("proxy"),
                               "prefill and decode are scaled to zero and no proxy pod is ready to hold requests")
    elif starting:
        ready = ConditionValue(ConditionType.READY, True, reasons.STARTING_FROM_ZERO,
                               f"prefill {roles['prefill']['ready']} and decode {roles['decode']['ready']} ready, "
                               f"starting from zero; {ready_counts['proxy']} proxy pod(s) hold requests until both "
                               "serve")
    elif all(observed.desired[c] == 0 for c in ready_counts):
        ready = ConditionValue(ConditionType.READY, False, reasons.SCALED_TO_ZERO, "every pool has 0 replicas")
    elif missing:
        ready = ConditionValue(ConditionType.READY, False, reasons.role_unavailable(missing[0]),
                               "no ready pod in: " + ", ".join(missing))
    else:
        complete = all(ready_counts[c] >= observed.desired[c] for c in ready_counts)
        reason = reasons.ALL_REPLICAS_READY if complete else reasons.PARTIALLY_READY
        ready = ConditionValue(ConditionType.READY, True, reason,
                               "prefill {prefill}, decode {decode}, proxy {proxy} ready".format(**ready_counts))

    rolling = [c for c in ("prefill", "decode", "proxy")
               if not _rolled_out(observed.workloads.get(c), observed.desired[c])]
    outdated = {c: _outdated(observed.workloads.get(c)) for c in ("prefill", "decode")}
    if all(outdated.values()):  # a change both roles share: their pods' KV compatibility hash changes
        progressing = ConditionValue(
            ConditionType.PROGRESSING, True, reasons.KV_REVISION_ROLLING_OUT,
            "prefill and decode roll to a new KV revision: the proxies pair old with old and new with new "
            "until both have rolled (" + ", ".join(f"{c}: {n} of the old template left"
                                                  for c, n in outdated.items()) + ")"
            + ("; " + " and ".join(r for r in ROLES if r in observed.held) + " keep their old pods until both "
               "roles have a ready pod of the new revision" if observed.held else ""))
    elif rolling:
        progressing = ConditionValue(ConditionType.PROGRESSING, True, reasons.ROLLING_OUT,
                                     "waiting for " + ", ".join(rolling) + " to reach the desired state")
    else:
        progressing = ConditionValue(ConditionType.PROGRESSING, False, reasons.CONVERGED,
                                     "every pool runs the desired template and replicas")

    gpu_resources = {spec.prefill.gpu.resource_name, spec.decode.gpu.resource_name}
    if spec.kv_transfer.rdma:
        gpu_resources.add(spec.kv_transfer.rdma.resource_name)
    degraded = observed.problem or pending_problem(observed.pods, gpu_resources) or \
        kv_transfer_problem(observed.pods) or ConditionValue(ConditionType.DEGRADED, False, reasons.AS_EXPECTED, "")

    if spec.autoscaling.mode == AutoscalingMode.OFF:
        scaling = ConditionValue(ConditionType.SCALING_ACTIVE, False, reasons.AUTOSCALING_OFF,
                                 "spec replicas rule (autoscaling.mode is Off)")
    else:  # the autoscaler owns the condition once it has decided anything
        scaling = _autoscaler_condition(old_status) or ConditionValue(
            ConditionType.SCALING_ACTIVE, None, reasons.AUTOSCALER_NOT_RUNNING,
            f"autoscaling.mode is {spec.autoscaling.mode.value}; no decision has been made yet")

    conditions = merge_conditions(old_status.get("conditions", []), [ready, progressing, degraded, scaling],
                                  generation, now)
    return {
        "observedGeneration": generation,
        "conditions": conditions,
        "prefill": roles["prefill"],
        "decode": roles["decode"],
        "proxy": proxy_status,
        "endpoint": endpoint,
        "kvTransport": transport,
    }


def _autoscaler_condition(old_status: JSON) -> ConditionValue | None:
    """The ScalingActive condition the autoscaler wrote, if any (not the reconcile's own)."""
    for condition in old_status.get("conditions", []):
        if condition.get("type") == ConditionType.SCALING_ACTIVE.value and condition.get("reason") not in (
                reasons.AUTOSCALING_OFF, reasons.AUTOSCALER_NOT_RUNNING):
            value = {"True": True, "False": False}.get(condition.get("status", ""))
            return ConditionValue(ConditionType.SCALING_ACTIVE, value, condition["reason"],
                                  condition.get("message", ""))
    return None


def invalid_status(old_status: JSON, generation: int | None, message: str, now: str) -> JSON:
    """Status of a spec that got past the schema but not the models: nothing is touched."""
    conditions = merge_conditions(old_status.get("conditions", []), [
        ConditionValue(ConditionType.READY, False, reasons.INVALID_SPEC, message),
        ConditionValue(ConditionType.PROGRESSING, False, reasons.INVALID_SPEC, "fix the spec to continue"),
    ], generation, now)
    return {"observedGeneration": generation, "conditions": conditions}


def status_changed(old: JSON, new: JSON) -> bool:
    """Whether writing `new` would change anything in `old` (only the keys `new` sets)."""
    return any(old.get(key) != value for key, value in new.items())
