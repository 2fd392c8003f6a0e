"""KVAware routing's engine side, checked against vLLM's own released code (issue 29).

For every release of `vllm_release.RELEASES`, the `--kv-events-config` the operator renders for a
KVAware pool with the Events index must validate whole with that release's `KVEventsConfig`
(`vllm/config/kv_events.py`, loaded in a subprocess without torch by `vllm_release.validate_configs`,
as KVTransferConfig is) and carry only its fields; the ports the pod declares per data-parallel rank must be
the ones the release's `ZmqEventPublisher.offset_endpoint_port` binds; the API must refuse the Events
index without the user's PYTHONHASHSEED exactly where the release seeds NONE_HASH at random without it,
and the render must never set one itself; the xxhash algorithms, which the API refuses with Events,
must be the ones the release seeds at random whatever the release; and the KV-cache group kinds the
proxy's subscriber follows (`kvevents.FULL_ATTENTION_KINDS`) must be those the release gives its
full-attention specs, written into each BlockStored, while BlockRemoved carries the group.
"""

from __future__ import annotations

import ast
import json
from functools import cache
from typing import Any

import pytest

from tests.conformance.vllm_release import RELEASES, release_root, validate_configs
from tests.servings import serving
from xpyd import vllm
from xpyd.api.load import SpecError, parse_serving
from xpyd.api.models import KV_EVENTS_PORT, KV_EVENTS_REPLAY_PORT, XXHASH_ALGOS
from xpyd.proxy.kvevents import FULL_ATTENTION_KINDS
from xpyd.render import engine, kvaware

pytestmark = pytest.mark.integration

KV_EVENTS = "vllm/config/kv_events.py"
PUBLISHER = "vllm/distributed/kv_events.py"
CACHE_UTILS = "vllm/v1/core/kv_cache_utils.py"
KV_CACHE_INTERFACE = "vllm/v1/kv_cache_interface.py"
KV_CACHE_MANAGER = "vllm/v1/core/kv_cache_manager.py"
BLOCK_POOL = "vllm/v1/core/block_pool.py"
#: What of a validated KVEventsConfig is compared with what the operator meant.
ATTRIBUTES = ("publisher", "enable_kv_cache_events", "endpoint", "replay_endpoint", "topic")

def minor(release: str) -> str:
    return ".".join(release.split(".")[:2])


def kv_aware_object(release: str, seed: str | None = "random", **extra: Any) -> dict[str, Any]:
    """A KVAware pool on `release` with the Events index and, unless None, the user's PYTHONHASHSEED."""
    env = [{"name": "PYTHONHASHSEED", "value": seed}] if seed is not None else []
    return serving({"engine": {"vllmVersion": minor(release), "env": env},
                    "proxy": {"routingPolicy": "KVAware", "kvAware": {"index": "Events"}}, **extra})


def kv_aware_spec(release: str, seed: str | None = "random", **extra: Any) -> Any:
    return parse_serving(kv_aware_object(release, seed, **extra)).spec


@cache
def release_check(release: str, text: str) -> tuple[frozenset[str], Any]:
    check = validate_configs(release, KV_EVENTS, "KVEventsConfig", [text], ATTRIBUTES)
    return check.fields, check.results[0]


@pytest.mark.parametrize("release", RELEASES)
def test_the_rendered_kv_events_config_is_accepted_whole(release: str) -> None:
    spec = kv_aware_spec(release)
    for role in ("prefill", "decode"):
        args = engine.args(spec, role, "proxy")
        (flag,) = [a for a in args if a.startswith("--kv-events-config=")]
        text = flag.split("=", 1)[1]
        fields, verdict = release_check(release, text)
        assert not isinstance(verdict, str), f"vLLM {release} refuses {text}:\n{verdict}"
        assert set(json.loads(text)) <= fields, f"{sorted(set(json.loads(text)) - fields)} unknown to {release}"
        assert verdict == {"publisher": "zmq", "enable_kv_cache_events": True,
                           "endpoint": f"tcp://*:{KV_EVENTS_PORT}", "replay_endpoint": f"tcp://*:{KV_EVENTS_REPLAY_PORT}",
                           "topic": "kv-events"}


