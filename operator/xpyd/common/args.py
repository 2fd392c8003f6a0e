"""Command-line arguments: reading them the way argparse would (vLLM's and the proxy's flags in pod
specs), and the argparse types the project's commands share."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence


def last_flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value argparse keeps for `flag`: `--flag=V` or `--flag V`, the last one wins; None if absent."""
    value = None
    for index, arg in enumerate(args):
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        elif arg == flag and index + 1 < len(args):
            value = args[index + 1]
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer above zero."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number above zero."""
    value = _number(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number of at least zero."""
    value = _number(text)
    if not value >= 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0: {text!r}")
    return value


def port(text: str) -> int:
    """An argparse type: a TCP port, 1 to 65535."""
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a port (1..65535): {text!r}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
