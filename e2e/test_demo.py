"""The README's first command, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from e2e.conftest import ROOT

pytestmark = pytest.mark.e2e


def test_demo_runs_to_its_summary() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py")], capture_output=True, text=True,
                            timeout=600, check=False)
    out = result.stdout
    assert result.returncode == 0, result.stdout + result.stderr
    table = next(line for line in out.splitlines() if line.startswith("llama-8b "))
    assert table.split()[1:4] == ["1/1", "2/2", "True"]
    assert "AllReplicasReady" in out and "attainment" in out and "demo finished" in out
    report = json.loads((ROOT / "build" / "demo" / "sim-report.json").read_text())
    assert report["requests"] == 200 and 0 <= report["attainment"] <= 1
    assert (ROOT / "build" / "demo" / "sim.png").stat().st_size > 10_000
    assert not (ROOT / "build" / "demo" / "cluster" / "state.json").exists()  # torn down
