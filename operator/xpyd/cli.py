"""The `xpyd` command: one entry point, a sub-command per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from xpyd import __version__


def _cmd_crd(args: argparse.Namespace) -> int:
    from xpyd.api.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


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
    options = RenderOptions(operator_image=args.operator_image) if args.operator_image else RenderOptions()
    objects = [obj for s in servings for obj in render(s.metadata.name, s.metadata.namespace, s.spec, options)]
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False, width=1000))
    return 0


def _cmd_operator(args: argparse.Namespace) -> int:
    from xpyd.controller.main import run

    return run(namespaces=args.namespace, all_namespaces=args.all_namespaces, liveness=args.liveness,
               operator_image=args.operator_image, resync_seconds=args.resync_seconds, verbose=args.verbose)


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
    operator.add_argument("--operator-image", default=None, help="image the proxy Deployments run "
                          "(default: this operator's release image)")
    operator.add_argument("--resync-seconds", type=float, default=60.0,
                          help="period of the drift check of every DisaggregatedServing")
    operator.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    operator.set_defaults(func=_cmd_operator)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
