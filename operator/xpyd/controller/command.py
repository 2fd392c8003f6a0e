"""`xpyd operator`'s command line. The process it runs is `xpyd.controller.main`'s, imported only when
the command runs: kopf takes over a second to import, which the other sub-commands should not pay."""

from __future__ import annotations

import argparse
from typing import Any

from xpyd.common.args import positive_float, positive_int


def add_parser(subparsers: Any) -> None:
    """Register `xpyd operator` on the `xpyd` command's sub-parsers."""
    parser = subparsers.add_parser("operator", help="run the operator against the current kubeconfig or "
                                   "in-cluster config")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], help="watch this namespace "
                       "(repeatable; the default is every namespace)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                        help="liveness endpoint URL (empty to disable)")
    parser.add_argument("--metrics", default="http://0.0.0.0:8081/metrics",
                        help="URL the operator's Prometheus metrics are served on (empty to disable)")
    parser.add_argument("--operator-image", default=None, help="image the proxy Deployments run "
                        "(default: this operator's release image)")
    parser.add_argument("--resync-seconds", type=positive_float, default=600.0,
                        help="period of the resync that reconciles every DisaggregatedServing from the "
                        "operator's watch-fed cache (drift is otherwise repaired on its watch event)")
    parser.add_argument("--workers", type=positive_int, default=8,
                        help="DisaggregatedServings reconciled at once (and autoscaler decisions made at once)")
    parser.add_argument("--leader-elect", action="store_true", help="elect one active replica on the Lease "
                        "xpyd-operator (the others stand by with warm caches and take over when it stops)")
    parser.add_argument("--leader-election-namespace", default=None, help="namespace of that Lease (default: "
                        "the pod's own namespace, else xpyd-system)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from xpyd.controller.main import run as run_operator

    return run_operator(namespaces=args.namespace, all_namespaces=args.all_namespaces, liveness=args.liveness,
                        operator_image=args.operator_image, resync_seconds=args.resync_seconds,
                        verbose=args.verbose, metrics=args.metrics or None, workers=args.workers,
                        leader_elect=args.leader_elect, lease_namespace=args.leader_election_namespace)
