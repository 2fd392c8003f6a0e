"""The operator (kopf, real HTTP) against the mock Kubernetes API (`tests/integration/fakekube.py`):
`Operator` starts and stops one like a pod; the serving the tests create (`SERVING`) and its
children. Shared by test_operator and test_operator_ha."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from typing import Any

import aiohttp
import kopf
import kubernetes

from tests.integration.fakekube import FakeKube
from xpyd.controller.leader import Timing
from xpyd.controller.main import build, serve
from xpyd.kube import Kube

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


async def request(fake: FakeKube, method: str, path: str, body: Any = None,
                  content_type: str = "application/json") -> Any:
    async with aiohttp.ClientSession() as session, session.request(
            method, str(fake.url).rstrip("/") + path, json=body, headers={"Content-Type": content_type}) as r:
        return await r.json()


def children_exist(fake: FakeKube) -> bool:
    return all(fake.get_object(res, NS, name) for res, names in CHILDREN.items() for name in names)


async def create_serving(fake: FakeKube, body: dict[str, Any] | None = None) -> None:
    await request(fake, "POST", CR_PATH, copy.deepcopy(body or SERVING))
