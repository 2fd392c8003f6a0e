"""Leader election on a `coordination.k8s.io/v1` Lease (client-go's leaderelection, in small).

Every replica is a candidate. Every `retry_period` it reads the Lease and takes its `next_lease_step()`:

- ACQUIRE: the Lease is absent (create it), released (no holder), expired, or already names this
  candidate (a write whose answer was lost). "Expired" is judged on this candidate's own clock:
  `leaseDurationSeconds` after it first *saw* the Lease's current version, never from the
  `renewTime` in it, so clocks of different nodes need not agree.
- RENEW: this candidate leads; write a new `renewTime`.
- WAIT: another candidate holds an unexpired Lease.
- STEP_DOWN: this candidate led, but another one holds the Lease now, or the Lease is gone, or its
  last successful write is `renew_deadline` old.

Every write is a PUT carrying the `resourceVersion` that was read (or a create), so of two
candidates racing for the same version one gets 409 Conflict: two can never both hold it.

Why two leaders never act at once: a leader acts only while less than `renew_deadline` has passed
since it *sent* its last successful write (`Candidate.leading`, which the operator also checks
before each of its writes). Any other candidate saw that write no earlier than it was sent, and
takes over no earlier than `lease_duration` after seeing it. `renew_deadline < lease_duration`, so
the old leader stops at least `lease_duration - renew_deadline` before the new one may start.

A graceful stop releases the Lease (no holder, `leaseDurationSeconds: 1`), so a standby takes over
at its next read, within `retry_period`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from typing import Final

from xpyd.common.jsontypes import JSON
from xpyd.common.timefmt import rfc3339
from xpyd.kube import Kube, KubeError

log = logging.getLogger(__name__)

LEASE_API_VERSION: Final = "coordination.k8s.io/v1"
LEASE_KIND: Final = "Lease"


@dataclass(frozen=True)
class Timing:
    """client-go's defaults (those of kube-controller-manager and controller-runtime)."""

    #: How long a standby waits, after it saw the Lease change, before it takes an unrenewed Lease.
    lease_duration: float = 15.0
    #: How long a leader acts after its last successful renewal was sent.
    renew_deadline: float = 10.0
    #: How often every candidate reads (and the leader renews) the Lease.
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(f"leader election needs 0 < retry period ({self.retry_period}) < renew deadline "
                             f"({self.renew_deadline}) < lease duration ({self.lease_duration})")

    @property
    def takeover_bound(self) -> float:
        """The longest a standby needs to take over after the leader dies without releasing: the
        leader's last renewal may be `retry_period` old, the standby sees it up to `retry_period`
        later, and waits `lease_duration` from then."""
        return math.ceil(self.lease_duration) + 2 * self.retry_period


class Action(Enum):
    ACQUIRE = "acquire"
    RENEW = "renew"
    WAIT = "wait"
    STEP_DOWN = "step down"


@dataclass(frozen=True)
class Candidate:
    """What one candidate knows between two reads of the Lease."""

    identity: str
    #: resourceVersion of the Lease as last read, and when (this candidate's monotonic clock) that
    #: version was first read.
    observed_version: str = ""
    observed_at: float = -math.inf
    #: When the last successful acquire or renew was sent; None while not leading.
    renewed_at: float | None = None

    def leading(self, now: float, timing: Timing) -> bool:
        return self.renewed_at is not None and now < self.renewed_at + timing.renew_deadline


@dataclass(frozen=True)
class LeaseStep:
    """A decision: the action, the candidate after the read, and for ACQUIRE and RENEW the Lease
    to write (a create when it has no resourceVersion, else a PUT of that version)."""

    action: Action
    candidate: Candidate
    lease: JSON | None = None


def next_lease_step(lease: JSON | None, candidate: Candidate, now: float, wall: float, timing: Timing,
                    namespace: str, name: str) -> LeaseStep:
    """What `candidate` does, given the Lease as read (None: absent) at `now` (monotonic clock;
    `wall`: the same moment in seconds since the epoch, written into the Lease)."""
    led = candidate.renewed_at is not None
    duration = math.ceil(timing.lease_duration)
    stamp = rfc3339(wall, microseconds=True)
    if lease is None:
        if led:
            return LeaseStep(Action.STEP_DOWN, replace(candidate, renewed_at=None))
        created: JSON = {"apiVersion": LEASE_API_VERSION, "kind": LEASE_KIND,
                         "metadata": {"name": name, "namespace": namespace},
                         "spec": {"holderIdentity": candidate.identity, "leaseDurationSeconds": duration,
                                  "acquireTime": stamp, "renewTime": stamp, "leaseTransitions": 0}}
        return LeaseStep(Action.ACQUIRE, candidate, created)
    meta = lease.get("metadata") or {}
    spec: JSON = lease.get("spec") or {}
    version = str(meta.get("resourceVersion") or "")
    if version != candidate.observed_version:
        candidate = replace(candidate, observed_version=version, observed_at=now)
    holder = spec.get("holderIdentity") or ""
    if led and (holder != candidate.identity or not candidate.leading(now, timing)):
        return LeaseStep(Action.STEP_DOWN, replace(candidate, renewed_at=None))
    if holder and holder != candidate.identity:
        held_for = float(spec.get("leaseDurationSeconds") or duration)
        if now < candidate.observed_at + held_for:
            return LeaseStep(Action.WAIT, candidate)
    mine = holder == candidate.identity
    transitions = int(spec.get("leaseTransitions") or 0)
    new_spec = {**spec, "holderIdentity": candidate.identity, "leaseDurationSeconds": duration,
                "renewTime": stamp, "acquireTime": spec.get("acquireTime") if mine else stamp,
                "leaseTransitions": transitions if mine else transitions + 1}
    written = {"apiVersion": LEASE_API_VERSION, "kind": LEASE_KIND, "spec": new_spec,
               "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}
    return LeaseStep(Action.RENEW if led else Action.ACQUIRE, candidate, written)


def succeeded(candidate: Candidate, sent_at: float, written: JSON) -> Candidate:
    """The candidate after its acquire or renew, sent at `sent_at`, returned `written`."""
    version = str((written.get("metadata") or {}).get("resourceVersion") or "")
    return replace(candidate, renewed_at=sent_at, observed_version=version, observed_at=sent_at)


def released(lease: JSON | None, identity: str, wall: float) -> JSON | None:
    """The Lease to write on a graceful stop, as client-go releases it (no holder, a one-second
    duration), or None when `identity` does not hold it."""
    if lease is None or (lease.get("spec") or {}).get("holderIdentity") != identity:
        return None
    stamp = rfc3339(wall, microseconds=True)
    spec = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1,
            "acquireTime": stamp, "renewTime": stamp}
    meta = {k: v for k, v in (lease.get("metadata") or {}).items() if k != "managedFields"}
    return {"apiVersion": LEASE_API_VERSION, "kind": LEASE_KIND, "metadata": meta, "spec": spec}


