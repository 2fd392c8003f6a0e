"""One engine's KV blocks with prefix caching: vLLM V1's `BlockPool` and the parts of its KV-cache
manager that decide hits and evictions, reduced to what they decide, kept in runs of blocks.

Read from vLLM 0.32's `vllm/v1/core/` (`block_pool.py`, `kv_cache_utils.py`, `kv_cache_manager.py`,
`single_type_kv_cache_manager.py`), for one full-attention KV-cache group:

- A block holds `block_size` tokens. Only full blocks are cached, each under the key of its hash
  chain (`hash_block_tokens(parent hash, the block's token ids, extra keys)`; here any key whose
  equality means "the same prefix up to this block's end": `chains` makes them from a trace, `hashing`
  from real token ids). A request's keys are those of its full prompt blocks, in order.
- Lookup (`find_longest_cache_hit`): the longest run of the request's keys that are cached, from its
  first block; a missing key ends it (the chain makes every later key miss too). vLLM caps the hit at
  `prompt - 1` tokens, so a prompt that hits entirely still recomputes its last block (the engine
  needs the last token's logits): `max_hit_blocks` is that cap.
- A hit block is touched: its reference count goes up, and one with none left the free queue.
  Blocks are reference-counted while requests hold them; two requests share a hit block.
- Blocks become cached when the request's tokens in them are scheduled (`cache_full_blocks`, called
  from `allocate_slots`), or, for a KV transfer, once it has landed. Several blocks may hold the same
  key (two requests computed it side by side): a lookup finds the first one cached that is still there.
- A finished request frees its blocks in reverse order (the tail first). A freed block nobody else
  holds goes back to the free queue: a block with no hash to its front (reused first), a cached one to
  its end (evicted last): so the free queue is always the uncached free blocks, then the cached free
  blocks from least to most recently freed. A new block is taken from the front; a cached one taken
  there is evicted (its key forgotten). This pool keeps exactly that: a count of uncached free blocks
  and the cached free blocks in LRU order.

The pool has `num_blocks` blocks, shared by the requests' blocks (`in_use`, each block once however
many requests hold it) and the cached free blocks, which are only what the requests leave: when
requests take more, the least recently freed cached blocks are evicted.

**Runs.** A request's keys come as runs (`BlockKeys`): run `r` of `n` blocks stands for the keys
`(r, 0)`, ..., `(r, n - 1)`, and every request that has run `r` has a prefix of those keys. In a
Mooncake trace a run is a stretch of trace blocks no request branches inside (`chains.TraceKeys`),
at least one trace block (its 512 tokens are 32 blocks of 16); a key hashed from token ids is a run
of one block. The pool keeps its cached blocks as `Segment`s: the blocks `(r, lo)` to `(r, hi - 1)`
of one run that are alike in everything the rules above look at: one reference count; while free,
next to each other in the free queue, tail first (`hi - 1` nearest its head, as a request frees
them); and, for each of their keys, the same place among the blocks cached under it (a run's
segments are chained in the order they were cached, and a lookup of a block takes the first that
holds it). Each operation treats a segment's blocks alike, and first cuts a segment in two where its
blocks are to differ: a hit that covers part of it, an eviction that takes its tail (that one only
shortens it). Two segments become one again only where nothing could tell them apart: a request
caching its own run chunk by chunk into the segment it cached last, the lower part of a cut segment
freed right after the upper part. So the pool holds, counts and evicts the very blocks of vLLM's
block-by-block pool, in the same order (`tests/kvcache_reference.py` keeps that pool block by block;
the tests drive both with the same operations and replay the simulator through each), while a
lookup, a hit, caching, freeing and evicting cost per segment: a Mooncake prompt (30 trace blocks,
some 960 blocks of 16) is 1.5 runs on average.

**Listening.** A `PoolListener` set as `listener` hears, in vLLM's order, which keys became cached
(`stored`, per `cache` call: vLLM's `BlockStored` event), which cached blocks were evicted (`removed`,
per segment, its blocks from the last: vLLM's one `BlockRemoved` per block, in free-queue order) and
when the cache was reset (`cleared`: `AllBlocksCleared`). Unset (the simulator), it costs one test per
call that can cache or evict.

What the pool leaves to its caller: how many blocks a request takes (`admit`'s `blocks`: vLLM
allocates them chunk by chunk, the simulator reserves them at admission), when its blocks are full
(`cache`), and how many of its blocks past its prompt keys hold generated tokens (`free`'s
`generated`: cached under hashes of the request's own output, which no other request has, so they
only take a place in the LRU order).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol


class BlockKeys:
    """A request's block keys in runs: run `ids[i]` of `lengths[i]` blocks stands for the keys
    `(ids[i], 0)` to `(ids[i], lengths[i] - 1)`, the runs in the prompt's order; `blocks` in all."""

    __slots__ = ("blocks", "ids", "lengths")

    def __init__(self, ids: list[Hashable], lengths: list[int]) -> None:
        blocks = 0
        for length in lengths:
            if length < 1:
                break
            blocks += length
        else:
            if len(ids) == len(lengths):
                self.ids = ids
                self.lengths = lengths
                self.blocks = blocks
                return
        raise ValueError(f"runs need one length of at least 1 each, not {lengths} for {len(ids)} runs")

    @staticmethod
    def of(keys: Sequence[Hashable]) -> BlockKeys:
        """Keys given block by block (vLLM's hashes of token ids): a run of one block each."""
        return BlockKeys(list(keys), [1] * len(keys))

    def per_block(self) -> list[tuple[Hashable, int]]:
        """Every block's key, `(run, index)`, in order."""
        return [(run, index) for run, length in zip(self.ids, self.lengths, strict=True) for index in range(length)]


