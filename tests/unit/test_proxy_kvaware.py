"""KVAware routing (`xpyd.kvcache.scoring`, `xpyd.proxy.kvrouting`): the one formula as tables, the
router's picks over indexed instances, the prompt forms it hashes, and its flags from the render."""

from __future__ import annotations

import argparse
import random
from typing import Any

import pytest

from tests.servings import serving
from xpyd.api.load import parse_serving
from xpyd.api.models import KVIndex, RoutingPolicy
from xpyd.kvcache import scoring
from xpyd.kvcache.hashing import request_block_hashes
from xpyd.proxy.breaker import Breaker
from xpyd.proxy.kvrouting import KVRequest, KVRouter, KVSettings, block_keys, event_key, first_prompt
from xpyd.proxy.main import _check, add_arguments, config_from_args
from xpyd.proxy.pool import Instance, Pool
from xpyd.render import proxy_args

pytestmark = pytest.mark.unit

BLOCK = 4


# -- the formula -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("computed", "prompt", "hit", "weight", "cost"), [
    (0, 100, 0, 1.0, 100.0),       # idle, nothing cached: the prompt's compute
    (0, 100, 96, 1.0, 4.0),        # idle, all but the last block cached
    (500, 100, 96, 1.0, 504.0),    # a backlog outweighs a hit
    (500, 100, 96, 0.0, 500.0),    # weight 0: least expected compute alone
    (10, 100, 40, 2.0, 130.0),
])
def test_prefill_cost(computed: float, prompt: int, hit: int, weight: float, cost: float) -> None:
    assert scoring.prefill_cost(computed, prompt, hit, weight) == cost


@pytest.mark.parametrize(("requests", "prompt", "hit", "credit", "cost"), [
    (3, 100, 0, 1.0, 3.0),
    (3, 100, 100, 1.0, 2.0),       # holding all of it is worth one request at most
    (3, 100, 50, 0.5, 2.75),
    (0, 0, 0, 1.0, 0.0),           # an empty prompt: load alone
])
def test_decode_cost(requests: float, prompt: int, hit: int, credit: float, cost: float) -> None:
    assert scoring.decode_cost(requests, prompt, hit, credit) == cost


@pytest.mark.parametrize(("prompt", "block", "limit"), [(0, 16, 0), (1, 16, 0), (16, 16, 0), (17, 16, 1),
                                                         (32, 16, 1), (33, 16, 2), (1000, 128, 7)])
def test_a_hit_stops_before_the_prompts_last_token(prompt: int, block: int, limit: int) -> None:
    assert scoring.hit_limit(prompt, block) == limit


def test_ties_are_broken_uniformly_and_a_strict_minimum_costs_no_draw() -> None:
    rng = random.Random(1)
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[scoring.least([2.0, 1.0, 1.0, 1.0][1:], rng)] += 1
    assert all(900 < count < 1100 for count in counts), counts
    state = rng.getstate()
    assert scoring.least([3.0, 1.0, 2.0], rng) == 1
    assert rng.getstate() == state
    with pytest.raises(ValueError):
        scoring.least([], rng)


# -- the router ----------------------------------------------------------------------------------------

def instance(url: str, role: str = "prefill", computed: int = 0, requests: int = 0) -> Instance:
    node = Instance(url=url, role=role, breaker=Breaker())  # type: ignore[arg-type]
    node.outstanding_computed, node.outstanding_requests = computed, requests
    return node


def router(index: KVIndex = KVIndex.EVENTS, **settings: Any) -> KVRouter:
    return KVRouter(KVSettings(index=index, block_size=BLOCK, **settings), random.Random(0))


def request_of(r: KVRouter, tokens: list[int]) -> KVRequest:
    keys = block_keys(r.hasher, tokens)
    return KVRequest(len(tokens), keys if keys.blocks else None)


def hold(r: KVRouter, url: str, tokens: list[int], role: str = "prefill") -> None:
    """The engine at `url` caches the full blocks of `tokens` (as its BlockStored events would say)."""
    for key in block_keys(r.hasher, tokens).ids:
        r.index(url, role).store(key, 0.0)  # type: ignore[arg-type]


