"""`xpyd crd`: print the DisaggregatedServing CRD (`xpyd.api.crd`), identical to crds/."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from xpyd.api.crd import crd_yaml


def add_parser(subparsers: Any) -> None:
    """Register `xpyd crd` on the `xpyd` command's sub-parsers."""
    parser = subparsers.add_parser("crd", help="print the DisaggregatedServing CRD (identical to crds/)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(crd_yaml())
    return 0
