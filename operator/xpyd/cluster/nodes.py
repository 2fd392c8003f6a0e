"""The fake nodes of the local cluster: GPU nodes as a GPU cloud would label and taint them,
and one plain node for the operator and the proxies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
#: The NVLink domain (clique) GPU feature discovery labels multi-node NVLink nodes with: here, the
#: rack of each pair of GPU nodes, which multi-node replicas use as their topology key.
CLIQUE_LABEL = "nvidia.com/gpu.clique"


@dataclass(frozen=True)
class NodeSpec:
    name: str
    gpu_product: str | None = None
    gpus: int = 0
    rdma: dict[str, int] = field(default_factory=dict)
    cpu: str = "96"
    memory: str = "1024Gi"
    labels: dict[str, str] = field(default_factory=dict)


def _gpu_node(name: str, product: str, rdma: dict[str, int], clique: str) -> NodeSpec:
    return NodeSpec(name=name, gpu_product=product, gpus=8, rdma=rdma, labels={CLIQUE_LABEL: clique})


_H200_RDMA = {"rdma/ib": 8, "rdma/roce_gdr": 8}
_H100 = "NVIDIA-H100-80GB-HBM3"
DEFAULT_NODES: tuple[NodeSpec, ...] = (
    _gpu_node("gpu-h200-0", "NVIDIA-H200", _H200_RDMA, "h200-rack-0"),
    _gpu_node("gpu-h200-1", "NVIDIA-H200", _H200_RDMA, "h200-rack-0"),
    _gpu_node("gpu-l40s-0", "NVIDIA-L40S", {"rdma/roce_gdr": 4}, "l40s-rack-0"),
    _gpu_node("gpu-l40s-1", "NVIDIA-L40S", {"rdma/roce_gdr": 4}, "l40s-rack-0"),
    # Two racks of two: room for multi-node replicas placed one per rack.
    *(_gpu_node(f"gpu-h100-{i}", _H100, {"rdma/ib": 8}, f"h100-rack-{i // 2}") for i in range(4)),
    NodeSpec(name="cpu-0", cpu="32", memory="128Gi"),
)


def node_object(node: NodeSpec) -> dict[str, Any]:
    """The Node object, with capacity in status (kwok keeps what it finds there)."""
    labels = {"kubernetes.io/hostname": node.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
              "type": "kwok", **node.labels}
    capacity: dict[str, str] = {"cpu": node.cpu, "memory": node.memory, "pods": "110",
                                "ephemeral-storage": "1Ti"}
    taints: list[dict[str, str]] = []
    if node.gpu_product:
        labels.update({"nvidia.com/gpu.product": node.gpu_product, "nvidia.com/gpu.count": str(node.gpus),
                       "nvidia.com/gpu.present": "true"})
        capacity["nvidia.com/gpu"] = str(node.gpus)
        taints.append(GPU_TAINT)
    capacity.update({name: str(count) for name, count in node.rdma.items()})
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node.name, "labels": labels, "annotations": {"kwok.x-k8s.io/node": "fake"}},
        "spec": {"taints": taints} if taints else {},
        "status": {"capacity": capacity, "allocatable": dict(capacity)},
    }
