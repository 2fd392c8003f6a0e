"""Multi-node replicas on LeaderWorkerSet, on the local control plane: the LWS controller and its
webhooks (built from its Go module) run beside the API server, and engine-sim plays each group
(the leader serves once its worker joined, and fails when it leaves).

One pool of a 2-node prefill group and two 2-node decode groups (DeepSeek-V3, DP16 + EP per
group) under open-loop load through a proxy pod: placement by NVLink domain, a killed worker (the
group is recreated; the proxy routes to the other decode group meanwhile), scale-down by a group
with its drain, and deletion. Every client request is counted."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import ROOT, Cluster, eventually, pods_of, provide_prerequisites, serving_of, wait_ready
from xpyd.api.load import load_servings
from xpyd.api.naming import LWS_GROUP_KEY_LABEL, LWS_WORKER_INDEX_LABEL
from xpyd.cluster.nodes import CLIQUE_LABEL
from xpyd.cluster.pidfiles import PID_FILE
from xpyd.common.netguard import LOOPBACK_ONLY_ENV, require_loopback
from xpyd.kube.pods import pod_ready as ready

pytestmark = pytest.mark.e2e

SAMPLE = ROOT / "manifests" / "samples" / "deepseek-v3-multinode.yaml"
NAME = "deepseek-v3"
MODEL = "deepseek-v3"


def pool(decode_replicas: int) -> str:
    obj = yaml.safe_load(SAMPLE.read_text())
    obj["spec"]["decode"]["replicas"] = decode_replicas
    obj["spec"]["proxy"] = {"replicas": 1}
    return yaml.safe_dump(obj)


def proxy_url(cluster: Cluster, namespace: str) -> str:
    (pod,) = pods_of(cluster, namespace, NAME, "proxy")
    port = pod["spec"]["containers"][0]["ports"][0]["containerPort"]
    return f"http://{require_loopback(pod['status']['podIP'])}:{port}"


def groups(cluster: Cluster, namespace: str, role: str) -> dict[str, list[Any]]:
    """The role's pods by group (LWS group key), each list ordered leader first."""
    result: dict[str, list[Any]] = {}
    for pod in sorted(pods_of(cluster, namespace, NAME, role),
                      key=lambda p: int(p["metadata"]["labels"].get(LWS_WORKER_INDEX_LABEL, "0"))):
        result.setdefault(pod["metadata"]["labels"][LWS_GROUP_KEY_LABEL], []).append(pod)
    return result


class Load:
    """`xpyd bench` at a steady open-loop rate through one proxy pod, in the background (bounded by
    its duration, its request cap and a timeout)."""

    def __init__(self, url: str, report: Path, duration_s: int, rate: float = 8.0) -> None:
        self.report = report
        self.process = subprocess.Popen(
            ["timeout", str(duration_s + 60), sys.executable, "-m", "xpyd.cli", "bench", "--url", url,
             "--model", MODEL, "--rate", str(rate), "--isl", "512", "--osl", "32", "--duration", str(duration_s),
             "--max-requests", str(int(rate * duration_s * 2)), "--timeout", "30", "--report", str(report)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, LOOPBACK_ONLY_ENV: "1"})

    def result(self) -> dict[str, Any]:
        output, _ = self.process.communicate(timeout=180)
        assert self.process.returncode == 0, output
        report: dict[str, Any] = json.loads(self.report.read_text())
        print(f"load: {report['succeeded']} succeeded, {report['failed']} failed {report['errors']}")
        return report


