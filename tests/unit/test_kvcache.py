"""The prefix-cache model (`xpyd.kvcache`): the block pool against hand-computed sequences (eviction
order, reference counts, capacity shared with running requests, duplicates), in runs of blocks and
against vLLM's pool kept block by block (`tests/kvcache_reference.py`) under random operations; the
trace keys, and vLLM's hash of token ids."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from typing import Protocol

import pytest

from tests.kvcache_reference import ReferencePool, RunTree
from tests.paths import TRACES
from xpyd.kvcache.chains import TraceChains, TraceKeys, repeat_share
from xpyd.kvcache.hashing import cbor, hash_block_tokens, hash_function, none_hash, request_block_hashes
from xpyd.kvcache.pool import BlockKeys, BlockPool, RequestBlocks
from xpyd.traces import read_trace

pytestmark = pytest.mark.unit


class Pool(Protocol):
    """What both pools offer (`BlockPool`, and the reference block by block)."""

    in_use: int
    evicted: int

    @property
    def num_free(self) -> int: ...
    def cached_free_keys(self) -> list[tuple[Hashable, int] | None]: ...
    def refs(self, key: tuple[Hashable, int]) -> int: ...
    def lookup(self, keys: BlockKeys | None, max_hit_blocks: int) -> int: ...
    def admit(self, keys: BlockKeys | None, max_hit_blocks: int, blocks: int) -> RequestBlocks: ...
    def cache(self, held: RequestBlocks, keys: BlockKeys, full_blocks: int) -> None: ...
    def free(self, held: RequestBlocks, generated: int = 0) -> None: ...


POOLS: dict[str, Callable[[int], Pool]] = {"runs": BlockPool, "block by block": ReferencePool}


@pytest.fixture(params=sorted(POOLS))
def make(request: pytest.FixtureRequest) -> Callable[[int], Pool]:
    return POOLS[request.param]


def keys(*names: str) -> BlockKeys:
    """Keys given block by block, as vLLM hashes token ids: a run of one block each."""
    return BlockKeys.of(names)


def free_keys(pool: Pool) -> list[Hashable | None]:
    """The cached free blocks in eviction order, a one-block run's key by its name."""
    return [None if key is None else key[0] if key[1] == 0 and isinstance(key[0], str) else key
            for key in pool.cached_free_keys()]


def refs(pool: Pool, *names: str) -> list[int]:
    return [pool.refs((name, 0)) for name in names]


def run(pool: Pool, prompt: BlockKeys, blocks: int, max_hit: int | None = None) -> RequestBlocks:
    """A request admitted with its longest hit, its full prompt blocks then cached."""
    held = pool.admit(prompt, prompt.blocks if max_hit is None else max_hit, blocks)
    pool.cache(held, prompt, prompt.blocks)
    return held


def test_freed_blocks_are_evicted_least_recently_freed_first_and_a_requests_tail_first(
        make: Callable[[int], Pool]) -> None:
    pool = make(8)
    a = run(pool, keys("a0", "a1", "a2"), 4)      # three full blocks and a partial one
    assert pool.in_use == 4 and free_keys(pool) == []
    pool.free(a)
    # Tail first: a2 is evicted before a1, a1 before a0; the partial block went back uncached.
    assert pool.in_use == 0 and free_keys(pool) == ["a2", "a1", "a0"]
    b = run(pool, keys("b0", "b1"), 2)
    pool.free(b)
    assert free_keys(pool) == ["a2", "a1", "a0", "b1", "b0"]
    c = pool.admit(None, 0, 5)                    # 8 - 5 = 3 blocks left for the cache: evict 2
    assert pool.evicted == 2 and free_keys(pool) == ["a0", "b1", "b0"]
    assert pool.lookup(keys("a0", "a1", "a2"), 3) == 1   # a1 is gone, so a2 cannot hit either
    pool.free(c)
    assert free_keys(pool) == ["a0", "b1", "b0"]   # uncached blocks do not enter the LRU order


