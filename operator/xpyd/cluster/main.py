"""`xpyd cluster up|down|status|runtime`: the local control plane (`xpyd.cluster.controlplane`) and,
as `runtime`, the pod process runtime it starts (`xpyd.cluster.runtime`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from xpyd.cluster.binaries import BinariesMissing
from xpyd.cluster.controlplane import ClusterError, ControlPlane


def add_parser(subparsers: Any) -> None:
    """Register `xpyd cluster` on the `xpyd` command's sub-parsers."""
    parser = subparsers.add_parser("cluster", help="the local control plane (real API server, fake GPU nodes)")
    parser.add_argument("action", choices=["up", "down", "status", "runtime"],
                        help="up: start (building binaries if needed); down: stop and remove state; "
                        "status: what runs; runtime: the pod process runtime (started by up)")
    parser.add_argument("--state-dir", help="cluster state directory (default $XPYD_CLUSTER_DIR or "
                        "~/.cache/xpyd/cluster)")
    parser.add_argument("--no-runtime", action="store_true", help="up: do not start the pod process runtime")
    parser.add_argument("--json", action="store_true", help="status: machine-readable output")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plane = ControlPlane(Path(args.state_dir) if args.state_dir else None)
    if args.action == "runtime":
        from xpyd.cluster import runtime

        return runtime.main(plane.state_dir)
    try:
        if args.action == "up":
            plane.up(runtime=not args.no_runtime)
        elif args.action == "down":
            plane.down()
        else:
            status = plane.status()
            _write_status(status, as_json=args.json)
            return 0 if status["running"] else 1
    except (ClusterError, BinariesMissing) as error:
        sys.stderr.write(f"xpyd cluster {args.action}: {error}\n")
        return 1
    return 0


def _write_status(status: dict[str, Any], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(status, indent=2) + "\n")
    elif not status["running"] and "processes" not in status:
        sys.stdout.write(f"no cluster (state directory {status['state_dir']})\n")
    else:
        sys.stdout.write(f"cluster {'running' if status['running'] else 'DEGRADED'}: {status['server']}  "
                         f"up {status['uptime_seconds']}s\n")
        sys.stdout.write(f"  export KUBECONFIG={status['kubeconfig']}\n")
        for name, process in status["processes"].items():
            sys.stdout.write(f"  {name:<24} pid {process['pid']:<8} {'running' if process['alive'] else 'EXITED'}\n")
        sys.stdout.write(f"  nodes: {', '.join(status['nodes'])}\n")
