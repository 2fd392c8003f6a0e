"""KVAware routing (`xpyd.kvcache.scoring`, `xpyd.proxy.kvaware`): the one formula as tables, the
router's picks over indexed instances, the prompt forms it hashes and those it does not, `/tokenize`
within one deadline (against a fake session), each role's block size, what the Events subscriber
takes of a batch (block sizes, a hybrid model's groups), the index's memory per block, and its flags
from the render."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import aiohttp
import pytest

from tests.servings import serving
from xpyd.api.load import parse_serving
from xpyd.api.models import KVIndex, RoutingPolicy
from xpyd.kvcache import events, scoring
from xpyd.kvcache.events import block_hash_key
from xpyd.kvcache.hashing import request_block_hashes
from xpyd.kvcache.pool import BlockKeys
from xpyd.proxy.breaker import Breaker
from xpyd.proxy.kvaware import KVAwareRequest, KVAwareRouter, KVAwareSettings, block_keys, first_prompt, untokenizable
from xpyd.proxy.main import _check, add_arguments, config_from_args
from xpyd.proxy.pool import Instance, Pool
from xpyd.render.proxy import proxy_args

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


def router(index: KVIndex = KVIndex.EVENTS, **settings: Any) -> KVAwareRouter:
    return KVAwareRouter(KVAwareSettings(index=index, block_size=BLOCK, **settings), random.Random(0))


def request_of(r: KVAwareRouter, tokens: list[int]) -> KVAwareRequest:
    keys = block_keys(r.hasher, tokens)
    return KVAwareRequest(len(tokens), keys if keys.blocks else None, block_size=r.hasher.block_size)


def hold(r: KVAwareRouter, url: str, tokens: list[int], role: str = "prefill") -> None:
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
    assert r.choose("prefill", nodes, KVAwareRequest(17), 0.0).url == "b"


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
    assert block_hash_key(digests[0]) == block_hash_key(int.from_bytes(digests[0], "big") & (2**64 - 1))
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
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "media_io_kwargs": {"video": {"num_frames": 8}},
      "mm_processor_kwargs": {"fps": 2}, "tools": []}, True, None,
     {"model": "m", "messages": [{"role": "user", "content": "hi"}], "media_io_kwargs": {"video": {"num_frames": 8}},
      "mm_processor_kwargs": {"fps": 2}, "tools": []}),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "media_io_kwargs": None, "documents": None},
     True, None, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),   # never documents
])
def test_the_prompt_forms(body: dict[str, Any], chat: bool, ids: list[int] | None, ask: dict[str, Any] | None) -> None:
    assert first_prompt(body, chat) == (ids, ask)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]


@pytest.mark.parametrize(("extra", "chat", "reason"), [
    ({}, True, None),
    ({"documents": [{"title": "t", "text": "x"}]}, True, "documents"),
    ({"reasoning_effort": "low"}, True, "reasoning_effort"),
    ({"response_format": {"type": "json_object"}}, True, "response_format"),
    ({"tools": TOOLS, "tool_choice": "none"}, True, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required"}, True, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}}, True, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, True, None),        # what tools without tool_choice mean
    ({"tools": TOOLS}, True, None),
    ({"tool_choice": "none"}, True, None),                        # without tools it renders nothing
    ({"documents": None, "reasoning_effort": None, "response_format": None}, True, None),
    ({"truncate_prompt_tokens": 100}, True, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 100, "prompt": [1, 2, 3]}, False, "truncate_prompt_tokens"),
    ({"documents": [{"text": "x"}], "prompt": "hi"}, False, None),   # a chat field on a completion: not read
])
def test_requests_whose_ids_tokenize_cannot_give(extra: dict[str, Any], chat: bool, reason: str | None) -> None:
    """Fields vLLM's chat template is fed (ChatCompletionRequest.build_chat_params) that no release's
    TokenizeChatRequest takes: /tokenize would render another prompt, so the request goes by load."""
    assert untokenizable({**CHAT, **extra}, chat) == reason


# -- /tokenize, against a fake session ---------------------------------------------------------------------

class Tokenizer:
    """How a fake engine answers /tokenize: after `delay` seconds, `status` with `tokens`, or `refused`."""

    def __init__(self, status: int = 200, delay: float = 0.0, refused: bool = False,
                 tokens: object = (1, 2, 3, 4, 5, 6, 7, 8, 9)) -> None:
        self.status, self.delay, self.refused, self.tokens = status, delay, refused, tokens
        self.asked = 0


class FakeResponse:
    def __init__(self, status: int, answer: object) -> None:
        self.status, self.answer = status, answer

    async def json(self, content_type: str | None = None) -> object:
        return self.answer


class FakeSession:
    """`session.post(url, ...)` as the router calls it, answered by each URL's `Tokenizer`."""

    def __init__(self, engines: dict[str, Tokenizer]) -> None:
        self.engines = engines

    @asynccontextmanager
    async def post(self, url: str, **_: object) -> AsyncIterator[FakeResponse]:
        engine = self.engines[url.removesuffix("/tokenize")]
        engine.asked += 1
        await asyncio.sleep(engine.delay)
        if engine.refused:
            raise aiohttp.ClientConnectionError("connection refused")
        tokens = list(engine.tokens) if isinstance(engine.tokens, tuple) else engine.tokens
        yield FakeResponse(engine.status, {"count": 9, "max_model_len": 100, "tokens": tokens})


