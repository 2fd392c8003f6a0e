"""`benchmarks/operator_scale.py` at smoke size, on a control plane of its own (no pod runtime; the
operator out of cluster as the chart's ServiceAccount): it converges, the two counts of the
operator's requests (the API server's and its own) agree, the idle operator writes nothing and
lists nothing, drift is repaired from the event, and the children are collected after the delete.
The floor round (no operator, on a cluster of its own) runs first. Figures are not checked (timing
is the benchmark's business), only that each was measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.cluster import ROOT

pytestmark = pytest.mark.e2e


def test_operator_scale_smoke(tmp_path: Path) -> None:
    out = tmp_path / "rounds.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "operator_scale.py"), "--pools", "3",
                             "--idle-seconds", "5", "--converge-timeout", "120", "--json", str(out)],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    floor, round_ = json.loads(out.read_text())
    # The floor: the same children, written by the benchmark's own writer on a cluster of its own.
    assert floor["writer"] == "floor" and floor["pools"] == 3 and len(floor["children_s"]) == 3
    assert floor["cleanup_s"] > 0 and floor["converge_by_kind"] == {}
    assert round_["writer"] == "operator" and round_["pools"] == 3 and len(round_["children_s"]) == 3
    # The API server counted, for the operator's ServiceAccount alone, what the operator says it sent.
    assert round_["converge_dispatched"] == round_["converge_requests"] > 3 * 12
    assert round_["converge_by_kind"]["PATCH deployments"] == 9  # three pools, three Deployments each
    # Idle: no writes, and nothing but watches (none restarted within 5 s either).
    assert round_["idle_requests"] == {} and round_["idle_dispatched"] == 0
    assert round_["drift_delete_s"] > 0 and round_["drift_scale_s"] > 0 and round_["cleanup_s"] > 0
    assert "idle req/s" in result.stdout and "CPU seconds from the create" in result.stdout
    assert "3 pools, operator / floor: last child after the create" in result.stdout
