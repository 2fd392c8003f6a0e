"""The leader election's pure core (`controller.leader.next_lease_step`) on a fake clock, and its shell
against an in-memory Lease store with the API server's optimistic concurrency."""

from __future__ import annotations

import copy
import itertools
import math
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from xpyd.controller.leader import (
    Action,
    Candidate,
    LeaderElector,
    Timing,
    next_lease_step,
    released,
    succeeded,
)
from xpyd.controller.main import candidate_identity, default_lease_namespace
from xpyd.kube import KubeError

pytestmark = pytest.mark.unit

T = Timing(lease_duration=15, renew_deadline=10, retry_period=2)
NS, NAME = "xpyd-system", "xpyd-operator"
WALL = 1_800_000_000.0


def lease(holder: str, version: str = "7", duration: int = 15, transitions: int = 3) -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": NAME, "namespace": NS, "resourceVersion": version, "managedFields": [{}]},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration, "leaseTransitions": transitions,
                     "acquireTime": "2027-01-15T08:00:00.000000Z", "renewTime": "2027-01-15T08:00:01.000000Z"}}


ME = Candidate("a")
#: `a` has seen version 7 since t=100.
SEEN = replace(ME, observed_version="7", observed_at=100.0)
#: `a` leads: its last renewal (which wrote version 7) was sent at t=100.
LEADING = replace(SEEN, renewed_at=100.0)

CASES: list[tuple[str, dict[str, Any] | None, Candidate, float, Action]] = [
    ("no Lease: create it", None, ME, 100.0, Action.ACQUIRE),
    ("held by b, first seen now", lease("b"), ME, 100.0, Action.WAIT),
    ("held by b, seen 14.9 s ago", lease("b"), SEEN, 114.9, Action.WAIT),
    ("held by b, unchanged for its duration", lease("b"), SEEN, 115.0, Action.ACQUIRE),
    ("held by b, its own shorter duration", lease("b", duration=5), SEEN, 105.0, Action.ACQUIRE),
    ("renewed by b just now (a new version)", lease("b", version="8"), SEEN, 115.0, Action.WAIT),
    ("released by b", lease(""), ME, 100.0, Action.ACQUIRE),
    ("names a, which does not lead (a write whose answer was lost)", lease("a"), ME, 100.0, Action.ACQUIRE),
    ("a leads: renew", lease("a"), LEADING, 102.0, Action.RENEW),
    ("a leads, 9.9 s after its last renewal", lease("a"), LEADING, 109.9, Action.RENEW),
    ("a leads, renew deadline passed", lease("a"), LEADING, 110.0, Action.STEP_DOWN),
    ("a led, b holds it now", lease("b", version="9"), LEADING, 102.0, Action.STEP_DOWN),
    ("a led, the Lease was deleted", None, LEADING, 102.0, Action.STEP_DOWN),
]