async def tokenize(engines: dict[str, Tokenizer], timeout: float = 0.25, body: dict[str, Any] | None = None,
                   seed: int = 0) -> tuple[KVAwareRouter, KVAwareRequest, float]:
    r = KVAwareRouter(KVAwareSettings(block_size=BLOCK, tokenize_timeout_s=timeout), random.Random(seed))
    started = time.monotonic()
    request = await r.prepare(body or {"model": "m", "prompt": "some text"}, False, 3,
                              [instance(url) for url in engines], cast(aiohttp.ClientSession, FakeSession(engines)),
                              {})
    return r, request, time.monotonic() - started


async def test_token_ids_come_from_tokenize_and_are_hashed() -> None:
    r, request, _ = await tokenize({"a": Tokenizer()})
    assert request.prompt_tokens == 9 and request.keys is not None
    assert request.keys.ids == block_keys(r.hasher, list(range(1, 10))).ids
    assert r.tokenize_seconds.count("completions") == 1 and not r.tokenize_failures.value("timeout")


async def test_a_slow_tokenize_costs_one_short_deadline_and_no_second_attempt() -> None:
    """The review's 4 s: two engines each given the whole timeout. Now one deadline for the request, and
    after a timeout no other engine is asked: the request goes by load alone, counted."""
    engines = {"a": Tokenizer(delay=5.0), "b": Tokenizer(delay=5.0)}
    r, request, took = await tokenize(engines, timeout=0.05)
    assert (request.prompt_tokens, request.keys) == (3, None)          # the estimate, by load alone
    assert 0.04 < took < 0.5
    assert sum(e.asked for e in engines.values()) == 1
    assert r.tokenize_failures.value("timeout") == 1


@pytest.mark.parametrize("first", [Tokenizer(refused=True), Tokenizer(status=503), Tokenizer(tokens=["x"])],
                         ids=["refused", "5xx", "malformed"])
async def test_a_fast_failure_asks_one_other_engine(first: Tokenizer) -> None:
    for seed in range(6):    # whichever engine the draw asks first
        engines = {"a": first, "b": Tokenizer()}
        first.asked = 0
        r, request, _ = await tokenize(engines, seed=seed)
        assert request.prompt_tokens == 9 and request.keys is not None
        assert engines["b"].asked == 1 and first.asked <= 1
        assert sum(r.tokenize_failures.value(reason) for reason in ("error", "http_5xx", "malformed")) == 0


async def test_the_deadline_covers_the_second_engine_too() -> None:
    """A fast failure, then a slow engine: the second gets only what is left of the one deadline."""
    for seed in range(4):
        engines = {"a": Tokenizer(status=500, delay=0.03), "b": Tokenizer(delay=0.3)}
        r, request, took = await tokenize(engines, timeout=0.05, seed=seed)
        assert request.keys is None and 0.04 < took < 0.2
        assert r.tokenize_failures.value("timeout") == 1 and engines["b"].asked == 1


