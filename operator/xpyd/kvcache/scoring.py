"""How a router picks an instance: KV-aware routing's one formula (how it scores an instance for a
prompt, given how much of the prompt that instance holds) and the least-loaded pick. Pure; the proxy
(`xpyd.proxy.kvaware` for `KVAware`, `xpyd.proxy.picking` for `LeastLoaded` and `PowerOfTwo`) and
the simulator's replay of it pick with these functions, so their figures are one policy's.

- Prefill: `expected compute outstanding + kv_weight x prompt tokens not cached there`. The
  outstanding compute is the prompt tokens the router sent that instance, less the tokens it expected
  cached when it sent them: a queue of prompts that hit drains faster than one of prompts that miss.
  The second term is what this prompt would add; `kv_weight` above 1 favours hits over balance.
- Decode: `outstanding requests - decode_credit x share of the prompt held there`. A decode engine
  loads only the blocks it lacks, so holding the prompt saves a transfer; the credit (at most
  `decode_credit` requests' worth) is small beside the load, which decides.
- A hit covers at most the prompt's full blocks before its last token (`hit_limit`): vLLM always
  computes a prompt's last token, so a fully cached prompt still recomputes its last block.
- Ties are broken uniformly at random (`least`: one draw per tie after the first, reservoir style).
- LeastLoaded and PowerOfTwo (`least_loaded`): the least load, or the lesser of two drawn at random;
  what a load is (prompt tokens for prefill, requests for decode) is the caller's.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def hit_limit(prompt_tokens: int, block_size: int) -> int:
    """The most blocks of a prompt of `prompt_tokens` a cache can spare computing (vLLM computes its
    last token, so a hit stops at the full blocks before it)."""
    if block_size < 1:
        raise ValueError(f"a block has at least one token, not {block_size}")
    return (prompt_tokens - 1) // block_size if prompt_tokens > 0 else 0


def prefill_cost(outstanding_computed: float, prompt_tokens: int, hit_tokens: int, kv_weight: float) -> float:
    """A prefill instance's score for a prompt (lower is better): the compute it has outstanding plus
    `kv_weight` times the prompt tokens it would compute."""
    return outstanding_computed + kv_weight * (prompt_tokens - hit_tokens)


def decode_cost(outstanding_requests: float, prompt_tokens: int, hit_tokens: int, decode_credit: float) -> float:
    """A decode instance's score for a prompt (lower is better): its outstanding requests less
    `decode_credit` times the share of the prompt it holds."""
    if prompt_tokens <= 0:
        return outstanding_requests
    return outstanding_requests - decode_credit * hit_tokens / prompt_tokens


def least(costs: Sequence[float], rng: random.Random) -> int:
    """The position of the lowest cost; ties uniformly at random (each later tie replaces the choice
    with probability 1/ties: one `rng.random()` per tie, none without one). `costs` must not be empty."""
    if not costs:
        raise ValueError("no costs to choose from")
    best = 0
    best_cost = costs[0]
    ties = 1
    for position in range(1, len(costs)):
        cost = costs[position]
        if cost < best_cost:
            best, best_cost, ties = position, cost, 1
        elif cost == best_cost:
            ties += 1
            if rng.random() * ties < 1.0:
                best = position
    return best


def least_loaded(loads: Sequence[float], rng: random.Random, power_of_two: bool = False) -> int:
    """The position LeastLoaded picks: the least load, ties uniformly at random (`least`). With
    `power_of_two` (PowerOfTwo), two distinct positions are drawn first (`rng.sample`) when there are
    more than two, and the less loaded of them wins. `loads` must not be empty."""
    if power_of_two and len(loads) > 2:
        first, second = rng.sample(range(len(loads)), 2)
        return (first, second)[least((loads[first], loads[second]), rng)]
    return least(loads, rng)
