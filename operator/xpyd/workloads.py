"""Synthetic workloads built from a seed, for what the recorded traces in `data/` lack.

`conversations()`: multi-turn chat, where each prompt repeats the one before it. The public traces
either carry no prefix information (Azure) or mix many kinds of reuse (Mooncake); this one has the
shape KV-aware routing exists for, with every number stated:

- Conversations start as a Poisson process (`rate_per_s`). Each opens with one of `system_prompts`
  system prompts (`system_tokens` long; tools and instructions that many conversations share), drawn
  uniformly.
- A conversation has a geometric number of turns (mean `mean_turns`, at least 1). Turn k's prompt is
  the system prompt, every earlier user message and answer, and the new user message: the
  conversation so far. User messages and answers have log-normal lengths (means `user_tokens`,
  `answer_tokens`, sigma 0.6); a conversation ends early when its next prompt and answer would pass
  `max_context` tokens.
- The next user message comes after the answer (`answer_s_per_token` per output token, the rate a
  decode engine streams at) and an exponential think time (mean `think_s`).
- Prefix blocks are Mooncake's: `BLOCK_TOKENS`-token blocks of the conversation's text, the same id
  where the text is the same. A block inside the system prompt has that prompt's id in every
  conversation; any other full block of the conversation has one id in all its turns; a prompt's
  partial last block has an id of its own (the next turn's text goes on where it stops).

Arrivals are seconds from the first request; requests are sorted by arrival.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from xpyd.traces import TraceRequest

BLOCK_TOKENS = 512
"""Tokens per prefix block, as Mooncake's `hash_ids` count them."""


@dataclass(frozen=True)
class Conversations:
    """How `conversations()` builds a multi-turn workload (see the module docstring)."""

    conversations: int = 3000
    rate_per_s: float = 6.0
    mean_turns: float = 5.0
    system_prompts: int = 8
    system_tokens: int = 4096
    user_tokens: int = 600
    answer_tokens: int = 300
    think_s: float = 20.0
    answer_s_per_token: float = 0.03
    max_context: int = 32768
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.conversations, self.system_prompts, self.user_tokens, self.answer_tokens) < 1:
            raise ValueError("conversations, system_prompts, user_tokens and answer_tokens must be at least 1")
        if not (self.rate_per_s > 0 and self.mean_turns >= 1 and self.think_s >= 0 and self.answer_s_per_token >= 0):
            raise ValueError("rate_per_s must be positive, mean_turns at least 1, think_s and "
                             "answer_s_per_token not negative")
        if self.system_tokens < 0 or self.max_context < self.system_tokens + 2:
            raise ValueError("system_tokens must not be negative and max_context must leave room for a turn")


def conversations(spec: Conversations | None = None) -> list[TraceRequest]:
    """The workload `spec` describes (defaults: `Conversations()`), sorted by arrival."""
    spec = spec or Conversations()
    rng = random.Random(spec.seed)
    next_id = spec.system_prompts * (spec.system_tokens // BLOCK_TOKENS)   # ids below: the system prompts'
    requests: list[TraceRequest] = []
    start_s = 0.0
    for _ in range(spec.conversations):
        start_s += rng.expovariate(spec.rate_per_s)
        system = rng.randrange(spec.system_prompts)
        system_blocks = spec.system_tokens // BLOCK_TOKENS
        # The conversation's full blocks, in order: the system prompt's, then ids of its own.
        blocks = [system * system_blocks + b for b in range(system_blocks)]
        context = spec.system_tokens
        at_s = start_s
        turns = 1 + _geometric(rng, 1.0 / spec.mean_turns)
        for _turn in range(turns):
            user = _lognormal(rng, spec.user_tokens)
            answer = _lognormal(rng, spec.answer_tokens)
            prompt = context + user
            if prompt + answer > spec.max_context:
                break
            while len(blocks) < prompt // BLOCK_TOKENS:
                blocks.append(next_id)
                next_id += 1
            ids = blocks[:prompt // BLOCK_TOKENS]
            if prompt % BLOCK_TOKENS:
                ids.append(next_id)           # the partial last block: its own text
                next_id += 1
            requests.append(TraceRequest(at_s, prompt, answer, tuple(ids)))
            context = prompt + answer
            at_s += answer * spec.answer_s_per_token + (rng.expovariate(1.0 / spec.think_s) if spec.think_s else 0.0)
    if not requests:
        raise ValueError(f"no conversation has a first turn within max_context ({spec.max_context} tokens)")
    requests.sort(key=lambda r: r.arrival_s)
    first = requests[0].arrival_s
    return [TraceRequest(r.arrival_s - first, r.isl, r.osl, r.prefix_blocks) for r in requests]


def _geometric(rng: random.Random, p: float) -> int:
    """Failures before the first success of a Bernoulli(p) (0 when p is 1)."""
    if p >= 1.0:
        return 0
    return int(math.log(1.0 - rng.random()) / math.log(1.0 - p))


def _lognormal(rng: random.Random, mean: int, sigma: float = 0.6) -> int:
    """A log-normal length of mean `mean` tokens, at least 1."""
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))
