"""The router's prefix index (`xpyd.kvcache.index`): matching from the first block, the touch order
and its capacity, the TTL of routed entries, and what the engines' events do to it."""

from __future__ import annotations

import math

import pytest

from xpyd.kvcache.index import PrefixIndex
from xpyd.kvcache.pool import BlockKeys

pytestmark = pytest.mark.unit


def runs(*pairs: tuple[str, int]) -> BlockKeys:
    return BlockKeys([run for run, _ in pairs], [length for _, length in pairs])


@pytest.mark.parametrize(("held", "request_runs", "limit", "hit"), [
    ({}, [("a", 3)], 10, 0),                                   # nothing held
    ({"a": 3}, [("a", 3)], 10, 3),                             # all of it
    ({"a": 3}, [("a", 3)], 2, 2),                              # capped (a full hit recomputes its last block)
    ({"a": 2}, [("a", 3), ("b", 2)], 10, 2),                   # a run held in part ends the match there
    ({"a": 5}, [("a", 3), ("b", 2)], 10, 3),                   # another request's longer stretch of the run
    ({"a": 3, "b": 2}, [("a", 3), ("b", 2), ("c", 1)], 10, 5),
    ({"b": 2}, [("a", 3), ("b", 2)], 10, 0),                   # a later run without its parent is no use
])
def test_a_match_counts_the_blocks_held_from_the_first_up_to_the_first_one_missing(
        held: dict[str, int], request_runs: list[tuple[str, int]], limit: int, hit: int) -> None:
    index = PrefixIndex(100)
    for run, blocks in held.items():
        index.store(run, 0.0, blocks)
    assert index.match(runs(*request_runs), 0.0, limit) == hit
    assert index.match(None, 0.0, limit) == 0


def test_recording_holds_every_key_and_storing_never_shrinks_a_run() -> None:
    index = PrefixIndex(100)
    index.record(runs(("a", 3), ("b", 2)), 0.0)
    assert (index.blocks, len(index)) == (5, 2)
    index.store("a", 0.0, 1)
    assert index.match(runs(("a", 3), ("b", 2)), 0.0, 10) == 5
    index.remove("a")
    assert (index.blocks, index.match(runs(("a", 3), ("b", 2)), 0.0, 10)) == (2, 0)
    index.remove("unknown")
    index.clear()
    assert (index.blocks, len(index)) == (0, 0)


def test_over_capacity_the_least_recently_touched_runs_go_first() -> None:
    index = PrefixIndex(4)
    for run in "abcd":
        index.store(run, 0.0)
    index.store("a", 0.0)                  # touched again: now the most recent
    index.store("e", 0.0)                  # one too many: b, the least recent, goes
    assert [index.match(runs((run, 1)), 0.0, 1) for run in "abcde"] == [1, 0, 1, 1, 1]
    index.record(runs(("f", 2)), 0.0)      # two more: c and d go
    assert [index.match(runs((run, 1)), 0.0, 1) for run in "acdef"] == [1, 0, 0, 1, 1]
    assert (index.blocks, index.evicted) == (4, 3)


def test_routed_runs_expire_their_ttl_after_the_last_request_that_carried_them() -> None:
    index = PrefixIndex(100, ttl_s=10.0)
    index.record(runs(("a", 2)), 0.0)
    index.record(runs(("b", 1)), 5.0)
    index.record(runs(("a", 2)), 8.0)      # a renewed until 18
    assert index.match(runs(("a", 2)), 17.9, 5) == 2
    assert index.match(runs(("b", 1)), 15.0, 5) == 0     # expired at 15: forgotten on the way
    assert (index.blocks, len(index)) == (2, 1)
    index.record(runs(("c", 1)), 18.0)                   # recording forgets what expired before it
    assert (index.blocks, len(index)) == (1, 1)


def test_an_expired_run_recorded_again_counts_only_what_is_recorded_now() -> None:
    index = PrefixIndex(100, ttl_s=1.0)
    index.record(runs(("a", 5)), 0.0)
    index.store("a", 2.0, 2)
    assert (index.blocks, index.match(runs(("a", 5)), 2.0, 10)) == (2, 2)


@pytest.mark.parametrize(("capacity", "ttl"), [(0, math.inf), (10, 0.0), (10, -1.0)])
def test_an_index_refuses_no_room_and_a_ttl_that_is_not_positive(capacity: int, ttl: float) -> None:
    with pytest.raises(ValueError, match=r"at least one block|TTL must be positive"):
        PrefixIndex(capacity, ttl)