def test_blocks_are_reference_counted_while_requests_hold_them(make: Callable[[int], Pool]) -> None:
    pool = make(10)
    a = run(pool, keys("k0", "k1"), 3)
    b = run(pool, keys("k0", "k1", "k2"), 4)      # hits k0 k1, which a still holds
    assert refs(pool, "k0", "k1", "k2") == [2, 2, 1]
    assert pool.in_use == 3 + 2                   # a's 3, b's k2 and its last block: shared blocks count once
    pool.free(a)
    assert refs(pool, "k0", "k1") == [1, 1] and free_keys(pool) == []
    pool.free(b)
    assert refs(pool, "k0", "k1", "k2") == [0, 0, 0]
    assert free_keys(pool) == ["k2", "k1", "k0"] and pool.in_use == 0


def test_a_hit_takes_a_free_block_out_of_the_middle_of_the_free_list(make: Callable[[int], Pool]) -> None:
    pool = make(10)
    pool.free(run(pool, keys("k0", "k1", "k2"), 3))
    assert free_keys(pool) == ["k2", "k1", "k0"]
    held = run(pool, keys("k0", "k1", "x2"), 4)   # hits k0 k1 (free): they leave the LRU order
    assert free_keys(pool) == ["k2"]
    assert pool.in_use == 4 and refs(pool, "k0", "k1", "x2") == [1, 1, 1]
    pool.free(held)
    assert free_keys(pool) == ["k2", "x2", "k1", "k0"]


def test_the_cache_holds_only_what_running_requests_leave(make: Callable[[int], Pool]) -> None:
    pool = make(10)
    running = run(pool, keys("r0", "r1", "r2", "r3", "r4", "r5"), 6)
    pool.free(run(pool, keys("f0", "f1", "f2", "f3"), 4))
    assert pool.num_free == 4 and free_keys(pool) == ["f3", "f2", "f1", "f0"]
    more = pool.admit(None, 0, 2)                 # the running requests take 8: 2 left for the cache
    assert free_keys(pool) == ["f1", "f0"] and pool.evicted == 2
    assert refs(pool, "r0", "r5", "f3", "f0") == [1, 1, -1, 0]   # held blocks are never evicted
    with pytest.raises(ValueError, match="do not fit"):
        pool.admit(None, 0, 3)
    assert pool.in_use == 8 and free_keys(pool) == ["f1", "f0"]   # a refused admission changes nothing
    pool.free(more)
    pool.free(running)
    assert free_keys(pool) == ["f1", "f0", "r5", "r4", "r3", "r2", "r1", "r0"]


def test_a_lookup_stops_at_the_first_miss_and_at_its_cap(make: Callable[[int], Pool]) -> None:
    pool = make(10)
    pool.free(run(pool, keys("k0", "k1", "k2"), 3))
    assert pool.lookup(keys("k0", "k1", "k2"), 3) == 3
    assert pool.lookup(keys("k0", "k1", "k2"), 2) == 2      # a full hit recomputes the last block (the caller's cap)
    assert pool.lookup(keys("k0", "zz", "k2"), 3) == 1
    assert pool.lookup(keys("zz", "k1"), 2) == 0


def test_blocks_cached_twice_are_found_while_either_is_there(make: Callable[[int], Pool]) -> None:
    pool = make(6)
    a = pool.admit(None, 0, 2)                    # a and b miss together (b admitted before a's KV landed)
    b = pool.admit(None, 0, 2)
    pool.cache(a, keys("k0", "k1"), 2)
    pool.cache(b, keys("k0", "k1"), 2)
    assert refs(pool, "k0") == [1]                # the lookup finds a's (the first cached)
    pool.free(a)
    pool.free(b)
    assert free_keys(pool) == ["k1", "k0", "k1", "k0"]
    c = pool.admit(None, 0, 4)                    # evicts a's two blocks: b's are found instead
    assert free_keys(pool) == ["k1", "k0"] and pool.lookup(keys("k0", "k1"), 2) == 2
    pool.free(c)
    d = pool.admit(None, 0, 6)
    assert pool.lookup(keys("k0"), 1) == 0 and pool.evicted == 4
    pool.free(d)