PROMPT = list(range(1, 18))   # 17 tokens: 4 full blocks, of which 4 can hit (the last token is computed)


@pytest.mark.parametrize(("held", "loads", "weight", "chosen"), [
    ({"a": PROMPT}, {}, 1.0, "a"),                                   # where the prefix is
    ({"a": PROMPT[:8], "b": PROMPT}, {}, 1.0, "b"),                  # the longer prefix
    ({"a": PROMPT}, {"a": 100}, 1.0, "b"),                           # a backlog outweighs the hit
    ({"a": PROMPT}, {"a": 10}, 1.0, "a"),                            # 10 + 1 < 0 + 17
    ({"a": PROMPT}, {"a": 10}, 0.0, "b"),                            # weight 0: least compute outstanding
    ({"a": PROMPT[4:]}, {}, 1.0, None),                              # a later block without its parent: no hit
    ({"a": [9, 9, 9, 9, *PROMPT[4:]]}, {}, 1.0, None),               # the same blocks after another first one
])
def test_prefill_goes_where_the_prefix_is_weighed_against_load(held: dict[str, list[int]], loads: dict[str, int],
                                                              weight: float, chosen: str | None) -> None:
    r = router(kv_weight=weight)
    for url, tokens in held.items():
        hold(r, url, tokens)
    candidates = [instance("a", computed=loads.get("a", 0)), instance("b", computed=loads.get("b", 0))]
    picks = {r.choose("prefill", candidates, request_of(r, PROMPT), 0.0).url for _ in range(40)}
    assert picks == ({chosen} if chosen else {"a", "b"})    # no hit anywhere: a tie, broken at random


def test_the_chosen_prefill_is_charged_what_it_is_expected_to_compute() -> None:
    r = router()
    hold(r, "a", PROMPT)
    request = request_of(r, PROMPT)
    chosen = r.choose("prefill", [instance("a"), instance("b")], request, 0.0)
    assert (chosen.url, request.hits, request.computed("a"), request.computed("b")) == ("a", {"a": 16}, 1, 17)
    assert r.prompt_tokens.value("prefill") == 17 and r.predicted_hits.value("prefill") == 16


@pytest.mark.parametrize(("held", "loads", "chosen"), [
    ({"a": PROMPT}, {}, "a"),                                        # equal load: the credit decides
    ({"a": PROMPT}, {"a": 1}, "b"),                                  # a request more outweighs the credit
    ({}, {"a": 1}, "b"),
])
def test_decode_is_least_loaded_with_a_credit_for_what_it_holds(held: dict[str, list[int]], loads: dict[str, int],
                                                                chosen: str) -> None:
    r = router()
    for url, tokens in held.items():
        hold(r, url, tokens, "decode")
    candidates = [instance("a", "decode", requests=loads.get("a", 0)),
                  instance("b", "decode", requests=loads.get("b", 0))]
    assert {r.choose("decode", candidates, request_of(r, PROMPT), 0.0).url for _ in range(20)} == {chosen}


def test_routed_remembers_what_it_sent_until_the_ttl() -> None:
    r = router(KVIndex.ROUTED, ttl_s=60.0)
    nodes = [instance("a"), instance("b"), instance("c")]
    first = r.choose("prefill", nodes, request_of(r, PROMPT), 0.0)
    follow_up = PROMPT + list(range(100, 120))              # the next turn carries the conversation so far
    assert all(r.choose("prefill", nodes, request_of(r, follow_up), 30.0).url == first.url for _ in range(10))
    assert r.blocks(first.url) == 9
    assert r.hit_tokens(first, request_of(r, follow_up), 89.0) == 36
    assert r.hit_tokens(first, request_of(r, follow_up), 91.0) == 0    # 60 s after the last request with it


def test_a_request_without_token_ids_goes_by_load() -> None:
    r = router()
    hold(r, "a", PROMPT)
    nodes = [instance("a", computed=5), instance("b", computed=2)]
    assert r.choose("prefill", nodes, KVRequest(17), 0.0).url == "b"


