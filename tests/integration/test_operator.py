"""The operator (kopf, real HTTP) against a mock Kubernetes API: create, no-op resync, drift,
invalid specs, API errors and restarts, with every API write counted."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import kopf
import kubernetes
import pytest

from tests.integration.fakekube import FakeKube
from xpyd.controller.leader import Timing
from xpyd.controller.main import build, serve
from xpyd.kube import Kube

pytestmark = pytest.mark.integration

NS = "inference"
CR = "xpyd.io/v1alpha1/disaggregatedservings"
CR_PATH = f"/apis/xpyd.io/v1alpha1/namespaces/{NS}/disaggregatedservings"
DEPLOYMENTS = ("llama-prefill", "llama-decode", "llama-proxy")
CHILDREN = {
    "apps/v1/deployments": DEPLOYMENTS,
    "v1/services": DEPLOYMENTS,
    "policy/v1/poddisruptionbudgets": DEPLOYMENTS,
    "v1/serviceaccounts": ("llama-proxy",),
    "rbac.authorization.k8s.io/v1/roles": ("llama-proxy",),
    "rbac.authorization.k8s.io/v1/rolebindings": ("llama-proxy",),
}
SERVING = {
    "apiVersion": "xpyd.io/v1alpha1",
    "kind": "DisaggregatedServing",
    "metadata": {"name": "llama", "namespace": NS},
    "spec": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "decode": {"replicas": 2}},
}


#: Leader election in tests: short, so that a takeover takes seconds.
LEASE_TIMING = Timing(lease_duration=2.0, renew_deadline=1.5, retry_period=0.3)
LEASE_NAMESPACE = "xpyd-system"


class Operator:
    """One operator instance in this event loop; start and stop it like a pod. With `identity`, it
    elects its leader on the Lease (LEASE_TIMING), and its requests carry the User-Agent
    `xpyd-test/<identity>` (which FakeKube records with every write)."""

    def __init__(self, url: str, resync_seconds: float = 3600.0, identity: str | None = None) -> None:
        self.url = url
        self.resync_seconds = resync_seconds
        self.identity = identity
        self.task: asyncio.Task[None] | None = None
        self.stop_flag = asyncio.Event()
        self.memo = kopf.Memo()

    def build(self) -> tuple[kopf.OperatorRegistry, kopf.Memo]:
        config = kubernetes.client.Configuration(host=self.url)
        config.connection_pool_maxsize = 32
        kube = Kube(kubernetes.client.ApiClient(config))
        if self.identity is not None:
            kube.api.user_agent = f"xpyd-test/{self.identity}"
        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=self.url, insecure=True)

        # Cluster-wide, as the chart installs it (kmock cannot serve kopf's namespace watch).
        elected = self.identity is not None
        registry, memo = build("example/xpyd:test", self.resync_seconds, [], kube=kube, retry_seconds=0.5,
                               login=login, lease_namespace=LEASE_NAMESPACE if elected else None,
                               lease_timing=LEASE_TIMING if elected else None, identity=self.identity)
        self.memo = memo
        return registry, memo

    async def start(self) -> None:
        registry, memo = self.build()
        self.stop_flag = asyncio.Event()
        self.task = asyncio.create_task(serve(registry, memo, [], liveness=None,
                                              stop_flag=self.stop_flag))  # type: ignore[arg-type]

    async def stop(self) -> None:
        self.stop_flag.set()
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(self.task, timeout=20)


@pytest.fixture
async def operator(fake: FakeKube) -> AsyncIterator[Operator]:
    op = Operator(str(fake.url).rstrip("/"))
    await op.start()
    yield op
    await op.stop()


async def eventually(check: Callable[[], Any], timeout: float = 20.0, what: str = "") -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = check()
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        await asyncio.sleep(0.05)


async def request(fake: FakeKube, method: str, path: str, body: Any = None,
                  content_type: str = "application/json") -> Any:
    async with aiohttp.ClientSession() as session, session.request(
            method, str(fake.url).rstrip("/") + path, json=body, headers={"Content-Type": content_type}) as r:
        return await r.json()


def children_exist(fake: FakeKube) -> bool:
    return all(fake.get_object(res, NS, name) for res, names in CHILDREN.items() for name in names)


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


async def create_serving(fake: FakeKube, body: dict[str, Any] | None = None) -> None:
    await request(fake, "POST", CR_PATH, copy.deepcopy(body or SERVING))


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
