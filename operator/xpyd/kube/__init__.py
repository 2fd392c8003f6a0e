"""Kubernetes access: `client` (a thin JSON client) and `cache` (watch-fed read caches)."""

from xpyd.kube.client import (
    CLUSTER_SCOPED,
    PLURALS,
    REQUEST_TIMEOUT_SECONDS,
    Fenced,
    Kube,
    KubeError,
    load_client_config,
    resource_path,
)

__all__ = ["CLUSTER_SCOPED", "PLURALS", "REQUEST_TIMEOUT_SECONDS", "Fenced", "Kube", "KubeError",
           "load_client_config", "resource_path"]
