"""The CPU sample (`manifests/samples/cpu.yaml`) as this machine runs it with real vLLM: the pool the
real-vLLM e2e test applies and the proxy benchmark starts engines from.

What it changes in the sample, and why (each is a field a user of a small CPU node would set):
- the tiny model `make tools` builds, served as `tiny-llama` from a claim, and a 1 GiB KV cache;
- `--enforce-eager --dtype=float32`: without compilation an engine starts in about 40 s rather than
  two minutes and more, and the first requests of each shape do not compile on two shared cores. In
  eager mode with bfloat16 (vLLM's default on CPUs with AMX) vLLM 0.32's decode engine dies with an
  illegal instruction in `cpu_attention_with_kv_cache` at its first NIXL hand-off; float32 takes
  another kernel;
- `kv_lease_duration` 120 s: prefill keeps a request's KV this long for decode to pull (vLLM's
  default is 30 s); a decode engine's first handshake and pull on busy cores took longer, and a
  pull of released blocks then hung instead of failing;
- a core of its own for each engine's OpenMP threads (`VLLM_CPU_OMP_THREADS_BIND` per role, as a node
  without the static CPU manager needs): NIXL's spinning progress thread starts there, so the two
  spin on different cores; vLLM's NIXL worker then moves both model threads to the last core
  whatever the binding (docs/cpu.md, "Cores");
- proxy health probes that may take 10 s: an engine's `/health` answers slowly while its cores
  spin, and a proxy that counts it unhealthy answers 503;
- drains of 20 s, within what the local runtime waits for a pod to stop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import yaml

NAME: Final = "tiny"
MODEL: Final = "tiny-llama"
CLAIM: Final = "tiny-llama"
SAMPLE: Final = Path(__file__).resolve().parents[3] / "manifests" / "samples" / "cpu.yaml"


def tiny_pool(sample: Path = SAMPLE) -> dict[str, Any]:
    """The DisaggregatedServing object (see the module docstring)."""
    obj: dict[str, Any] = yaml.safe_load(sample.read_text())
    obj["metadata"]["name"] = NAME
    spec = obj["spec"]
    spec["model"] = {"name": "xpyd/tiny-llama", "servedModelName": MODEL, "source": {"pvc": {"claimName": CLAIM}}}
    spec["engine"]["cpu"] = {"kvCacheSpaceGiB": 1}
    spec["engine"]["extraArgs"] = ["--enforce-eager", "--dtype=float32"]
    spec["kvTransfer"]["extraConfig"] = {"kv_lease_duration": 120}
    for core, role in enumerate(("prefill", "decode")):
        spec[role]["resources"] = {"cpu": "1", "memory": "6Gi"}
        spec[role]["drainTimeoutSeconds"] = 20
        spec[role]["env"] = [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": str(core)}]
    spec["proxy"]["extraArgs"] = ["--health-timeout=10", "--connect-timeout=10"]
    return obj
