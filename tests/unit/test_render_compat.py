"""The KV compatibility hash (`xpyd.render.compat`): which changes move it and which do not, and
where it goes."""

from __future__ import annotations

from typing import Any

import pytest

from tests.servings import serving
from xpyd.api.load import parse_serving
from xpyd.api.naming import KV_COMPAT_LABEL, ROLES
from xpyd.render import render
from xpyd.render.compat import HASH_DIGITS, compat_hash

pytestmark = pytest.mark.unit


def hashes(spec: dict[str, Any]) -> tuple[str, str]:
    parsed = parse_serving(serving(spec)).spec
    labels = {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"].get(KV_COMPAT_LABEL)
              for o in render("llama", "ns", parsed) if o["kind"] == "Deployment"}
    assert labels["llama-prefill"] == labels["llama-decode"] == compat_hash(parsed)
    return labels["llama-prefill"], labels["llama-decode"]


BASE = hashes({})

# Changes of what both ends must agree on: both roles' hash moves, and stays equal between them.
MOVES = {
    "engine image": {"engine": {"image": "vllm/vllm-openai:v0.33.1"}},
    "vllm version": {"engine": {"vllmVersion": "0.32"}},
    "model": {"model": {"name": "meta-llama/Llama-3.1-70B-Instruct"}},
    "hub revision": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "source": {"hub": {"revision": "abc"}}}},
    "pvc path": {"model": {"name": "llama", "source": {"pvc": {"claimName": "models", "path": "/other"}}}},
    "kv cache dtype": {"engine": {"extraArgs": ["--kv-cache-dtype=fp8"]}},
    "block size, space form": {"engine": {"extraArgs": ["--block-size", "32"]}},
    "dtype": {"engine": {"extraArgs": ["--dtype=float16"]}},
    "quantization": {"engine": {"extraArgs": ["--quantization=fp8"]}},
    "hybrid kv cache manager": {"engine": {"extraArgs": ["--disable-hybrid-kv-cache-manager"]}},
    "kv cache layout": {"engine": {"env": [{"name": "VLLM_KV_CACHE_LAYOUT", "value": "HND"}]}},
    "connector": {"kvTransfer": {"connector": "NixlPushConnector"}},
    "nixl backends": {"kvTransfer": {"nixl": {"backends": ["Mooncake", "UCX"]}}},
    "buffer device": {"kvTransfer": {"bufferDevice": "cpu"}},
    "user extra config": {"kvTransfer": {"extraConfig": {"enforce_handshake_compat": False}}},
}

# Changes that differ legitimately between the roles, or do not touch the KV: no hash moves.
KEEPS = {
    "hetero tensor parallel": {"prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 4}},
    "data parallel": {"prefill": {"dataParallelSize": 2}},
    "replicas": {"prefill": {"replicas": 3}, "decode": {"replicas": 5}},
    "per-role unrelated flag": {"decode": {"extraArgs": ["--max-num-seqs=256"]}},
    "unrelated env": {"engine": {"env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]}},
    "served model name": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "servedModelName": "llama"}},
    "max model len": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192}},
    "rdma": {"kvTransfer": {"rdma": {"resourceName": "rdma/ib"}}},
    "ucx": {"kvTransfer": {"ucx": {"tls": "rc,cuda_copy"}}},
    "load failure policy": {"kvTransfer": {"loadFailurePolicy": "recompute"}},
    "kv lease": {"kvTransfer": {"extraConfig": {"kv_lease_duration": 120}}},
    "drain timeout": {"decode": {"drainTimeoutSeconds": 600}},
    "proxy": {"proxy": {"replicas": 3, "routingPolicy": "RoundRobin"}},
}

# A must-match setting on one role only: a new revision of the pool, both roles' hash moves (and
# both roll), so the pool is never split into halves that do not pair.
ONE_SIDED = {
    "kv cache dtype on decode": {"decode": {"extraArgs": ["--kv-cache-dtype=fp8"]}},
    "block size on prefill": {"prefill": {"extraArgs": ["--block-size=32"]}},
    "layout env on prefill": {"prefill": {"env": [{"name": "VLLM_KV_CACHE_LAYOUT", "value": "HND"}]}},
}


def test_the_roles_of_one_spec_share_a_short_hash() -> None:
    prefill, decode = BASE
    assert prefill == decode
    assert len(prefill) == HASH_DIGITS and int(prefill, 16) >= 0


@pytest.mark.parametrize("change", MOVES.values(), ids=MOVES.keys())
def test_what_both_ends_must_agree_on_moves_the_hash(change: dict[str, Any]) -> None:
    prefill, decode = hashes(change)
    assert prefill == decode
    assert prefill != BASE[0]


@pytest.mark.parametrize("change", KEEPS.values(), ids=KEEPS.keys())
def test_what_may_differ_keeps_the_hash(change: dict[str, Any]) -> None:
    assert hashes(change) == BASE


@pytest.mark.parametrize("change", ONE_SIDED.values(), ids=ONE_SIDED.keys())
def test_a_must_match_setting_on_one_role_is_a_new_revision_of_both(change: dict[str, Any]) -> None:
    prefill, decode = hashes(change)
    assert prefill == decode != BASE[0]
    assert hashes({"prefill": change.get("decode", {}), "decode": change.get("prefill", {})}) != (prefill, decode)


def test_the_hash_labels_the_pods_not_the_deployment_or_its_selector() -> None:
    s = parse_serving(serving()).spec
    deployments = {o["metadata"]["name"]: o for o in render("llama", "ns", s) if o["kind"] == "Deployment"}
    for role in ROLES:
        deployment = deployments[f"llama-{role}"]
        assert deployment["spec"]["template"]["metadata"]["labels"][KV_COMPAT_LABEL] == compat_hash(s)
        assert KV_COMPAT_LABEL not in deployment["metadata"]["labels"]
        assert KV_COMPAT_LABEL not in deployment["spec"]["selector"]["matchLabels"]
    assert KV_COMPAT_LABEL not in deployments["llama-proxy"]["spec"]["template"]["metadata"]["labels"]
