"""vLLM 0.32's block pool block by block: the reference `xpyd.kvcache.pool.BlockPool` is checked
against (tests/unit/test_kvcache.py drives both with the same operations, tests/unit/test_sim_prefix_cache.py
replays Mooncake windows through the simulator with each).

`BlockByBlock` is the simulator's first pool (issue 28, before the pool kept runs), kept as it was:
one object per cached block, a dict from key to the first block cached under it, vLLM's free queue
as a linked list of blocks. `ReferencePool` gives it `BlockPool`'s interface: a request's runs of
keys become one key per block, `(run, index)`, and its `RequestBlocks` say what it hit and cached.
`RunTree` makes the random prompts both are driven with.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence

from xpyd.kvcache.pool import BlockKeys, RequestBlocks


class Block:
    """A cached block (vLLM's `KVCacheBlock`): its key, how many requests hold it, and its neighbours
    in the free list while it is free (least recently freed towards `BlockPool`'s head)."""

    __slots__ = ("key", "next", "prev", "refs")

    def __init__(self, key: Hashable | None, refs: int) -> None:
        self.key = key            # None: a block of generated tokens, which no lookup finds
        self.refs = refs
        self.prev: Block | None = None
        self.next: Block | None = None


class HeldBlocks:
    """The blocks one request holds: `count` in all, the first `len(cached)` of them cached (in block
    order: vLLM caches a request's blocks in order, so its cached blocks are its first)."""

    __slots__ = ("cached", "count")

    def __init__(self, cached: list[Block], count: int) -> None:
        self.cached = cached
        self.count = count


class BlockByBlock:
    """The KV blocks of one engine with prefix caching (see the module docstring for the rules).

    Only cached blocks are objects (`Block`); uncached ones are counted. The cached free blocks form a
    doubly linked list between a fake head and tail, as vLLM's free queue links its blocks (a hit
    takes one out of the middle in O(1)).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, not {num_blocks}")
        self.num_blocks = num_blocks
        self.in_use = 0            # blocks held by requests (reference count > 0), each counted once
        self.num_cached_free = 0   # cached blocks in the free list
        self.evicted = 0           # cached blocks evicted so far
        self._first: dict[Hashable, Block] = {}        # key -> the first block cached under it
        self._more: dict[Hashable, list[Block]] = {}   # key -> later blocks cached under it (rare)
        self._spare: list[Block] = []                  # evicted blocks, reused (fewer objects for the GC)
        self._head = Block(None, 0)
        self._tail = Block(None, 0)
        self._head.next = self._tail
        self._tail.prev = self._head

    @property
    def num_free(self) -> int:
        """Free blocks: `num_blocks - in_use`, the cached free ones among them."""
        return self.num_blocks - self.in_use

    def cached_free_keys(self) -> list[Hashable | None]:
        """The keys of the cached free blocks in eviction order (None for a block of generated tokens)."""
        out: list[Hashable | None] = []
        block = self._head.next
        while block is not None and block is not self._tail:
            out.append(block.key)
            block = block.next
        return out

    def refs(self, key: Hashable) -> int:
        """The reference count of the block a lookup of `key` finds (0: free), -1 when none is cached."""
        block = self._first.get(key)
        return -1 if block is None else block.refs

    def lookup(self, keys: Sequence[Hashable], max_hit_blocks: int) -> list[Block]:
        """The cached blocks of the longest run of `keys` from the first, at most `max_hit_blocks`."""
        first = self._first
        hit: list[Block] = []
        for index in range(min(len(keys), max_hit_blocks)):
            block = first.get(keys[index])
            if block is None:
                break
            hit.append(block)
        return hit

    def admit(self, hit: list[Block], blocks: int) -> HeldBlocks:
        """Give a request `blocks` blocks: first its `hit` (`lookup`'s answer, touched: they leave the
        free list), then new ones taken from the free queue's front (evicting cached blocks once no
        uncached one is left). Raises ValueError when they do not fit."""
        if len(hit) > blocks:
            raise ValueError(f"{len(hit)} hit blocks of {blocks}")
        taken = blocks - len(hit)
        for block in hit:
            if block.refs == 0:
                self._unlink(block)
                taken += 1
            block.refs += 1
        if self.in_use + taken > self.num_blocks:
            raise ValueError(f"{blocks} blocks ({len(hit)} of them hits) do not fit a pool of {self.num_blocks} "
                             f"with {self.in_use} in use")
        self.in_use += taken
        self._evict()
        return HeldBlocks(hit, blocks)

    def cache(self, held: HeldBlocks, keys: Sequence[Hashable], full_blocks: int) -> None:
        """The request's first `full_blocks` blocks are full (their tokens computed or loaded): cache
        those not cached yet under their keys (at most `len(keys)`)."""
        cached = held.cached
        first = self._first
        for index in range(len(cached), min(full_blocks, len(keys), held.count)):
            key = keys[index]
            block = self._new_block(key, 1)
            if first.setdefault(key, block) is not block:   # cached already by another request
                self._more.setdefault(key, []).append(block)
            cached.append(block)

    def free(self, held: HeldBlocks, generated: int = 0) -> None:
        """Release a request's blocks, tail first. `generated`: its blocks after the cached ones that
        are full of generated tokens (cached under hashes nobody else has)."""
        cached = held.cached
        uncached = held.count - len(cached)
        if not 0 <= generated <= uncached:
            raise ValueError(f"{generated} blocks of generated tokens, but {uncached} blocks are not cached")
        released = uncached
        for _ in range(generated):            # cached, then freed at once: to the LRU end, tail first
            self._append(self._new_block(None, 0))
        for index in range(len(cached) - 1, -1, -1):
            block = cached[index]
            block.refs -= 1
            if block.refs == 0:
                self._append(block)
                released += 1
        self.in_use -= released
        held.cached = []
        held.count = 0
        self._evict()

    def _new_block(self, key: Hashable | None, refs: int) -> Block:
        spare = self._spare
        if not spare:
            return Block(key, refs)
        block = spare.pop()
        block.key = key
        block.refs = refs
        return block

    def _append(self, block: Block) -> None:
        """Put a cached block at the free list's end (most recently freed)."""
        tail = self._tail
        last = tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = tail
        tail.prev = block
        self.num_cached_free += 1

    def _unlink(self, block: Block) -> None:
        """Take a cached block out of the free list (touched by a hit, or evicted)."""
        before, after = block.prev, block.next
        assert before is not None and after is not None
        before.next = after
        after.prev = before
        block.prev = block.next = None
        self.num_cached_free -= 1

    def _evict(self) -> None:
        """Forget the least recently freed cached blocks until the cached free ones fit the free blocks."""
        room = self.num_blocks - self.in_use
        while self.num_cached_free > room:
            block = self._head.next
            assert block is not None
            self._unlink(block)
            self.evicted += 1
            key = block.key
            block.key = None
            self._spare.append(block)
            if key is None:
                continue                      # a block of generated tokens: no key to forget
            found = self._first.pop(key)
            if not self._more:
                continue
            more = self._more.get(key)
            if more is None:
                continue
            if found is block:                # the next block cached under its key is found from now on
                self._first[key] = more.pop(0)
            else:
                self._first[key] = found
                more.remove(block)
            if not more:
                del self._more[key]


class ReferencePool:
    """`BlockByBlock` behind `BlockPool`'s interface (what `EngineCore` calls)."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = BlockByBlock(num_blocks)
        self._held: dict[RequestBlocks, HeldBlocks] = {}

    @property
    def in_use(self) -> int:
        return self.blocks.in_use

    @property
    def evicted(self) -> int:
        return self.blocks.evicted

    @property
    def num_free(self) -> int:
        return self.blocks.num_free

    def cached_free_keys(self) -> list[Hashable | None]:
        return self.blocks.cached_free_keys()

    def refs(self, key: Hashable) -> int:
        return self.blocks.refs(key)

    def lookup(self, keys: BlockKeys | None, max_hit_blocks: int) -> int:
        return len(self.blocks.lookup(keys.per_block(), max_hit_blocks)) if keys is not None else 0

    def admit(self, keys: BlockKeys | None, max_hit_blocks: int, blocks: int) -> RequestBlocks:
        hit = self.blocks.lookup(keys.per_block(), min(max_hit_blocks, blocks)) if keys is not None else []
        held = RequestBlocks(blocks)
        self._held[held] = self.blocks.admit(hit, blocks)
        held.hit = held.cached = len(hit)
        return held

    def cache(self, held: RequestBlocks, keys: BlockKeys, full_blocks: int) -> None:
        blocks = self._held[held]
        self.blocks.cache(blocks, keys.per_block(), full_blocks)
        held.cached = len(blocks.cached)

    def free(self, held: RequestBlocks, generated: int = 0) -> None:
        self.blocks.free(self._held.pop(held), generated)
        held.count = held.cached = 0


class RunTree:
    """Random prompts over a growing tree of runs, as conversations share prefixes: each a path of 1 to
    `depth` runs from the root, taking a new branch where a node has none or with probability 0.3, each
    run `per_run` blocks long but the last, which ends at random inside it."""

    def __init__(self, rng: random.Random, per_run: int, depth: int) -> None:
        self.rng, self.per_run, self.depth = rng, per_run, depth
        self.children: dict[int, list[int]] = {-1: []}

    def prompt(self) -> BlockKeys:
        rng, children = self.rng, self.children
        ids: list[Hashable] = []
        node = -1
        for _ in range(rng.randint(1, self.depth)):
            below = children.setdefault(node, [])
            if not below or rng.random() < 0.3:
                below.append(len(children))
                children[len(children)] = []
            node = rng.choice(below)
            ids.append(node)
        lengths = [self.per_run] * len(ids)
        lengths[-1] = rng.randint(1, self.per_run)
        return BlockKeys(ids, lengths)