def test_blocks_of_generated_tokens_take_a_place_in_the_lru_order(make: Callable[[int], Pool]) -> None:
    pool = make(10)
    held = run(pool, keys("k0", "k1"), 5)         # two prompt blocks, two blocks of output, a partial one
    pool.free(held, generated=2)
    assert free_keys(pool) == [None, None, "k1", "k0"]
    pool.admit(None, 0, 8)                        # 2 left: the output blocks go first
    assert free_keys(pool) == ["k1", "k0"]
    with pytest.raises(ValueError, match="generated"):
        pool.free(run(pool, keys("x"), 1), generated=1)


def test_a_run_is_evicted_from_its_tail_and_found_as_far_as_it_is_left(make: Callable[[int], Pool]) -> None:
    pool = make(8)
    prompt = BlockKeys(["r", "s"], [4, 2])        # a trace block of 4 blocks, then one of 2
    pool.free(run(pool, prompt, 6))
    assert pool.cached_free_keys() == [("s", 1), ("s", 0), ("r", 3), ("r", 2), ("r", 1), ("r", 0)]
    held = pool.admit(None, 0, 5)                 # 3 left for the cache: s's blocks and r's tail go
    assert pool.cached_free_keys() == [("r", 2), ("r", 1), ("r", 0)] and pool.evicted == 3
    assert pool.lookup(prompt, 6) == 3
    assert pool.lookup(BlockKeys(["r"], [2]), 2) == 2      # a prompt that ends inside the run
    pool.free(held)


def test_a_hit_on_part_of_a_run_holds_only_that_part(make: Callable[[int], Pool]) -> None:
    pool = make(12)
    a = run(pool, BlockKeys(["r"], [4]), 4)
    b = run(pool, BlockKeys(["r"], [4]), 5, max_hit=3)     # a full hit computes its last block again
    assert [pool.refs(("r", i)) for i in range(4)] == [2, 2, 2, 1]
    assert pool.in_use == 4 + 2                   # b's copy of block 3 and its partial block
    pool.free(a)                                  # a's block 3 is free; the others b still holds
    assert pool.cached_free_keys() == [("r", 3)]
    assert [pool.refs(("r", i)) for i in range(4)] == [1, 1, 1, 0]   # the lookup finds a's block 3 first
    pool.free(b)
    assert pool.cached_free_keys() == [("r", 3), ("r", 3), ("r", 2), ("r", 1), ("r", 0)]
    c = pool.admit(None, 0, 8)                    # 4 left for the cache: a's block 3 goes, b's is found
    assert pool.lookup(BlockKeys(["r"], [4]), 4) == 4 and pool.evicted == 1
    pool.free(c)


def test_a_run_cached_chunk_by_chunk_and_cut_by_a_hit_is_one_segment_again_once_free() -> None:
    pool = BlockPool(64)
    prompt = BlockKeys(["r"], [32])
    held = pool.admit(prompt, 31, 32)
    for full in (5, 17, 32):                      # chunked prefill: cached as its chunks are scheduled
        pool.cache(held, prompt, full)
    assert pool.num_segments == 1
    other = run(pool, BlockKeys(["r"], [10]), 10, max_hit=9)
    assert pool.num_segments == 3                 # blocks 0-8 shared, 9-31 not; other's own copy of block 9
    pool.free(other)
    pool.free(held)
    assert pool.num_segments == 2 and pool.cached_free_keys()[:2] == [("r", 9), ("r", 31)]