@pytest.mark.parametrize(("engines", "reason", "asked"), [
    ({"a": Tokenizer(refused=True), "b": Tokenizer(refused=True)}, "error", 2),
    ({"a": Tokenizer(status=502), "b": Tokenizer(status=500)}, "http_5xx", 2),
    ({"a": Tokenizer(status=400), "b": Tokenizer(status=400)}, "http_4xx", 1),   # the request's own fault
    ({"a": Tokenizer(status=404), "b": Tokenizer(status=404)}, "http_4xx", 1),
    ({"a": Tokenizer(tokens=None), "b": Tokenizer(tokens=[1, True])}, "malformed", 2),
])
async def test_failures_are_counted_by_reason(engines: dict[str, Tokenizer], reason: str, asked: int) -> None:
    r, request, _ = await tokenize(engines)
    assert request.keys is None and r.tokenize_failures.value(reason) == 1
    assert sum(e.asked for e in engines.values()) == asked


async def test_a_chat_tokenize_cannot_render_goes_by_load_without_asking() -> None:
    engines = {"a": Tokenizer()}
    r = KVAwareRouter(KVAwareSettings(block_size=BLOCK), random.Random(0))
    request = await r.prepare({**CHAT, "documents": [{"text": "x"}]}, True, 40, [instance("a")],
                              cast(aiohttp.ClientSession, FakeSession(engines)), {})
    assert (request.prompt_tokens, request.keys, engines["a"].asked) == (40, None, 0)
    assert r.tokenize_failures.value("documents") == 1


# -- each role's block size ------------------------------------------------------------------------------

def test_a_role_takes_the_block_size_its_engines_publish() -> None:
    """vLLM picks another block size than the render guessed (an MLA backend's 64, say): the role whose
    engines publish it hashes at it from then on, the other role keeps its own."""
    r = router()
    assert r.learn_block_size("decode", 2 * BLOCK) and r.block_size("decode") == 2 * BLOCK
    assert r.block_size("prefill") == BLOCK and r.block_size_changes.value("decode") == 1
    assert not r.learn_block_size("decode", 2 * BLOCK) and not r.learn_block_size("decode", 0)
    assert not r.learn_block_size("prefill", 1 << 40) and r.block_size("prefill") == BLOCK
    request = request_of(r, PROMPT)     # hashed by the prefill hasher only
    assert request.keys_at(2 * BLOCK) is None
    hold(r, "p", PROMPT)
    r.index("d", "decode").store(block_keys(r.hashers["decode"], PROMPT).ids[0], 0.0)
    assert r.hit_tokens(instance("p"), request, 0.0) == 16


async def test_a_request_is_hashed_at_each_roles_block_size() -> None:
    r = router()
    r.learn_block_size("decode", 2 * BLOCK)
    r.index("d", "decode").store(block_keys(r.hashers["decode"], PROMPT).ids[0], 0.0)
    prepared = await r.prepare({"model": "m", "prompt": PROMPT}, False, 1, [], cast(aiohttp.ClientSession, None), {})
    assert prepared.keys is not None and prepared.keys_at(BLOCK) is prepared.keys
    assert prepared.keys.ids == block_keys(r.hasher, PROMPT).ids
    assert r.hit_tokens(instance("d", "decode"), prepared, 0.0) == 2 * BLOCK
    decode = [instance("d", "decode"), instance("e", "decode")]
    assert {r.choose("decode", decode, prepared, 0.0).url for _ in range(10)} == {"d"}


def test_a_role_whose_engines_hold_blocks_keeps_its_size() -> None:
    """Engines of one role disagreeing: the size some engine's blocks are indexed at stays (no flapping);
    once none is indexed (they restarted, say), the next size seen is taken."""
    r = router()
    hold(r, "a", PROMPT)
    assert not r.learn_block_size("prefill", 64) and r.block_size("prefill") == BLOCK
    r.index("a", "prefill").clear()
    assert r.learn_block_size("prefill", 64) and r.hasher.block_size == 64


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
    (["--kv-events-port", "65535", "--kv-events-decode-ranks", "2"], "below 65536"),
    (["--kv-events-port", "65534", "--kv-events-decode-ranks", "2"], None),
    (["--kv-events-replay-port", "65535", "--kv-events-decode-ranks", "2"], "--kv-events-replay-port 65535"),
    (["--kv-events-port", "7000", "--kv-events-replay-port", "7001", "--kv-events-prefill-ranks", "2"], "overlap"),
    (["--kv-events-port", "7000", "--kv-events-replay-port", "7000"], "overlap"),
    (["--kv-events-port", "7001", "--kv-events-replay-port", "7000", "--kv-events-decode-ranks", "2"], "overlap"),
    (["--kv-index", "Routed", "--kv-events-port", "65535", "--kv-events-decode-ranks", "2"], None),   # unused
    (["--kv-tokenize-timeout", "0.1"], None),
    (["--kv-tokenize-timeout", "11"], "--kv-tokenize-timeout"),
])
def test_flags_that_cannot_work_are_refused(argv: list[str], problem: str | None) -> None:
    args = parse(["--routing-policy", "KVAware", "--prefill", "http://127.0.0.1:1", "--decode",
                  "http://127.0.0.1:2", *argv])
    message = _check(args)
    assert (message is None) if problem is None else (message is not None and problem in message)