def test_data_parallel_ranks_each_have_an_index_and_the_best_rank_counts() -> None:
    r = router(prefill_ranks=2)
    for key in block_keys(r.hasher, PROMPT).ids[:2]:
        r.index("a", "prefill", 1).store(key, 0.0)
    assert r.hit_tokens(instance("a"), request_of(r, PROMPT), 0.0) == 8
    r.keep_only({"b"})
    assert r.blocks("a") == 0 and "a" not in r.indexes


def test_indexes_are_capped() -> None:
    r = router(index_blocks=3)
    hold(r, "a", list(range(40)))
    assert r.blocks("a") == 3


def test_keys_are_vllms_hashes_as_its_events_carry_them() -> None:
    r = router(hash_seed="0")
    tokens = list(range(10))
    digests = request_block_hashes(tokens, BLOCK, seed="0")
    assert block_keys(r.hasher, tokens).ids == [int.from_bytes(d, "big") & (2**64 - 1) for d in digests]
    assert event_key(digests[0]) == event_key(int.from_bytes(digests[0], "big") & (2**64 - 1))
    salted = block_keys(r.hasher, tokens, "salt").ids
    assert salted[0] != block_keys(r.hasher, tokens).ids[0]


@pytest.mark.parametrize(("body", "chat", "ids", "ask"), [
    ({"model": "m", "prompt": [1, 2, 3]}, False, [1, 2, 3], None),
    ({"model": "m", "prompt": [[4, 5], [6]]}, False, [4, 5], None),
    ({"model": "m", "prompt": "hello"}, False, None, {"model": "m", "prompt": "hello", "add_special_tokens": True}),
    ({"model": "m", "prompt": ["a b", "c"], "add_special_tokens": False}, False, None,
     {"model": "m", "prompt": "a b", "add_special_tokens": False}),
    ({"model": "m", "prompt": ""}, False, None, None),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False,
      "temperature": 0.5}, True, None,
     {"model": "m", "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}),
])
def test_the_prompt_forms(body: dict[str, Any], chat: bool, ids: list[int] | None, ask: dict[str, Any] | None) -> None:
    assert first_prompt(body, chat) == (ids, ask)


# -- the pool and the legs' accounting -------------------------------------------------------------------

def test_a_pools_pick_takes_the_requests_chooser_and_computed_tokens_are_counted() -> None:
    pool = Pool("prefill", RoutingPolicy.KV_AWARE, random.Random(0))
    a, b = instance("a"), instance("b")
    assert pool.choose([a, b], lambda candidates: candidates[1]) is b
    a.acquire(100, 30)
    assert (a.outstanding_tokens, a.outstanding_computed) == (100, 30)
    a.release(100, 30)
    b.acquire(100)
    assert b.outstanding_computed == 100
    assert pool.choose([a, b]) is a                      # no request: least loaded


# -- flags ---------------------------------------------------------------------------------------------

def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("index", ["Events", "Routed"])
def test_the_rendered_flags_reach_the_proxy(index: str) -> None:
    spec = parse_serving(serving({"prefill": {"dataParallelSize": 2}, "engine": {
                                      "vllmVersion": "0.24", "env": [{"name": "PYTHONHASHSEED", "value": "0"}]},
                                  "proxy": {"routingPolicy": "KVAware", "kvAware": {
                                      "index": index, "kvWeight": 0.5, "ttlSeconds": 30, "indexBlocks": 5000}}})).spec
    args = parse(proxy_args("llama", "ns", spec))
    assert _check(args) is None
    kv = config_from_args(args).kv
    assert (kv.index, kv.kv_weight, kv.index_blocks, kv.block_size, kv.hash_algo) == \
        (KVIndex(index), 0.5, 5000, 16, "sha256")
    if index == "Events":
        assert (kv.hash_seed, kv.prefill_ranks, kv.decode_ranks, kv.events_port, kv.events_topic) == \
            ("0", 2, 1, 7557, "kv-events")
    else:
        assert kv.ttl_s == 30.0


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_a_routed_xxhash_pool_starts_and_hashes_with_sha256(algo: str) -> None:
    """The crash loop of review: an xxhash pool's proxy was told `--kv-hash-algo=xxhash`, which needs a
    package the proxy image lacks. Routed compares only its own keys: it is not told the algorithm, and
    hashes with sha256 whatever it is told."""
    spec = parse_serving(serving({"engine": {"extraArgs": [f"--prefix-caching-hash-algo={algo}"]},
                                  "proxy": {"routingPolicy": "KVAware", "kvAware": {"index": "Routed"}}})).spec
    rendered = proxy_args("llama", "ns", spec)
    assert not any(a.startswith("--kv-hash") for a in rendered)
    for argv in (rendered, [*rendered, "--kv-hash-algo", algo, "--kv-hash-seed", "9"]):
        args = parse(argv)
        assert _check(args) is None
        hasher = config_from_args(args).kv.hasher()
        assert hasher.algo == "sha256"
        assert hasher.hashes(list(range(8))) == request_block_hashes(list(range(8)), 16)