@pytest.mark.parametrize(("lease_read", "candidate", "now", "action"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_next_lease_step(lease_read: dict[str, Any] | None, candidate: Candidate, now: float, action: Action) -> None:
    step = next_lease_step(copy.deepcopy(lease_read), candidate, now, WALL, T, NS, NAME)
    assert step.action == action
    leading_after = step.candidate.renewed_at is not None
    assert leading_after == (action == Action.RENEW)  # acquiring leads only once the write succeeded
    assert (step.lease is not None) == (action in (Action.ACQUIRE, Action.RENEW))
    if step.lease is not None:
        spec = step.lease["spec"]
        assert spec["holderIdentity"] == "a" and spec["leaseDurationSeconds"] == 15
        assert spec["renewTime"] == "2027-01-15T08:00:00.000000Z"
        assert "managedFields" not in step.lease["metadata"]
        if lease_read is None:
            assert "resourceVersion" not in step.lease["metadata"] and spec["leaseTransitions"] == 0
        else:  # a PUT of the version read: the API server refuses it if anyone wrote in between
            assert step.lease["metadata"]["resourceVersion"] == lease_read["metadata"]["resourceVersion"]
            mine = lease_read["spec"]["holderIdentity"] == "a"
            assert spec["leaseTransitions"] == (3 if mine else 4)
            assert spec["acquireTime"] == ("2027-01-15T08:00:00.000000Z" if not mine
                                           else lease_read["spec"]["acquireTime"])


def test_a_new_version_restarts_the_wait() -> None:
    step = next_lease_step(lease("b", version="8"), SEEN, 114.0, WALL, T, NS, NAME)
    assert step.candidate.observed_version == "8" and step.candidate.observed_at == 114.0


def test_leading_ends_at_the_renew_deadline_before_any_standby_may_start() -> None:
    # a's renewal is sent at t=100 and lands at once; b reads it at the earliest moment possible.
    a = succeeded(replace(ME, renewed_at=None), 100.0, {"metadata": {"resourceVersion": "8"}})
    b = next_lease_step(lease("a", version="8"), Candidate("b"), 100.0, WALL, T, NS, NAME).candidate
    for tenth in range(0, 300):
        now = 100.0 + tenth / 10
        a_acts = a.leading(now, T)
        b_acquires = next_lease_step(lease("a", version="8"), b, now, WALL, T, NS, NAME).action == Action.ACQUIRE
        assert not (a_acts and b_acquires), now
        if b_acquires:
            assert now - (100.0 + T.renew_deadline) >= T.lease_duration - T.renew_deadline
    assert not a.leading(110.0, T) and a.leading(109.99, T)


def test_release() -> None:
    body = released(lease("a"), "a", WALL)
    assert body is not None
    assert body["spec"]["holderIdentity"] == "" and body["spec"]["leaseDurationSeconds"] == 1
    assert body["spec"]["leaseTransitions"] == 3
    assert body["metadata"]["resourceVersion"] == "7"
    assert released(lease("b"), "a", WALL) is None
    assert released(None, "a", WALL) is None


@pytest.mark.parametrize(("timing", "ok"), [((15, 10, 2), True), ((10, 10, 2), False), ((15, 10, 10), False),
                                            ((15, 10, 0), False)])
def test_timing_must_leave_a_gap(timing: tuple[float, float, float], ok: bool) -> None:
    if ok:
        assert Timing(*timing).takeover_bound == 19
    else:
        with pytest.raises(ValueError, match="renew deadline"):
            Timing(*timing)


# ---- the shell against an in-memory API ----------------------------------------------------------


class Leases:
    """Leases as the API server keeps them: a create of an existing name and a PUT of a stale
    resourceVersion are 409."""

    def __init__(self) -> None:
        self.stored: dict[str, Any] | None = None
        self.versions = itertools.count(1)
        self.down = False

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        if self.down:
            raise KubeError(0, "connection refused")
        return copy.deepcopy(self.stored)

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        if self.stored is not None:
            raise KubeError(409, "already exists")
        return self._store(obj)

    def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        assert self.stored is not None
        if obj["metadata"]["resourceVersion"] != self.stored["metadata"]["resourceVersion"]:
            raise KubeError(409, "the object has been modified")
        return self._store(obj)

    def _store(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.stored = copy.deepcopy(obj)
        self.stored["metadata"]["resourceVersion"] = str(next(self.versions))
        return copy.deepcopy(self.stored)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def elector(api: Leases, identity: str, clock: Clock, log: list[str]) -> LeaderElector:
    return LeaderElector(api, NS, NAME, identity, T, on_started=lambda: log.append(f"{identity} started"),  # type: ignore[arg-type]
                         on_stopped=lambda: log.append(f"{identity} stopped"), clock=clock, wall=lambda: WALL)


def test_two_electors_hand_over() -> None:
    api, clock, log = Leases(), Clock(), []
    a, b = elector(api, "a", clock, log), elector(api, "b", clock, log)
    assert a.round() == Action.ACQUIRE and a.holding()
    assert b.round() == Action.WAIT and not b.holding()
    assert log == ["a started"]
    # b read the same version as a and races it: the stale PUT is refused, b stays a standby.
    stale = copy.deepcopy(api.stored)
    assert stale is not None
    a.round()
    with pytest.raises(KubeError):
        api.replace({**stale, "spec": {**stale["spec"], "holderIdentity": "b"}})

    # a stops renewing (dies): it stops acting at its renew deadline, b acquires only later.
    a.stop()
    moments = []
    while not b.holding():
        clock.now += 0.5
        assert not (a.holding() and b.holding())
        b.round()
        moments.append(clock.now)
    assert not a.holding()
    assert moments[-1] - 1000.0 <= T.takeover_bound
    assert api.stored is not None and api.stored["spec"]["leaseTransitions"] == 1

    # A graceful hand-over: b resigns and releases; a fresh candidate acquires at its next round.
    b.stop()
    b.resign()
    b.release()
    assert log == ["a started", "b started", "b stopped"]
    c = elector(api, "c", clock, log)
    assert c.round() == Action.ACQUIRE and c.holding()


def test_a_leader_that_cannot_reach_the_api_server_steps_down_at_its_deadline() -> None:
    api, clock, log = Leases(), Clock(), []
    a = elector(api, "a", clock, log)
    a.round()
    api.down = True
    clock.now += T.renew_deadline - 0.1
    assert a.round() is None and a.holding()
    clock.now += 0.1
    assert not a.holding()  # the fence closes on time, even before the next round
    a.round()
    assert log == ["a started", "a stopped"]
    api.down = False
    assert a.round() == Action.ACQUIRE and a.holding()  # the Lease still names it: nobody took over
    assert math.isclose(a.candidate.renewed_at or 0, clock.now)


# ---- the operator's candidate --------------------------------------------------------------------


def test_lease_namespace_is_the_pods_own(tmp_path: Path) -> None:
    own = tmp_path / "namespace"
    own.write_text("ops\n")
    assert default_lease_namespace(own) == "ops"
    assert default_lease_namespace(tmp_path / "absent") == "xpyd-system"


def test_identity_is_the_pod_name_and_a_fresh_suffix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "xpyd-operator-7d9f-abcde")
    first, second = candidate_identity(), candidate_identity()
    assert first.startswith("xpyd-operator-7d9f-abcde_") and second.startswith("xpyd-operator-7d9f-abcde_")
    assert first != second  # a restarted process never passes for the one that held the Lease
    monkeypatch.delenv("POD_NAME")
    assert candidate_identity().startswith(socket.gethostname() + "_")