@pytest.mark.parametrize("argv", [["--kv-weight", "-1"], ["--kv-block-size", "0"], ["--kv-index", "Guess"],
                                  ["--kv-events-port", "70000"], ["--kv-weight", "nan"],
                                  ["--kv-tokenize-timeout", "0"], ["--kv-tokenize-timeout", "inf"]])
def test_bad_values_are_refused_by_the_parser(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse(argv)


# -- instances leaving -----------------------------------------------------------------------------

async def test_an_engine_that_leaves_mid_leg_loses_its_index_when_the_leg_ends() -> None:
    """Discovery drops a prefill while a leg is still on it: the instance stays until the leg ends, and
    then its index goes with it (not at the next discovery change, which may never come)."""
    from xpyd.proxy.config import ProxyConfig
    from xpyd.proxy.pool import Endpoint
    from xpyd.proxy.server import Proxy

    proxy = Proxy(ProxyConfig(routing_policy=RoutingPolicy.KV_AWARE, kv=KVAwareSettings(index=KVIndex.ROUTED)))
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


# -- the Events index: what its subscriber takes (no sockets) -----------------------------------------------

def subscriber(r: KVAwareRouter, url: str = "a", role: str = "prefill", rank: int = 0) -> Any:
    from xpyd.proxy.kvevents import EventMetrics, Subscriber

    return Subscriber(r, url, role, rank, "127.0.0.1", cast(Any, None), EventMetrics())  # type: ignore[arg-type]


def feed(sub: Any, *batch: events.KVEvent, version: events.Version = events.LATEST) -> None:
    """One batch as the engine publishes it, through the subscriber's reading, applied."""
    from xpyd.proxy.kvevents import index_update

    sub.apply(0 if sub.next_seq is None else sub.next_seq, index_update(events.encode_batch(
        events.EventBatch(1.0, list(batch)), version)))


def stored_event(r: KVAwareRouter, tokens: list[int], size: int, **fields: Any) -> events.BlockStored:
    hashes = cast(list[events.ExternalBlockHash], block_keys(r.settings.hasher(size), tokens).ids)
    return events.BlockStored(hashes, None, tokens[:len(hashes) * size], size, **fields)


LONG = list(range(1, 8 * BLOCK + 2))   # 8 blocks of BLOCK, 4 of 2 x BLOCK


@pytest.mark.parametrize("version", [(0, 13), (0, 23), (0, 33)])
def test_the_events_block_size_becomes_the_roles(version: events.Version) -> None:
    """vLLM chose another block size than --kv-block-size (an MLA backend's 64, say): the first blocks
    published give the role that size, so the prompts hash as the engines do, instead of every
    BlockStored being dropped and KVAware silently routing by load."""
    r = router()
    a = subscriber(r)
    feed(a, stored_event(r, LONG, 2 * BLOCK), version=version)
    assert r.block_size("prefill") == 2 * BLOCK and r.block_size("decode") == BLOCK
    assert r.block_size_changes.value("prefill") == 1 and r.blocks("a") == 4
    request = KVAwareRequest(len(LONG), block_keys(r.hasher, LONG), block_size=r.hasher.block_size)
    assert r.hit_tokens(instance("a"), request, 0.0) == 8 * BLOCK
    # Another engine of the role publishing the old size: skipped (counted), the role keeps its size.
    b = subscriber(r, "b")
    feed(b, stored_event(r, LONG, BLOCK), version=version)
    assert r.block_size("prefill") == 2 * BLOCK and r.blocks("b") == 0
    assert b.metrics.skipped.value("prefill", "block_size") == 1


def test_blocks_of_the_roles_size_are_taken_as_they_are() -> None:
    r = router()
    a = subscriber(r)
    feed(a, stored_event(r, LONG, BLOCK))
    assert r.blocks("a") == 8 and r.block_size_changes.value("prefill") == 0


HYBRID = ("sliding_window", "full_attention")


@pytest.mark.parametrize("version", [(0, 23), (0, 24), (0, 33)])
@pytest.mark.parametrize("full", [0, 1])
def test_a_hybrid_models_sliding_window_group_does_not_evict_the_full_attention_groups_blocks(
        version: events.Version, full: int) -> None:
    """vLLM 0.23+ publishes each KV-cache group's blocks under the same hashes, with group_idx, and the
    group's kind in BlockStored: the sliding-window group drops blocks out of its window that the
    full-attention group still holds, and those still hit. Only the full-attention group counts."""
    kinds = HYBRID if full == 1 else HYBRID[::-1]
    r = router()
    a = subscriber(r)
    feed(a, *[stored_event(r, LONG, BLOCK, group_idx=g, kv_cache_spec_kind=kinds[g]) for g in (0, 1)],
         version=version)
    keys = cast(list[events.ExternalBlockHash], block_keys(r.hasher, LONG).ids)
    window = 1 - full
    feed(a, *[events.BlockRemoved([key], group_idx=window) for key in keys[:6]], version=version)
    assert r.blocks("a") == 8 and a.metrics.skipped.value("prefill", "group") == 1 + 6
    feed(a, events.BlockRemoved([keys[7]], group_idx=full), version=version)
    assert r.blocks("a") == 7 and a.followed_group == full


@pytest.mark.parametrize(("kind", "taken"), [("mla_attention", True), ("sink_full_attention", True),
                                             ("full_attention", True), ("mamba", False),
                                             ("chunked_local_attention", False)])
def test_the_group_followed_is_the_first_named_full_attention(kind: str, taken: bool) -> None:
    r = router()
    a = subscriber(r)
    feed(a, stored_event(r, LONG, BLOCK, group_idx=0, kv_cache_spec_kind=kind))
    assert (r.blocks("a") == 8) is taken


def test_groups_without_a_kind_follow_group_0_and_no_group_is_always_followed() -> None:
    r = router()
    a = subscriber(r)
    keys = cast(list[events.ExternalBlockHash], block_keys(r.hasher, LONG).ids)
    feed(a, stored_event(r, LONG[:2 * BLOCK], BLOCK), stored_event(r, LONG, BLOCK, group_idx=2))
    assert r.blocks("a") == 2
    feed(a, stored_event(r, LONG, BLOCK, group_idx=0), events.BlockRemoved([keys[0]], group_idx=1))
    assert r.blocks("a") == 8
    feed(a, events.BlockRemoved([keys[0]]))
    assert r.blocks("a") == 7


def test_an_engine_restart_forgets_the_group_followed() -> None:
    r = router()
    a = subscriber(r)
    feed(a, stored_event(r, LONG, BLOCK, group_idx=1, kv_cache_spec_kind="full_attention"))
    assert a.followed_group == 1
    a.reset()
    assert a.followed_group is None and r.blocks("a") == 0


# -- the index's memory ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("index", "most"), [(KVIndex.EVENTS, 95), (KVIndex.ROUTED, 175)])
def test_the_index_costs_what_docs_proxy_md_says_a_block(index: KVIndex, most: int) -> None:
    """docs/proxy.md: about 76 B a block with Events and 140 B with Routed at a power-of-two capacity
    (the default 131,072; dicts' fill moves it by about 15%), the keys included (64-bit ints from the
    events, one float expiry per run with Routed)."""
    import tracemalloc

    blocks = 1 << 15
    rng = random.Random(blocks)
    raw = [rng.getrandbits(64) for _ in range(blocks)]
    r = router(index, index_blocks=blocks)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        target = r.index("a", "prefill")
        if index == KVIndex.EVENTS:
            for key in raw:
                target.store(key ^ 1, 0.0)
        else:
            for start in range(0, blocks, 128):
                target.record(BlockKeys.of([key ^ 1 for key in raw[start:start + 128]]), 0.0)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    size = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert target.blocks == blocks and size / blocks < most, size / blocks
