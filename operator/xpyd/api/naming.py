"""Names and labels of the child objects (shared by rendering, the operator and the proxy)."""

from __future__ import annotations

from typing import Final, Literal

#: An engine pool's role (one definition for rendering, the proxy, the autoscaler and the simulator).
Role = Literal["prefill", "decode"]
Component = Literal["prefill", "decode", "proxy"]
PREFILL: Final = "prefill"
DECODE: Final = "decode"
ROLES: Final[tuple[Role, ...]] = (PREFILL, DECODE)

FIELD_MANAGER: Final = "xpyd-operator"
SERVING_LABEL: Final = "xpyd.io/serving"
ROLE_LABEL: Final = "xpyd.io/role"
#: On engine pods: the KV compatibility hash of their pool (`xpyd.render.compat`); the proxy pairs a
#: prefill and a decode instance only when theirs are equal.
KV_COMPAT_LABEL: Final = "xpyd.io/kv-compat"
#: LeaderWorkerSet's label of a pod's index in its group: 0 on the leader, which alone serves.
LWS_WORKER_INDEX_LABEL: Final = "leaderworkerset.sigs.k8s.io/worker-index"
#: LeaderWorkerSet's label of every pod of one group (one multi-node replica), and its annotation of
#: the group's size.
LWS_GROUP_KEY_LABEL: Final = "leaderworkerset.sigs.k8s.io/group-key"
LWS_SIZE_ANNOTATION: Final = "leaderworkerset.sigs.k8s.io/size"


def child_name(serving: str, component: Component) -> str:
    """`llama-prefill`, `llama-decode`, `llama-proxy`."""
    return f"{serving}-{component}"


def selector_labels(serving: str, component: Component) -> dict[str, str]:
    """The labels a child's selector matches: stable for the life of the object."""
    return {SERVING_LABEL: serving, ROLE_LABEL: component}


def selector_string(serving: str, component: Component) -> str:
    """`selector_labels` as a label-selector string for list/watch calls."""
    return ",".join(f"{key}={value}" for key, value in selector_labels(serving, component).items())


def serving_selector_string(serving: str, role: Role, multi_node: bool) -> str:
    """The pods of a role that serve requests: every pod, or each multi-node replica's leader."""
    selector = selector_string(serving, role)
    return f"{selector},{LWS_WORKER_INDEX_LABEL}=0" if multi_node else selector


def labels(serving: str, component: Component) -> dict[str, str]:
    """Every label a child carries: the selector labels plus the app.kubernetes.io set."""
    return {
        "app.kubernetes.io/name": "xpyd-proxy" if component == "proxy" else "vllm",
        "app.kubernetes.io/instance": serving,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "xpyd",
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
        **selector_labels(serving, component),
    }
