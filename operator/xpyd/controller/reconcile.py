"""One level-based reconcile of a DisaggregatedServing: render, adopt, apply what differs,
then write the status computed from what exists. Called on create, resume and update, on
changes of child Deployments and Services, and by the periodic drift sweep.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import kopf

from xpyd.api.conditions import INVALID_SPEC, ConditionType
from xpyd.api.load import SpecError, parse_serving
from xpyd.api.models import AutoscalingMode, DisaggregatedServing
from xpyd.api.naming import FIELD_MANAGER, ROLE_LABEL, ROLES, SERVING_LABEL, Component, Role, child_name
from xpyd.common.jsontypes import JSON
from xpyd.common.timefmt import rfc3339
from xpyd.controller.diff import is_subset
from xpyd.controller.rollout import held_roles
from xpyd.controller.status import ConditionValue, Observed, compute_status, invalid_status, status_changed
from xpyd.kube import Kube
from xpyd.render import RenderOptions, render, service_url
from xpyd.render.compat import compat_hash
from xpyd.render.engine import transport

log = logging.getLogger(__name__)


class InvalidSpec(Exception):
    """The object passed the CRD schema but not the models (e.g. a CRD older than the operator)."""


@dataclass
class Outcome:
    """What one reconcile did: the API writes it sent, by kind."""

    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    #: Children of a shape the spec no longer asks for (a role's Deployment once it spans nodes).
    deleted: list[str] = field(default_factory=list)
    status_written: bool = False
    #: Seconds until the status, which changed, may be written (0: not deferred).
    status_deferred: float = 0.0
    #: Why children could not be applied (LeaderWorkerSet not served): Degraded, retried later.
    blocked: ConditionValue | None = None

    @property
    def writes(self) -> int:
        return len(self.created) + len(self.updated) + len(self.deleted) + int(self.status_written)


def desired_replicas(serving: DisaggregatedServing) -> dict[Component, int]:
    """Replicas per pool. The spec rules, except in Auto mode, where the autoscaler's decision in
    status wins (clamped to the bounds, which the user may just have changed)."""
    spec = serving.spec
    result: dict[Component, int] = {"proxy": spec.proxy.replicas}
    for role in ROLES:
        replicas = getattr(spec, role).replicas
        if spec.autoscaling.mode == AutoscalingMode.AUTO:
            bounds = getattr(spec.autoscaling, role)
            decided = getattr(serving.status, role)
            autoscaler = serving.status.autoscaler
            if decided is not None and autoscaler is not None and autoscaler.last_decision is not None:
                replicas = decided.desired_replicas
            replicas = max(bounds.min_replicas, min(bounds.max_replicas, replicas))
        result[role] = replicas
    return result


#: Kinds whose metadata.generation moves with every change of their spec (scale included).
_GENERATION_KINDS: Final = frozenset({"Deployment", "LeaderWorkerSet", "PodDisruptionBudget"})
LWS_API_VERSION: Final = "leaderworkerset.x-k8s.io/v1"
#: The kinds that run a pool's pods: a Deployment, or a LeaderWorkerSet for multi-node replicas.
WORKLOAD_KINDS: Final = frozenset({"Deployment", "LeaderWorkerSet"})


class LeaderWorkerSetCheck(Protocol):
    """Whether the cluster lets the operator use LeaderWorkerSets (see controller.lws)."""

    def __call__(self) -> ConditionValue | None:
        """None when it does (looking again if it did not), else the Degraded condition of a pool
        that needs them."""

    @property
    def available(self) -> bool:
        """What the last look found (no request)."""


class AssumeLeaderWorkerSets:
    """The check of a cluster known to serve LeaderWorkerSets (tests, tools)."""

    available = True

    def __call__(self) -> ConditionValue | None:
        return None

ChildRef = tuple[str, str, str]  # apiVersion, kind, name


def fingerprint(live: JSON, rendered: JSON) -> tuple[Any, ...]:
    """What must stay the same for a child found equal to its desired state `rendered` to still be
    equal: its spec (through metadata.generation where the kind has one, else the whole object
    through its resourceVersion) and the labels, annotations and owner rendering sets (others'
    labels and annotations, such as the Deployment controller's revision, do not matter). A
    Deployment's status churns without changing it."""
    meta = live.get("metadata") or {}
    if live.get("kind") not in _GENERATION_KINDS or meta.get("generation") is None:
        return meta.get("uid"), meta.get("resourceVersion")
    want = rendered.get("metadata") or {}
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    return (meta.get("uid"), meta.get("generation"), json.dumps(meta.get("ownerReferences"), sort_keys=True),
            tuple(labels.get(k) for k in sorted(want.get("labels") or {})),
            tuple(annotations.get(k) for k in sorted(want.get("annotations") or {})))


@dataclass
class Verified:
    """What one pool's last reconcile established (kept between reconciles by the operator): for the
    render inputs `key`, its children and the fingerprint each had when found (or applied) equal to
    the desired state. While neither changes, a reconcile need not render or compare again: it only
    recomputes the status (which most child events, a Deployment's status, are about)."""

    key: tuple[Any, ...] = ()
    #: child -> (its fingerprint, the metadata rendering gave it)
    children: dict[ChildRef, tuple[tuple[Any, ...], JSON]] = field(default_factory=dict)
    #: When the pool's status was last written (time.monotonic), for `status_interval`.
    status_written_at: float = -math.inf


def reconcile(kube: Kube, body: JSON, operator_image: str, now: Callable[[], str] = rfc3339,
              verified: Verified | None = None, status_interval: float = 0.0,
              clock: Callable[[], float] = time.monotonic,
              lws: LeaderWorkerSetCheck | None = None) -> Outcome:
    """Bring the children of `body` to their desired state and update its status. With `verified`
    (the pool's memory of its last reconcile, updated here), unchanged children are not rendered
    and compared again, and a status that only follows its children's progress is written at most
    once per `status_interval` (`Outcome.status_deferred` says when to come back); a reconcile that
    wrote a child or saw a new generation writes its status at once. `lws` says whether
    LeaderWorkerSets can be used; when not, a pool with multi-node roles gets everything else and
    `Degraded` (`Outcome.blocked`)."""
    meta = body["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation")
    try:
        serving = parse_serving(body)
    except SpecError as error:
        _write_invalid_status(kube, body, str(error), now())
        raise InvalidSpec(str(error)) from None

    outcome = Outcome()
    replicas = desired_replicas(serving)
    verified = verified if verified is not None else Verified()
    pods = kube.list_objects("v1", "Pod", namespace, f"{SERVING_LABEL}={name}")
    held = held_roles(compat_hash(serving.spec), pods,
                      [role for role in ROLES if not getattr(serving.spec, role).multi_node])
    key = (meta.get("uid"), generation, operator_image, tuple(sorted(replicas.items())), tuple(sorted(held)))
    live_workloads = _unchanged_workloads(kube, namespace, key, verified)
    if live_workloads is None:
        options = RenderOptions(operator_image=operator_image, replicas={role: replicas[role] for role in ROLES},
                                held=held)
        live_workloads = _converge(kube, body, serving, options, key, verified, outcome,
                                   lws or AssumeLeaderWorkerSets())

    observed = _observed(name, live_workloads, replicas, pods, outcome.blocked, held)
    status = compute_status(serving.spec, observed, body.get("status") or {}, generation,
                            service_url(name, namespace, serving.spec), transport(serving.spec), now())
    _write_status(kube, body, status, verified, status_interval, clock, outcome)
    _announce_writes(kube, body, outcome)
    return outcome


def _write_invalid_status(kube: Kube, body: JSON, message: str, now: str) -> None:
    """Say in the status (and an Event, when it changes) why the spec cannot be used."""
    meta = body["metadata"]
    old_status: JSON = body.get("status") or {}
    status = invalid_status(old_status, meta.get("generation"), message, now)
    if status_changed(old_status, status):
        kube.patch_status(meta["namespace"], meta["name"], status)
        kube.event(body, "Warning", INVALID_SPEC, message)


def _observed(name: str, live_workloads: dict[str, JSON], replicas: dict[Component, int], pods: list[JSON],
              problem: ConditionValue | None, held: frozenset[Role]) -> Observed:
    """What the status is computed from: the pool's workloads, and the pods that explain a pool
    short of ready replicas (Pending for lack of GPUs, crash loops); the proxy pods always report
    their KV-transfer health."""
    components: tuple[Component, ...] = ("prefill", "decode", "proxy")
    workloads = {c: live_workloads.get(child_name(name, c)) for c in components}
    short = any((workloads[c] or {}).get("status", {}).get("readyReplicas", 0) < replicas[c] for c in workloads)
    if not short:
        pods = [p for p in pods if ((p.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL) == "proxy"]
    return Observed(workloads=workloads, desired=replicas, pods=pods, problem=problem, held=held)


def _write_status(kube: Kube, body: JSON, status: JSON, verified: Verified, status_interval: float,
                  clock: Callable[[], float], outcome: Outcome) -> None:
    """Write `status` when it changed: at once when this reconcile wrote a child or saw a new
    generation, else at most once per `status_interval` (`outcome.status_deferred`: when to come
    back). An Event for each condition that changed with it."""
    meta = body["metadata"]
    old_status: JSON = body.get("status") or {}
    if not status_changed(old_status, status):
        return
    wait = verified.status_written_at + status_interval - clock()
    progress_only = not outcome.writes and old_status.get("observedGeneration") == meta.get("generation")
    if wait > 0 and progress_only:
        outcome.status_deferred = wait
        return
    kube.patch_status(meta["namespace"], meta["name"], status)
    verified.status_written_at = clock()
    outcome.status_written = True
    _report_transitions(kube, body, old_status, status)


def _announce_writes(kube: Kube, body: JSON, outcome: Outcome) -> None:
    """An Event for the children created, updated and deleted."""
    if outcome.created:
        kube.event(body, "Normal", "Created", "created " + ", ".join(outcome.created))
    if outcome.updated:
        kube.event(body, "Normal", "Updated", "applied the desired state to " + ", ".join(outcome.updated))
    if outcome.deleted:
        kube.event(body, "Normal", "Deleted", "deleted " + ", ".join(outcome.deleted) + " (replaced: the "
                   "spec asks for another kind)")


def _unchanged_workloads(kube: Kube, namespace: str, key: tuple[Any, ...],
                         verified: Verified) -> dict[str, JSON] | None:
    """The live workloads (Deployments, LeaderWorkerSets) by name, when every child is as the last
    reconcile of the same inputs left it; else None (render and compare)."""
    if verified.key != key or not verified.children:
        return None
    workloads: dict[str, JSON] = {}
    for (api_version, kind, child), (known, rendered) in verified.children.items():
        live = kube.get(api_version, kind, namespace, child)
        if live is None or fingerprint(live, rendered) != known:
            return None
        if kind in WORKLOAD_KINDS:
            workloads[child] = live
    return workloads


def desired_children(body: JSON, serving: DisaggregatedServing, options: RenderOptions) -> list[JSON]:
    """The children of `body` as rendering makes them, owned by it (garbage-collected with it)."""
    meta = body["metadata"]
    objects = render(meta["name"], meta["namespace"], serving.spec, options)
    kopf.adopt(objects, owner=kopf.Body(body))  # type: ignore[arg-type]
    return objects


def _converge(kube: Kube, body: JSON, serving: DisaggregatedServing, options: RenderOptions,
              key: tuple[Any, ...], verified: Verified, outcome: Outcome,
              lws: LeaderWorkerSetCheck) -> dict[str, JSON]:
    """Render, delete children of a shape no longer asked for, apply what differs (recording it in
    `outcome`), remember what was verified; the live workloads."""
    namespace = body["metadata"]["namespace"]
    objects = desired_children(body, serving, options)
    verified.key, verified.children = (), {}  # until every child is known equal
    multi_node = [role for role in ROLES if getattr(serving.spec, role).multi_node]
    lws_problem = lws() if multi_node else None
    if lws_problem is not None:
        # The rest still converges and the pool says why it cannot serve; nothing is deleted for a
        # LeaderWorkerSet that cannot be made (a role's Deployment stays until it can).
        objects = [o for o in objects if o["kind"] != "LeaderWorkerSet"]
        outcome.blocked = lws_problem
    else:
        _prune(kube, body, serving, bool(multi_node) or lws.available, outcome)
    equal: list[tuple[JSON, JSON]] = []
    stale: list[JSON] = []
    for obj in objects:
        kind, child = obj["kind"], obj["metadata"]["name"]
        live = kube.get(obj["apiVersion"], kind, namespace, child)
        if live is None or not is_subset(obj, live):
            (outcome.created if live is None else outcome.updated).append(f"{kind}/{child}")
            stale.append(obj)
        else:
            equal.append((obj, live))
    children: dict[ChildRef, tuple[tuple[Any, ...], JSON]] = {}
    live_workloads: dict[str, JSON] = {}
    for obj, live in [*equal, *apply_in_waves(kube, stale)]:  # each child with its live object
        kind, child = obj["kind"], obj["metadata"]["name"]
        children[(obj["apiVersion"], kind, child)] = (fingerprint(live, obj), _rendered_metadata(obj))
        if kind in WORKLOAD_KINDS:
            live_workloads[child] = live
    if outcome.blocked is None:
        verified.key, verified.children = key, children
    return live_workloads


#: Applied after the rest of a pool's children (see apply_in_waves).
_SECOND_WAVE: Final = frozenset({"RoleBinding", *WORKLOAD_KINDS})


def apply_in_waves(kube: Kube, objects: list[JSON]) -> list[tuple[JSON, JSON]]:
    """Server-side apply of a pool's children, together, in two waves: what the pods need (their
    ServiceAccount, Role, Services), then the workloads that create them with the RoleBinding (the
    API server checks a binding's Role exists and grants nothing beyond the binder's own rights: it
    must come after). Each object with what the API server returned."""
    applied: list[tuple[JSON, JSON]] = []
    first = [o for o in objects if o["kind"] not in _SECOND_WAVE]
    for wave in (first, [o for o in objects if o["kind"] in _SECOND_WAVE]):
        applied.extend(zip(wave, kube.apply_all(wave), strict=True))
    return applied


def _prune(kube: Kube, body: JSON, serving: DisaggregatedServing, lws_usable: bool, outcome: Outcome) -> None:
    """Delete the workload a role had in its other shape: a multi-node role has no Deployment, a
    single-node role no LeaderWorkerSet (the same name; everything else of the role is reused).
    Only the operator's own children of this pool are touched, by uid."""
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    uid = body["metadata"].get("uid")
    for role in ROLES:
        child = child_name(name, role)
        if getattr(serving.spec, role).multi_node:
            api_version, kind = "apps/v1", "Deployment"
        elif lws_usable:
            api_version, kind = LWS_API_VERSION, "LeaderWorkerSet"
        else:
            continue  # no LeaderWorkerSet can exist where the API is not served (or not ours to read)
        live = kube.get(api_version, kind, namespace, child)
        meta = (live or {}).get("metadata") or {}
        ours = (meta.get("labels") or {}).get("app.kubernetes.io/managed-by") == FIELD_MANAGER and any(
            ref.get("uid") == uid for ref in meta.get("ownerReferences") or [])
        if live is not None and ours:
            kube.delete(api_version, kind, namespace, child, uid=meta.get("uid"))
            outcome.deleted.append(f"{kind}/{child}")


def _rendered_metadata(obj: JSON) -> JSON:
    meta = obj.get("metadata") or {}
    return {"metadata": {"labels": meta.get("labels") or {}, "annotations": meta.get("annotations") or {}}}


def _report_transitions(kube: Kube, body: JSON, old: JSON, new: JSON) -> None:
    """An Event for every condition that changed status (Ready, Degraded, ...)."""
    before = {c["type"]: c["status"] for c in old.get("conditions", [])}
    for condition in new.get("conditions", []):
        if before.get(condition["type"]) == condition["status"]:
            continue
        bad = (condition["type"] == ConditionType.READY and condition["status"] == "False") or (
            condition["type"] == ConditionType.DEGRADED and condition["status"] == "True")
        if condition["type"] in (ConditionType.READY, ConditionType.DEGRADED) and (bad or condition["type"] in before):
            kube.event(body, "Warning" if bad else "Normal", condition["reason"],
                       f"{condition['type']}={condition['status']}: {condition['message']}")
