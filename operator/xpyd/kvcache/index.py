"""A router's view of one engine's prefix cache: which prompt blocks the engine holds, as far as the
router knows, so that it can send a prompt where most of its prefix is cached (KV-aware routing).

The index keeps keys the way `pool.BlockKeys` gives them, in runs: for run `r` it records how many
of the run's blocks from its first, `(r, 0)` to `(r, held - 1)`, the engine holds. A key hashed from
token ids is a run of one block (held 1); a Mooncake trace's run is a stretch of blocks every request
that has it shares a prefix of, so holding its first `held` blocks is all there is to know.

Two ways to fill it, the same structure for both:
- *Precise*: the engine's own KV events (`store` on BlockStored, `remove` on BlockRemoved, `clear` on
  AllBlocksCleared): the index is the engine's cache, late by the events' delivery.
- *Approximate*: what this router sent there (`record`), each run forgotten `ttl_s` after the last
  request that carried it; for engines that publish no events.

A lookup (`match`) counts the request's blocks from the first that the index holds, stopping at the
first one it lacks, as vLLM's own lookup does (a block whose parent is gone is of no use). It changes
nothing. Recording and storing touch a run; the index holds at most `capacity` blocks and forgets the
least recently touched runs first (an engine evicts its least recently freed blocks first, which a
router cannot see; this bounds the index's memory and approximates it). Expired runs are forgotten
lazily: on a lookup that meets them and from the front of the touch order as runs are recorded.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

from xpyd.kvcache.pool import BlockKeys


class PrefixIndex:
    """One engine's cached prefix blocks as a router knows them (see the module docstring)."""

    __slots__ = ("_expiry", "_held", "blocks", "capacity", "evicted", "ttl_s")

    def __init__(self, capacity: int, ttl_s: float = math.inf) -> None:
        if capacity < 1:
            raise ValueError(f"a prefix index needs room for at least one block, not {capacity}")
        if not ttl_s > 0:
            raise ValueError(f"the index's TTL must be positive, not {ttl_s}")
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.blocks = 0        # blocks held now (the sum over runs)
        self.evicted = 0       # blocks forgotten for capacity (not expiry, removal or clearing)
        self._held: dict[Hashable, int] = {}       # run -> blocks held from its first; touch order
        self._expiry: dict[Hashable, float] = {}   # run -> when it is forgotten (finite TTL only)

    def __len__(self) -> int:
        """Runs held."""
        return len(self._held)

    def match(self, keys: BlockKeys | None, now: float, limit: int) -> int:
        """How many of `keys` from the first the index holds, at most `limit` blocks."""
        if keys is None or limit <= 0:
            return 0
        held_by = self._held
        expiry = self._expiry
        hit = 0
        ids, lengths = keys.ids, keys.lengths
        for k in range(len(ids)):
            run = ids[k]
            held = held_by.get(run, 0)
            if held and expiry and expiry[run] <= now:
                self._forget(run)
                held = 0
            length = lengths[k]
            if held < length:
                hit += held
                break
            hit += length
            if hit >= limit:
                break
        return min(hit, limit)

    def record(self, keys: BlockKeys, now: float) -> None:
        """The router sent a request with `keys` there: the engine will hold all of them."""
        ids, lengths = keys.ids, keys.lengths
        for k in range(len(ids)):
            self._touch(ids[k], lengths[k], now)
        self._expire(now)
        self._bound()

    def store(self, run: Hashable, now: float, blocks: int = 1) -> None:
        """The engine cached the first `blocks` blocks of `run` (a BlockStored event)."""
        self._touch(run, blocks, now)
        self._bound()

    def remove(self, run: Hashable) -> None:
        """The engine evicted `run` (a BlockRemoved event for a run of one block); unknown runs are ignored."""
        if run in self._held:
            self._forget(run)

    def clear(self) -> None:
        """The engine dropped its whole cache (AllBlocksCleared), or the router lost track of it."""
        self._held.clear()
        self._expiry.clear()
        self.blocks = 0

    # --- internals ------------------------------------------------------------------------------

    def _touch(self, run: Hashable, blocks: int, now: float) -> None:
        held_by = self._held
        held = held_by.pop(run, 0)
        if held and self._expiry and self._expiry[run] <= now:
            self.blocks -= held
            held = 0
        if blocks > held:
            self.blocks += blocks - held
            held = blocks
        held_by[run] = held                     # to the end of the touch order
        if self.ttl_s != math.inf:
            self._expiry.pop(run, None)
            self._expiry[run] = now + self.ttl_s

    def _forget(self, run: Hashable) -> None:
        self.blocks -= self._held.pop(run)
        self._expiry.pop(run, None)

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry:
            run = next(iter(expiry))
            if expiry[run] > now:
                return
            self._forget(run)

    def _bound(self) -> None:
        held_by = self._held
        while self.blocks > self.capacity:
            run = next(iter(held_by))
            self.evicted += held_by[run]
            self._forget(run)
