"""The simulator's block keys: runs made from a trace's prefix blocks, for any block size.

A Mooncake trace gives each request `hash_ids`, one per 512 tokens of its prompt (the last may cover
fewer): equal ids mean an equal prefix up to that block's end. vLLM keys each full block of
`block_size` tokens by its hash chain, so a key must mean "the same tokens from the first up to this
block's end". The mapping:

1. Each trace block gets a chain id: the id interned for (its parent's chain id, its hash id), the
   first block's parent being none (`TraceChains`). Equal ids along equal paths give equal chains,
   whether or not the trace's ids already encode their prefix (Mooncake's do: each id follows one
   parent only, so an id is looked up alone and the pair only when it comes after another parent).
   A prompt longer than its ids cover continues in trace blocks of its own (fresh chain ids).
2. Engine block `j` holds tokens `[j * block_size, (j + 1) * block_size)`. Its key is the chain of
   the trace block holding the block's last token with that token's offset in it: the prefix up to
   the block's end is that trace block's chain (everything before it) and its first `offset + 1`
   tokens.
3. The chains of a whole trace form a tree, and a replay knows it before it starts: `TraceKeys` cuts
   it into runs (`pool.BlockKeys`) only after a chain that two chains follow, so a run is a stretch
   of trace blocks every request holding its first block goes on through (or ends in). A run's key
   for an engine block is (the run's first chain, the block's number among the run's blocks, from
   0), the blocks whose last token lies in the run's trace blocks: for a given run that number and
   (chain, offset) determine each other, so equal keys mean equal prefixes exactly as before (with
   blocks of 16 a trace block is 32 blocks; with 96, five blocks end in the first trace block, then
   one in the second). The pool keeps a run's blocks together, so a prompt costs it per run, not per
   engine block: Mooncake's synthetic trace has 30.5 trace blocks a request (some 960 blocks of 16)
   and 1.5 runs.
4. Only full engine blocks get keys (`tokens // block_size` of them); a partial last block is never
   cached. A trace block's tokens are the same whether it is whole or the partial last block of a
   prompt (its text is a prefix of the whole block's, as `xpyd bench` writes prompts), so a partial
   trace block shares its full engine blocks with the whole one: a request's last run may be a prefix
   of the run other requests go on through.

A trace without prefix blocks (the Azure traces) gives no keys: nothing is shared.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from xpyd.kvcache.pool import BlockKeys

TRACE_BLOCK_TOKENS = 512
"""Tokens per prefix block in Mooncake's traces (`hash_ids`)."""


class TraceChains:
    """Interns trace prefix blocks into chain ids (one table per replay): `parents[chain]` is the
    chain before it (-1: none), `children[chain]` how many chains follow it."""

    def __init__(self, trace_block_tokens: int = TRACE_BLOCK_TOKENS) -> None:
        if trace_block_tokens < 1:
            raise ValueError(f"a trace block has at least one token, not {trace_block_tokens}")
        self.trace_block_tokens = trace_block_tokens
        self.parents: list[int] = []
        self.children: list[int] = []
        self._by_id: dict[object, int] = {}   # hash id -> the first chain made for it
        self._pairs: dict[tuple[int, object], int] = {}   # (parent, hash id) -> chain, for ids under two parents

    def chain_ids(self, hash_ids: Sequence[int], tokens: int) -> list[int]:
        """The chain id of each trace block of a prompt of `tokens` tokens (fresh ids past `hash_ids`)."""
        out: list[int] = []
        self._walk(hash_ids, tokens, out)
        return out

    def last_chain(self, hash_ids: Sequence[int], tokens: int) -> int:
        """The chain id of the last trace block of a prompt of `tokens` tokens (-1 for none)."""
        return self._walk(hash_ids, tokens, None)

    def _walk(self, hash_ids: Sequence[object], tokens: int, out: list[int] | None) -> int:
        size = self.trace_block_tokens
        needed = (tokens + size - 1) // size
        parents = self.parents
        by_id = self._by_id
        parent = -1
        walked = 0
        for hash_id in hash_ids:
            if walked == needed:
                break
            # A hash id is found by itself (Mooncake's follow one parent each), by the pair otherwise.
            chain = by_id.get(hash_id, -1)
            if chain < 0:
                chain = self._new(parent)
                by_id[hash_id] = chain
            elif parents[chain] != parent:
                pair = (parent, hash_id)
                chain = self._pairs.get(pair, -1)
                if chain < 0:
                    chain = self._new(parent)
                    self._pairs[pair] = chain
            if out is not None:
                out.append(chain)
            parent = chain
            walked += 1
        for _ in range(walked, needed):       # past its ids: trace blocks of its own
            parent = self._new(parent)
            if out is not None:
                out.append(parent)
        return parent

    def _new(self, parent: int) -> int:
        chain = len(self.parents)
        self.parents.append(parent)
        self.children.append(0)
        if parent >= 0:
            self.children[parent] += 1
        return chain


