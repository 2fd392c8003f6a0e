"""The simulator's outcome pinned request by request: a golden of replays on trace slices, written
by the simulator before its speed work (issue 13), so an optimisation that changes any request's
TTFT or end, the event count, a replica sample, a decision or anything a policy observes fails here.

Regenerate only after an intended change of the model, with
`XPYD_UPDATE_GOLDEN=1 pytest tests/unit/test_sim_golden.py`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests.sim_goldens import CASES, GOLDEN, replay

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    if os.environ.get("XPYD_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps({name: replay(case) for name, case in CASES.items()}, indent=1) + "\n")
    loaded: dict[str, Any] = json.loads(GOLDEN.read_text())
    return loaded


@pytest.mark.parametrize("name", sorted(CASES))
def test_replay_matches_golden(name: str, golden: dict[str, Any]) -> None:
    assert json.loads(json.dumps(replay(CASES[name]))) == golden[name]


def test_golden_cases_exercise_the_simulator(golden: dict[str, Any]) -> None:
    # The pins are only worth having if the cases queue, scale and fuse: check they still do.
    assert golden["code-xpyd"]["scaling_actions"] > 0 and golden["code-queue-threshold"]["scaling_actions"] > 0
    assert all(case["events"] > case["requests"] for case in golden.values())
    assert min(golden["mooncake-prefix-cache"]["cached_tokens"].values()) > 0