def test_routed_keys_do_not_depend_on_the_algorithm_or_seed_it_is_told() -> None:
    told = router(KVIndex.ROUTED, hash_algo="sha256_cbor", hash_seed="1")
    assert block_keys(told.hasher, list(range(12))).ids == block_keys(router(KVIndex.ROUTED).hasher,
                                                                      list(range(12))).ids


@pytest.mark.parametrize(("argv", "problem"), [
    (["--kv-hash-algo", "sha256_cbor"], None),
    (["--kv-hash-algo", "sha256_cbor", "--kv-hash-seed", "random"], None),
    (["--kv-hash-algo", "xxhash"], "--kv-hash-algo xxhash with --kv-index Events needs --kv-hash-seed"),
    (["--kv-hash-algo", "xxhash_cbor", "--kv-hash-seed", "3"], "xxhash is required"),   # not installed
    (["--kv-index", "Routed", "--kv-hash-algo", "xxhash"], None),
    (["--kv-events-port", "65535", "--kv-events-prefill-ranks", "2"], "below 65536"),
])
def test_flags_that_cannot_work_are_refused(argv: list[str], problem: str | None) -> None:
    args = parse(["--routing-policy", "KVAware", "--prefill", "http://127.0.0.1:1", "--decode",
                  "http://127.0.0.1:2", *argv])
    message = _check(args)
    assert (message is None) if problem is None else (message is not None and problem in message)


@pytest.mark.parametrize("argv", [["--kv-weight", "-1"], ["--kv-block-size", "0"], ["--kv-index", "Guess"],
                                  ["--kv-events-port", "70000"], ["--kv-weight", "nan"]])
def test_bad_values_are_refused_by_the_parser(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse(argv)


# -- instances leaving -----------------------------------------------------------------------------

def test_an_engine_that_leaves_mid_leg_loses_its_index_when_the_leg_ends() -> None:
    """Discovery drops a prefill while a leg is still on it: the instance stays until the leg ends, and
    then its index goes with it (not at the next discovery change, which may never come)."""
    from xpyd.proxy.config import ProxyConfig
    from xpyd.proxy.pool import Endpoint
    from xpyd.proxy.server import Proxy

    proxy = Proxy(ProxyConfig(routing_policy=RoutingPolicy.KV_AWARE, kv=KVSettings(index=KVIndex.ROUTED)))
    router = proxy.kv.router if proxy.kv is not None else None
    assert router is not None
    urls = ("http://127.0.0.1:1", "http://127.0.0.1:2")
    proxy.set_endpoints("prefill", [Endpoint(url) for url in urls])
    router.index(urls[0], "prefill").store("block", 0.0)
    leaving = proxy.pools["prefill"].instances[urls[0]]
    leaving.acquire(100, 100)
    proxy.set_endpoints("prefill", [Endpoint(urls[1])])
    assert urls[0] in proxy.pools["prefill"].instances and router.blocks(urls[0]) == 1   # its leg is running
    leaving.release(100, 100)
    proxy.pools["prefill"].forget_if_done(leaving)
    assert urls[0] not in proxy.pools["prefill"].instances and urls[0] not in router.indexes
