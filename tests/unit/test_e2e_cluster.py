"""e2e/cluster.py's kubectl and helm calls: a request that never reached the API server is made again."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import e2e.cluster as cluster
from xpyd.cluster.binaries import Binaries
from xpyd.cluster.controlplane import ClusterState

pytestmark = pytest.mark.unit


def fake_kubectl(tmp_path: Path, failures: int, message: str) -> cluster.Cluster:
    """A kubectl that fails `failures` times with `message` on stderr, then prints ok; it counts its calls."""
    script = tmp_path / "kubectl"
    calls = tmp_path / "calls"
    script.write_text(f"""#!/bin/sh
echo x >> {calls}
n=$(wc -l < {calls})
if [ "$n" -le {failures} ]; then echo "{message}" >&2; exit 1; fi
echo ok
""")
    script.chmod(0o755)
    binaries = Binaries(**{f.name: script for f in dataclasses.fields(Binaries)})   # every tool is this script
    return cluster.Cluster(ClusterState(state_dir=str(tmp_path), apiserver_port=1, etcd_port=2), binaries)


def calls(tmp_path: Path) -> int:
    path = tmp_path / "calls"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster.time, "sleep", lambda _: None)


def test_a_tls_handshake_timeout_is_retried(tmp_path: Path) -> None:
    fake = fake_kubectl(tmp_path, 2, "Unable to connect to the server: net/http: TLS handshake timeout")
    assert fake.kubectl("get", "pods").stdout == "ok\n"
    assert calls(tmp_path) == 3


def test_retries_are_bounded(tmp_path: Path) -> None:
    fake = fake_kubectl(tmp_path, 5, "dial tcp 127.0.0.1:1: connect: connection refused")
    with pytest.raises(AssertionError, match=f"after {cluster.ATTEMPTS} attempts:\ndial tcp"):
        fake.kubectl("delete", "pod", "x", "--wait=false")
    assert calls(tmp_path) == cluster.ATTEMPTS


@pytest.mark.parametrize("args", [("delete", "pod", "x"), ("create", "namespace", "x"), ("exec", "x", "--", "ls")])
def test_a_command_of_several_requests_or_not_idempotent_is_not_retried(tmp_path: Path, args: tuple[str, ...]) -> None:
    """A delete that waits, a create, an exec: part of it may have reached the server."""
    fake = fake_kubectl(tmp_path, 1, "Unable to connect to the server: net/http: TLS handshake timeout")
    assert fake.kubectl(*args, check=False).returncode == 1
    assert calls(tmp_path) == 1


def test_helm_is_not_retried(tmp_path: Path) -> None:
    fake = fake_kubectl(tmp_path, 1, "Unable to connect to the server: net/http: TLS handshake timeout")
    assert fake.run("helm", "install", "x", "chart", "--wait", check=False).returncode == 1
    assert calls(tmp_path) == 1


def test_an_answer_from_the_server_is_not_retried(tmp_path: Path) -> None:
    fake = fake_kubectl(tmp_path, 1, 'Error from server (NotFound): pods "x" not found')
    assert fake.kubectl("get", "pods", "x", check=False).returncode == 1
    assert calls(tmp_path) == 1