class PoolListener(Protocol):
    """Told what the pool caches and evicts (see the module docstring)."""

    def stored(self, keys: BlockKeys, start: int, end: int) -> None:
        """Blocks `start` to `end - 1` of a request's `keys` (counted over all its runs) became cached."""
        ...

    def removed(self, run: Hashable | None, lo: int, hi: int) -> None:
        """Cached blocks `(run, hi - 1)` down to `(run, lo)` were evicted, in that order (run None:
        blocks of generated tokens, which have no keys here)."""
        ...

    def cleared(self) -> None:
        """Every cached block was forgotten (`reset`)."""
        ...


class Segment:
    """Cached blocks `(run, lo)` to `(run, hi - 1)`, alike (see the module docstring): `refs`
    requests hold them; while free (refs 0) they are next to each other in the free list (`prev`,
    `next`), `hi - 1` nearest its head. `later` is the next segment of the run in the order they were
    cached. `after` is the segment cut from this one that holds the blocks from `hi` on (None when
    there is none or they are gone), `before` the one this was cut from: the blocks a request took as
    one segment are found again along `after`."""

    __slots__ = ("after", "before", "hi", "later", "lo", "next", "prev", "refs", "run")

    def __init__(self, run: Hashable | None, lo: int, hi: int, refs: int) -> None:
        self.run = run            # None: blocks of generated tokens, which no lookup finds
        self.lo = lo
        self.hi = hi
        self.refs = refs
        self.prev: Segment | None = None
        self.next: Segment | None = None
        self.later: Segment | None = None
        self.after: Segment | None = None
        self.before: Segment | None = None


class RequestBlocks:
    """The blocks one request holds: `count` in all, its first `cached` of them cached (vLLM caches a
    request's blocks in order), `hit` of those found cached at admission. `segments[i]` and the
    segments after it (`Segment.after`) up to block `ends[i]` of its run are the cached ones; caching
    goes on at block `offset` of its keys' run `run`."""

    __slots__ = ("cached", "count", "ends", "hit", "offset", "run", "segments")

    def __init__(self, count: int) -> None:
        self.count = count
        self.hit = 0
        self.cached = 0
        self.segments: list[Segment] = []
        self.ends: list[int] = []
        self.run = 0
        self.offset = 0


