"""The `xpyd` command: one entry point, a sub-command per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from xpyd import __version__
from xpyd.common.args import positive_float, positive_int

if TYPE_CHECKING:
    from xpyd.api.models import DisaggregatedServing


def _cmd_crd(args: argparse.Namespace) -> int:
    from xpyd.api.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def _lmcache_problems(text: str, servings: list[DisaggregatedServing]) -> list[str]:
    """Checks the LMCache ConfigMaps that come in the same file as the servings that use them."""
    from xpyd.render.lmcache import pd_config_problems

    config_maps = {doc["metadata"]["name"]: doc.get("data") or {} for doc in yaml.safe_load_all(text)
                   if isinstance(doc, dict) and doc.get("kind") == "ConfigMap" and doc.get("metadata", {}).get("name")}
    problems = []
    for s in servings:
        lmcache = s.spec.kv_transfer.lmcache
        if lmcache is None or lmcache.config_map_ref.name not in config_maps:
            continue
        data = config_maps[lmcache.config_map_ref.name]
        for role in ("prefill", "decode"):
            if f"{role}.yaml" not in data:
                problems.append(f"{lmcache.config_map_ref.name}: key {role}.yaml is missing")
            else:
                problems += [f"{lmcache.config_map_ref.name}: {p}"
                             for p in pd_config_problems(s.spec, role, data[f"{role}.yaml"])]
    return problems


def _cmd_render(args: argparse.Namespace) -> int:
    from xpyd.api.load import SpecError, load_servings
    from xpyd.render import RenderOptions, render

    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    except OSError as error:
        print(f"xpyd render: cannot read {args.file}: {error.strerror}", file=sys.stderr)
        return 1
    try:
        servings = load_servings(text, source=args.file, vllm_version=args.vllm_version)
    except SpecError as error:
        print(f"xpyd render: {error}", file=sys.stderr)
        return 1
    problems = _lmcache_problems(text, servings)
    if problems:
        print("xpyd render: " + "\n  ".join([f"{args.file}: the LMCache ConfigMap does not fit P/D:", *problems]),
              file=sys.stderr)
        return 1
    options = RenderOptions(operator_image=args.operator_image) if args.operator_image else RenderOptions()
    objects = [obj for s in servings for obj in render(s.metadata.name, s.metadata.namespace, s.spec, options)]
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False, width=1000))
    return 0


def _cmd_operator(args: argparse.Namespace) -> int:
    from xpyd.controller.main import run

    return run(namespaces=args.namespace, all_namespaces=args.all_namespaces, liveness=args.liveness,
               operator_image=args.operator_image, resync_seconds=args.resync_seconds, verbose=args.verbose,
               metrics=args.metrics or None, workers=args.workers, leader_elect=args.leader_elect,
               lease_namespace=args.leader_election_namespace)


def _cmd_cluster(args: argparse.Namespace) -> int:
    import json

    from xpyd.cluster.binaries import BinariesMissing
    from xpyd.cluster.controlplane import ClusterError, ControlPlane

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
            if args.json:
                print(json.dumps(status, indent=2))
            elif not status["running"] and "processes" not in status:
                print(f"no cluster (state directory {status['state_dir']})")
            else:
                print(f"cluster {'running' if status['running'] else 'DEGRADED'}: {status['server']}  "
                      f"up {status['uptime_seconds']}s")
                print(f"  export KUBECONFIG={status['kubeconfig']}")
                for name, process in status["processes"].items():
                    print(f"  {name:<24} pid {process['pid']:<8} {'running' if process['alive'] else 'EXITED'}")
                print(f"  nodes: {', '.join(status['nodes'])}")
            return 0 if status["running"] else 1
    except (ClusterError, BinariesMissing) as error:
        print(f"xpyd cluster {args.action}: {error}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xpyd", description="vLLM prefill/decode-disaggregated serving on "
                                     "Kubernetes.")
    parser.add_argument("--version", action="version", version=f"xpyd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    crd = commands.add_parser("crd", help="print the DisaggregatedServing CRD (identical to crds/)")
    crd.set_defaults(func=_cmd_crd)

    render = commands.add_parser("render", help="print every child object of DisaggregatedServing files")
    render.add_argument("-f", "--file", required=True, help="YAML file with DisaggregatedServing objects, or -")
    render.add_argument("--vllm-version", help="render for this vLLM release (MAJOR.MINOR) instead of the "
                        "spec's engine.vllmVersion")
    render.add_argument("--operator-image", help="image of the proxy (defaults to the operator's image)")
    render.set_defaults(func=_cmd_render)

    operator = commands.add_parser("operator", help="run the operator against the current kubeconfig or "
                                   "in-cluster config")
    scope = operator.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], help="watch this namespace "
                       "(repeatable; the default is every namespace)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    operator.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                          help="liveness endpoint URL (empty to disable)")
    operator.add_argument("--metrics", default="http://0.0.0.0:8081/metrics",
                          help="URL the operator's Prometheus metrics are served on (empty to disable)")
    operator.add_argument("--operator-image", default=None, help="image the proxy Deployments run "
                          "(default: this operator's release image)")
    operator.add_argument("--resync-seconds", type=positive_float, default=600.0,
                          help="period of the resync that reconciles every DisaggregatedServing from the "
                          "operator's watch-fed cache (drift is otherwise repaired on its watch event)")
    operator.add_argument("--workers", type=positive_int, default=8,
                          help="DisaggregatedServings reconciled at once (and autoscaler decisions made at once)")
    operator.add_argument("--leader-elect", action="store_true", help="elect one active replica on the Lease "
                          "xpyd-operator (the others stand by with warm caches and take over when it stops)")
    operator.add_argument("--leader-election-namespace", default=None, help="namespace of that Lease (default: "
                          "the pod's own namespace, else xpyd-system)")
    operator.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    operator.set_defaults(func=_cmd_operator)
    cluster = commands.add_parser("cluster", help="the local control plane (real API server, fake GPU nodes)")
    cluster.add_argument("action", choices=["up", "down", "status", "runtime"],
                         help="up: start (building binaries if needed); down: stop and remove state; "
                         "status: what runs; runtime: the pod process runtime (started by up)")
    cluster.add_argument("--state-dir", help="cluster state directory (default $XPYD_CLUSTER_DIR or "
                         "~/.cache/xpyd/cluster)")
    cluster.add_argument("--no-runtime", action="store_true", help="up: do not start the pod process runtime")
    cluster.add_argument("--json", action="store_true", help="status: machine-readable output")
    cluster.set_defaults(func=_cmd_cluster)

    from xpyd.bench.main import add_parser as add_bench_parser
    from xpyd.demo.main import add_parser as add_demo_parser
    from xpyd.plan import add_parser as add_plan_parser
    from xpyd.proxy.main import add_parser as add_proxy_parser
    from xpyd.sim.cli import add_parser as add_sim_parser
    from xpyd.sim.emulator.main import add_parser as add_engine_sim_parser

    add_plan_parser(commands)
    add_sim_parser(commands)
    add_engine_sim_parser(commands)
    add_proxy_parser(commands)
    add_bench_parser(commands)
    add_demo_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
