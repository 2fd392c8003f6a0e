"""The API's KVAware routing (`spec.proxy.routingPolicy: KVAware`, `spec.proxy.kvAware`): the
combinations that cannot work are refused by the models and by the CRD's CEL rules alike, each with a
message naming the field; the ones that can pass both."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests import celcheck
from tests.servings import serving
from xpyd import vllm
from xpyd.api.load import parse_serving
from xpyd.api.models import KV_EVENTS_BEFORE_REGEX, KV_EVENTS_CHECKED_FROM, KVIndex, RoutingPolicy

pytestmark = pytest.mark.unit

ROOT_SCHEMA = celcheck.ROOT_SCHEMA
model_errors = celcheck.model_errors
LMCACHE = {"connector": "LMCacheConnectorV1", "lmcache": {"configMapRef": {"name": "cfg"}}}
SEED = {"name": "PYTHONHASHSEED", "value": "random"}
FROM_SECRET = {"name": "PYTHONHASHSEED", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
XXHASH = "proxy.kvAware.index Events needs the engines' --prefix-caching-hash-algo sha256"
SEED_IN_ENGINE_ENV = "set it, if at all, as a literal value in engine.env"
SEED_NEEDED = "proxy.kvAware.index Events on engine.vllmVersion < 0.32 needs PYTHONHASHSEED in engine.env"


def kv_aware(index: str | None = None, **spec: Any) -> dict[str, Any]:
    proxy: dict[str, Any] = {"routingPolicy": "KVAware"}
    if index is not None:
        proxy["kvAware"] = {"index": index}
    return serving({"proxy": proxy, **spec})


VALID = {
    "events by default": kv_aware(),
    "routed": kv_aware("Routed"),
    "weights": serving({"proxy": {"routingPolicy": "KVAware", "kvAware": {
        "index": "Routed", "kvWeight": 2.5, "decodeCredit": 0, "ttlSeconds": 60, "indexBlocks": 4096}}}),
    "events 0.13 seeded": kv_aware("Events", engine={"vllmVersion": "0.13", "env": [SEED]}),
    "events seeded on 0.33": kv_aware(engine={"env": [{"name": "PYTHONHASHSEED", "value": "2718281828"}]}),
    "events sha256 given twice": kv_aware(engine={"extraArgs": ["--prefix-caching-hash-algo", "sha256"]},
                                          prefill={"extraArgs": ["--prefix-caching-hash-algo=sha256_cbor"]}),
    "routed xxhash_cbor unseeded on 0.24": kv_aware("Routed", engine={"vllmVersion": "0.24"}, decode={
        "extraArgs": ["--prefix-caching-hash-algo", "xxhash_cbor"]}),
    "routed seed per role": kv_aware("Routed", prefill={"env": [{"name": "PYTHONHASHSEED", "value": "1"}]}),
    "events with data parallel": kv_aware("Events", prefill={"dataParallelSize": 2}),
    "routed on 0.12": kv_aware("Routed", engine={"vllmVersion": "0.12"}),
    "routed multi-node": kv_aware("Routed", prefill={"nodesPerReplica": 2, "tensorParallelSize": 16}),
    "lmcache without kvaware": serving({"kvTransfer": LMCACHE}),
    "kvAware settings ignored by another policy": serving({"proxy": {"kvAware": {"index": "Routed"}}}),
    "decode without a prefix cache": kv_aware(decode={"extraArgs": ["--no-enable-prefix-caching"]}),
}

INVALID = [
    ("lmcache", kv_aware(kvTransfer=LMCACHE), "proxy.routingPolicy KVAware routes on vLLM's prefix cache"),
    ("lmcache routed", kv_aware("Routed", kvTransfer=LMCACHE), "LMCacheConnectorV1 pools run without"),
    ("prefix cache off", kv_aware(engine={"extraArgs": ["--no-enable-prefix-caching"]}),
     "--no-enable-prefix-caching in engine.extraArgs or prefill.extraArgs"),
    ("prefill prefix cache off", kv_aware("Routed", prefill={"extraArgs": ["--no-enable-prefix-caching"]}),
     "turns off"),
    ("events before 0.13", kv_aware("Events", engine={"vllmVersion": "0.12"}),
     "proxy.kvAware.index Events needs engine.vllmVersion >= 0.13"),
    ("events multi-node", kv_aware("Events", decode={"nodesPerReplica": 2, "tensorParallelSize": 16}),
     "proxy.kvAware.index Events needs nodesPerReplica 1 on both roles"),
    ("events with the user's kv-events-config", kv_aware(
        prefill={"extraArgs": ['--kv-events-config={"enable_kv_cache_events": true}']}),
     "proxy.kvAware.index Events renders the engines' --kv-events-config"),
    ("events with the user's kv-events-config, two args", kv_aware(
        engine={"extraArgs": ["--kv-events-config", "{}"]}), "remove it from engine.extraArgs"),
    ("events xxhash", kv_aware(engine={"extraArgs": ["--prefix-caching-hash-algo=xxhash"]}), XXHASH),
    ("events xxhash_cbor", kv_aware(engine={"extraArgs": ["--prefix-caching-hash-algo=xxhash_cbor"]}), XXHASH),
    ("events xxhash on prefill, two args", kv_aware(prefill={"extraArgs": ["--prefix-caching-hash-algo", "xxhash"]}),
     XXHASH),
    ("events xxhash on decode, seeded", kv_aware(engine={"env": [SEED]}, decode={
        "extraArgs": ["--prefix-caching-hash-algo", "xxhash_cbor"]}), "or use index Routed"),
    ("events xxhash overridden later", kv_aware(engine={"extraArgs": [
        "--prefix-caching-hash-algo=xxhash", "--prefix-caching-hash-algo=sha256"]}), "remove xxhash from"),
    ("events 0.13 unseeded", kv_aware("Events", engine={"vllmVersion": "0.13"}), SEED_NEEDED),
    ("events 0.31.2 unseeded", kv_aware(engine={"vllmVersion": "0.31.2"}), "use engine.vllmVersion >= 0.32"),
    ("events 0.24 seeded per role", kv_aware(engine={"vllmVersion": "0.24"}, prefill={"env": [SEED]},
                                             decode={"env": [SEED]}), SEED_IN_ENGINE_ENV),
    ("events seed on prefill", kv_aware(prefill={"env": [SEED]}), SEED_IN_ENGINE_ENV),
    ("events seed on decode", kv_aware(engine={"env": [SEED]}, decode={"env": [SEED]}), SEED_IN_ENGINE_ENV),
    ("events seed from a secret", kv_aware(engine={"env": [FROM_SECRET]}), SEED_IN_ENGINE_ENV),
    ("events seed without a value", kv_aware(engine={"env": [{"name": "PYTHONHASHSEED"}]}), SEED_IN_ENGINE_ENV),
]

SCHEMA_INVALID = [
    ("negative weight", serving({"proxy": {"kvAware": {"kvWeight": -1}}}), "spec.proxy.kvAware.kvWeight"),
    ("unknown index", serving({"proxy": {"kvAware": {"index": "Guess"}}}), "spec.proxy.kvAware.index"),
    ("tiny index", serving({"proxy": {"kvAware": {"indexBlocks": 10}}}), "spec.proxy.kvAware.indexBlocks"),
    ("zero ttl", serving({"proxy": {"kvAware": {"ttlSeconds": 0}}}), "spec.proxy.kvAware.ttlSeconds"),
    ("unknown field", serving({"proxy": {"kvAware": {"weight": 1}}}), "spec.proxy.kvAware.weight"),
]


@pytest.mark.parametrize("obj", VALID.values(), ids=VALID.keys())
def test_workable_combinations_pass_models_and_cel(obj: dict[str, Any]) -> None:
    celcheck.judged(obj)


@pytest.mark.parametrize(("obj", "message"), [(o, m) for _, o, m in INVALID], ids=[c for c, _, _ in INVALID])
def test_unworkable_combinations_are_refused_alike_naming_the_field(obj: dict[str, Any], message: str) -> None:
    cel_problems = celcheck.judged(obj, message)
    assert all("proxy." in line for line in cel_problems if message in line)


@pytest.mark.parametrize(("obj", "field"), [(o, f) for _, o, f in SCHEMA_INVALID],
                         ids=[c for c, _, _ in SCHEMA_INVALID])
def test_schema_violations_name_the_field(obj: dict[str, Any], field: str) -> None:
    problems = model_errors(obj)
    assert any(field in line for line in problems), problems


def test_defaults() -> None:
    spec = parse_serving(kv_aware()).spec
    assert spec.proxy.routing_policy == RoutingPolicy.KV_AWARE
    settings = spec.proxy.kv_aware
    assert (settings.index, settings.kv_weight, settings.decode_credit, settings.ttl_seconds) == \
        (KVIndex.EVENTS, 1.0, 1.0, 600)
    assert settings.index_blocks == 131072


@pytest.mark.parametrize("minor", range(13, 40))
@pytest.mark.parametrize("seeded", [False, True])
def test_events_needs_the_users_seed_exactly_where_vllm_seeds_at_random(minor: int, seeded: bool) -> None:
    obj = kv_aware(engine={"vllmVersion": f"0.{minor}", **({"env": [SEED]} if seeded else {})})
    refused = not seeded and (0, minor) < vllm.FIXED_NONE_HASH_ADDED
    for problems in (model_errors(obj), celcheck.server_view(ROOT_SCHEMA, obj)):
        assert any(SEED_NEEDED in line for line in problems) == refused, problems
        assert len(problems) == int(refused), problems


def test_the_seed_version_regex_agrees_with_its_boundary() -> None:
    for minor in range(0, 40):
        for text in (f"0.{minor}", f"0.{minor}.7"):
            assert bool(re.match(vllm.BEFORE_0_32_REGEX, text)) == ((0, minor) < vllm.FIXED_NONE_HASH_ADDED)


def test_the_events_version_regex_agrees_with_its_boundary() -> None:
    for minor in range(0, 40):
        assert bool(re.match(KV_EVENTS_BEFORE_REGEX, f"0.{minor}")) == ((0, minor) < KV_EVENTS_CHECKED_FROM)
        assert bool(re.match(KV_EVENTS_BEFORE_REGEX, f"0.{minor}.3")) == ((0, minor) < KV_EVENTS_CHECKED_FROM)
    assert not re.match(KV_EVENTS_BEFORE_REGEX, "1.2")
