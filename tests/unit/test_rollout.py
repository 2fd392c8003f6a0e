"""The paired rollout (`controller.rollout.held_roles`): which Deployments keep their old pods while
both roles roll to a new KV revision."""

from __future__ import annotations

from typing import Any

import pytest

from xpyd.api.naming import KV_COMPAT_LABEL, LWS_WORKER_INDEX_LABEL, ROLE_LABEL, SERVING_LABEL
from xpyd.controller.rollout import held_roles

pytestmark = pytest.mark.unit

OLD, NEW, OLDER = "0ld0ld0ld0ld0ld0", "new0new0new0new0", "01d3r01d3r01d3r0"
BOTH = ("prefill", "decode")


def pod(role: str, revision: str | None, ready: bool = True, deleting: bool = False,
        worker: str | None = None) -> dict[str, Any]:
    labels = {SERVING_LABEL: "llama", ROLE_LABEL: role}
    if revision is not None:
        labels[KV_COMPAT_LABEL] = revision
    if worker is not None:
        labels[LWS_WORKER_INDEX_LABEL] = worker
    meta: dict[str, Any] = {"name": f"{role}-{revision}", "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-02T00:00:00Z"
    return {"metadata": meta, "status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}


@pytest.mark.parametrize(("pods", "holdable", "held"), [
    # Steady state, or a fresh pool: nothing to hold.
    ([pod("prefill", NEW), pod("decode", NEW)], BOTH, set()),
    ([], BOTH, set()),
    ([pod("prefill", NEW, ready=False), pod("decode", NEW, ready=False)], BOTH, set()),
    # The new prefill is Ready before any new decode: both keep their old pods.
    ([pod("prefill", OLD), pod("prefill", NEW), pod("decode", OLD), pod("decode", OLD)], BOTH, set(BOTH)),
    # Both rolled a pod each, one not Ready yet: held; once Ready, released.
    ([pod("prefill", OLD), pod("prefill", NEW), pod("decode", OLD), pod("decode", NEW, ready=False)], BOTH,
     set(BOTH)),
    ([pod("prefill", OLD), pod("prefill", NEW), pod("decode", OLD), pod("decode", NEW)], BOTH, set()),
    # Neither has a new pod Ready yet (the rollout just began): held, so the first to be Ready waits.
    ([pod("prefill", OLD), pod("prefill", NEW, ready=False), pod("decode", OLD)], BOTH, set(BOTH)),
    # No old pair is left to protect: a role without old pods, a terminating or unready old pod,
    # or old pods of two different revisions (they never paired).
    ([pod("prefill", NEW), pod("decode", OLD)], BOTH, set()),
    ([pod("prefill", NEW), pod("prefill", OLD, deleting=True), pod("decode", OLD)], BOTH, set()),
    ([pod("prefill", NEW), pod("prefill", OLD, ready=False), pod("decode", OLD)], BOTH, set()),
    ([pod("prefill", NEW), pod("prefill", OLDER), pod("decode", OLD)], BOTH, set()),
    # Pods without the label (made before the label existed) are neither.
    ([pod("prefill", None), pod("prefill", NEW), pod("decode", None)], BOTH, set()),
    # A multi-node role (a LeaderWorkerSet) is never held, and counts by its leaders: its Ready
    # workers of the new revision do not make the group Ready.
    ([pod("prefill", OLD), pod("prefill", NEW), pod("decode", OLD, worker="0"), pod("decode", NEW, worker="1"),
      pod("decode", NEW, worker="0", ready=False)], ("prefill",), {"prefill"}),
    ([pod("prefill", OLD), pod("prefill", NEW), pod("decode", OLD, worker="0"), pod("decode", NEW, worker="0")],
     ("prefill",), set()),
    # The proxies are not engines.
    ([pod("proxy", OLD), pod("prefill", NEW), pod("decode", NEW)], BOTH, set()),
])
def test_held_roles(pods: list[dict[str, Any]], holdable: tuple[str, ...], held: set[str]) -> None:
    assert held_roles(NEW, pods, holdable) == held  # type: ignore[arg-type]
