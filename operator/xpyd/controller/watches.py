"""What the operator watches, and what each event means for the pool it concerns.

The operator's cache (`xpyd.kube.cache.Cache`) holds the DisaggregatedServings, every kind the
operator renders for a pool (selected by the operator's labels: `CHILD_SELECTOR`), LeaderWorkerSets
once the cluster serves them (`LWS_KIND`), and the pools' pods (reduced to what the operator reads).
An event concerns the pool that owns the object (`owner_of`); it is urgent when it may need a child
written (`is_urgent`); a pod event matters only when what the reconcile reads of the pod changed
(`pod_signal`) or when a proxy reports newly held requests (`held_signal`).
"""

from __future__ import annotations

from typing import Any, Final

from xpyd.api import models
from xpyd.api.conditions import KV_TRANSFER_POD_CONDITION
from xpyd.api.naming import FIELD_MANAGER, SERVING_LABEL
from xpyd.api.waiting import Held
from xpyd.autoscaler.collect import held_requests
from xpyd.common.jsontypes import JSON
from xpyd.controller.reconcile import LWS_API_VERSION
from xpyd.kube.cache import Kind, without_managed_fields
from xpyd.kube.pods import pod_ready

#: Every kind the operator renders for a pool (a test holds this equal to what rendering produces).
CHILD_KINDS: Final[tuple[tuple[str, str], ...]] = (
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("v1", "ServiceAccount"),
    ("policy/v1", "PodDisruptionBudget"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
)
#: The children the operator watches: its own, of some pool.
CHILD_SELECTOR: Final = f"app.kubernetes.io/managed-by={FIELD_MANAGER},{SERVING_LABEL}"
#: Rendered for multi-node roles only, and watched once the cluster serves it (see controller.lws).
LWS_KIND: Final = Kind(LWS_API_VERSION, "LeaderWorkerSet", CHILD_SELECTOR)

#: A pool: (namespace, name) of its DisaggregatedServing.
Key = tuple[str, str]


def cache_kinds() -> list[Kind]:
    """What the operator's cache holds: the pools, their children, their pods."""
    return [Kind(models.API_VERSION, models.KIND),
            *(Kind(api_version, kind, CHILD_SELECTOR) for api_version, kind in CHILD_KINDS),
            Kind("v1", "Pod", SERVING_LABEL, pod_view, index_label=SERVING_LABEL)]


def pod_view(pod: JSON) -> JSON:
    """What the operator reads of a pod, as its cache stores it: metadata, the node it runs on, and
    its status."""
    pod = without_managed_fields(pod)
    spec = pod.get("spec") or {}
    view: JSON = {"apiVersion": pod.get("apiVersion", "v1"), "kind": "Pod", "metadata": pod.get("metadata", {}),
                  "spec": {k: spec[k] for k in ("nodeName",) if k in spec}, "status": pod.get("status", {})}
    return view


def owner_of(kind: Kind, obj: JSON) -> Key | None:
    """The pool an object belongs to: a DisaggregatedServing itself, or the one its label names."""
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace")
    name = meta.get("name") if kind.kind == models.KIND else (meta.get("labels") or {}).get(SERVING_LABEL)
    return (namespace, name) if namespace and name else None


def pod_signal(pod: JSON | None) -> tuple[Any, ...]:
    """What the reconcile reads of a pod (scheduling, readiness for a held rollout, crash loops,
    deletion, a proxy's KV-transfer health): a pod event that leaves it unchanged needs no reconcile."""
    if pod is None:
        return ()
    status = pod.get("status") or {}
    read = [(c.get("type"), c.get("status"), c.get("reason"), c.get("message")) for c in status.get("conditions") or []
            if c.get("type") in ("PodScheduled", KV_TRANSFER_POD_CONDITION)]
    read.append(("Ready", pod_ready(pod), None, None))
    waiting = [(s.get("state") or {}).get("waiting", {}).get("reason") for s in status.get("containerStatuses") or []]
    return bool((pod.get("metadata") or {}).get("deletionTimestamp")), tuple(read), tuple(waiting)


def held_signal(pod: JSON | None) -> Held:
    """What a proxy pod says it holds for a ready pair (nothing for any other pod)."""
    return Held() if pod is None else held_requests([pod])


def is_urgent(kind: Kind, old: JSON | None, new: JSON | None) -> bool:
    """Whether an event may need a child written (a new or changed DisaggregatedServing, a deleted
    or edited child), rather than only a status refreshed (a child's or a pod's status moved; the
    first listing). Urgent work is done first, so that under a burst of status churn new pools
    still get their children at once."""
    if kind.kind == "Pod":
        return False
    if new is None:
        return kind.kind != models.KIND  # a deleted child comes back; a deleted pool needs nothing
    if old is None:
        return kind.kind == models.KIND  # a new pool (a child's first sighting is its own creation)
    before, after = old.get("metadata") or {}, new.get("metadata") or {}
    if before.get("generation") != after.get("generation"):
        return True
    if kind.kind == models.KIND:
        return False  # its status moved (the autoscaler's decision queues its own urgent reconcile)
    if after.get("generation") is None:
        return True  # a kind without generation (Service, RBAC): any change may be an edit
    return any(before.get(k) != after.get(k) for k in ("labels", "annotations", "ownerReferences"))
