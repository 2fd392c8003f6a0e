"""KVAware routing's render (`xpyd.render.kvaware`): the engines' --kv-events-config and its ports per
data-parallel rank with the Events index, the proxy's flags for both indexes, and the NONE_HASH seed,
which is only ever the user's PYTHONHASHSEED: the render sets none."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.servings import serving
from xpyd import vllm
from xpyd.api.load import parse_serving
from xpyd.api.models import DisaggregatedServingSpec
from xpyd.common.args import last_flag_value
from xpyd.render import engine, kvaware
from xpyd.render.proxy import proxy_args

pytestmark = pytest.mark.unit


def spec_of(index: str | None = "Events", **extra: Any) -> DisaggregatedServingSpec:
    proxy: dict[str, Any] = {"routingPolicy": "KVAware", "kvAware": {"index": index}} if index else {}
    return parse_serving(serving({"proxy": proxy, **extra} if proxy else extra)).spec


def env_of(spec: DisaggregatedServingSpec, role: str) -> dict[str, Any]:
    return {var["name"]: var.get("value") for var in engine.env(spec, role)}  # type: ignore[arg-type]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_events_turn_on_both_roles_publishers(role: str) -> None:
    args = engine.args(spec_of(), role, "proxy")  # type: ignore[arg-type]
    (flag,) = [a for a in args if a.startswith("--kv-events-config=")]
    assert json.loads(flag.split("=", 1)[1]) == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:7557",
        "replay_endpoint": "tcp://*:7657", "topic": "kv-events"}
    assert args.index(flag) < next(i for i, a in enumerate(args) if a.startswith("--kv-transfer-config="))


@pytest.mark.parametrize("spec", [spec_of("Routed"), spec_of(None)], ids=["routed", "least-loaded"])
def test_without_events_the_engines_are_untouched(spec: DisaggregatedServingSpec) -> None:
    for role in ("prefill", "decode"):
        assert not any(a.startswith("--kv-events-config") for a in engine.args(spec, role, "proxy"))
        assert not any(p["name"].startswith("kv-") for p in engine.ports(spec, role))
        assert "PYTHONHASHSEED" not in env_of(spec, role)


def test_each_data_parallel_rank_has_its_ports_and_the_proxy_subscribes_to_each() -> None:
    spec = spec_of(prefill={"dataParallelSize": 3})
    ports = {p["name"]: p["containerPort"] for p in engine.ports(spec, "prefill")}
    assert {k: v for k, v in ports.items() if k.startswith("kv-")} == {
        "kv-events-0": 7557, "kv-events-1": 7558, "kv-events-2": 7559,
        "kv-replay-0": 7657, "kv-replay-1": 7658, "kv-replay-2": 7659}
    assert [p["name"] for p in engine.ports(spec, "decode") if p["name"].startswith("kv-")] == \
        ["kv-events-0", "kv-replay-0"]
    args = proxy_args("x", "ns", spec)
    assert last_flag_value(args, "--kv-events-prefill-ranks") == "3"
    assert last_flag_value(args, "--kv-events-decode-ranks") is None


def test_the_proxy_is_told_the_policy_weights_and_hashing() -> None:
    spec = parse_serving(serving({"proxy": {"routingPolicy": "KVAware", "kvAware": {
        "kvWeight": 2.5, "decodeCredit": 0.5, "indexBlocks": 4096}}})).spec
    args = proxy_args("x", "ns", spec)
    assert {flag: last_flag_value(args, flag) for flag in (
        "--routing-policy", "--kv-index", "--kv-weight", "--kv-decode-credit", "--kv-index-blocks",
        "--kv-block-size", "--kv-hash-algo", "--kv-hash-seed", "--kv-events-port", "--kv-events-replay-port",
        "--kv-events-topic", "--kv-ttl")} == {
        "--routing-policy": "KVAware", "--kv-index": "Events", "--kv-weight": "2.5", "--kv-decode-credit": "0.5",
        "--kv-index-blocks": "4096", "--kv-block-size": "16", "--kv-hash-algo": "sha256", "--kv-hash-seed": None,
        "--kv-events-port": "7557", "--kv-events-replay-port": "7657", "--kv-events-topic": "kv-events",
        "--kv-ttl": None}


@pytest.mark.parametrize("extra", [
    {},
    {"engine": {"vllmVersion": "0.24", "extraArgs": ["--prefix-caching-hash-algo=xxhash"],
                "env": [{"name": "PYTHONHASHSEED", "value": "5"}]}},
    {"prefill": {"extraArgs": ["--prefix-caching-hash-algo", "xxhash_cbor", "--block-size", "32"]}},
], ids=["default", "xxhash seeded", "xxhash_cbor"])
def test_routed_tells_the_proxy_its_ttl_and_block_size_but_not_the_engines_hashing(extra: dict[str, Any]) -> None:
    """Routed compares only the proxy's own hashes (sha256): the engines' algorithm and seed are not
    rendered, so an xxhash pool never gives the proxy an algorithm it cannot run."""
    spec = parse_serving(serving({"proxy": {"routingPolicy": "KVAware", "kvAware": {
        "index": "Routed", "ttlSeconds": 90}}, **extra})).spec
    args = proxy_args("x", "ns", spec)
    assert last_flag_value(args, "--kv-ttl") == "90"
    assert last_flag_value(args, "--kv-block-size") == str(kvaware.block_size(spec))
    assert not any(a.startswith(("--kv-events", "--kv-hash-algo", "--kv-hash-seed")) for a in args)


def test_other_policies_get_no_kv_flags() -> None:
    assert not any(a.startswith("--kv-") for a in proxy_args("x", "ns", spec_of(None)))


@pytest.mark.parametrize(("extra", "size"), [
    ({}, 16),
    ({"engine": {"extraArgs": ["--block-size=32"]}}, 32),
    ({"engine": {"extraArgs": ["--block-size", "32"]}, "prefill": {"extraArgs": ["--block-size=64"]}}, 64),
    ({"engine": {"device": "cpu"}, "prefill": {"resources": {"cpu": "4"}},
      "decode": {"resources": {"cpu": "4"}}}, 128),
    ({"engine": {"extraArgs": ["--block-size=big"]}}, 16),   # vLLM refuses it at start-up
])
def test_the_block_size_is_the_engines(extra: dict[str, Any], size: int) -> None:
    spec = spec_of(**extra)
    assert kvaware.block_size(spec) == size
    assert last_flag_value(proxy_args("x", "ns", spec), "--kv-block-size") == str(size)


@pytest.mark.parametrize(("version", "env", "seed"), [
    ("0.33", None, None),                      # vLLM's fixed seed "vllm-none-hash"
    ("0.32", None, None),
    ("0.33", "42", "42"),                      # the user's wins on every release
    ("0.24", "random", "random"),              # vLLM seeds with the string; Python stays randomised
    ("0.13", "7", "7"),
])
def test_the_proxy_gets_the_users_seed_and_the_render_sets_none(version: str, env: str | None,
                                                                seed: str | None) -> None:
    user = [{"name": "PYTHONHASHSEED", "value": env}] if env is not None else []
    spec = spec_of(engine={"vllmVersion": version, "env": user})
    assert kvaware.hash_seed(spec) == seed
    assert last_flag_value(proxy_args("x", "ns", spec), "--kv-hash-seed") == seed
    for role in ("prefill", "decode"):
        assert [v for v in engine.env(spec, role) if v["name"] == "PYTHONHASHSEED"] == user


@pytest.mark.parametrize("version", ["0.13", "0.24", "0.32", "0.33"])
@pytest.mark.parametrize("index", ["Events", "Routed"])
def test_no_pool_gets_a_rendered_pythonhashseed(version: str, index: str) -> None:
    """A seed the render chose would be the same public value in every pool, and an integer one turns
    off Python's hash randomisation in the engines' API server: without the user's, there is none."""
    env = [{"name": "PYTHONHASHSEED", "value": "random"}] if index == "Events" and \
        vllm.parse_version(version) < vllm.FIXED_NONE_HASH_ADDED else []
    spec = spec_of(index, engine={"vllmVersion": version, "env": env})
    for role in ("prefill", "decode"):
        assert [v.get("value") for v in engine.env(spec, role)
                if v["name"] == "PYTHONHASHSEED"] == [e["value"] for e in env]


@pytest.mark.parametrize(("args", "algo"), [
    ([], "sha256"),
    (["--prefix-caching-hash-algo", "sha256_cbor"], "sha256_cbor"),
    (["--prefix-caching-hash-algo=sha256_cbor", "--prefix-caching-hash-algo=sha256"], "sha256"),
])
def test_events_tell_the_proxy_the_engines_hash_algorithm(args: list[str], algo: str) -> None:
    spec = spec_of(engine={"extraArgs": args})
    assert last_flag_value(proxy_args("x", "ns", spec), "--kv-hash-algo") == algo
