"""The synthetic multi-turn workload (`xpyd.workloads.conversations`): its prefixes are the conversations'
text, shared where the text is."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from xpyd.kvcache.chains import repeat_share
from xpyd.workloads import BLOCK_TOKENS, Conversations, conversations

pytestmark = pytest.mark.unit


def test_each_turn_repeats_the_conversation_so_far_and_partial_blocks_are_its_own() -> None:
    spec = Conversations(conversations=40, mean_turns=4.0, system_prompts=2, system_tokens=1024, seed=7)
    trace = conversations(spec)
    assert trace == conversations(spec)                       # seeded: the same workload every time
    assert trace[0].arrival_s == 0 and all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(trace))
    counts = Counter(block for request in trace for block in request.prefix_blocks)
    system_ids = set(range(spec.system_prompts * spec.system_tokens // BLOCK_TOKENS))
    for request in trace:
        blocks = request.prefix_blocks
        assert len(blocks) == -(-request.isl // BLOCK_TOKENS)
        assert set(blocks[:2]) <= system_ids and not set(blocks[2:]) & system_ids
        assert blocks[:2] in ((0, 1), (2, 3))
        if request.isl % BLOCK_TOKENS:
            assert counts[blocks[-1]] == 1                    # a partial last block: text no one else has
        assert request.isl + request.osl <= spec.max_context
    # A conversation's later turn extends an earlier one's full blocks: find each turn's predecessor.
    by_last_full = {request.prefix_blocks[:request.isl // BLOCK_TOKENS]: request for request in trace}
    extended = sum(1 for request in trace for cut in range(3, request.isl // BLOCK_TOKENS)
                   if by_last_full.get(request.prefix_blocks[:cut], request) is not request)
    assert extended > 0
    assert repeat_share(r.prefix_blocks for r in trace) > 0.5


def test_the_default_workload_is_mostly_repeated_text() -> None:
    trace = conversations()
    assert 14000 < len(trace) < 16000
    assert 0.8 < repeat_share(r.prefix_blocks for r in trace) < 0.9


def test_a_workload_without_any_turn_is_refused() -> None:
    with pytest.raises(ValueError, match="no conversation has a first turn within max_context"):
        conversations(Conversations(conversations=3, system_tokens=4000, max_context=4002, user_tokens=50))


@pytest.mark.parametrize(("fields", "message"), [
    ({"conversations": 0}, "at least 1"),
    ({"rate_per_s": 0.0}, "rate_per_s must be positive"),
    ({"mean_turns": 0.5}, "mean_turns at least 1"),
    ({"max_context": 4097}, "max_context must leave room"),
])
def test_a_workload_spec_refuses_what_cannot_be_built(fields: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Conversations(**fields)  # type: ignore[arg-type]
