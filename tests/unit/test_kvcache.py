"""The prefix-cache model (`xpyd.kvcache`): the block pool against hand-computed sequences (eviction
order, reference counts, capacity shared with running requests, duplicates), the trace keys, and
vLLM's hash of token ids."""

from __future__ import annotations

import pytest

from tests.paths import TRACES
from xpyd.kvcache.chains import TraceChains, repeat_share
from xpyd.kvcache.hashing import cbor, hash_block_tokens, hash_function, none_hash, request_block_hashes
from xpyd.kvcache.pool import BlockPool, RequestBlocks
from xpyd.traces import read_trace

pytestmark = pytest.mark.unit


def run(pool: BlockPool, keys: list[str], blocks: int, max_hit: int | None = None) -> RequestBlocks:
    """A request admitted with its longest hit, its full prompt blocks (`keys`) then cached."""
    held = pool.admit(pool.lookup(keys, len(keys) if max_hit is None else max_hit), blocks)
    pool.cache(held, keys, len(keys))
    return held


def test_freed_blocks_are_evicted_least_recently_freed_first_and_a_requests_tail_first() -> None:
    pool = BlockPool(8)
    a = run(pool, ["a0", "a1", "a2"], 4)          # three full blocks and a partial one
    assert pool.in_use == 4 and pool.cached_free_keys() == []
    pool.free(a)
    # Tail first: a2 is evicted before a1, a1 before a0; the partial block went back uncached.
    assert pool.in_use == 0 and pool.cached_free_keys() == ["a2", "a1", "a0"]
    b = run(pool, ["b0", "b1"], 2)
    pool.free(b)
    assert pool.cached_free_keys() == ["a2", "a1", "a0", "b1", "b0"]
    c = pool.admit([], 5)                         # 8 - 5 = 3 blocks left for the cache: evict 2
    assert pool.evicted == 2 and pool.cached_free_keys() == ["a0", "b1", "b0"]
    assert len(pool.lookup(["a0", "a1", "a2"], 3)) == 1   # a1 is gone, so a2 cannot hit either
    pool.free(c)
    assert pool.cached_free_keys() == ["a0", "b1", "b0"]   # uncached blocks do not enter the LRU order


def test_blocks_are_reference_counted_while_requests_hold_them() -> None:
    pool = BlockPool(10)
    a = run(pool, ["k0", "k1"], 3)
    b = run(pool, ["k0", "k1", "k2"], 4)          # hits k0 k1, which a still holds
    assert [pool.refs(k) for k in ("k0", "k1", "k2")] == [2, 2, 1]
    assert pool.in_use == 3 + 2                   # a's 3, b's k2 and its last block: shared blocks count once
    pool.free(a)
    assert [pool.refs(k) for k in ("k0", "k1")] == [1, 1] and pool.cached_free_keys() == []
    pool.free(b)
    assert [pool.refs(k) for k in ("k0", "k1", "k2")] == [0, 0, 0]
    assert pool.cached_free_keys() == ["k2", "k1", "k0"] and pool.in_use == 0


def test_a_hit_takes_a_free_block_out_of_the_middle_of_the_free_list() -> None:
    pool = BlockPool(10)
    pool.free(run(pool, ["k0", "k1", "k2"], 3))
    assert pool.cached_free_keys() == ["k2", "k1", "k0"]
    held = run(pool, ["k0", "k1", "x2"], 4)       # hits k0 k1 (free): they leave the LRU order
    assert pool.cached_free_keys() == ["k2"]
    assert pool.in_use == 4 and [pool.refs(k) for k in ("k0", "k1", "x2")] == [1, 1, 1]
    pool.free(held)
    assert pool.cached_free_keys() == ["k2", "x2", "k1", "k0"]


def test_the_cache_holds_only_what_running_requests_leave() -> None:
    pool = BlockPool(10)
    running = run(pool, ["r0", "r1", "r2", "r3", "r4", "r5"], 6)
    pool.free(run(pool, ["f0", "f1", "f2", "f3"], 4))
    assert pool.num_free == 4 and pool.cached_free_keys() == ["f3", "f2", "f1", "f0"]
    more = pool.admit([], 2)                      # the running requests take 8: 2 left for the cache
    assert pool.cached_free_keys() == ["f1", "f0"] and pool.evicted == 2
    assert [pool.refs(k) for k in ("r0", "r5", "f3", "f0")] == [1, 1, -1, 0]   # held blocks are never evicted
    with pytest.raises(ValueError, match="do not fit"):
        pool.admit([], 3)
    pool.free(more)
    pool.free(running)
    assert pool.cached_free_keys() == ["f1", "f0", "r5", "r4", "r3", "r2", "r1", "r0"]


