"""Where the pod runtime records its pod processes (`<state>/pods/<pod>/pid`), and the clean-up of
processes left behind by a runtime that was killed (used by `cluster down` and `cluster up`)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

PID_FILE = "pid"


def kill_leftover_pods(state_dir: Path) -> int:
    """SIGKILL the pod processes a runtime recorded under `state_dir/pods/*/pid` that still run (and are
    still ours: an xpyd command line), e.g. after the runtime itself was killed. Returns how many."""
    killed = 0
    for pid_file in (state_dir / "pods").glob(f"*/{PID_FILE}"):
        try:
            pid = int(pid_file.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if b"xpyd" not in cmdline:
            continue  # the pid was reused by something else
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
            killed += 1
    return killed
