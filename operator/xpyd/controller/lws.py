"""Whether the operator can use LeaderWorkerSets (multi-node replicas) in this cluster.

The API is optional: a cluster without the LeaderWorkerSet CRD, or an operator installed without
RBAC on leaderworkersets, still runs every single-node pool. A pool that needs the API gets its
other children and `Degraded` with a reason saying what is missing; the answer is looked up again
at most every `recheck_seconds`, so installing LWS (or granting the RBAC) later is picked up
without a restart (`on_available` then runs once: the operator starts watching the kind).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from xpyd.api import conditions as reasons
from xpyd.api.conditions import ConditionType
from xpyd.controller.reconcile import LWS_API_VERSION
from xpyd.controller.status import ConditionValue
from xpyd.kube import Kube, KubeError

log = logging.getLogger(__name__)

RECHECK_SECONDS: Final = 30.0
#: The release the chart and docs name (the one the local control plane runs).
LWS_RELEASE: Final = "v0.9.0"


@dataclass
class LeaderWorkerSetSupport:
    kube: Kube
    #: Where the operator works: None for every namespace, else the first namespace it watches.
    namespace: str | None = None
    recheck_seconds: float = RECHECK_SECONDS
    on_available: Callable[[], None] | None = None
    clock: Callable[[], float] = time.monotonic
    _problem: ConditionValue | None = field(default=None, init=False)
    _checked_at: float = field(default=-float("inf"), init=False)
    _available: bool = field(default=False, init=False)
    _guard: threading.Lock = field(default_factory=threading.Lock, init=False)

    @property
    def available(self) -> bool:
        """Whether the last look found LeaderWorkerSets usable (no request)."""
        return self._available

    def __call__(self) -> ConditionValue | None:
        """None when LeaderWorkerSets can be used, else the Degraded condition of a pool that needs them."""
        with self._guard:
            if self._available:
                return None
            if self.clock() - self._checked_at < self.recheck_seconds:
                return self._problem
            self._checked_at = self.clock()
            self._problem = self._probe()
            if self._problem is not None:
                return self._problem
            self._available = True
        log.info("LeaderWorkerSets (%s) are served and permitted: multi-node pools can run", LWS_API_VERSION)
        if self.on_available is not None:
            self.on_available()
        return None

    def _probe(self) -> ConditionValue | None:
        try:
            served = self.kube.discover(LWS_API_VERSION)
        except KubeError as error:
            return ConditionValue(ConditionType.DEGRADED, True, reasons.LEADER_WORKER_SET_MISSING,
                                  f"could not ask the API server whether it serves {LWS_API_VERSION}: {error}")
        if "leaderworkersets" not in served:
            return ConditionValue(
                ConditionType.DEGRADED, True, reasons.LEADER_WORKER_SET_MISSING,
                f"a role has nodesPerReplica above 1, which runs on LeaderWorkerSet, but this cluster does not "
                f"serve {LWS_API_VERSION}: install LeaderWorkerSet ({LWS_RELEASE} or later, "
                "https://github.com/kubernetes-sigs/lws) or set nodesPerReplica to 1; the other children are "
                f"applied, and this is checked again every {self.recheck_seconds:.0f} s")
        try:
            self.kube.list_objects(LWS_API_VERSION, "LeaderWorkerSet", self.namespace, field_selector="metadata.name=-")
        except KubeError as error:
            if error.status != 403:
                raise
            return ConditionValue(
                ConditionType.DEGRADED, True, reasons.LEADER_WORKER_SET_FORBIDDEN,
                "a role has nodesPerReplica above 1, but the operator may not list leaderworkersets "
                f"({LWS_API_VERSION}): upgrade the chart with rbac.leaderWorkerSet=true (or grant get, list, "
                "watch, create, patch and delete on leaderworkersets.leaderworkerset.x-k8s.io)")
        return None
