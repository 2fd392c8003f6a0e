"""Reading command-line arguments the way argparse would (vLLM's and the proxy's flags in pod specs)."""

from __future__ import annotations

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
