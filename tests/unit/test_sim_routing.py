"""The simulated proxy's routing policies (`SimConfig.routing`): where each leg goes, and what
KV-aware routing and the shared-cache ceiling do to the prefill engines' hits."""

from __future__ import annotations

import pytest

from tests.unit.test_sim_core import LinearPerf
from xpyd.api.naming import PREFILL
from xpyd.autoscaler.observation import Desired
from xpyd.sim.policy import StaticPolicy
from xpyd.sim.report import prefix_cache
from xpyd.sim.simulator import (
    EVENTS,
    KV_AWARE,
    LEAST_LOADED,
    POWER_OF_TWO,
    ROUND_ROBIN,
    ROUTED,
    Routing,
    SimConfig,
    SimResult,
    Simulator,
)
from xpyd.traces import TraceRequest

pytestmark = pytest.mark.unit

TURNS = 4
ALL_HITS = 2 * sum(512 * turn for turn in range(TURNS))
"""Both conversations' later turns finding every earlier turn's blocks (a turn adds one 512-token block)."""


def conversation(gap_s: float, first_id: int, offset_s: float) -> list[TraceRequest]:
    """Turn k's prompt: k + 1 blocks of 512 tokens, the earlier turn's and one more."""
    return [TraceRequest(offset_s + k * gap_s, 512 * (k + 1), 4, tuple(range(first_id, first_id + k + 1)))
            for k in range(TURNS)]


TRACE = sorted(conversation(10.0, 0, 0.0) + conversation(10.0, 100, 5.0), key=lambda r: r.arrival_s)
"""Two conversations, turns interleaved and far apart: every engine is idle when a request arrives."""


def replay(routing: Routing, seed: int = 0) -> tuple[SimResult, list[str]]:
    """The result and, per request, the name of the prefill engine that served it."""
    simulator = Simulator(TRACE, LinearPerf(), StaticPolicy(Desired(2, 1)),
                          SimConfig(prefill=2, decode=1, routing=routing, seed=seed))
    result = simulator.run()
    return result, [replica.name if replica else "" for replica in simulator._prefill_of]


@pytest.mark.parametrize("index", [EVENTS, ROUTED])
def test_kv_aware_routing_keeps_each_conversation_where_its_prefix_is_cached(index: str) -> None:
    result, served = replay(Routing(policy=KV_AWARE, index=index))
    assert len(set(served[0::2])) == 1 and len(set(served[1::2])) == 1
    assert prefix_cache(result)[PREFILL]["cached_tokens"] == ALL_HITS


def test_the_ceiling_shares_one_cache_so_any_engine_finds_every_prefix() -> None:
    result, served = replay(Routing(shared_cache=True), seed=3)
    assert len(set(served[0::2])) == 2          # least-loaded's random ties split the conversations...
    assert prefix_cache(result)[PREFILL]["cached_tokens"] == ALL_HITS   # ...and still every prefix hits


@pytest.mark.parametrize("policy", [LEAST_LOADED, POWER_OF_TWO])
def test_blind_policies_split_conversations_across_caches(policy: str) -> None:
    result, served = replay(Routing(policy=policy), seed=3)
    assert len(set(served[0::2])) == 2
    assert prefix_cache(result)[PREFILL]["cached_tokens"] < ALL_HITS


def test_round_robin_takes_the_engines_in_turn() -> None:
    _, served = replay(Routing(policy=ROUND_ROBIN))
    assert served == ["prefill-0", "prefill-1"] * TURNS


@pytest.mark.parametrize(("routing", "message"), [
    ({"policy": "Fastest"}, "routing policy 'Fastest': not one of"),
    ({"index": "Gossip"}, "KV index 'Gossip': not one of"),
    ({"kv_weight": -1.0}, "must not be negative"),
    ({"ttl_s": 0.0}, "ttl_s must be positive"),
])
def test_a_routing_config_refuses_what_cannot_work(routing: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Routing(**routing)  # type: ignore[arg-type]