class BlockPool:
    """The KV blocks of one engine with prefix caching (see the module docstring for the rules).

    Cached blocks are held in `Segment`s, uncached ones only counted. `_runs` finds each run's first
    segment in the order they were cached (the others follow along `Segment.later`); the free segments
    form a doubly linked list between a fake head and tail, as vLLM's free queue links its blocks (a
    hit takes one out of the middle in O(1)). Segments no longer used are kept for reuse: the
    simulator makes millions, and fewer new objects mean fewer collections of the GC.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, not {num_blocks}")
        self.num_blocks = num_blocks
        self.in_use = 0            # blocks held by requests (reference count > 0), each counted once
        self.num_cached_free = 0   # cached blocks in the free list
        self.evicted = 0           # cached blocks evicted so far
        self._runs: dict[Hashable, Segment] = {}
        self._spare: list[Segment] = []
        self._head = Segment(None, 0, 0, 0)
        self._tail = Segment(None, 0, 0, 0)
        self._head.next = self._tail
        self._tail.prev = self._head
        #: Told what is cached and evicted (None: nobody listens, the simulator's case).
        self.listener: PoolListener | None = None

    @property
    def num_free(self) -> int:
        """Free blocks: `num_blocks - in_use`, the cached free ones among them."""
        return self.num_blocks - self.in_use

    @property
    def num_segments(self) -> int:
        """Segments cached under keys (what lookups walk)."""
        return sum(count for _, count in self.runs())

    def runs(self) -> list[tuple[Hashable, int]]:
        """Each run cached under keys with its segments, in the order the runs were first cached (a key
        hashed from token ids is a run of one block: its segments are the block's copies)."""
        out: list[tuple[Hashable, int]] = []
        for run, first in self._runs.items():
            count = 0
            segment: Segment | None = first
            while segment is not None:
                count += 1
                segment = segment.later
            out.append((run, count))
        return out

    def cached_free_keys(self) -> list[tuple[Hashable, int] | None]:
        """The keys of the cached free blocks in eviction order (None for a block of generated tokens)."""
        out: list[tuple[Hashable, int] | None] = []
        segment = self._head.next
        while segment is not None and segment is not self._tail:
            for index in range(segment.hi - 1, segment.lo - 1, -1):
                out.append(None if segment.run is None else (segment.run, index))
            segment = segment.next
        return out

    def refs(self, key: tuple[Hashable, int]) -> int:
        """The reference count of the block a lookup of `key` finds (0: free), -1 when none is cached."""
        run, index = key
        segment, _ = _first(self._runs.get(run), index, index + 1)
        return -1 if segment is None else segment.refs

    def lookup(self, keys: BlockKeys | None, max_hit_blocks: int) -> int:
        """How many of `keys` from the first are cached, at most `max_hit_blocks` (nothing changes)."""
        hit, _ = self._scan(keys, max_hit_blocks)
        return hit

    def admit(self, keys: BlockKeys | None, max_hit_blocks: int, blocks: int) -> RequestBlocks:
        """Give a request `blocks` blocks: first its longest cached prefix of `keys` (at most
        `max_hit_blocks`; touched: they leave the free list), then new ones taken from the free queue's
        front (evicting cached blocks once no uncached one is left). Raises ValueError when they do
        not fit (and then changes nothing)."""
        held = RequestBlocks(blocks)
        limit = min(max_hit_blocks, blocks)
        if self.in_use + blocks > self.num_blocks:
            hit, shared = self._scan(keys, limit)
            if self.in_use + blocks - shared > self.num_blocks:
                raise ValueError(f"{blocks} blocks ({hit} of them hits) do not fit a pool of {self.num_blocks} "
                                 f"with {self.in_use} in use")
        taken = blocks
        if keys is not None and limit > 0:
            runs = self._runs
            ids, lengths = keys.ids, keys.lengths
            hit = k = offset = 0
            while k < len(ids) and hit < limit:
                length = lengths[k]
                first = runs.get(ids[k])
                if first is None:
                    break
                found, touched = self._take(first, min(length, limit - hit), held)
                hit += found
                taken += touched
                if found < length:
                    offset = found
                    break
                k += 1
            held.hit = held.cached = hit
            held.run = k
            held.offset = offset
            taken -= hit
        self.in_use += taken
        self._evict()
        return held

    def cache(self, held: RequestBlocks, keys: BlockKeys, full_blocks: int) -> None:
        """The request's first `full_blocks` blocks are full (their tokens computed or loaded): cache
        those not cached yet under their keys (at most `keys.blocks`)."""
        target = min(full_blocks, keys.blocks, held.count)
        cached = held.cached
        if cached >= target:
            return
        first = cached
        ids, lengths = keys.ids, keys.lengths
        runs = self._runs
        segments = held.segments
        ends = held.ends
        k, offset = held.run, held.offset
        while cached < target:
            length = lengths[k]
            hi = min(length, offset + target - cached)
            run = ids[k]
            last: Segment | None = runs.get(run)
            if last is not None:
                while last.later is not None:
                    last = last.later
            if offset > 0 and last is not None and segments[-1] is last and last.refs == 1 and last.hi == offset \
                    and last.after is None:
                # The blocks of this run it cached (or hit) last, held by it alone and cached last of
                # the run: the new blocks join them (found after every other one either way).
                last.hi = hi
                ends[-1] = hi
            else:
                segment = self._segment(run, offset, hi, 1)
                if last is None:
                    runs[run] = segment
                else:
                    last.later = segment
                segments.append(segment)
                ends.append(hi)
            cached += hi - offset
            offset = hi
            if offset == length:
                k += 1
                offset = 0
        held.cached = cached
        held.run = k
        held.offset = offset
        listener = self.listener
        if listener is not None:
            listener.stored(keys, first, cached)

    def reset(self) -> bool:
        """vLLM's `reset_prefix_cache`: forget every cached block, which needs every block free (False,
        and nothing changes, while requests hold any)."""
        if self.in_use:
            return False
        segment = self._head.next
        while segment is not None and segment is not self._tail:
            following = segment.next
            segment.prev = segment.next = segment.later = segment.after = segment.before = None
            segment.run = None
            self._spare.append(segment)
            segment = following
        self._head.next = self._tail
        self._tail.prev = self._head
        self._runs.clear()
        self.num_cached_free = 0
        listener = self.listener
        if listener is not None:
            listener.cleared()
        return True

    def free(self, held: RequestBlocks, generated: int = 0) -> None:
        """Release a request's blocks, tail first. `generated`: its blocks after the cached ones that
        are full of generated tokens (cached under hashes nobody else has)."""
        uncached = held.count - held.cached
        if not 0 <= generated <= uncached:
            raise ValueError(f"{generated} blocks of generated tokens, but {uncached} blocks are not cached")
        released = uncached
        if generated:                     # cached, then freed at once: to the LRU end, tail first
            self._append(self._segment(None, 0, generated, 0))
        segments, ends = held.segments, held.ends
        for index in range(len(segments) - 1, -1, -1):
            segment = segments[index]
            end = ends[index]
            if segment.hi == end:
                released += self._release(segment)
                continue
            pieces = [segment]            # cut since the request took it: its pieces, tail first
            while segment.hi != end:
                after = segment.after
                assert after is not None
                segment = after
                pieces.append(segment)
            for piece in reversed(pieces):
                released += self._release(piece)
        self.in_use -= released
        segments.clear()
        ends.clear()
        held.count = held.cached = 0
        self._evict()

    # --- internals ------------------------------------------------------------------------------

    def _scan(self, keys: BlockKeys | None, limit: int) -> tuple[int, int]:
        """The blocks a lookup of `keys` (at most `limit`) finds, and how many of them requests hold."""
        hit = shared = 0
        if keys is None:
            return hit, shared
        runs = self._runs
        ids, lengths = keys.ids, keys.lengths
        for k in range(len(ids)):
            length = lengths[k]
            want = min(length, limit - hit)
            first = runs.get(ids[k])
            if want <= 0 or first is None:
                break
            pos = 0
            while pos < want:
                segment, end = _first(first, pos, want)
                if segment is None:
                    break
                if segment.refs > 0:
                    shared += end - pos
                pos = end
            hit += pos
            if pos < length:
                break
        return hit, shared

    def _take(self, first: Segment, want: int, held: RequestBlocks) -> tuple[int, int]:
        """Touch the first `want` blocks of a run (its segments from `first`) as far as they are cached,
        cutting segments where the hit begins or ends inside one; the pieces join `held`. Returns the
        blocks found and how many of them were free (taken out of the free list)."""
        pos = touched = 0
        while pos < want:
            segment, end = _first(first, pos, want)
            if segment is None:
                break
            if segment.lo < pos:
                segment = self._cut(segment, pos)
            if end < segment.hi:
                self._cut(segment, end)
            if segment.refs == 0:
                self._unlink(segment)
                touched += end - pos
            segment.refs += 1
            held.segments.append(segment)
            held.ends.append(end)
            pos = end
        return pos, touched

    def _cut(self, segment: Segment, at: int) -> Segment:
        """Cut `segment` at block `at`: it keeps the blocks below, and a new segment takes the rest,
        right after it among the run's segments (and, while free, right before it in the free list: a
        tail goes first). Returns the new one."""
        rest = self._segment(segment.run, at, segment.hi, segment.refs)
        rest.later = segment.later
        segment.later = rest
        after = segment.after
        rest.after = after
        if after is not None:
            after.before = rest
        rest.before = segment
        segment.after = rest
        segment.hi = at
        if segment.refs == 0:
            _link(rest, segment)
        return rest

    def _release(self, segment: Segment) -> int:
        """Drop one reference; a segment nobody holds any more goes to the free list's end. Returns the
        blocks that became free."""
        segment.refs -= 1
        if segment.refs > 0:
            return 0
        blocks = segment.hi - segment.lo
        after = segment.after
        if after is not None and after.refs == 0 and after.lo == segment.hi and self._tail.prev is after:
            # The rest of what it was cut from, freed just before it: one segment again, at the end.
            self._unlink(after)
            segment.hi = after.hi
            self._drop(after, joined=True)
        self._append(segment)
        return blocks

    def _append(self, segment: Segment) -> None:
        """Put a free segment at the free list's end (most recently freed)."""
        _link(segment, self._tail)
        self.num_cached_free += segment.hi - segment.lo

    def _unlink(self, segment: Segment) -> None:
        """Take a free segment out of the free list (touched by a hit, or evicted)."""
        before, after = segment.prev, segment.next
        assert before is not None and after is not None
        before.next = after
        after.prev = before
        segment.prev = segment.next = None
        self.num_cached_free -= segment.hi - segment.lo

    def _segment(self, run: Hashable | None, lo: int, hi: int, refs: int) -> Segment:
        """A new segment (a spare one when there is)."""
        spare = self._spare
        if not spare:
            return Segment(run, lo, hi, refs)
        segment = spare.pop()
        segment.run = run
        segment.lo = lo
        segment.hi = hi
        segment.refs = refs
        return segment

    def _drop(self, segment: Segment, joined: bool) -> None:
        """Forget a segment taken out of the free list that holds no blocks any more (evicted, or
        `joined` to the one it was cut from, which then goes on where it went on) and keep it for
        reuse: nothing points to it after this."""
        before, after = segment.before, segment.after
        if joined:
            assert before is not None
            before.after = after
            if after is not None:
                after.before = before
        else:                             # evicted: the blocks between its neighbours are gone
            if before is not None:
                before.after = None
            if after is not None:
                after.before = None
        run = segment.run
        if run is not None:
            first = self._runs[run]
            if first is segment:
                if segment.later is None:
                    del self._runs[run]
                else:
                    self._runs[run] = segment.later
            else:
                while first.later is not segment:
                    later = first.later
                    assert later is not None
                    first = later
                first.later = segment.later
        segment.run = None
        segment.later = segment.after = segment.before = None
        self._spare.append(segment)

    def _evict(self) -> None:
        """Forget the least recently freed cached blocks until the cached free ones fit the free blocks."""
        excess = self.num_cached_free - (self.num_blocks - self.in_use)
        listener = self.listener
        while excess > 0:
            segment = self._head.next
            assert segment is not None
            blocks = segment.hi - segment.lo
            if blocks > excess:           # its tail goes: the blocks freed first
                if listener is not None:
                    listener.removed(segment.run, segment.hi - excess, segment.hi)
                segment.hi -= excess
                self.num_cached_free -= excess
                self.evicted += excess
                after = segment.after     # no longer next to it
                if after is not None:
                    after.before = None
                    segment.after = None
                return
            if listener is not None:
                listener.removed(segment.run, segment.lo, segment.hi)
            self._unlink(segment)
            self._drop(segment, joined=False)
            self.evicted += blocks
            excess -= blocks


def _link(segment: Segment, successor: Segment) -> None:
    """Put `segment` right before `successor` in the free list."""
    before = successor.prev
    assert before is not None
    before.next = segment
    segment.prev = before
    segment.next = successor
    successor.prev = segment


def _first(first: Segment | None, pos: int, want: int) -> tuple[Segment | None, int]:
    """Of a run's segments from `first` on (in the order they were cached), the one a lookup of block
    `pos` finds (the first that holds it; None when none does), and the block before `want` where that
    stops being so (the segment ends, or one cached before it begins)."""
    end = want
    segment = first
    while segment is not None:
        lo = segment.lo
        if lo <= pos:
            if pos < segment.hi:
                return segment, min(end, segment.hi)
        elif lo < end:
            end = lo
        segment = segment.later
    return None, want