def test_a_lookup_stops_at_the_first_miss_and_at_its_cap() -> None:
    pool = BlockPool(10)
    pool.free(run(pool, ["k0", "k1", "k2"], 3))
    assert len(pool.lookup(["k0", "k1", "k2"], 3)) == 3
    assert len(pool.lookup(["k0", "k1", "k2"], 2)) == 2      # a full hit recomputes the last block (the caller's cap)
    assert len(pool.lookup(["k0", "zz", "k2"], 3)) == 1
    assert pool.lookup(["zz", "k1"], 2) == []


def test_blocks_cached_twice_are_found_while_either_is_there() -> None:
    pool = BlockPool(6)
    a = pool.admit([], 2)                         # a and b miss together (b admitted before a's KV landed)
    b = pool.admit([], 2)
    pool.cache(a, ["k0", "k1"], 2)
    pool.cache(b, ["k0", "k1"], 2)
    assert pool.refs("k0") == 1                   # the lookup finds a's (the first cached)
    pool.free(a)
    pool.free(b)
    assert pool.cached_free_keys() == ["k1", "k0", "k1", "k0"]
    c = pool.admit([], 4)                         # evicts a's two blocks: b's are found instead
    assert pool.cached_free_keys() == ["k1", "k0"] and len(pool.lookup(["k0", "k1"], 2)) == 2
    pool.free(c)
    d = pool.admit([], 6)
    assert pool.lookup(["k0"], 1) == [] and pool.evicted == 4
    pool.free(d)


def test_blocks_of_generated_tokens_take_a_place_in_the_lru_order() -> None:
    pool = BlockPool(10)
    held = run(pool, ["k0", "k1"], 5)            # two prompt blocks, two blocks of output, a partial one
    pool.free(held, generated=2)
    assert pool.cached_free_keys() == [None, None, "k1", "k0"]
    pool.admit([], 8)                             # 2 left: the output blocks go first
    assert pool.cached_free_keys() == ["k1", "k0"]
    with pytest.raises(ValueError, match="generated"):
        pool.free(run(pool, ["x"], 1), generated=1)


@pytest.mark.parametrize(("hash_ids", "tokens", "block_size", "expected"), [
    # 512-token trace blocks split into 32 blocks of 16: chain * 32 + index.
    ([5, 9], 600, 16, list(range(32)) + [32 + i for i in range(5)]),
    # A block size that does not divide 512 (gcd 32: 16 units a trace block): block 5, tokens 480-575,
    # ends in trace block 1 at offset 63, its second unit.
    ([5, 9], 600, 96, [2, 5, 8, 11, 14, 16 + 1]),
    # Only full blocks: 40 tokens are two blocks of 16 and a partial one.
    ([5], 40, 16, [0, 1]),
    ([], 600, 16, []),
])
def test_trace_blocks_become_engine_block_keys(hash_ids: list[int], tokens: int, block_size: int,
                                              expected: list[int]) -> None:
    assert TraceChains().block_keys(hash_ids, tokens, block_size) == expected


def test_equal_keys_mean_equal_prefixes() -> None:
    chains = TraceChains()
    whole = chains.block_keys([5, 6], 1024, 16)
    partial = chains.block_keys([5], 224, 16)     # block 5's first 224 tokens, as a prompt's last block
    assert partial == whole[:14]
    assert chains.block_keys([6], 512, 16) != whole[32:]          # block 6 after 5 is not block 6 first
    assert chains.block_keys([5, 6], 1024, 16) == whole           # the same path, the same chains
    longer = chains.block_keys([5], 1024, 16)     # past its hash ids a prompt's blocks are its own
    assert longer[:32] == whole[:32] and not set(longer[32:]) & set(chains.block_keys([5], 1024, 16)[32:])


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
    with pytest.raises(ValueError, match="xxhash"):
        hash_function("xxhash")
