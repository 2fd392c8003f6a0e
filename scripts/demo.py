"""The README's first command until `xpyd demo` lands: validate every sample DisaggregatedServing,
render its children and summarise what a cluster would run (no cluster needed).

Writes the rendered manifests to build/demo/<sample>.yaml.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from xpyd.api.load import SpecError, load_servings
from xpyd.render import render
from xpyd.render.engine import transport

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    out_dir = ROOT / "build" / "demo"
    out_dir.mkdir(parents=True, exist_ok=True)
    header = f"{'sample':<24} {'serving':<20} {'connector':<20} {'vLLM':<5} {'prefill':<9} {'decode':<9} " \
             f"{'KV':<5} objects"
    print(header)
    print("-" * len(header))
    for sample in sorted((ROOT / "manifests" / "samples").glob("*.yaml")):
        try:
            servings = load_servings(sample.read_text(), str(sample.relative_to(ROOT)))
        except SpecError as error:
            print(f"invalid sample: {error}", file=sys.stderr)
            return 1
        documents = []
        for s in servings:
            objects = render(s.metadata.name, s.metadata.namespace, s.spec)
            documents += objects
            spec = s.spec
            print(f"{sample.stem:<24} {s.metadata.name:<20} {spec.kv_transfer.connector.value:<20} "
                  f"{spec.engine.vllm_version:<5} {spec.prefill.replicas}x{spec.prefill.gpus}GPU{'':<3} "
                  f"{spec.decode.replicas}x{spec.decode.gpus}GPU{'':<3} {transport(spec):<5} {len(objects)}")
        (out_dir / sample.name).write_text(yaml.safe_dump_all(documents, sort_keys=False, width=1000))
    print(f"\nRendered manifests: {out_dir.relative_to(ROOT)}/ (apply them with the CRD in crds/ and the operator).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
