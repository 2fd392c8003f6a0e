"""What `xpyd bench` sends and when: the arrival schedule and the prompts (pure; no I/O).

Arrivals are wall seconds from the run's start. A trace's are its own timestamps (already windowed
and divided by the speed-up by `xpyd.traces.load_trace`); a synthetic load is a Poisson process
with fixed prompt and output lengths.

Prompts are text of about ISL tokens: ISL words from a list of common English words that are one
token each in current BPE vocabularies (Llama 3, GPT-4 style: a leading space and three letters)
and four characters each, so that `xpyd engine-sim` and the proxy, which count four characters a
token, see exactly ISL tokens. Words are drawn per 512-token block from a seeded generator: blocks
of different requests differ (no accidental prefix-cache hits), while Mooncake traces' `hash_ids`
(equal ids: a shared 512-token prefix block) give equal blocks equal text, so shared prefixes stay
shared on the wire.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from xpyd.traces import TraceRequest

PROMPT_WORDS = (" the", " and", " for", " are", " but", " not", " you", " all", " any", " can", " had",
                " her", " was", " one", " our", " out", " day", " get", " has", " him", " his", " how",
                " man", " new", " now", " old", " see", " two", " way", " who", " did", " its", " let",
                " put", " say", " she", " too", " use")
"""One-token, four-character words: the prompt's alphabet."""
BLOCK_TOKENS = 512
"""Tokens per prefix block, as Mooncake's `hash_ids` count them."""


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request to send: its position, its send time (wall seconds from the start), its lengths."""

    index: int
    at_s: float
    isl: int
    osl: int
    prefix_blocks: tuple[int, ...] = ()


def trace_arrivals(requests: Sequence[TraceRequest], max_requests: int | None = None) -> list[Arrival]:
    """A trace's requests (arrival times already in wall seconds) as arrivals, the first `max_requests`."""
    ordered = sorted(requests, key=lambda r: r.arrival_s)[:max_requests]
    return [Arrival(i, r.arrival_s, r.isl, r.osl, r.prefix_blocks) for i, r in enumerate(ordered)]


def poisson_arrivals(rate_rps: float, isl: int, osl: int, *, duration_s: float | None = None,
                     max_requests: int | None = None, seed: int = 0) -> list[Arrival]:
    """A Poisson process of `rate_rps` over [0, duration_s), at most `max_requests` (one bound needed).

    The first request goes at 0, so even a short run sends something.
    """
    if not rate_rps > 0 or not math.isfinite(rate_rps):
        raise ValueError(f"rate must be a positive number of requests per second, not {rate_rps}")
    if isl < 1 or osl < 1:
        raise ValueError(f"prompt and output lengths must be at least 1 token, not {isl} and {osl}")
    if duration_s is None and max_requests is None:
        raise ValueError("a synthetic load needs a bound: a duration or a maximum number of requests")
    end_s = math.inf if duration_s is None else duration_s
    limit = math.inf if max_requests is None else max_requests
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    at_s = 0.0
    while at_s < end_s and len(arrivals) < limit:
        arrivals.append(Arrival(len(arrivals), at_s, isl, osl))
        at_s += rng.expovariate(rate_rps)
    return arrivals


@functools.lru_cache(maxsize=4096)
def block_text(key: str, tokens: int) -> str:
    """`tokens` words drawn by a generator seeded with `key` (cached: shared blocks repeat)."""
    return "".join(random.Random(key).choices(PROMPT_WORDS, k=tokens))


def build_prompt(arrival: Arrival, seed: int = 0) -> str:
    """A prompt of `arrival.isl` words (tokens): one block of text per 512 tokens, a prefix block's
    text keyed by its hash id, any other block's by the run's seed, the request and the block."""
    blocks = []
    for number in range(math.ceil(arrival.isl / BLOCK_TOKENS)):
        tokens = min(BLOCK_TOKENS, arrival.isl - number * BLOCK_TOKENS)
        if number < len(arrival.prefix_blocks):
            key = f"prefix {arrival.prefix_blocks[number]}"
        else:
            key = f"request {seed} {arrival.index} {number}"
        blocks.append(block_text(key, tokens))
    return "".join(blocks)


def completion_body(arrival: Arrival, model: str | None, seed: int = 0) -> dict[str, Any]:
    """The streamed `/v1/completions` body of an arrival. `ignore_eos` with `min_tokens` = `max_tokens`
    = OSL makes vLLM produce exactly OSL tokens (as vLLM's own benchmarks ask)."""
    body: dict[str, Any] = {"prompt": build_prompt(arrival, seed), "max_tokens": arrival.osl,
                            "min_tokens": arrival.osl, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if model is not None:
        body = {"model": model, **body}
    return body