@pytest.mark.parametrize("seed", range(40))
def test_the_pool_keeps_the_blocks_vllms_pool_keeps_block_by_block(seed: int) -> None:
    """Random requests over a random tree of runs (prompts ending inside a run, capped hits, requests
    admitted before others cached what they share, chunked caching, generated blocks, small pools):
    after every operation the runs pool and the reference hit, hold, count and order the same blocks."""
    rng = random.Random(seed)
    num_blocks = rng.choice([4, 8, 16, 40, 100])
    per_run = rng.choice([1, 2, 3, 8])
    fast, reference = BlockPool(num_blocks), ReferencePool(num_blocks)
    prompt = RunTree(rng, per_run, 5).prompt

    live: list[tuple[BlockKeys | None, RequestBlocks, RequestBlocks]] = []
    for _ in range(300):
        choice = rng.random()
        if choice < 0.4 or not live:
            prompt_keys = prompt() if rng.random() < 0.9 else None
            blocks = (prompt_keys.blocks if prompt_keys else rng.randint(1, 4)) + rng.randint(0, 3)
            if fast.in_use + blocks > num_blocks:
                continue
            cap = rng.randint(0, blocks)
            a, b = fast.admit(prompt_keys, cap, blocks), reference.admit(prompt_keys, cap, blocks)
            assert a.hit == b.hit
            live.append((prompt_keys, a, b))
        elif choice < 0.75:
            prompt_keys, a, b = rng.choice(live)
            if prompt_keys is not None:
                full = a.cached + rng.randint(0, prompt_keys.blocks)
                fast.cache(a, prompt_keys, full)
                reference.cache(b, prompt_keys, full)
                assert a.cached == b.cached
        else:
            prompt_keys, a, b = live.pop(rng.randrange(len(live)))
            generated = rng.randint(0, a.count - a.cached)
            fast.free(a, generated)
            reference.free(b, generated)
        assert (fast.in_use, fast.evicted) == (reference.in_use, reference.evicted)
        assert fast.cached_free_keys() == reference.cached_free_keys()
        for prompt_keys, _, _ in live:
            if prompt_keys is not None:
                every = prompt_keys.per_block()
                assert [fast.refs(k) for k in every] == [reference.refs(k) for k in every]
                for cap in (1, prompt_keys.blocks // 2, prompt_keys.blocks):
                    assert fast.lookup(prompt_keys, cap) == reference.lookup(prompt_keys, cap)


def runs(trace: list[tuple[list[int], int]], block_size: int) -> list[tuple[list[Hashable], list[int]] | None]:
    """Each request's runs (`TraceKeys`) of a trace of (hash ids, prompt tokens)."""
    made = TraceKeys([ids for ids, _ in trace], [tokens for _, tokens in trace], block_size)
    out: list[tuple[list[Hashable], list[int]] | None] = []
    for index in range(len(trace)):
        found = made.keys(index)
        out.append(None if found is None else (found.ids, found.lengths))
    return out


@pytest.mark.parametrize(("trace", "block_size", "expected"), [
    # Alone, a request is one run: 600 tokens are 37 blocks of 16 (chains 0 and 1, one run from 0).
    ([([5, 9], 600)], 16, [([0], [37])]),
    # Two requests part after block 5 (chain 0 has two children): runs start at 0, then 1 and 2; a
    # trace block splits into 32 blocks of 16.
    ([([5, 9], 600), ([5, 7], 1024)], 16, [([0, 1], [32, 5]), ([0, 2], [32, 32])]),
    # A block size that does not divide 512: five blocks of 96 end in the first trace block (the last at
    # token 479), the sixth (480-575) in the second.
    ([([5, 9], 600), ([5, 7], 1024)], 96, [([0, 1], [5, 1]), ([0, 2], [5, 5])]),
    # Blocks longer than trace blocks: no block ends in chain 0, so its run has no keys.
    ([([5, 9], 1024), ([5, 7], 1024)], 1024, [([1], [1]), ([2], [1])]),
    # Only full blocks: 40 tokens are two blocks of 16 and a partial one; no hash ids, no keys.
    ([([5], 40), ([], 600), ([5], 8)], 16, [([0], [2]), None, None]),
    # A prompt that ends inside another's run has a prefix of it (block 5's first 224 tokens).
    ([([5, 6], 1024), ([5], 224)], 16, [([0], [64]), ([0], [14])]),
])
def test_trace_blocks_become_runs_of_engine_block_keys(trace: list[tuple[list[int], int]], block_size: int,
                                                       expected: list[tuple[list[int], list[int]] | None]) -> None:
    assert runs(trace, block_size) == expected


def test_equal_keys_mean_equal_prefixes() -> None:
    made = runs([([5, 6], 1024), ([6], 512), ([5], 1024), ([5], 1024)], 16)
    assert made[0] == ([0, 1], [32, 32])          # block 5 is followed by 6 and by a fresh block: cut after it
    assert made[1] == ([2], [32])                 # block 6 first is not block 6 after 5
    assert made[2] is not None and made[3] is not None
    assert made[2][0][0] == made[3][0][0] == 0 and made[2][0][1] != made[3][0][1]   # past its hash ids, its own


@pytest.mark.parametrize("block_size", [16, 96, 1024])
def test_runs_key_the_blocks_as_chains_and_offsets_do(block_size: int) -> None:
    """A block keyed (run, number in the run) is keyed as (its last token's trace block's chain, that
    token's offset) would key it: the same blocks share a key either way (Mooncake's first 400 requests)."""
    trace = read_trace(TRACES / "mooncake_synthetic.jsonl")[:400]
    made = TraceKeys([r.prefix_blocks for r in trace], [r.isl for r in trace], block_size)
    chains = TraceChains()
    by_chain: dict[tuple[int, int], tuple[Hashable, int]] = {}
    by_run: dict[tuple[Hashable, int], tuple[int, int]] = {}
    for index, request in enumerate(trace):
        path = chains.chain_ids(request.prefix_blocks, request.isl)
        found = made.keys(index)
        blocks = found.per_block() if found is not None else []
        assert len(blocks) == request.isl // block_size
        for number, key in enumerate(blocks):
            last = (number + 1) * block_size - 1
            chain_key = (path[last // 512], last % 512)
            assert by_chain.setdefault(chain_key, key) == key
            assert by_run.setdefault(key, chain_key) == chain_key
    assert len(by_chain) == len(by_run) > 4_000


def test_repeat_share_counts_blocks_whose_prefix_came_earlier() -> None:
    assert repeat_share([[1, 2, 3], [1, 2, 4], [2], [1, 2, 3, 5]]) == pytest.approx(5 / 11)
    assert repeat_share([[], []]) == 0.0


def test_the_mooncake_trace_repeats_64_percent_of_its_prompt_blocks() -> None:
    trace = read_trace(TRACES / "mooncake_synthetic.jsonl")
    assert repeat_share(r.prefix_blocks for r in trace) == 77_953 / 121_877   # 0.6396


@pytest.mark.parametrize(("value", "encoded"), [
    # RFC 8949, appendix A.
    (0, "00"), (23, "17"), (24, "1818"), (100, "1864"), (1000, "1903e8"), (1_000_000, "1a000f4240"),
    (1_000_000_000_000, "1b000000e8d4a51000"), (-1, "20"), (-1000, "3903e7"), (b"", "40"), ("a", "6161"),
    ([1, [2, 3]], "8201820203"), ((), "80"), (None, "f6"), (True, "f5"),
])
def test_cbor_is_the_canonical_encoding(value: object, encoded: str) -> None:
    assert cbor(value).hex() == encoded


def test_block_hashes_chain_from_vllms_none_hash() -> None:
    # NONE_HASH of vLLM 0.32 with sha256 and no PYTHONHASHSEED, as its own init_none_hash makes it
    # (tests/conformance/test_prefix_cache_hashing.py checks every hash here against vLLM's code).
    assert none_hash().hex() == "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
    hashes = request_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert [h.hex()[:16] for h in hashes] == ["52a7f141c60918f6", "bee96bce54f5fcab"]   # the 9th token: no block
    assert hashes[1] == hash_block_tokens(hash_function("sha256"), hashes[0], [5, 6, 7, 8])
    salted = request_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, cache_salt="s")
    assert salted[0] != hashes[0] and salted[1] != hashes[1]      # the salt keys the first block, so the chain
    with pytest.raises(ValueError, match="Unsupported hash function: md5"):
        hash_function("md5")
