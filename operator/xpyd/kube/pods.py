"""Reading objects' conditions as the API (or the watch cache) gives them. Pure."""

from __future__ import annotations

from xpyd.common.jsontypes import JSON


def condition(obj: JSON | None, kind: str) -> JSON:
    """The object's `status.conditions` entry of type `kind`, or {} when it has none."""
    for entry in ((obj or {}).get("status") or {}).get("conditions") or []:
        if entry.get("type") == kind:
            return dict(entry)
    return {}


def pod_ready(pod: JSON | None) -> bool:
    """The Pod's condition Ready=True (a terminating pod keeps it while its probes pass)."""
    return condition(pod, "Ready").get("status") == "True"


def terminating(obj: JSON | None) -> bool:
    """Whether the object has been deleted and is waiting for its finalizers or grace period."""
    return bool(((obj or {}).get("metadata") or {}).get("deletionTimestamp"))