def test_multi_node_pool_places_recovers_scales_and_deletes(operator: Cluster, namespace: str,
                                                            tmp_path: Path) -> None:
    (spec_obj,) = load_servings(pool(2))
    provide_prerequisites(operator, namespace, spec_obj)
    operator.apply(pool(2), namespace)
    wait_ready(operator, namespace, NAME, timeout=120)

    # Placement: a group's pods share one NVLink domain, which no other group uses; the leader is pod 0.
    nodes = {n["metadata"]["name"]: n["metadata"]["labels"] for n in operator.get("nodes")["items"]}
    cliques = []
    for role, product, count in (("prefill", "NVIDIA-H200", 1), ("decode", "NVIDIA-H100-80GB-HBM3", 2)):
        by_group = groups(operator, namespace, role)
        assert len(by_group) == count and all(len(members) == 2 for members in by_group.values()), by_group
        for members in by_group.values():
            labels = [nodes[p["spec"]["nodeName"]] for p in members]
            assert {lab["nvidia.com/gpu.product"] for lab in labels} == {product}
            assert len({p["spec"]["nodeName"] for p in members}) == 2
            (clique,) = {lab[CLIQUE_LABEL] for lab in labels}
            cliques.append(clique)
            assert [p["metadata"]["labels"][LWS_WORKER_INDEX_LABEL] for p in members] == ["0", "1"]
    assert len(set(cliques)) == len(cliques)
    service = operator.get("service", "-n", namespace, f"{NAME}-decode")
    assert service["spec"]["publishNotReadyAddresses"] is True  # workers find a leader that is not ready
    table = operator.kubectl("get", "xpyd", "-n", namespace).stdout.splitlines()
    assert table[1].split()[1:4] == ["1/1", "2/2", "True"]  # replicas are groups
    wide = operator.kubectl("get", "xpyd", "-n", namespace, "-o", "wide").stdout.splitlines()
    starts = [m.start() for m in re.finditer(r"\S+", wide[0])]   # cells by the header's offsets: some are empty
    columns = {wide[0][a:b].strip(): wide[1][a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)}
    assert (columns["PREFILL-GPUS"], columns["DECODE-GPUS"]) == ("16", "32")  # every pod of every group
    # What LWS's webhooks default in the LeaderWorkerSets does not look like drift: applied once.
    assert not operator.get("events", "-n", namespace, "--field-selector", "reason=Updated")["items"]

    # A decode worker is killed (kill -9, no drain): its group goes down and is recreated whole, and the
    # proxy routes to the other decode group meanwhile.
    url = proxy_url(operator, namespace)
    load = Load(url, tmp_path / "kill.json", duration_s=30)
    time.sleep(8)
    victim_group, members = sorted(groups(operator, namespace, "decode").items())[0]
    leader, worker = members
    pid_file = Path(operator.state.state_dir) / "pods" / f"{namespace}_{worker['metadata']['name']}" / PID_FILE
    os.kill(int(pid_file.read_text()), signal.SIGKILL)

    def replaced() -> Any:
        now = operator.get("pod", "-n", namespace, leader["metadata"]["name"])
        return now if now and now["metadata"]["uid"] != leader["metadata"]["uid"] and ready(now) else None

    recreated = eventually(replaced, timeout=60, what="the decode group recreated with a new, ready leader")
    assert recreated["metadata"]["labels"][LWS_GROUP_KEY_LABEL] == victim_group
    report = load.result()
    # Only requests streaming on the killed group at that instant may fail (they cannot be moved
    # mid-stream); every later request has the other decode group.
    assert report["failed"] <= 2, report["errors"]
    assert report["succeeded"] >= 150
    wait_ready(operator, namespace, NAME, timeout=60)

    # Scale decode down by a group: the leader drains, then the group goes; nothing is lost.
    load = Load(url, tmp_path / "scale.json", duration_s=20)
    time.sleep(4)
    operator.kubectl("patch", "disaggregatedserving", NAME, "-n", namespace, "--type=merge",
                     "-p", '{"spec": {"decode": {"replicas": 1}}}')
    eventually(lambda: len(groups(operator, namespace, "decode")) == 1
               and (operator.get("leaderworkerset", "-n", namespace, f"{NAME}-decode") or {})
               .get("status", {}).get("replicas") == 1, timeout=90, what="decode down to one group")
    report = load.result()
    assert report["failed"] == 0, report["errors"]
    obj = wait_ready(operator, namespace, NAME, timeout=60)
    assert obj["status"]["decode"]["ready"] == "1/1"

    # Deleting the pool takes the LeaderWorkerSets and every pod of their groups with it.
    operator.kubectl("delete", "disaggregatedserving", NAME, "-n", namespace, "--wait=true", "--timeout=60s",
                     timeout=90)
    eventually(lambda: not operator.get("leaderworkersets", "-n", namespace)["items"]
               and not [p for p in operator.get("pods", "-n", namespace, "-l", f"xpyd.io/serving={NAME}")["items"]],
               timeout=90, what="the groups gone")
    assert serving_of(operator, namespace, NAME) is None
