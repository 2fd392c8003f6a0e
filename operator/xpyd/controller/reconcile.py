"""One level-based reconcile of a DisaggregatedServing: render, adopt, apply what differs,
then write the status computed from what exists. Called on create, resume and update, on
changes of child Deployments and Services, and by the periodic drift sweep.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import kopf

from xpyd.api.conditions import INVALID_SPEC, ConditionType
from xpyd.api.load import SpecError, parse_serving
from xpyd.api.models import AutoscalingMode, DisaggregatedServing
from xpyd.api.naming import ROLES, SERVING_LABEL, Component, child_name
from xpyd.common.jsontypes import JSON
from xpyd.common.timefmt import rfc3339
from xpyd.controller.diff import is_subset
from xpyd.controller.status import Observed, compute_status, invalid_status, status_changed
from xpyd.kube import Kube
from xpyd.render import RenderOptions, endpoint, render
from xpyd.render.engine import transport

log = logging.getLogger(__name__)


class InvalidSpec(Exception):
    """The object passed the CRD schema but not the models (e.g. a CRD older than the operator)."""


@dataclass
class Outcome:
    """What one reconcile did: the API writes it sent, by kind."""

    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    status_written: bool = False

    @property
    def writes(self) -> int:
        return len(self.created) + len(self.updated) + int(self.status_written)


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


def reconcile(kube: Kube, body: JSON, operator_image: str, now: Callable[[], str] = rfc3339) -> Outcome:
    """Bring the children of `body` to their desired state and update its status."""
    meta = body["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation")
    old_status: JSON = body.get("status") or {}
    outcome = Outcome()
    try:
        serving = parse_serving(body)
    except SpecError as error:
        message = str(error)
        status = invalid_status(old_status, generation, message, now())
        if status_changed(old_status, status):
            kube.patch_status(namespace, name, status)
            kube.event(body, "Warning", INVALID_SPEC, message)
            outcome.status_written = True
        raise InvalidSpec(message) from None

    replicas = desired_replicas(serving)
    objects = render(name, namespace, serving.spec,
                     RenderOptions(operator_image=operator_image,
                                   replicas={role: replicas[role] for role in ROLES}))
    kopf.adopt(objects, owner=kopf.Body(body))  # type: ignore[arg-type]

    live_deployments: dict[str, JSON] = {}
    stale: list[JSON] = []
    for obj in objects:
        kind, child = obj["kind"], obj["metadata"]["name"]
        live = kube.get(obj["apiVersion"], kind, namespace, child)
        if live is None or not is_subset(obj, live):
            (outcome.created if live is None else outcome.updated).append(f"{kind}/{child}")
            stale.append(obj)
        elif kind == "Deployment":
            live_deployments[child] = live
    # The applies go out together, in two waves: what the pods need (their ServiceAccount, RBAC,
    # Services), then the Deployments that create them.
    for wave in ([o for o in stale if o["kind"] != "Deployment"], [o for o in stale if o["kind"] == "Deployment"]):
        for obj, live in zip(wave, kube.apply_all(wave), strict=True):
            if obj["kind"] == "Deployment":
                live_deployments[obj["metadata"]["name"]] = live

    components: tuple[Component, ...] = ("prefill", "decode", "proxy")
    deployments = {c: live_deployments.get(child_name(name, c)) for c in components}
    # Pods explain a pool short of ready replicas (Pending for lack of GPUs, crash loops).
    short = any((deployments[c] or {}).get("status", {}).get("readyReplicas", 0) < replicas[c]
                for c in deployments)
    pods = kube.list_objects("v1", "Pod", namespace, f"{SERVING_LABEL}={name}") if short else []
    observed = Observed(deployments=deployments, desired=replicas, pods=pods)
    status = compute_status(serving.spec, observed, old_status, generation,
                            endpoint(name, namespace, serving.spec), transport(serving.spec), now())
    if status_changed(old_status, status):
        kube.patch_status(namespace, name, status)
        outcome.status_written = True
        _report_transitions(kube, body, old_status, status)
    if outcome.created:
        kube.event(body, "Normal", "Created", "created " + ", ".join(outcome.created))
    if outcome.updated:
        kube.event(body, "Normal", "Updated", "applied the desired state to " + ", ".join(outcome.updated))
    return outcome


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
