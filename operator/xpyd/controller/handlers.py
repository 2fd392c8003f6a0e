"""kopf handlers: thin entry points around `reconcile()`.

- create/resume/update of a DisaggregatedServing reconcile it (kopf retries on errors);
- events of child Deployments and Services (labelled managed-by xpyd-operator) reconcile their
  owner, so status follows readiness and a deleted or edited child comes back at once;
- a periodic sweep reconciles every object to catch any other drift. (A kopf timer would do
  the same per object, but kopf guards timers with a finalizer, and a finalizer makes deleting a
  DisaggregatedServing hang whenever the operator is not running.)
- the autoscaler loop (same reasoning: not a kopf timer) makes a decision for every object whose
  autoscaling mode is not Off once per interval, under the same per-object lock as the reconcile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kopf

from xpyd.api import models
from xpyd.api.naming import FIELD_MANAGER, SERVING_LABEL
from xpyd.common.jsontypes import JSON
from xpyd.controller.autoscale import Autoscaler
from xpyd.controller.reconcile import InvalidSpec, reconcile
from xpyd.kube import Kube, KubeError

log = logging.getLogger(__name__)

CHILD_SELECTOR = {"app.kubernetes.io/managed-by": FIELD_MANAGER}


@dataclass
class OperatorState:
    """Per-operator state, kept in kopf's memo (no module globals)."""

    kube: Kube
    operator_image: str
    resync_seconds: float
    namespaces: list[str]
    #: Backoff of kopf's retries after an API error.
    retry_seconds: float = 10.0
    #: The autoscaler (None: no autoscaling in this operator, e.g. in tests of the reconcile alone).
    autoscaler: Autoscaler | None = None
    #: How often the autoscaler loop looks for objects whose decision is due.
    autoscale_tick_seconds: float = 5.0
    _locks: dict[tuple[str, str], threading.Lock] = field(default_factory=dict)
    _locks_guard: threading.Lock = field(default_factory=threading.Lock)
    sweeper: asyncio.Task[None] | None = None
    scaler: asyncio.Task[None] | None = None

    def lock(self, namespace: str, name: str) -> threading.Lock:
        """One reconcile at a time per object, whichever handler triggered it."""
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def forget_locks(self, present: set[tuple[str, str]], scopes: list[str | None]) -> None:
        """Drop the idle locks of objects that no longer exist in the listed scopes (the map would
        otherwise grow with every object ever seen). A held lock stays until a later sweep."""
        with self._locks_guard:
            for key, lock in list(self._locks.items()):
                if key not in present and (None in scopes or key[0] in scopes) and not lock.locked():
                    del self._locks[key]

    def reconcile(self, namespace: str, name: str) -> None:
        """Read the object and reconcile it, under its lock: a reconcile that waited for another
        must see that one's writes, or it would write a stale status again."""
        with self.lock(namespace, name):
            body = self.kube.get(models.API_VERSION, models.KIND, namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return
            outcome = reconcile(self.kube, body, self.operator_image)
        if outcome.writes:
            log.info("reconciled %s/%s: created %s, updated %s, status %s", namespace, name,
                     outcome.created or "-", outcome.updated or "-", "written" if outcome.status_written else "-")

    def autoscale(self, namespace: str, name: str) -> None:
        """One autoscaler decision for the object, then (Auto mode, replicas changed) its reconcile."""
        assert self.autoscaler is not None
        with self.lock(namespace, name):
            body = self.kube.get(models.API_VERSION, models.KIND, namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                self.autoscaler.forget(namespace, name)
                return
            actuate = self.autoscaler.step(body)
        if actuate:
            self.reconcile(namespace, name)


def configure_settings(settings: kopf.OperatorSettings) -> None:
    """The operator's own prefixes, quiet event posting and bounded watches."""
    settings.persistence.finalizer = f"{models.GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=models.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=models.GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # Events are written by the reconciler itself.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    settings.execution.max_workers = 8
    # The resources are fixed: no need to list CustomResourceDefinitions (and no RBAC for it).
    settings.scanning.disabled = True


def register(registry: kopf.OperatorRegistry) -> None:
    """Register every handler on `registry` (the operator's own: no global registry)."""

    @kopf.on.startup(registry=registry)
    async def _startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        configure_settings(settings)
        state: OperatorState = memo.state
        state.sweeper = asyncio.create_task(_sweep_forever(state))
        if state.autoscaler is not None:
            state.scaler = asyncio.create_task(_autoscale_forever(state))

    @kopf.on.cleanup(registry=registry)
    async def _cleanup(memo: kopf.Memo, **_: Any) -> None:
        state: OperatorState = memo.state
        for task in (state.sweeper, state.scaler):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    @kopf.on.resume(models.GROUP, models.VERSION, models.PLURAL, registry=registry)
    @kopf.on.create(models.GROUP, models.VERSION, models.PLURAL, registry=registry)
    @kopf.on.update(models.GROUP, models.VERSION, models.PLURAL, registry=registry)
    def _on_change(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
        state: OperatorState = memo.state
        try:
            state.reconcile(namespace or "default", name)  # the resource is namespaced: always set
        except InvalidSpec as error:
            raise kopf.PermanentError(str(error)) from None
        except KubeError as error:
            raise kopf.TemporaryError(str(error), delay=state.retry_seconds) from None

    for group_version, plural in (("apps/v1", "deployments"), ("v1", "services")):
        group, _, version = group_version.rpartition("/")

        @kopf.on.event(group, version, plural, labels=CHILD_SELECTOR, registry=registry)
        def _on_child(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
            owner = body.get("metadata", {}).get("labels", {}).get(SERVING_LABEL)
            if owner:
                _reconcile_quietly(memo.state, body["metadata"]["namespace"], owner)


def _reconcile_quietly(state: OperatorState, namespace: str, name: str) -> None:
    """Reconcile from outside the object's own handlers: errors are logged, and the next event,
    sweep or retry of its own handler brings it back."""
    try:
        state.reconcile(namespace, name)
    except InvalidSpec:
        pass  # reported in its status and Events
    except KubeError as error:
        log.warning("reconcile of %s/%s failed, will retry: %s", namespace, name, error)


def _list_all(state: OperatorState, what: str) -> tuple[list[JSON], list[str | None]]:
    """Every DisaggregatedServing in the operator's scopes, and the scopes whose list succeeded (only
    there may an object missing from the list be taken as gone)."""
    bodies: list[JSON] = []
    listed: list[str | None] = []
    scopes: list[str | None] = list(state.namespaces) or [None]  # None: every namespace
    for scope in scopes:
        try:
            bodies.extend(state.kube.list_servings(scope))
        except KubeError as error:
            log.warning("%s could not list DisaggregatedServings: %s", what, error)
            continue
        listed.append(scope)
    return bodies, listed


def _key(body: JSON) -> tuple[str, str]:
    return body["metadata"]["namespace"], body["metadata"]["name"]


def _sweep(state: OperatorState) -> None:
    bodies, listed = _list_all(state, "drift sweep")
    for body in bodies:
        _reconcile_quietly(state, *_key(body))
    state.forget_locks({_key(body) for body in bodies}, listed)


async def _sweep_forever(state: OperatorState) -> None:
    while True:
        await asyncio.sleep(state.resync_seconds)
        await _survive(_sweep, state)


async def _survive(work: Callable[[OperatorState], None], state: OperatorState) -> None:
    """Run one round of a periodic loop in a thread; a bug in it is logged and the loop goes on."""
    try:
        await asyncio.to_thread(work, state)
    except Exception:
        log.exception("%s failed; the next round retries", work.__name__)


def _autoscale_due(state: OperatorState) -> None:
    """Decide for every autoscaled object whose decision is due (one list per scope and tick)."""
    assert state.autoscaler is not None
    bodies, listed = _list_all(state, "autoscaler")
    for body in bodies:
        namespace, name = _key(body)
        if not state.autoscaler.due(body, state.autoscaler.clock()):
            continue
        try:
            state.autoscale(namespace, name)
        except (KubeError, InvalidSpec) as error:
            log.warning("autoscaler decision for %s/%s failed, will retry: %s", namespace, name, error)
        except Exception:  # a bug in one object's decision must not stop the others' (or the loop)
            log.exception("autoscaler decision for %s/%s failed", namespace, name)
    state.autoscaler.forget_absent({_key(body) for body in bodies}, listed)


async def _autoscale_forever(state: OperatorState) -> None:
    while True:
        await _survive(_autoscale_due, state)
        await asyncio.sleep(state.autoscale_tick_seconds)