class LeaderElector:
    """The I/O shell: a thread running `next_lease_step()` every `retry_period` and writing what it says.

    `on_started` and `on_stopped` run in that thread when leadership begins and ends. `holding()`
    answers from the clock, not from the thread: a leader whose thread is stuck in a request still
    stops holding at its renew deadline."""

    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, timing: Timing,
                 on_started: Callable[[], None], on_stopped: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.kube, self.namespace, self.name, self.timing = kube, namespace, name, timing
        self.on_started, self.on_stopped = on_started, on_stopped
        self.clock, self.wall = clock, wall
        self.candidate = Candidate(identity)
        #: Whether `on_started` ran without its `on_stopped` yet.
        self.acting = False
        self._stopping = threading.Event()
        self._guard = threading.Lock()  # one round, or the resignation, at a time
        self._thread: threading.Thread | None = None

    @property
    def identity(self) -> str:
        return self.candidate.identity

    def holding(self) -> bool:
        """Whether this candidate may act now."""
        return self.candidate.leading(self.clock(), self.timing)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.round()
            except Exception:  # the loop must outlive a bug in one round
                log.exception("leader election round failed")
            self._stopping.wait(self.timing.retry_period)

    def round(self) -> Action | None:
        """Read the Lease, decide, write; the action taken (None when the Lease could not be read)."""
        with self._guard:
            if self._stopping.is_set():
                return None
            now = self.clock()
            try:
                lease = self.kube.get(LEASE_API_VERSION, LEASE_KIND, self.namespace, self.name)
            except KubeError as error:
                log.warning("cannot read Lease %s/%s: %s", self.namespace, self.name, error)
                self._settle()
                return None
            step = next_lease_step(lease, self.candidate, now, self.wall(), self.timing, self.namespace, self.name)
            self.candidate = step.candidate
            if step.lease is not None:
                try:
                    has_version = (step.lease.get("metadata") or {}).get("resourceVersion")
                    written = self.kube.replace(step.lease) if has_version else self.kube.create(step.lease)
                except KubeError as error:
                    # 409: another candidate wrote first; anything else: retried next round.
                    log.log(logging.DEBUG if error.status == 409 else logging.WARNING,
                            "could not %s Lease %s/%s: %s", step.action.value, self.namespace, self.name, error)
                else:
                    self.candidate = succeeded(step.candidate, now, written)
            self._settle()
            return step.action

    def _settle(self) -> None:
        """Run the callback of a change of leadership (called under the guard)."""
        holding = self.holding()
        if not holding and self.candidate.renewed_at is not None:
            self.candidate = replace(self.candidate, renewed_at=None)  # its deadline passed
        if holding and not self.acting:
            self.acting = True
            log.info("became the leader (Lease %s/%s, identity %s)", self.namespace, self.name, self.identity)
            self.on_started()
        elif not holding and self.acting:
            self.acting = False
            log.info("stopped leading (Lease %s/%s, identity %s)", self.namespace, self.name, self.identity)
            self.on_stopped()

    def stop(self) -> None:
        """Stop the rounds, and nothing else: as when the process dies, the Lease then expires on its
        own. A graceful stop follows this with `resign`, stops its work, then `release`s."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timing.lease_duration)

    def resign(self) -> None:
        """Stop acting now (the operator then stops its work before `release`)."""
        with self._guard:
            self.candidate = replace(self.candidate, renewed_at=None)
            self._settle()

    def release(self) -> None:
        """Hand the Lease over, if this candidate holds it (call after `resign`, once work stopped)."""
        try:
            lease = self.kube.get(LEASE_API_VERSION, LEASE_KIND, self.namespace, self.name)
            body = released(lease, self.identity, self.wall())
            if body is not None:
                self.kube.replace(body)
                log.info("released Lease %s/%s", self.namespace, self.name)
        except KubeError as error:  # it expires on its own
            log.warning("could not release Lease %s/%s: %s", self.namespace, self.name, error)
