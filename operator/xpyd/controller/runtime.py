"""The operator's runtime (`OperatorRuntime`): watch-fed caches, a work queue of pools, a bounded
set of workers.

- A `Cache` (xpyd.kube.cache) lists and watches the DisaggregatedServings and every kind the
  operator creates (selected by its labels) plus the pools' pods. The operator's `Kube` reads from
  it, so a reconcile sends the API server only writes, and an idle operator sends nothing but its
  watches.
- Every change the watches see queues the owning pool (a DisaggregatedServing's own key; a child's
  `xpyd.io/serving` label); a deleted or edited child is repaired as soon as its event arrives.
  Pod events queue the pool only when what the status reads of a pod changes (scheduling,
  crash loops, deletion): readiness arrives through the Deployments' status.
- `workers` threads take pools from the queue; one pool is never reconciled by two at once, and a
  slow pool holds only its own worker. A failed reconcile is retried with a per-pool exponential
  backoff (`retry_seconds` doubling, up to 5 minutes).
- A periodic resync (`resync_seconds`) queues every pool again, from the cache: it costs the API
  server nothing and catches what no event announced.
- The autoscaler loop (not a kopf timer: kopf guards timers with a finalizer, and a finalizer makes
  deleting a DisaggregatedServing hang whenever the operator is not running) starts a decision for
  every object whose decision is due, each in its own worker, so one slow Prometheus delays no
  other pool; a decision that changes replicas in Auto mode queues the pool's reconcile. Between an
  object's decisions it starts a look at the engines' gauges every `reactSeconds`
  (`Autoscaler.look`, which scales up at once on a backlog), never while a decision of the object
  is due or running.
- The demand signal of a pool at zero: when the pod watch sees a proxy's `xpyd.io/RequestsWaiting`
  condition report held requests (`api.waiting`), a decision starts at once (`wake`), outside the
  loop's schedule, and decides from the pool's pods alone (`Autoscaler.step(wake=True)`): the
  scale-up from zero waits neither for the loop's tick nor for Prometheus.
- With leader election (`elector`, see xpyd.controller.leader), every replica keeps its caches
  warm, but only the one holding the Lease runs workers, resyncs and autoscaler decisions: they
  start (every pool queued) when it acquires the Lease and stop when it loses it. Its writes are
  fenced (`Kube.fence`): once its renew deadline passes, a reconcile or decision still in flight
  cannot write, so the next leader never meets a write of the old one.
The watches and what each event means are declared in xpyd.controller.watches; kopf only hosts the
process (see xpyd.controller.main).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Final

from xpyd.api import models
from xpyd.common.jsontypes import JSON
from xpyd.controller.autoscale import Autoscaler
from xpyd.controller.leader import LeaderElector
from xpyd.controller.lws import LeaderWorkerSetSupport
from xpyd.controller.reconcile import InvalidSpec, Verified, reconcile
from xpyd.controller.watches import LWS_KIND, Key, cache_kinds, held_signal, is_urgent, owner_of, pod_signal
from xpyd.controller.workqueue import WorkQueue
from xpyd.kube import Kube, KubeError
from xpyd.kube.cache import Cache, Kind

log = logging.getLogger(__name__)

#: How long start-up waits for the caches' first lists before serving from the API server instead.
SYNC_TIMEOUT_SECONDS: Final = 60.0
RETRY_CAP_SECONDS: Final = 300.0
#: While a pool's children progress (replicas created, pods scheduled, ready), their many status
#: changes are written to its status at most this often, which keeps its status writes (and the
#: watch events they cause) few during a rollout of many pools.
STATUS_INTERVAL_SECONDS: Final = 2.0


@dataclass
class OperatorRuntime:
    """One operator replica at work: its caches, queue, workers and autoscaler decisions (kept in
    kopf's memo, no module globals)."""

    kube: Kube
    operator_image: str
    resync_seconds: float
    namespaces: list[str]
    #: First retry of a failed reconcile (doubling per failure, up to RETRY_CAP_SECONDS).
    retry_seconds: float = 1.0
    #: The autoscaler (None: no autoscaling in this operator, e.g. in tests of the reconcile alone).
    autoscaler: Autoscaler | None = None
    #: Reconciles (and, apart, autoscaler decisions) that run at once.
    workers: int = 8
    #: A pool's status that only follows its children's progress is written at most this often.
    status_interval: float = STATUS_INTERVAL_SECONDS
    #: Whether reads come from watch-fed caches (False: every read goes to the API server).
    use_cache: bool = True
    queue: WorkQueue[Key] = field(init=False)
    cache: Cache | None = None
    #: The Lease election (None: this replica always acts, as a single replica does).
    elector: LeaderElector | None = None
    _locks: dict[Key, threading.Lock] = field(default_factory=dict)
    #: Per pool, what its last reconcile verified (see `reconcile.Verified`), kept with its lock.
    _verified: dict[Key, Verified] = field(default_factory=dict)
    _locks_guard: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    _deciding: set[Key] = field(default_factory=set)
    #: Pools woken while a decision of theirs ran: decided again when it ends.
    _rewake: set[Key] = field(default_factory=set)
    #: How many wake-ups started a decision (for tests and the operator's log).
    wakes: int = 0
    _decisions: ThreadPoolExecutor | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    lws: LeaderWorkerSetSupport = field(init=False)

    def __post_init__(self) -> None:
        self.queue = WorkQueue(base=self.retry_seconds, cap=RETRY_CAP_SECONDS)
        self.lws = LeaderWorkerSetSupport(self.kube, self.namespaces[0] if self.namespaces else None,
                                          on_available=self._watch_leaderworkersets)

    def _watch_leaderworkersets(self) -> None:
        """Add LeaderWorkerSets to the cache (the first time they are found usable)."""
        if self.cache is not None:
            self.cache.add(LWS_KIND)

    # --- per-object locks ---------------------------------------------------------------------

    def lock(self, namespace: str, name: str) -> threading.Lock:
        """One reconcile or decision at a time per object, whichever started it."""
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def forget_locks(self, present: set[Key], scopes: list[str | None]) -> None:
        """Drop the idle locks of objects that no longer exist in the listed scopes (the map would
        otherwise grow with every object ever seen). A held lock stays until a later sweep."""
        with self._locks_guard:
            for key, lock in list(self._locks.items()):
                if key not in present and (None in scopes or key[0] in scopes) and not lock.locked():
                    del self._locks[key]
                    self._verified.pop(key, None)

    # --- one object ---------------------------------------------------------------------------

    def reconcile_pool(self, namespace: str, name: str) -> None:
        """Read the object and reconcile it, under its lock: a reconcile that waited for a decision
        must see that one's writes, or it would write a stale status again."""
        with self.lock(namespace, name):
            body = self.kube.get(models.API_VERSION, models.KIND, namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return
            with self._locks_guard:
                verified = self._verified.setdefault((namespace, name), Verified())
            outcome = reconcile(self.kube, body, self.operator_image, verified=verified,
                                status_interval=self.status_interval, lws=self.lws)
        if outcome.status_deferred:
            self.queue.add_after((namespace, name), outcome.status_deferred)
        if outcome.blocked is not None:
            self.queue.add_after((namespace, name), self.lws.recheck_seconds)
        if outcome.writes:
            log.info("reconciled %s/%s: created %s, updated %s, status %s", namespace, name,
                     outcome.created or "-", outcome.updated or "-", "written" if outcome.status_written else "-")

    def autoscale_pool(self, namespace: str, name: str, wake: bool = False) -> None:
        """One autoscaler decision for the object (`wake`: only if it is cold with requests held); in
        Auto mode, a change of replicas queues its reconcile."""
        assert self.autoscaler is not None
        with self.lock(namespace, name):
            body = self.kube.get(models.API_VERSION, models.KIND, namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                if not wake:
                    self.autoscaler.forget(namespace, name)
                return
            actuate = self.autoscaler.step(body, wake=wake)
        if actuate:
            self.queue.add((namespace, name), urgent=True)

    def look_pool(self, namespace: str, name: str) -> None:
        """A look at the object's gauges between its decisions (`Autoscaler.look`), under its lock; in
        Auto mode, a role it grows queues the pool's reconcile."""
        assert self.autoscaler is not None
        with self.lock(namespace, name):
            body = self.kube.get(models.API_VERSION, models.KIND, namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return
            actuate = self.autoscaler.look(body)
        if actuate:
            self.queue.add((namespace, name), urgent=True)

    # --- the loop -----------------------------------------------------------------------------

    def changed(self, kind: Kind, old: JSON | None, new: JSON | None) -> None:
        """A watch event (from a reflector's thread): queue the pool it concerns, urgently when the
        event may need a write to a child (see `is_urgent`)."""
        if kind.kind == "Pod":
            held = held_signal(new)
            if held.requests > 0 and held != held_signal(old):
                key = owner_of(kind, new or {})
                if key is not None:
                    self.wake(key)
            if pod_signal(old) == pod_signal(new):
                return
        key = owner_of(kind, new or old or {})
        if key is not None:
            self.queue.add(key, urgent=is_urgent(kind, old, new))

    def acting(self) -> bool:
        """Whether this replica may reconcile and decide now (holds the Lease, or needs none)."""
        return self.elector is None or self.elector.holding()

    def start(self) -> None:
        """Fill the caches (up to SYNC_TIMEOUT_SECONDS); then lead at once, or stand by for the Lease."""
        if self.use_cache:
            self.cache = Cache(self.kube, cache_kinds(), self.namespaces, on_change=self.changed)
            self.cache.start()
            try:
                self.lws()  # watched from the start where the cluster has it
            except KubeError as error:
                log.warning("could not tell whether LeaderWorkerSets are served: %s", error)
            late = self.cache.wait_synced(SYNC_TIMEOUT_SECONDS)
            if late:
                log.warning("not listed yet (read from the API server until they are): %s", late)
            self.kube.cache = self.cache
        if self.elector is None:
            self.lead()
        else:
            self.queue.shutdown()  # a standby's watch events queue nothing
            self.elector.start()

    def lead(self) -> None:
        """Start working: a fresh queue (the last term's may hold stale retries), its workers, every
        pool queued."""
        queue: WorkQueue[Key] = WorkQueue(base=self.retry_seconds, cap=RETRY_CAP_SECONDS)
        self.queue = queue
        self._threads = [thread for thread in self._threads if thread.is_alive()]
        for index in range(self.workers):
            thread = threading.Thread(target=self._work, args=(queue,), name=f"reconcile-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)
        self.resync()

    def follow(self) -> None:
        """Stop working: the workers finish their current pool and take no other; no decision starts."""
        self.queue.shutdown()

    def stop(self) -> None:
        """Stop working, then (when elected) hand the Lease over, then stop the caches."""
        if self.elector is not None:
            self.elector.stop()
            self.elector.resign()
        self.follow()
        if self._decisions is not None:
            self._decisions.shutdown(wait=False, cancel_futures=True)
        for thread in self._threads:
            thread.join(timeout=5.0)
        self._threads.clear()
        if self.elector is not None:
            self.elector.release()  # after the work stopped: the next leader starts at once
        if self.cache is not None:
            self.cache.stop()
            self.kube.cache = None

    def _work(self, queue: WorkQueue[Key]) -> None:
        while (key := queue.get()) is not None:
            try:
                self.reconcile_pool(*key)
            except InvalidSpec:
                queue.forget(key)  # reported in its status and Events; its next change comes back
            except KubeError as error:
                log.warning("reconcile of %s/%s failed, retrying in %.1f s: %s", *key, queue.retry(key), error)
            except Exception:  # a bug in one object's reconcile must not stop the worker
                log.exception("reconcile of %s/%s failed, retrying in %.1f s", *key, queue.retry(key))
            else:
                queue.forget(key)
            finally:
                queue.done(key)

    def resync(self) -> None:
        """Queue every pool (from the cache once it serves), and drop the locks of pools gone."""
        if not self.acting():
            return
        bodies, listed = _list_all(self, "resync")
        for body in bodies:
            self.queue.add(_key(body))
        self.forget_locks({_key(body) for body in bodies}, listed)

    @property
    def autoscale_tick_seconds(self) -> float:
        """How often the autoscaler loop looks for objects whose decision (or look at the gauges) is
        due: every second while the objects come from the watch cache (it costs the API server
        nothing), every 5 s when each tick lists them from the API server."""
        return 1.0 if self.use_cache else 5.0

    def autoscale_due(self) -> None:
        """Start a decision for every autoscaled object whose decision is due, else a look at its
        gauges when that is due, unless one of the two is running."""
        assert self.autoscaler is not None
        if not self.acting():
            return
        if self._decisions is None:
            self._decisions = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="autoscale")
        bodies, listed = _list_all(self, "autoscaler")
        now = self.autoscaler.clock()
        for body in bodies:
            key = _key(body)
            if not self.acting():
                break  # the Lease was lost meanwhile
            with self._locks_guard:
                if key in self._deciding:
                    continue
                decide = self.autoscaler.due(body, now)
                if not decide and not self.autoscaler.look_due(body, now):
                    continue
                self._deciding.add(key)
            self._decisions.submit(self._decide, key, False, not decide)
        self.autoscaler.forget_absent({_key(body) for body in bodies}, listed)

    def wake(self, key: Key) -> None:
        """A proxy of the pool reports held requests (from a reflector's thread): decide now, from
        the pool's pods (see the module docstring); once more after a decision already running."""
        if self.autoscaler is None or not self.acting():
            return
        with self._locks_guard:
            if key in self._deciding:
                self._rewake.add(key)
                return
            self._deciding.add(key)
            if self._decisions is None:
                self._decisions = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="autoscale")
            self.wakes += 1
            decisions = self._decisions
        try:
            decisions.submit(self._decide, key, True)
        except RuntimeError:  # shut down: the operator is stopping
            with self._locks_guard:
                self._deciding.discard(key)

    def _decide(self, key: Key, wake: bool = False, look: bool = False) -> None:
        """A decision (`look`: a look at the gauges between decisions) in an autoscaler worker."""
        what = "look at the gauges" if look else "decision"
        try:
            if look:
                self.look_pool(*key)
            else:
                self.autoscale_pool(*key, wake=wake)
        except (KubeError, InvalidSpec) as error:
            log.warning("autoscaler %s for %s/%s failed, will retry: %s", what, *key, error)
        except Exception:  # a bug in one object's decision must not stop the others' (or the loop)
            log.exception("autoscaler %s for %s/%s failed", what, *key)
        finally:
            with self._locks_guard:
                self._deciding.discard(key)
                again = key in self._rewake
                self._rewake.discard(key)
            if again:
                self.wake(key)


def _list_all(runtime: OperatorRuntime, what: str) -> tuple[list[JSON], list[str | None]]:
    """Every DisaggregatedServing in the operator's scopes, and the scopes whose list succeeded (only
    there may an object missing from the list be taken as gone)."""
    bodies: list[JSON] = []
    listed: list[str | None] = []
    scopes: list[str | None] = list(runtime.namespaces) or [None]  # None: every namespace
    for scope in scopes:
        try:
            bodies.extend(runtime.kube.list_servings(scope))
        except KubeError as error:
            log.warning("%s could not list DisaggregatedServings: %s", what, error)
            continue
        listed.append(scope)
    return bodies, listed


def _key(body: JSON) -> Key:
    return body["metadata"]["namespace"], body["metadata"]["name"]
