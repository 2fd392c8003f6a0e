"""The prefix caches keep runs of blocks (`xpyd.kvcache.pool.BlockPool`) and give the replays vLLM's
pool block by block gives (`tests/kvcache_reference.py`): Mooncake windows replayed both ways hit,
compute, load and time every request the same. The runs pool replays here, compiled when the build is
in use; the reference in a pure-Python child, where the engines' pool can be swapped (a compiled module
cannot be patched). The configurations make the pools work: the H200's capacity, small ones that
evict all the time, a block size that does not divide the trace's 512-token blocks, chunks that end
inside runs, and rate-scaled copies that hit each other, or miss side by side and cache the same blocks
twice. (tests/unit/test_kvcache.py drives both pools through random operations, which reach what these
replays rarely do.)"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.paths import H200_PROFILE, ROOT, TRACES
from xpyd.perf.model import PerfModel
from xpyd.sim.core import EngineConfig
from xpyd.sim.simulator import SimConfig, simulate
from xpyd.traces import load_trace

pytestmark = pytest.mark.integration

KV_BYTES_LLAMA_8B_BF16 = 2 * 32 * 8 * 128 * 2
CASES: dict[str, dict[str, Any]] = {
    # name: load_trace's arguments, the pools (prefill, decode), the engines' configuration
    "h200": {"trace": {"duration_s": 150.0}, "pools": (2, 1), "engine": {}},
    "blocks of 96": {"trace": {"duration_s": 150.0}, "pools": (1, 1),
                     "engine": {"max_kv_tokens": 60_000, "block_size": 96, "max_num_batched_tokens": 3000}},
    # Copies a few prompts apart, on pools that hold a few prompts: runs are hit while others' tails
    # are evicted (a pool that evicted a run's head instead fails these two).
    "copies": {"trace": {"duration_s": 60.0, "rate_scale": 4}, "pools": (1, 1),
               "engine": {"max_kv_tokens": 120_000, "max_num_batched_tokens": 2048}},
    "evicting": {"trace": {"duration_s": 100.0, "rate_scale": 2}, "pools": (1, 1),
                 "engine": {"max_kv_tokens": 40_000}},
}


def replay(name: str) -> dict[str, Any]:
    """One case's replay: per request TTFT, end, prompt tokens found cached and computed per role."""
    case = CASES[name]
    trace = load_trace(TRACES / "mooncake_synthetic.jsonl", **case["trace"])
    perf = PerfModel.from_profile(H200_PROFILE).with_kv_transfer(KV_BYTES_LLAMA_8B_BF16, 100.0)
    prefill, decode = case["pools"]
    result = simulate(trace, perf, SimConfig(prefill=prefill, decode=decode, engine=EngineConfig(**case["engine"])))
    return {"ttft_s": result.ttft_s, "e2e_s": result.e2e_s, "cached": result.cached_tokens,
            "computed": result.computed_tokens, "events": result.events, "end_s": result.end_s,
            "busy_seconds": result.busy_seconds}


CHILD = """
import json, sys
import xpyd.sim.core
from tests.integration.test_prefix_cache_reference import replay
from tests.kvcache_reference import ReferencePool
from xpyd.common import native
assert not native.compiled()
xpyd.sim.core.BlockPool = ReferencePool     # every engine keeps vLLM's pool block by block
print(json.dumps({name: replay(name) for name in sys.argv[1:]}))
"""


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    child = subprocess.run([sys.executable, "-c", CHILD, *CASES], cwd=ROOT, env={**os.environ, "XPYD_NATIVE": "off"},
                           capture_output=True, text=True, timeout=600, check=False)
    assert child.returncode == 0, child.stderr
    replays: dict[str, Any] = json.loads(child.stdout)
    return replays


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_mooncake_window_replays_the_same_with_runs_and_block_by_block(name: str, reference: dict[str, Any]) -> None:
    runs = json.loads(json.dumps(replay(name)))
    block_by_block = reference[name]
    assert sum(c for c in runs["cached"]["prefill"] if c > 0) > 0       # the caches hit
    for field in ("cached", "computed", "events", "end_s", "busy_seconds"):
        assert runs[field] == block_by_block[field], field
    for field in ("ttft_s", "e2e_s"):
        assert [None if math.isnan(t) else t for t in runs[field]] == \
               [None if math.isnan(t) else t for t in block_by_block[field]], field