def _offset_function(release: str) -> Any:
    """The release's `ZmqEventPublisher.offset_endpoint_port`, compiled from its source alone."""
    tree = ast.parse((release_root(release) / PUBLISHER).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "offset_endpoint_port":
            node.decorator_list = []
            module = ast.Module(body=[node], type_ignores=[])
            namespace: dict[str, Any] = {"Optional": Any}
            exec(compile(ast.fix_missing_locations(module), PUBLISHER, "exec"), namespace)
            return namespace["offset_endpoint_port"]
    raise AssertionError(f"vLLM {release} has no offset_endpoint_port in {PUBLISHER}")


@pytest.mark.parametrize("release", RELEASES)
def test_each_rank_listens_where_the_pod_declares_its_ports(release: str) -> None:
    offset = _offset_function(release)
    spec = kv_aware_spec(release, prefill={"dataParallelSize": 3})
    declared = {p["name"]: p["containerPort"] for p in engine.ports(spec, "prefill")}
    for rank in range(3):
        for name, base in (("kv-events", KV_EVENTS_PORT), ("kv-replay", KV_EVENTS_REPLAY_PORT)):
            bound = offset(f"tcp://*:{base}", rank)
            assert bound == f"tcp://*:{declared[f'{name}-{rank}']}", (release, rank, bound)


def _refusals(obj: dict[str, Any]) -> list[str]:
    try:
        parse_serving(obj)
    except SpecError as error:
        return str(error).splitlines()[1:]
    return []


@pytest.mark.parametrize("release", RELEASES)
def test_events_need_the_users_seed_exactly_where_the_release_seeds_none_hash_at_random(release: str) -> None:
    source = (release_root(release) / CACHE_UTILS).read_text()
    random_without_seed = "NONE_HASH = BlockHash(os.urandom(32))" in source or \
        "NONE_HASH = os.urandom(32)" in source
    assert random_without_seed == (vllm.parse_version(minor(release)) < vllm.FIXED_NONE_HASH_ADDED), release
    # The seed is PYTHONHASHSEED's string as it is, so any value the user picks (`random` too, which
    # keeps Python's own hash randomisation) seeds the proxy's hashes alike (`kvcache.hashing`).
    assert 'hash_seed = os.getenv("PYTHONHASHSEED")' in source, release
    assert "hash_fn(hash_seed)" in source or "_NONE_HASH_SEED = resolve_none_hash_seed(hash_fn)" in source, release
    refused = [line for line in _refusals(kv_aware_object(release, seed=None)) if "PYTHONHASHSEED" in line]
    assert bool(refused) == random_without_seed, (release, refused)
    for seed in ("random", "4021"):
        spec = kv_aware_spec(release, seed)
        assert kvaware.hash_seed(spec) == seed
        for role in ("prefill", "decode"):
            assert [v.get("value") for v in engine.env(spec, role) if v["name"] == "PYTHONHASHSEED"] == [seed]
    if not random_without_seed:
        spec = kv_aware_spec(release, seed=None)
        assert kvaware.hash_seed(spec) is None
        assert not any(v["name"] == "PYTHONHASHSEED" for role in ("prefill", "decode")
                       for v in engine.env(spec, role))


@pytest.mark.parametrize("release", RELEASES)
def test_the_refused_algorithms_are_the_ones_the_release_seeds_at_random(release: str) -> None:
    source = (release_root(release) / CACHE_UTILS).read_text()
    if vllm.parse_version(minor(release)) >= vllm.FIXED_NONE_HASH_ADDED:
        assert f"_NON_CRYPTO_HASH_FUNCTIONS = frozenset({{{', '.join(XXHASH_ALGOS)}}})" in source, release
    for algo in XXHASH_ALGOS:
        obj = kv_aware_object(release, engine={"vllmVersion": minor(release), "extraArgs": [
            f"--prefix-caching-hash-algo={algo}"], "env": [{"name": "PYTHONHASHSEED", "value": "random"}]})
        assert any("--prefix-caching-hash-algo" in line for line in _refusals(obj)), (release, algo)


def _spec_kinds(release: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """The release's `get_kv_cache_spec_kind` as (spec class -> kind value), its direct checks only, and
    every class's bases in `kv_cache_interface.py`."""
    tree = ast.parse((release_root(release) / KV_CACHE_INTERFACE).read_text())
    bases = {node.name: [ast.unparse(base) for base in node.bases] for node in ast.walk(tree)
             if isinstance(node, ast.ClassDef)}
    values = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "KVCacheSpecKind":
            values = {item.targets[0].id: item.value.value for item in node.body  # type: ignore[attr-defined]
                      if isinstance(item, ast.Assign) and isinstance(item.value, ast.Constant)}
    kinds = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "get_kv_cache_spec_kind":
            for item in node.body:
                if (isinstance(item, ast.If) and isinstance(item.test, ast.Call)
                        and ast.unparse(item.test.func) == "isinstance" and isinstance(item.body[-1], ast.Return)):
                    returned = ast.unparse(item.body[-1].value)   # type: ignore[arg-type]
                    if returned.startswith("KVCacheSpecKind."):
                        kinds[ast.unparse(item.test.args[1])] = values[returned.split(".", 1)[1]]
    return kinds, bases


@pytest.mark.parametrize("release", [r for r in RELEASES if vllm.parse_version(minor(r)) >= (0, 23)])
def test_the_groups_followed_are_the_releases_full_attention(release: str) -> None:
    kinds, bases = _spec_kinds(release)

    def full_attention(cls: str) -> bool:
        return cls == "FullAttentionSpec" or any(full_attention(base) for base in bases.get(cls, ()))

    assert kinds, f"vLLM {release}: no get_kv_cache_spec_kind in {KV_CACHE_INTERFACE}"
    assert {kind for cls, kind in kinds.items() if full_attention(cls)} == set(FULL_ATTENTION_KINDS), (release, kinds)
    assert "event.kv_cache_spec_kind = kind" in (release_root(release) / KV_CACHE_MANAGER).read_text(), release
    pool = (release_root(release) / BLOCK_POOL).read_text()
    removed = pool[pool.index("BlockRemoved("):]
    assert "group_idx=" in removed[:removed.index(")\n")], release
