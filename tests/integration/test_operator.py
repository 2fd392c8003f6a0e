"""The operator (kopf, real HTTP) against a mock Kubernetes API: create, no-op resync, drift,
invalid specs, API errors and restarts, with every API write counted."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.eventually import eventually
from tests.integration.fakekube import FakeKube
from tests.integration.operatorrig import (
    CHILDREN,
    CR,
    CR_PATH,
    DEPLOYMENTS,
    NS,
    SERVING,
    Operator,
    children_exist,
    create_serving,
    request,
)

pytestmark = pytest.mark.integration


@pytest.fixture
async def operator(fake: FakeKube) -> AsyncIterator[Operator]:
    op = Operator(str(fake.url).rstrip("/"))
    await op.start()
    yield op
    await op.stop()


def condition(fake: FakeKube, kind: str) -> dict[str, Any] | None:
    obj = fake.get_object(CR, NS, "llama") or {}
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), None)


async def mark_deployments_ready(fake: FakeKube) -> None:
    """What the deployment controller would do once pods are ready."""
    for name in DEPLOYMENTS:
        obj = fake.get_object("apps/v1/deployments", NS, name)
        assert obj is not None
        replicas = obj["spec"]["replicas"]
        obj["status"] = {"observedGeneration": obj["metadata"]["generation"], "replicas": replicas,
                         "readyReplicas": replicas, "updatedReplicas": replicas, "availableReplicas": replicas}
        await fake.put_object("apps/v1/deployments", obj)


async def converge(fake: FakeKube) -> None:
    await create_serving(fake)
    await eventually(lambda: children_exist(fake), what="children")
    await mark_deployments_ready(fake)
    await eventually(lambda: (condition(fake, "Ready") or {}).get("status") == "True", what="Ready=True")
    # The reconcile writes the status, then the Event of the transition.
    await eventually(lambda: any(e.get("reason") == "AllReplicasReady" for e in fake.objects_of("v1/events")),
                     what="the Ready event")


async def quiet_period(fake: FakeKube, seconds: float) -> list[Any]:
    """Writes (Events included) during `seconds` of resync sweeps."""
    before = len(fake.writes)
    await asyncio.sleep(seconds)
    return fake.writes[before:]


async def test_create_then_noop_resync_sends_no_writes(fake: FakeKube, operator: Operator) -> None:
    await converge(fake)
    obj = fake.get_object(CR, NS, "llama")
    assert obj is not None
    status = obj["status"]
    assert status["prefill"]["ready"] == "1/1" and status["decode"]["ready"] == "2/2"
    assert status["endpoint"] == "http://llama-proxy.inference:8000" and status["kvTransport"] == "TCP"
    assert status["observedGeneration"] == 1
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "True", "Progressing": "False", "Degraded": "False", "ScalingActive": "False"}
    # Children are owned by the DisaggregatedServing (garbage-collected with it).
    deployment = fake.get_object("apps/v1/deployments", NS, "llama-decode")
    assert deployment is not None
    (ref,) = deployment["metadata"]["ownerReferences"]
    assert ref["uid"] == obj["metadata"]["uid"] and ref["controller"] is True
    applies = [w for w in fake.writes if "apply-patch" in w.content_type]
    assert len(applies) == sum(len(names) for names in CHILDREN.values())  # each child applied once

    # Converged: several drift sweeps later, not one write.
    assert await quiet_period(fake, 1.5) == []


async def test_drift_is_corrected(fake: FakeKube, operator: Operator) -> None:
    await converge(fake)
    await request(fake, "DELETE", f"/apis/apps/v1/namespaces/{NS}/deployments/llama-decode")
    await eventually(lambda: fake.get_object("apps/v1/deployments", NS, "llama-decode"), what="decode back")

    await request(fake, "PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/llama-prefill",
                  {"spec": {"replicas": 9}}, "application/merge-patch+json")
    await eventually(lambda: (fake.get_object("apps/v1/deployments", NS, "llama-prefill") or {})
                     .get("spec", {}).get("replicas") == 1, what="replicas restored")

    await request(fake, "DELETE", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/llama-proxy")
    await eventually(lambda: fake.get_object("rbac.authorization.k8s.io/v1/roles", NS, "llama-proxy"),
                     what="role restored on its event")


async def test_spec_update_rolls_children_and_status_follows(fake: FakeKube, operator: Operator) -> None:
    await converge(fake)
    await request(fake, "PATCH", f"{CR_PATH}/llama", {"spec": {"decode": {"replicas": 3},
                                                               "engine": {"extraArgs": ["--enforce-eager"]}}},
                  "application/merge-patch+json")
    await eventually(lambda: (fake.get_object("apps/v1/deployments", NS, "llama-decode") or {})
                     .get("spec", {}).get("replicas") == 3, what="decode scaled")
    decode = fake.get_object("apps/v1/deployments", NS, "llama-decode")
    assert decode is not None
    assert "--enforce-eager" in decode["spec"]["template"]["spec"]["containers"][0]["args"]
    await eventually(lambda: (condition(fake, "Progressing") or {}).get("status") == "True", what="Progressing")
    await mark_deployments_ready(fake)
    await eventually(lambda: (condition(fake, "Progressing") or {}).get("status") == "False", what="converged")
    obj = fake.get_object(CR, NS, "llama")
    assert obj is not None and obj["status"]["observedGeneration"] == obj["metadata"]["generation"] == 2
    assert obj["status"]["decode"]["ready"] == "3/3"


async def test_invalid_spec_sets_condition_and_touches_nothing(fake: FakeKube, operator: Operator) -> None:
    # Passes a CRD that lacks the rule (e.g. an older CRD), fails the models.
    bad = copy.deepcopy(SERVING)
    bad["spec"]["kvTransfer"] = {"connector": "P2pNcclConnector"}
    await create_serving(fake, bad)
    ready = await eventually(lambda: condition(fake, "Ready"), what="Ready condition")
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
    assert "P2pNcclConnector was removed in vLLM 0.24" in ready["message"]
    # The status, then its Event; then nothing retries an invalid spec (its next change brings it back).
    await eventually(lambda: any(e.get("reason") == "InvalidSpec" for e in fake.objects_of("v1/events")),
                     what="the InvalidSpec event")
    assert await quiet_period(fake, 1.0) == []
    assert not any("apply-patch" in w.content_type for w in fake.writes)
    events = [w for w in fake.writes if w.path.endswith("/events")]
    assert len(events) == 1


@pytest.mark.parametrize("status", [500, 409, 504])
async def test_api_errors_are_retried_without_duplicates(fake: FakeKube, status: int) -> None:
    fake.fail("PATCH", "deployments", times=2, status=status)
    op = Operator(str(fake.url).rstrip("/"))
    await op.start()
    try:
        await converge(fake)
    finally:
        await op.stop()
    applied = [w.path for w in fake.writes if "apply-patch" in w.content_type]
    assert sorted(set(applied)) == sorted(applied) or len(applied) - len(set(applied)) <= 2
    names = {p.rsplit("/", 1)[1] for p in applied if "/deployments/" in p}
    assert names == set(DEPLOYMENTS)


async def test_restart_resumes_without_writes(fake: FakeKube) -> None:
    first = Operator(str(fake.url).rstrip("/"))
    await first.start()
    await converge(fake)
    await first.stop()
    before = len(fake.writes)
    second = Operator(str(fake.url).rstrip("/"))
    await second.start()
    try:
        await asyncio.sleep(1.5)
    finally:
        await second.stop()
    assert fake.writes[before:] == []
