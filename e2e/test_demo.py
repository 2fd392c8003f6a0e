"""The README's first command, as a user runs it: `xpyd demo` end to end on its own local cluster
(the default minute of the Azure conversation trace; `--keep` with a few seconds of it)."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from xpyd.cluster.binaries import locate_binaries

pytestmark = pytest.mark.e2e

STEP = re.compile(r"^\[\s*(\d+\.\d)s\] (\d)/7 (.+)$")
LIVE = re.compile(r"^ {10}t=\s*\d+\.\ds  P (\d+)/(\d+)  D (\d+)/(\d+)  done (\d+)/(\d+)  TTFT p90 .+  TPOT p90 .+  "
                  r"queue \S+  \| .+$")


def demo(tmp_path: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`xpyd demo` in a state directory and with a plot path of the test's own (stdout not a TTY)."""
    return subprocess.run([sys.executable, "-m", "xpyd.cli", "demo", "--state-dir", str(tmp_path / "state"),
                           "--plot", str(tmp_path / "out" / "demo.png"), *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def steps(output: str) -> list[tuple[float, int, str]]:
    return [(float(m[1]), int(m[2]), m[3]) for line in output.splitlines() if (m := STEP.match(line))]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def test_demo_runs_to_its_summary_and_plot(tmp_path: Path) -> None:
    result = demo(tmp_path, timeout=480)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr

    narrated = steps(out)
    assert [number for _, number, _ in narrated] == [1, 2, 3, 4, 5, 6, 7], out
    assert [t for t, _, _ in narrated] == sorted(t for t, _, _ in narrated)
    assert narrated[-1][2] == "tearing everything down"

    live = [LIVE.match(line) for line in out.splitlines() if LIVE.match(line)]
    assert len(live) >= 10, out   # one line per sample (~3 s) over about a minute of load
    requests = 1274  # tests/fixtures/traces/azure_conv_2023_600s_240s.csv
    assert all(int(m[6]) == requests for m in live) and int(live[-1][5]) == requests

    report = json.loads((tmp_path / "out" / "demo.json").read_text())
    assert report["requests"] == requests and 0 <= report["attainment"] <= 1
    assert report["ttft_ms"]["p90"] > 0 and report["tpot_ms"]["p90"] > 0
    decode = report["replicas"]["decode"]
    assert decode["before"] == 1 and decode["peak"] > 1, report["replicas"]   # the autoscaler visibly scales
    assert report["scaling_actions"] >= 1 and report["gpu_hours"] > 0
    reasons = {event["reason"] for event in report["events"]}
    grow_decode = {"TpotOverTarget", "DecodeDemand", "DecodeAdmission"}
    assert reasons & grow_decode, reasons
    assert any(run["reason"] in grow_decode for run in report["decisions"])

    assert f"attainment {report['attainment']:.1%}" in out
    assert f"decode   replicas 1 before, {decode['peak']} peak, {decode['after']} after" in out
    assert "Events of the DisaggregatedServing:" in out and "demo finished in" in out
    assert png_size(tmp_path / "out" / "demo.png") == (1100, 900)
    assert (tmp_path / "out" / "demo.png").stat().st_size > 30_000
    assert not (tmp_path / "state" / "state.json").exists()   # torn down


def test_keep_leaves_a_usable_cluster(tmp_path: Path) -> None:
    # 60 trace-seconds at x12: five seconds of load.
    result = demo(tmp_path, "--keep", "--duration", "60", timeout=300)
    out = result.stdout
    try:
        assert result.returncode == 0, out + result.stderr
        assert steps(out)[-1][1:] == (7, "leaving the cluster up (--keep)")
        kubeconfig = tmp_path / "state" / "kubeconfig"
        assert f"export KUBECONFIG={kubeconfig}" in out
        assert f"xpyd cluster down --state-dir {tmp_path / 'state'}" in out
        listed = subprocess.run([str(locate_binaries(build=False).kubectl), "get", "xpyd", "-A"], capture_output=True,
                                text=True, timeout=60, check=True, env={**os.environ, "KUBECONFIG": str(kubeconfig)})
        assert re.search(r"^default\s+llama-8b\s+\d+/\d+\s+\d+/\d+\s+True", listed.stdout, re.M), listed.stdout
    finally:
        subprocess.run([sys.executable, "-m", "xpyd.cli", "cluster", "down", "--state-dir", str(tmp_path / "state")],
                       capture_output=True, timeout=120, check=False)
    assert not (tmp_path / "state" / "state.json").exists()
