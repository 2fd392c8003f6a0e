"""The demo's DisaggregatedServing: an autoscaled pool of emulated H200 engines (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xpyd.api import models


@dataclass(frozen=True, slots=True)
class DemoPool:
    """What the demo deploys and the targets it is held to.

    The autoscaler decides every `interval_s` over `window_s` windows (Prometheus scrapes every 5 s
    on the local cluster), looks at the engines' gauges every `react_s` between decisions (less than
    `interval_s`, as the API requires) and expects new replicas to serve after `startup_s`: the emulated engines
    start at once, so the short values let the scaling show within a minute of load. The local
    cluster has 16 H200 GPUs: room for the largest pool (8 prefill, 4 decode, one GPU each).
    """

    name: str = "llama-8b"
    namespace: str = "default"
    served_model: str = "llama-8b"
    profile: str = "h200_llama31_8b_fp8_tp1"
    ttft_ms: int = 500
    tpot_ms: int = 15
    prefill_max_replicas: int = 8
    decode_max_replicas: int = 4
    interval_s: int = 5
    react_s: int = 2
    startup_s: int = 10
    window_s: int = 20


def serving_manifest(pool: DemoPool, prometheus_url: str) -> dict[str, Any]:
    """The DisaggregatedServing object of `pool`, autoscaling `Auto` from the Prometheus at `prometheus_url`."""
    return {
        "apiVersion": models.API_VERSION, "kind": models.KIND,
        "metadata": {"name": pool.name, "namespace": pool.namespace},
        "spec": {
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "servedModelName": pool.served_model},
            "prefill": {"gpu": {"product": "NVIDIA-H200"}},
            "decode": {"gpu": {"product": "NVIDIA-H200"}},
            "autoscaling": {
                "mode": "Auto", "prometheus": {"url": prometheus_url, "windowSeconds": pool.window_s},
                "slo": {"ttftMs": pool.ttft_ms, "tpotMs": pool.tpot_ms, "percentile": 90},
                "prefill": {"minReplicas": 1, "maxReplicas": pool.prefill_max_replicas},
                "decode": {"minReplicas": 1, "maxReplicas": pool.decode_max_replicas},
                "intervalSeconds": pool.interval_s, "reactSeconds": pool.react_s, "startupSeconds": pool.startup_s,
                "profile": {"name": pool.profile},
            },
        },
    }
