"""e2e fixtures: one local control plane per test session, the operator installed by Helm."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import pytest

from e2e.cluster import OPERATOR_NAMESPACE, RELEASE, ROOT, Cluster, delete_namespace, eventually
from xpyd.cluster.binaries import locate_binaries
from xpyd.cluster.controlplane import ControlPlane


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    state_dir = tmp_path_factory.mktemp("cluster")
    plane = ControlPlane(state_dir, locate_binaries())
    started = time.monotonic()
    state = plane.up(progress=lambda message: None)
    print(f"\ncluster up in {time.monotonic() - started:.1f}s ({state.server})")
    try:
        yield Cluster(state, plane.binaries)
    finally:
        plane.down(progress=lambda message: None)


@pytest.fixture(scope="session")
def operator(cluster: Cluster) -> Cluster:
    """The operator installed by `helm install` of the chart, running as a pod process."""
    cluster.run("helm", "install", RELEASE, str(ROOT / "charts" / "xpyd-operator"), "--namespace",
                OPERATOR_NAMESPACE, "--create-namespace", "--wait", "--timeout", "90s", timeout=150)
    eventually(lambda: (cluster.get("deployment", "-n", OPERATOR_NAMESPACE, RELEASE) or {})
               .get("status", {}).get("readyReplicas") == 1, what="operator Deployment ready")
    return cluster


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    slug = request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:6]  # parametrized ids share prefixes
    name = f"e2e-{slug[:40].strip('-')}-{digest}"
    cluster.kubectl("create", "namespace", name)
    yield name
    delete_namespace(cluster, name)
