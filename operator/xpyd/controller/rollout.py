"""The paired rollout of a pool's KV revision. Pure.

A change both roles share (the engine image, the model, a must-match flag: `render.compat`) gives
every engine pod a new KV compatibility hash, so both roles roll, and the proxies pair a prefill
only with a decode of its own revision. Each Deployment rolls on its own, though: once its first new
pod is Ready it removes an old one. If prefill's new pod is Ready long before decode's (a slower
start, a node still pulling the image), the old prefill is gone while only old decodes serve, and
no pair is left but the draining old prefill, for its drain timeout; then requests fail.

So while both roles roll and one of them has no Ready pod of the new revision yet, the operator
holds the other: its Deployment's `minReadySeconds` rises (`render.engine.rollout_hold_seconds`),
so its new pods, Ready and serving, do not count as available and the Deployment keeps its old pods
(maxUnavailable 0). As soon as each role has a Ready pod of the new revision, the hold ends and both
roll on: from then new pairs with new. A held Deployment still rolls on by itself once its new pod
has been Ready for the hold, so a revision whose other role never starts cannot freeze it.

Only Deployments are held: a LeaderWorkerSet has no minReadySeconds. A multi-node role's groups are
counted by their leaders (the pods that serve); its own rollout keeps old groups until new ones are
Ready (maxSurge 1, maxUnavailable 0).
"""

from __future__ import annotations

from collections.abc import Iterable

from xpyd.api.naming import KV_COMPAT_LABEL, LWS_WORKER_INDEX_LABEL, ROLE_LABEL, ROLES, Role
from xpyd.common.jsontypes import JSON
from xpyd.kube.pods import pod_ready, terminating


def held_roles(revision: str, pods: Iterable[JSON], holdable: Iterable[Role]) -> frozenset[Role]:
    """The roles among `holdable` (those on Deployments) whose old pods must stay for now: every one
    of them while an earlier revision still has a serving pair (a Ready, non-terminating prefill and
    decode of the same hash) and a role has no Ready pod of `revision` (the pool's current hash)."""
    new: dict[Role, bool] = {role: False for role in ROLES}
    old: dict[Role, set[str]] = {role: set() for role in ROLES}
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        role = labels.get(ROLE_LABEL)
        if role not in ROLES or labels.get(LWS_WORKER_INDEX_LABEL, "0") != "0":
            continue  # not an engine, or a multi-node worker (its group serves through its leader)
        if terminating(pod) or not pod_ready(pod):
            continue
        hash_ = labels.get(KV_COMPAT_LABEL)
        if hash_ == revision:
            new[role] = True
        elif hash_ is not None:
            old[role].add(hash_)
    if all(new.values()) or not old["prefill"] & old["decode"]:
        return frozenset()
    return frozenset(holdable)
