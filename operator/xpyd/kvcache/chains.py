"""The simulator's block keys: runs of integer chain ids made from a trace's prefix blocks, for any block size.

A Mooncake trace gives each request `hash_ids`, one per 512 tokens of its prompt (the last may cover
fewer): equal ids mean an equal prefix up to that block's end. vLLM keys each full block of
`block_size` tokens by its hash chain, so a key must mean "the same tokens from the first up to this
block's end". The mapping:

1. Each trace block gets a chain id: the id interned for (its parent's chain id, its hash id), the
   first block's parent being none. Equal ids along equal paths give equal chains, whether or not the
   trace's ids already encode their prefix (Mooncake's do: each id follows one parent only).
   A prompt longer than its ids cover continues in trace blocks of its own (fresh chain ids).
2. Engine block `j` holds tokens `[j * block_size, (j + 1) * block_size)`. Its key is the chain id
   of the trace block holding the block's last token with that token's offset in it: the prefix up
   to the block's end is that trace block's chain (everything before it) and its first `offset + 1`
   tokens. The blocks whose last token lies in one trace block are consecutive, so a trace block is
   one run of keys (`pool.BlockKeys`): run `chain`, its blocks numbered from 0 (the offset in another
   form, as the trace block's place in the prompt is its chain's). With a block size that divides 512
   each trace block is a run of `512 / block_size` blocks (32 of 16); any other block size works the
   same way across trace-block edges (with 96, five blocks end in the first trace block, then one in
   the second). The pool keeps a run's blocks together, so a prompt costs it per trace block, not per
   engine block.
3. Only full engine blocks get keys (`tokens // block_size` of them); a partial last block is never
   cached. A trace block's tokens are the same whether it is whole or the partial last block of a
   prompt (its text is a prefix of the whole block's, as `xpyd bench` writes prompts), so a partial
   trace block shares its full engine blocks with the whole one.

A trace without prefix blocks (the Azure traces) gives no keys: nothing is shared.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from xpyd.kvcache.pool import BlockKeys

TRACE_BLOCK_TOKENS = 512
"""Tokens per prefix block in Mooncake's traces (`hash_ids`)."""


class TraceChains:
    """Interns trace prefix blocks into chain ids (one table per replay) and gives requests their keys."""

    def __init__(self, trace_block_tokens: int = TRACE_BLOCK_TOKENS) -> None:
        if trace_block_tokens < 1:
            raise ValueError(f"a trace block has at least one token, not {trace_block_tokens}")
        self.trace_block_tokens = trace_block_tokens
        self._chains: dict[tuple[int, int], int] = {}
        self._count = 0

    def chain_ids(self, hash_ids: Sequence[int], tokens: int) -> list[int]:
        """The chain id of each trace block of a prompt of `tokens` tokens (fresh ids past `hash_ids`)."""
        size = self.trace_block_tokens
        needed = (tokens + size - 1) // size
        chains = self._chains
        out: list[int] = []
        parent = -1
        for index in range(needed):
            if index < len(hash_ids):
                pair = (parent, hash_ids[index])
                chain = chains.get(pair, -1)
                if chain < 0:
                    chain = self._count
                    self._count += 1
                    chains[pair] = chain
            else:
                chain = self._count
                self._count += 1
            out.append(chain)
            parent = chain
        return out

    def block_keys(self, hash_ids: Sequence[int], tokens: int, block_size: int) -> BlockKeys | None:
        """The keys of the full `block_size`-token blocks of a prompt of `tokens` tokens with these
        prefix blocks, one run per trace block; None without prefix blocks or full blocks."""
        if block_size < 1:
            raise ValueError(f"a block has at least one token, not {block_size}")
        blocks = tokens // block_size
        if not hash_ids or blocks == 0:
            return None
        size = self.trace_block_tokens
        ids: list[Hashable] = []
        lengths: list[int] = []
        done = 0                          # blocks whose last token is in an earlier trace block
        for index, chain in enumerate(self.chain_ids(hash_ids, tokens)):
            upto = min((index + 1) * size // block_size, blocks)
            if upto > done:
                ids.append(chain)
                lengths.append(upto - done)
                done = upto
        return BlockKeys(ids, lengths)


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
