"""The `xpyd` command: one entry point, a sub-command per job. Each sub-command owns its parser: its
module's `add_parser(subparsers)` registers it, with the function that runs it as `func`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from xpyd import __version__


def build_parser() -> argparse.ArgumentParser:
    from xpyd.api.main import add_parser as add_crd_parser
    from xpyd.bench.main import add_parser as add_bench_parser
    from xpyd.cluster.main import add_parser as add_cluster_parser
    from xpyd.controller.command import add_parser as add_operator_parser
    from xpyd.demo.main import add_parser as add_demo_parser
    from xpyd.plan import add_parser as add_plan_parser
    from xpyd.proxy.main import add_parser as add_proxy_parser
    from xpyd.render.main import add_parser as add_render_parser
    from xpyd.sim.emulator.main import add_parser as add_engine_sim_parser
    from xpyd.sim.main import add_parser as add_sim_parser

    parser = argparse.ArgumentParser(prog="xpyd", description="vLLM prefill/decode-disaggregated serving on "
                                     "Kubernetes.")
    parser.add_argument("--version", action="version", version=f"xpyd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_crd_parser(commands)
    add_render_parser(commands)
    add_operator_parser(commands)
    add_cluster_parser(commands)
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
