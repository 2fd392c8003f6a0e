"""LeaderWorkerSet on the local control plane: its CRDs, its controller as a local process, and
its admission webhooks served on loopback.

In a real cluster LWS runs as a pod behind a webhook Service and rotates its own certificate.
Here nothing may dial a Service address, so the controller runs beside kube-controller-manager,
its webhook server binds 127.0.0.1 with a certificate signed by the cluster's CA, and the webhook
configurations name that address by URL. The webhooks are the ones the release registers (its
`config/webhook`): defaulting and validation of LeaderWorkerSets, and the pod defaulting that
labels group pods and injects LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any, Final

import yaml

from xpyd.common.jsontypes import JSON

API_GROUP: Final = "leaderworkerset.x-k8s.io"
#: Pods of a group carry this label (its value is the LeaderWorkerSet's name); the pod webhooks
#: select on it, so the rest of the cluster's pods never wait for LWS.
POD_LABEL: Final = "leaderworkerset.sigs.k8s.io/name"
WEBHOOK_NAME: Final = "xpyd-local-lws"

#: (name, path, rules, pods only) of every webhook, from the release's config/webhook/manifests.yaml.
_MUTATING: Final = (
    ("mleaderworkerset.kb.io", "/mutate-leaderworkerset-x-k8s-io-v1-leaderworkerset",
     (API_GROUP, "leaderworkersets", ("CREATE", "UPDATE")), False),
    ("mpod.kb.io", "/mutate--v1-pod", ("", "pods", ("CREATE",)), True),
)
_VALIDATING: Final = (
    ("vleaderworkerset.kb.io", "/validate-leaderworkerset-x-k8s-io-v1-leaderworkerset",
     (API_GROUP, "leaderworkersets", ("CREATE", "UPDATE")), False),
    ("vpod.kb.io", "/validate--v1-pod", ("", "pods", ("CREATE", "UPDATE")), True),
    ("vdisaggregatedset.kb.io", "/validate-disaggregatedset-x-k8s-io-v1-disaggregatedset",
     ("disaggregatedset.x-k8s.io", "disaggregatedsets", ("CREATE", "UPDATE")), False),
)


def controller_config(host: str, webhook_port: int, health_port: int, cert_dir: Path) -> JSON:
    """The controller's Configuration file: no leader election (one replica), no internal
    certificate rotation (ours are issued by the cluster CA), metrics off, loopback only."""
    return {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"host": host, "port": webhook_port, "certDir": str(cert_dir)},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"{host}:{health_port}"},
    }


def _webhook(name: str, path: str, rules: tuple[str, str, tuple[str, ...]], pods_only: bool, base_url: str,
             ca_bundle: str) -> JSON:
    group, resource, operations = rules
    webhook: JSON = {
        "name": name,
        "admissionReviewVersions": ["v1"],
        "sideEffects": "None",
        "failurePolicy": "Fail",
        "timeoutSeconds": 10,
        "clientConfig": {"url": base_url + path, "caBundle": ca_bundle},
        "rules": [{"apiGroups": [group], "apiVersions": ["v1"], "operations": list(operations),
                   "resources": [resource]}],
    }
    if pods_only:
        webhook["objectSelector"] = {"matchExpressions": [{"key": POD_LABEL, "operator": "Exists"}]}
    return webhook


def webhook_configurations(host: str, port: int, ca_cert: bytes) -> list[JSON]:
    """The Mutating- and ValidatingWebhookConfiguration, calling https://host:port by URL."""
    base_url = f"https://{host}:{port}"
    ca_bundle = base64.b64encode(ca_cert).decode()
    return [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": kind, "metadata": {"name": WEBHOOK_NAME},
         "webhooks": [_webhook(name, path, rules, pods_only, base_url, ca_bundle)
                      for name, path, rules, pods_only in entries]}
        for kind, entries in (("MutatingWebhookConfiguration", _MUTATING),
                              ("ValidatingWebhookConfiguration", _VALIDATING))
    ]


def crds(directory: Path) -> list[JSON]:
    """The CRDs the build copied from the release's module (config/crd/bases)."""
    objects: list[JSON] = []
    for path in sorted(directory.glob("*.yaml")):
        objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return objects


def established(crd: dict[str, Any] | None) -> bool:
    conditions = ((crd or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)