class TraceKeys:
    """The block keys of a whole trace's requests for one block size (`keys(index)`, built at once): the
    chains of their trace blocks cut into runs where the trace branches (the module docstring)."""

    def __init__(self, prefix_blocks: Sequence[Sequence[int]], prompt_tokens: Sequence[int], block_size: int,
                 trace_block_tokens: int = TRACE_BLOCK_TOKENS) -> None:
        if block_size < 1:
            raise ValueError(f"a block has at least one token, not {block_size}")
        chains = TraceChains(trace_block_tokens)
        # Copies of a request (`traces.scale_rate`) share its hash ids: walked once (the entry keeps
        # them, so their id stays theirs).
        walked: dict[int, tuple[Sequence[int], int]] = {}
        lasts: list[int] = []
        for hash_ids, tokens in zip(prefix_blocks, prompt_tokens, strict=True):
            if not hash_ids:
                lasts.append(-1)
                continue
            if (tokens + trace_block_tokens - 1) // trace_block_tokens != len(hash_ids):
                lasts.append(chains.last_chain(hash_ids, tokens))   # fresh chains past its ids, or fewer blocks
                continue
            entry = walked.get(id(hash_ids))
            if entry is None or entry[0] is not hash_ids:
                entry = (hash_ids, chains.last_chain(hash_ids, tokens))
                walked[id(hash_ids)] = entry
            lasts.append(entry[1])
        parents, children = chains.parents, chains.children
        self._keys: list[BlockKeys | None] = []
        made: dict[tuple[int, int], BlockKeys] = {}   # (last chain, tokens) -> keys: the same for both
        for last, tokens in zip(lasts, prompt_tokens, strict=True):
            blocks = tokens // block_size
            if last < 0 or blocks == 0:
                self._keys.append(None)
                continue
            same = made.get((last, tokens))
            if same is not None:
                self._keys.append(same)
                continue
            # From the last trace block back: a chain starts a run when it is a first block or its
            # parent has two children. A run holds the blocks whose last token lies in its trace
            # blocks, numbered from 0 (none may, with blocks longer than trace blocks: then it has no keys).
            ids: list[Hashable] = []
            lengths: list[int] = []
            upto = blocks
            chain = last
            depth = (tokens + trace_block_tokens - 1) // trace_block_tokens - 1
            while chain >= 0:
                parent = parents[chain]
                if parent < 0 or children[parent] > 1:
                    below = min(depth * trace_block_tokens // block_size, blocks)
                    if upto > below:
                        ids.append(chain)
                        lengths.append(upto - below)
                        upto = below
                chain = parent
                depth -= 1
            ids.reverse()
            lengths.reverse()
            keys = BlockKeys(ids, lengths)
            made[last, tokens] = keys
            self._keys.append(keys)

    def keys(self, index: int) -> BlockKeys | None:
        """Request `index`'s keys (None without prefix blocks or a full block)."""
        return self._keys[index]


def repeat_share(prefix_blocks: Iterable[Sequence[int]]) -> float:
    """The share of a trace's prefix blocks (its requests' `hash_ids`, in arrival order) whose prefix
    up to that block an earlier request had: in trace blocks, what an engine that never evicts and sees
    every request in turn would find cached. 0 for a trace without prefix blocks."""
    chains = TraceChains()
    seen: set[int] = set()
    repeated = total = 0
    for hash_ids in prefix_blocks:
        ids = chains.chain_ids(hash_ids, len(hash_ids) * chains.trace_block_tokens)
        repeated += sum(1 for chain in ids if chain in seen)
        total += len(ids)
        seen.update(ids)
    return repeated / total if total else 0.0
