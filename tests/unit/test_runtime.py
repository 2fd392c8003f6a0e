"""The operator's per-object locks: one reconcile or decision at a time per object, and no growth
with every object ever seen."""

from __future__ import annotations

from typing import cast

import pytest

from xpyd.controller.runtime import OperatorRuntime
from xpyd.kube import Kube

pytestmark = pytest.mark.unit


def test_the_operator_forgets_the_locks_of_objects_that_are_gone() -> None:
    state = OperatorRuntime(kube=cast(Kube, None), operator_image="x", resync_seconds=60, namespaces=[])
    kept, gone, busy = state.lock("a", "kept"), state.lock("a", "gone"), state.lock("b", "busy")
    state.lock("c", "elsewhere")
    with busy:
        state.forget_locks({("a", "kept")}, ["a", "b"])   # namespace c was not listed: untouched
    assert state.lock("a", "kept") is kept
    assert state.lock("b", "busy") is busy               # held during the sweep: kept for now
    assert state.lock("a", "gone") is not gone           # a fresh one
    assert set(state._locks) == {("a", "kept"), ("a", "gone"), ("b", "busy"), ("c", "elsewhere")}
    state.forget_locks(set(), [None])                    # every namespace listed, nothing left
    assert state._locks == {}
