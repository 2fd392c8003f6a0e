"""The pure-Python simulator gives the golden replays (tests/sim_goldens.py) too: the compiled build
(`make native`) and the sources it shadows must not drift apart (tests/unit/test_sim_golden.py checks
the build in use)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.paths import ROOT
from tests.sim_goldens import GOLDEN

pytestmark = pytest.mark.integration

CHILD = """
import json
from tests.sim_goldens import CASES, replay
from xpyd.common import native
print(json.dumps({"compiled": native.compiled(), "replays": {name: replay(case) for name, case in CASES.items()}}))
"""


def test_the_pure_python_simulator_replays_the_golden_request_by_request() -> None:
    child = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env={**os.environ, "XPYD_NATIVE": "off"},
                           capture_output=True, text=True, timeout=300, check=False)
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout)
    assert out["compiled"] == []
    assert out["replays"] == json.loads(GOLDEN.read_text())
