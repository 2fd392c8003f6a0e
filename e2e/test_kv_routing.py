"""KVAware routing on the local control plane (issue 29's e2e), on the session's cluster and operator.

A pool of 6 prefill and 1 decode emulated H200 engines (`xpyd engine-sim`, run by the pod runtime,
4 times faster than real time) with one proxy, `routingPolicy: KVAware` and the Events index: the
operator renders the engines' `--kv-events-config` and the proxy's subscriptions. A slice of the
Mooncake trace (requests 3,400 to 3,599, 47 s of trace at x4: `xpyd bench --trace`, whose prompts
share text where `hash_ids` share blocks) goes through the proxy Service (`e2e.service`, as kube-proxy
routes it); the proxy asks a prefill engine's `/tokenize` for each text prompt's token ids.

1. KVAware: 0 failed requests; the engines' own hit rate (`vllm:prefix_cache_hits_total` over
   `vllm:prefix_cache_queries_total`, summed over the prefill engines) is recorded, beside the hit
   rate the proxy predicted.
2. Under load (another slice), the prefill pod the proxy's index holds most blocks of is deleted: 0
   failed requests. While it drains (and holds its KV for the lease, 10 s here) the proxy sends it
   nothing new and keeps its index, which is its cache still; once the pod is gone, so is its
   `xpyd_proxy_kv_index_blocks` series.
3. The same pool with `routingPolicy: LeastLoaded` (the engines roll without KV events, so their
   caches start empty again) replays the first slice: 0 failed requests, and KVAware's hit rate is at
   least twice this one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from e2e.cluster import ROOT, Cluster, eventually, pods_of, provide_prerequisites, wait_ready
from e2e.service import forwarded
from xpyd.api.load import load_servings
from xpyd.common.netguard import LOOPBACK_ONLY_ENV, require_loopback, require_loopback_url
from xpyd.kube import Kube
from xpyd.kube.pods import pod_ready

pytestmark = pytest.mark.e2e

NAME = "kv"
MODEL = "llama-8b"
TRACE = ROOT / "data" / "traces" / "mooncake_synthetic.jsonl"
#: Request 3,400 of the trace and the 199 after it: prompts of 16,500 tokens on average (at most
#: 66,758) whose prefixes repeat within the slice: one cache of the pool's size would hit 32% of their
#: tokens, 6 engines chosen at random 7.5% (at most 10.6% in 30 draws), so KVAware has room to hit
#: twice what LeastLoaded does however its ties fall.
SLICE = ("--start", "881.977", "--max-requests", "200", "--speedup", "4")
#: Requests 3,800 to 3,949, for the load while a prefill pod is deleted (the 150 after the first slice
#: have a prompt of 191,371 tokens, over the engines' 131,072).
NEXT_SLICE = ("--start", "975.398", "--max-requests", "150", "--speedup", "4")
TIME_SCALE = 4
PREFILL_ENGINES = 6
LEASE_SECONDS = 10


def manifest(policy: str) -> str:
    return yaml.safe_dump({
        "apiVersion": "xpyd.io/v1alpha1", "kind": "DisaggregatedServing", "metadata": {"name": NAME},
        "spec": {
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "servedModelName": MODEL},
            "engine": {"extraArgs": [f"--time-scale={TIME_SCALE}"]},
            # A prefill pod's drain holds the engine for the KV lease after its last answer: 10 s, not 30.
            "kvTransfer": {"connector": "NixlConnector", "extraConfig": {"kv_lease_duration": LEASE_SECONDS}},
            "prefill": {"replicas": PREFILL_ENGINES, "gpu": {"product": "NVIDIA-H200"}, "drainTimeoutSeconds": 20},
            "decode": {"replicas": 1, "gpu": {"product": "NVIDIA-H200"}},
            "proxy": {"replicas": 1, "routingPolicy": policy, "kvAware": {"index": "Events"}},
        },
    })


def bench(url: str, *args: str, report: Path) -> dict[str, Any]:
    """`xpyd bench` against `url` (loopback only) until it ends; its summary."""
    result = subprocess.run(
        [sys.executable, "-m", "xpyd.cli", "bench", "--url", url, "--model", MODEL, "--trace", str(TRACE), *args,
         "--max-concurrency", "512", "--timeout", "120", "--report", str(report)],
        capture_output=True, text=True, timeout=300, env={**os.environ, LOOPBACK_ONLY_ENV: "1"}, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    summary: dict[str, Any] = json.loads(report.read_text())
    return summary


def scrape(pod: dict[str, Any]) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A pod's /metrics on its "http" port: sample name -> (labels, value)."""
    ports = {p.get("name"): p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    url = require_loopback_url(f"http://{require_loopback(pod['status']['podIP'])}:{ports['http']}/metrics")
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def total(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(value for found, value in metrics.get(name, []) if labels.items() <= found.items())


def engines_hit_rate(cluster: Cluster, namespace: str) -> tuple[float, float]:
    """The prefill engines' own prefix-cache hit rate: (hit tokens, queried tokens) summed over them."""
    hits = queries = 0.0
    for pod in pods_of(cluster, namespace, NAME, "prefill"):
        metrics = scrape(pod)
        hits += total(metrics, "vllm:prefix_cache_hits_total")
        queries += total(metrics, "vllm:prefix_cache_queries_total")
    return hits, queries


def proxy_pod(cluster: Cluster, namespace: str) -> dict[str, Any]:
    (pod,) = [p for p in pods_of(cluster, namespace, NAME, "proxy") if pod_ready(p)]
    return pod


def index_blocks(cluster: Cluster, namespace: str) -> dict[str, float]:
    """The proxy's `xpyd_proxy_kv_index_blocks` per prefill upstream."""
    metrics = scrape(proxy_pod(cluster, namespace))
    return {labels["upstream"]: value for labels, value in metrics.get("xpyd_proxy_kv_index_blocks", [])
            if labels.get("role") == "prefill"}


def settled(cluster: Cluster, namespace: str, prefill: int) -> bool:
    pods = cluster.get("pods", "-n", namespace, "-l", f"xpyd.io/serving={NAME},xpyd.io/role=prefill")["items"]
    return len(pods) == prefill and all(pod_ready(p) and not p["metadata"].get("deletionTimestamp") for p in pods)


def test_kv_aware_routing_hits_twice_least_loaded_and_survives_a_deleted_prefill(
        operator: Cluster, namespace: str, tmp_path: Path) -> None:
    began = time.monotonic()
    (spec,) = load_servings(manifest("KVAware"))
    provide_prerequisites(operator, namespace, spec)
    operator.apply(manifest("KVAware"), namespace)
    wait_ready(operator, namespace, NAME, timeout=120)
    eventually(lambda: len([p for p in pods_of(operator, namespace, NAME, "proxy") if pod_ready(p)]) == 1,
               what="the proxy ready")
    kube = Kube.from_kubeconfig(Path(operator.state.kubeconfig))
    service = f"{NAME}-proxy"

    # 1. KVAware.
    with forwarded(kube, namespace, service) as url:
        kv_aware = bench(url, *SLICE, report=tmp_path / "kv-aware.json")
    assert kv_aware["requests"] == 200 and kv_aware["failed"] == 0, kv_aware["errors"]
    hits, queries = engines_hit_rate(operator, namespace)
    kv_rate = hits / queries
    proxy = scrape(proxy_pod(operator, namespace))
    predicted = total(proxy, "xpyd_proxy_kv_predicted_hit_tokens_total", role="prefill") / \
        total(proxy, "xpyd_proxy_kv_prompt_tokens_total", role="prefill")
    tokenize_failures = total(proxy, "xpyd_proxy_kv_tokenize_failures_total")
    print(f"\nKVAware: {kv_aware['requests']} requests, {kv_aware['failed']} failed, the prefill engines hit "
          f"{kv_rate:.1%} of {queries:,.0f} prompt tokens (the proxy predicted {predicted:.1%}; "
          f"{tokenize_failures:.0f} /tokenize failures); TTFT p50 {kv_aware['ttft_ms']['p50']:,.0f} ms")
    assert tokenize_failures == 0

    # 2. A prefill pod deleted under load: nothing lost, its index gone.
    blocks = index_blocks(operator, namespace)
    victim = max(pods_of(operator, namespace, NAME, "prefill"),
                 key=lambda p: blocks.get(f"http://{p['status']['podIP']}:8000", 0.0))
    victim_url = f"http://{victim['status']['podIP']}:8000"
    assert blocks.get(victim_url, 0.0) > 0, blocks
    with forwarded(kube, namespace, service) as url:
        load = subprocess.Popen(
            [sys.executable, "-m", "xpyd.cli", "bench", "--url", url, "--model", MODEL, "--trace", str(TRACE),
             *NEXT_SLICE, "--max-concurrency", "512", "--timeout", "120", "--report", str(tmp_path / "delete.json")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, LOOPBACK_ONLY_ENV: "1"})
        try:
            time.sleep(4)
            deleted = time.monotonic()
            operator.kubectl("delete", "pod", "-n", namespace, victim["metadata"]["name"], "--wait=false")
            # Terminating, the engine drains (and holds its KV for the lease) while the proxy sends it
            # nothing new; its index stays as long as the proxy lists it, until the pod is gone.
            eventually(lambda: operator.get("pod", "-n", namespace, victim["metadata"]["name"]) is None,
                       timeout=90, interval=0.5, what="the deleted prefill pod gone")
            pod_gone = time.monotonic() - deleted
            eventually(lambda: victim_url not in index_blocks(operator, namespace), timeout=30, interval=0.2,
                       what="the deleted engine's index gone from the proxy's metrics")
            index_gone = time.monotonic() - deleted
            eventually(lambda: settled(operator, namespace, PREFILL_ENGINES), timeout=90, interval=0.5,
                       what="the prefill pods back to full strength, every one ready")
            output, _ = load.communicate(timeout=240)
        finally:
            if load.poll() is None:
                load.kill()
    assert load.returncode == 0, output
    during = json.loads((tmp_path / "delete.json").read_text())
    print(f"deleting a prefill pod under load: {during['requests']} requests, {during['failed']} failed; its "
          f"{blocks[victim_url]:,.0f} indexed blocks gone from the proxy's metrics {index_gone:.1f} s after the delete "
          f"(the pod gone after {pod_gone:.1f} s)")
    assert during["requests"] == 150 and during["failed"] == 0, during["errors"]

    # 3. LeastLoaded on the same pool: the engines roll (no KV events), so their caches start empty.
    operator.kubectl("patch", "xpyd", NAME, "-n", namespace, "--type=merge",
                     "-p", json.dumps({"spec": {"proxy": {"routingPolicy": "LeastLoaded"}}}))

    def rolled() -> bool:
        pods = [p for role in ("prefill", "decode", "proxy") for p in operator.get(
            "pods", "-n", namespace, "-l", f"xpyd.io/serving={NAME},xpyd.io/role={role}")["items"]]
        args = [a for p in pods if p["metadata"]["labels"]["xpyd.io/role"] != "proxy"
                for a in p["spec"]["containers"][0].get("args", [])]
        proxy_args = [a for p in pods if p["metadata"]["labels"]["xpyd.io/role"] == "proxy"
                      for a in p["spec"]["containers"][0].get("args", [])]
        serving = all(pod_ready(p) and not p["metadata"].get("deletionTimestamp") for p in pods)
        return len(pods) == PREFILL_ENGINES + 2 and serving and "--routing-policy=LeastLoaded" in proxy_args \
            and not any(a.startswith("--kv-events-config") for a in args)

    eventually(rolled, timeout=150, interval=1.0, what="the engines and the proxy rolled to LeastLoaded")
    with forwarded(kube, namespace, service) as url:
        least_loaded = bench(url, *SLICE, report=tmp_path / "least-loaded.json")
    assert least_loaded["requests"] == 200 and least_loaded["failed"] == 0, least_loaded["errors"]
    hits, queries = engines_hit_rate(operator, namespace)
    ll_rate = hits / queries
    print(f"LeastLoaded: {least_loaded['requests']} requests, {least_loaded['failed']} failed, the prefill engines "
          f"hit {ll_rate:.1%} of {queries:,.0f} prompt tokens; TTFT p50 {least_loaded['ttft_ms']['p50']:,.0f} ms")
    print(f"KVAware's hit rate is {kv_rate / max(ll_rate, 1e-9):.1f} times LeastLoaded's; the scenario took "
          f"{time.monotonic() - began:.0f} s")
    assert kv_rate >= 2 * ll_rate, (kv_rate, ll_rate)
