"""Whether the operator can use LeaderWorkerSets: what it asks the API server, what a pool is told
when the answer is no, and that a later yes is picked up (once) without a restart."""

from __future__ import annotations

from typing import Any

import pytest

from xpyd.controller.lws import LeaderWorkerSetSupport
from xpyd.kube import KubeError

pytestmark = pytest.mark.unit


class FakeKube:
    def __init__(self, served: set[str], list_status: int = 200) -> None:
        self.served, self.list_status, self.requests = served, list_status, 0

    def discover(self, api_version: str) -> set[str]:
        assert api_version == "leaderworkerset.x-k8s.io/v1"
        self.requests += 1
        return self.served

    def list_objects(self, api_version: str, kind: str, namespace: str | None, selector: str = "",
                     field_selector: str = "") -> list[Any]:
        self.requests += 1
        assert field_selector  # a list that matches nothing: permission only
        if self.list_status != 200:
            raise KubeError(self.list_status, "forbidden")
        return []


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def support(kube: FakeKube, clock: Clock, found: list[int]) -> LeaderWorkerSetSupport:
    return LeaderWorkerSetSupport(kube, None, recheck_seconds=30, on_available=lambda: found.append(1),  # type: ignore[arg-type]
                                  clock=clock)


def test_not_served_says_how_to_get_it_and_looks_again_only_after_the_interval() -> None:
    kube, clock, found = FakeKube(set()), Clock(), []
    check = support(kube, clock, found)
    problem = check()
    assert problem is not None and problem.reason == "LeaderWorkerSetMissing" and problem.status is True
    assert "leaderworkerset.x-k8s.io/v1" in problem.message and "nodesPerReplica" in problem.message
    assert check() is problem and kube.requests == 1  # cached within the interval
    kube.served = {"leaderworkersets", "leaderworkersets/status"}  # installed meanwhile
    clock.now = 31
    assert check() is None and check.available and found == [1]
    assert check() is None and kube.requests == 3 and found == [1]  # never asked again


def test_served_but_forbidden_names_the_chart_value() -> None:
    kube, clock, found = FakeKube({"leaderworkersets"}, list_status=403), Clock(), []
    problem = support(kube, clock, found)()
    assert problem is not None and problem.reason == "LeaderWorkerSetForbidden"
    assert "rbac.leaderWorkerSet=true" in problem.message and found == []


def test_other_failures_are_errors_not_answers() -> None:
    kube, clock, found = FakeKube({"leaderworkersets"}, list_status=500), Clock(), []
    with pytest.raises(KubeError):
        support(kube, clock, found)()
