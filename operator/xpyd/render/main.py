"""`xpyd render`: print every child object of the DisaggregatedServings in a file, as the operator
would apply them (`xpyd.render.render`), after the checks the operator makes: the spec's
validation and, for LMCache ConfigMaps in the same file, that they fit P/D."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from xpyd.api.load import SpecError, load_servings
from xpyd.api.models import DisaggregatedServing
from xpyd.render import RenderOptions, render
from xpyd.render.lmcache import pd_config_problems


def add_parser(subparsers: Any) -> None:
    """Register `xpyd render` on the `xpyd` command's sub-parsers."""
    parser = subparsers.add_parser("render", help="print every child object of DisaggregatedServing files")
    parser.add_argument("-f", "--file", required=True, help="YAML file with DisaggregatedServing objects, or -")
    parser.add_argument("--vllm-version", help="render for this vLLM release (MAJOR.MINOR) instead of the "
                        "spec's engine.vllmVersion")
    parser.add_argument("--operator-image", help="image of the proxy (defaults to the operator's image)")
    parser.set_defaults(func=run)


def lmcache_problems(text: str, servings: list[DisaggregatedServing]) -> list[str]:
    """Checks the LMCache ConfigMaps that come in the same file as the servings that use them."""
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


def run(args: argparse.Namespace) -> int:
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    except OSError as error:
        sys.stderr.write(f"xpyd render: cannot read {args.file}: {error.strerror}\n")
        return 1
    try:
        servings = load_servings(text, source=args.file, vllm_version=args.vllm_version)
    except SpecError as error:
        sys.stderr.write(f"xpyd render: {error}\n")
        return 1
    problems = lmcache_problems(text, servings)
    if problems:
        sys.stderr.write("xpyd render: " + "\n  ".join([f"{args.file}: the LMCache ConfigMap does not fit P/D:",
                                                        *problems]) + "\n")
        return 1
    options = RenderOptions(operator_image=args.operator_image) if args.operator_image else RenderOptions()
    objects = [obj for s in servings for obj in render(s.metadata.name, s.metadata.namespace, s.spec, options)]
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False, width=1000))
    return 0
