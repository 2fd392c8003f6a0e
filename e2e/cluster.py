"""The local control plane as the e2e tests drive it: kubectl and helm against it, polling until
something holds, and a DisaggregatedServing's conditions. The fixtures are in e2e/conftest.py."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.eventually import eventually_blocking as eventually
from xpyd.cluster.binaries import Binaries
from xpyd.cluster.controlplane import ClusterState
from xpyd.kube.pods import condition

ROOT = Path(__file__).resolve().parents[1]
OPERATOR_NAMESPACE = "xpyd-system"
RELEASE = "xpyd-operator"
#: What kubectl prints when the API server could not be reached (a 2-core machine busy with real vLLM
#: engines can starve the TLS handshake). A command that only reads, or that leaves the same object
#: however often it runs (`RETRIED`, and a `delete --wait=false`: one request), is then run again, at
#: most `ATTEMPTS` times; others (a `delete` that waits, `helm install --wait`) make several requests,
#: and one may have landed before another failed.
UNSENT = ("TLS handshake timeout", "connect: connection refused")
RETRIED = frozenset({"get", "describe", "logs", "wait", "apply", "patch", "scale"})
ATTEMPTS = 3


@dataclass
class Cluster:
    state: ClusterState
    binaries: Binaries

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.state.kubeconfig)}

    def run(self, tool: str, *args: str, check: bool = True, stdin: str | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        binary = {"kubectl": self.binaries.kubectl, "helm": self.binaries.helm}[tool]
        once = bool(args) and (args[0] in RETRIED or (args[0] == "delete" and "--wait=false" in args))
        attempts = ATTEMPTS if tool == "kubectl" and once else 1
        for attempt in range(1, attempts + 1):
            result = subprocess.run([str(binary), *args], capture_output=True, text=True, env=self.env,
                                    input=stdin, timeout=timeout, check=False)
            if result.returncode == 0 or attempt == attempts or not any(m in result.stderr for m in UNSENT):
                break
            time.sleep(2.0 * attempt)
        if check and result.returncode != 0:
            tried = f" after {attempt} attempts" if attempt > 1 else ""
            raise AssertionError(f"{tool} {' '.join(args)} failed ({result.returncode}){tried}:\n{result.stderr}")
        return result

    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.run("kubectl", *args, **kwargs)

    def get(self, *args: str) -> Any:
        """`kubectl get ... -o json`, parsed (None when not found)."""
        result = self.kubectl("get", *args, "-o", "json", check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr or "not found" in result.stderr:
                return None
            raise AssertionError(result.stderr)
        return json.loads(result.stdout)

    def apply(self, manifest: str | Path, namespace: str) -> None:
        if isinstance(manifest, Path):
            self.kubectl("apply", "-n", namespace, "-f", str(manifest))
        else:
            self.kubectl("apply", "-n", namespace, "-f", "-", stdin=manifest)


def serving_of(cluster: Cluster, namespace: str, name: str) -> Any:
    return cluster.get("disaggregatedserving", "-n", namespace, name)


def wait_ready(cluster: Cluster, namespace: str, name: str, timeout: float = 90) -> Any:
    """Every replica ready (Ready=True alone also covers PartiallyReady: one pod per role serving)."""
    def complete(obj: Any) -> Any:
        ready = condition(obj, "Ready")
        return obj if (ready.get("status"), ready.get("reason")) == ("True", "AllReplicasReady") else None
    return eventually(lambda: complete(serving_of(cluster, namespace, name)), timeout=timeout,
                      what=f"{name} Ready=True, AllReplicasReady")


def pods_of(cluster: Cluster, namespace: str, name: str, role: str) -> list[Any]:
    result = cluster.get("pods", "-n", namespace, "-l", f"xpyd.io/serving={name},xpyd.io/role={role}")
    return [p for p in result["items"] if not p["metadata"].get("deletionTimestamp")]


def provide_prerequisites(cluster: Cluster, namespace: str, serving_obj: Any) -> None:
    """What a user creates beside a DisaggregatedServing: the model volume and the token Secret."""
    model = serving_obj.spec.model
    if model.source.pvc is not None:
        claim = model.source.pvc.claim_name
        volume = f"{namespace}-{claim}"
        cluster.apply(yaml.safe_dump_all([
            {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume},
             "spec": {"capacity": {"storage": "1Ti"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                      "hostPath": {"path": f"/models/{volume}"}, "persistentVolumeReclaimPolicy": "Delete"}},
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
             "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": volume,
                      "resources": {"requests": {"storage": "1Ti"}}}},
        ]), namespace)
        eventually(lambda: (cluster.get("pvc", "-n", namespace, claim) or {}).get("status", {}).get("phase")
                   == "Bound", what="model PVC bound")
    if model.hf_token_secret_ref is not None:
        ref = model.hf_token_secret_ref
        cluster.kubectl("create", "secret", "generic", ref.name, "-n", namespace, f"--from-literal={ref.key}=hf_x")


def delete_namespace(cluster: Cluster, name: str) -> None:
    """Delete a test's namespace and wait until it is gone, so the next test finds the GPUs free.
    Its pods go at once, without their drains (e2e/test_chaos.py is where drains are tested): once
    the namespace is terminating nothing recreates them."""
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
    cluster.kubectl("delete", "pods", "--all", "-n", name, "--grace-period=0", "--force", check=False)
    cluster.kubectl("wait", "--for=delete", f"namespace/{name}", "--timeout=90s", check=False, timeout=120)
