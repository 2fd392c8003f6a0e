"""Prefix caching in the engine model and the simulator: prefill computes only what its cache lacks
(a full hit still recomputes its last block), decode loads only what its cache lacks, capacity is
shared with the running requests, and one engine that never evicts finds every block the Mooncake
trace repeats."""

from __future__ import annotations

import json
import struct
from collections.abc import Hashable
from pathlib import Path

import pytest

from tests.paths import FIXTURE_TRACES, H200_PROFILE, TRACES
from tests.unit.test_sim_core import LinearPerf, drive, times
from xpyd.api.naming import DECODE, PREFILL
from xpyd.kvcache.chains import TraceKeys, repeat_share
from xpyd.kvcache.pool import BlockKeys
from xpyd.sim.core import EngineConfig, EngineCore, EngineRequest, EventKind
from xpyd.sim.report import build_report, prefix_cache, summary
from xpyd.sim.simulator import SimConfig, simulate
from xpyd.traces import TraceRequest, read_trace

pytestmark = pytest.mark.unit

K = BlockKeys.of(["k0", "k1"])   # the keys of two full 16-token blocks


def prefill(core: EngineCore, name: str, prompt: int, keys: BlockKeys) -> EngineRequest:
    """Run one request alone to completion on an idle engine; returns it."""
    request = EngineRequest(name, prompt, 1, block_keys=keys)
    core.add(request, 0.0)
    drive(core)
    return request


@pytest.mark.parametrize(("q", "costs_marginal"), [(0.0, False), (1e-4, True)])
def test_a_prefill_computes_only_what_its_cache_lacks(q: float, costs_marginal: bool) -> None:
    perf = LinearPerf(q=q)
    core = EngineCore(perf, EngineConfig(block_size=16))
    prefill(core, "a", 32, K)
    # A full hit is capped at prompt - 1 tokens: the last block is computed again.
    again = EngineRequest("again", 32, 1, block_keys=K)
    core.add(again, 0.0)
    step = core.next_step(0.0)
    assert step is not None and step.prefill == ((again, 16),)
    assert again.cached_tokens == 16
    # A chunk continued from a cached prefix costs at least its batch's time, or its marginal cost in context.
    marginal = perf.prefill_seconds(32) - perf.prefill_seconds(16)
    assert step.step_seconds == pytest.approx(marginal if costs_marginal else perf.prefill_seconds(16))
    assert (marginal > perf.prefill_seconds(16)) is costs_marginal
    core.complete(step, step.end)
    longer = prefill(core, "longer", 40, K)       # both blocks hit, the 8 tokens after them are computed
    assert longer.cached_tokens == 32
    other = prefill(core, "other", 40, BlockKeys.of(["x0", "x1"]))
    assert other.cached_tokens == 0
    metrics = core.metrics
    assert (metrics.prefix_cache_queries, metrics.prefix_cache_hits) == (32 + 32 + 40 + 40, 16 + 32)
    assert metrics.prompt_tokens_local_compute == 32 + 16 + 8 + 40
    assert metrics.prompt_tokens_local_cache_hit == 48 and metrics.prompt_tokens_total == 144


def test_a_decode_leg_loads_only_what_its_cache_lacks() -> None:
    perf = LinearPerf()
    core = EngineCore(perf, EngineConfig(block_size=16))

    def hand_off(name: str, prompt: int, at: float) -> float:
        core.add(EngineRequest(name, prompt, 10, do_remote_prefill=True, block_keys=K), at)
        events = drive(core)
        return times(events, EventKind.KV_LOADED)[name]

    assert hand_off("a", 40, 0.0) == pytest.approx(perf.kv_transfer_seconds(40))
    assert hand_off("b", 40, 0.0) == pytest.approx(perf.kv_transfer_seconds(40 - 32))
    assert core.metrics.prompt_tokens_external_kv_transfer == 40 + 8
    assert core.metrics.prompt_tokens_local_cache_hit == 32
    # Each left a block of generated tokens (40 + 10 - 1 tokens have KV: 3 full blocks, 2 of them the
    # prompt's), freed before its prompt's blocks; b's hits were a's, freed again after b's output.
    assert core.pool is not None and core.pool.cached_free_keys() == [None, None, ("k1", 0), ("k0", 0)]


def test_blocks_still_transferring_are_not_hit() -> None:
    # b is admitted while a's KV is on its way: a's blocks are cached only once it has landed (vLLM
    # caches a remote prefill's blocks when its load finishes), so b loads everything too.
    core = EngineCore(LinearPerf(), EngineConfig(block_size=16))
    for name in ("a", "b"):
        core.add(EngineRequest(name, 40, 4, do_remote_prefill=True, block_keys=K), 0.0)
    drive(core)
    assert core.metrics.prompt_tokens_external_kv_transfer == 80 and core.metrics.prefix_cache_hits == 0


def test_the_cache_holds_what_the_running_requests_leave() -> None:
    core = EngineCore(LinearPerf(max_kv_tokens=64), EngineConfig(block_size=16))   # 4 blocks
    prefill(core, "a", 32, K)                     # frees k1 k0 into the cache
    b = EngineRequest("b", 40, 10, block_keys=BlockKeys.of(["b0", "b1"]))   # holds (40 + 10) // 16 = 3 blocks
    core.add(b, 0.0)
    step = core.next_step(0.0)
    assert step is not None
    core.complete(step, step.end)
    assert core.pool is not None and core.pool.cached_free_keys() == [("k0", 0)]   # k1, freed first, was evicted
    drive(core)
    assert prefill(core, "c", 33, K).cached_tokens == 16


def test_without_prefix_caching_nothing_hits() -> None:
    core = EngineCore(LinearPerf(), EngineConfig(enable_prefix_caching=False))
    prefill(core, "a", 32, K)
    assert core.pool is None and prefill(core, "b", 40, K).cached_tokens == 0
    assert core.metrics.prefix_cache_queries == 0 and core.metrics.prompt_tokens_local_compute == 72


def mooncake() -> list[TraceRequest]:
    return read_trace(TRACES / "mooncake_synthetic.jsonl")


def never_evicting_hits(trace: list[TraceRequest], block_size: int) -> int:
    """Prompt tokens one engine that never evicts finds cached when it sees the requests in turn."""
    made = TraceKeys([r.prefix_blocks for r in trace], [r.isl for r in trace], block_size)
    seen: set[tuple[Hashable, int]] = set()
    hits = 0
    for index, request in enumerate(trace):
        found_keys = made.keys(index)
        keys = found_keys.per_block() if found_keys is not None else []
        found = 0
        while found < min(len(keys), (request.isl - 1) // block_size) and keys[found] in seen:
            found += 1
        hits += found * block_size
        seen.update(keys)
    return hits


def test_one_engine_that_never_evicts_finds_every_block_the_trace_repeats() -> None:
    from tests.unit.test_simulator import real_perf

    trace = mooncake()
    result = simulate(trace, real_perf(), SimConfig(prefill=1, decode=1, engine=EngineConfig(max_kv_tokens=10**12)))
    cache = prefix_cache(result)[PREFILL]
    assert cache["cached_tokens"] == never_evicting_hits(trace, 16)
    assert cache["hit_rate"] >= repeat_share(r.prefix_blocks for r in trace) > 0.63
    assert cache["computed_tokens"] == cache["prompt_tokens"] - cache["cached_tokens"]


def test_a_trace_without_prefix_blocks_shares_nothing_and_the_report_says_what_hit() -> None:
    from tests.unit.test_simulator import LinearPerf as SimPerf

    head = mooncake()[:60]
    bare = [TraceRequest(r.arrival_s, r.isl, r.osl) for r in head]
    config = SimConfig(prefill=1, decode=1)
    without = build_report(simulate(bare, SimPerf(), config))["prefix_cache"]
    assert without[PREFILL]["cached_tokens"] == without[DECODE]["cached_tokens"] == 0
    assert without[DECODE]["transferred_tokens"] == without[DECODE]["prompt_tokens"] == sum(r.isl for r in head)
    result = simulate(head, SimPerf(), config)
    report = build_report(result)
    cache = report["prefix_cache"]
    assert cache[PREFILL]["cached_tokens"] > 0 and cache[DECODE]["cached_tokens"] > 0
    for role in (PREFILL, DECODE):
        found = [c for c in result.cached_tokens[role] if c >= 0]
        assert sum(found) == cache[role]["cached_tokens"] and len(found) == len(head)
        rates = [r for r in report["timeline"][f"{role}_hit_rate"] if r is not None]
        assert rates and max(rates) > 0
    assert cache[DECODE]["transferred_tokens"] == cache[DECODE]["prompt_tokens"] - cache[DECODE]["cached_tokens"]
    assert f"prefill hit {cache[PREFILL]['hit_rate']:.1%}" in summary(report)
    off = simulate(head, SimPerf(), SimConfig(prefill=1, decode=1, engine=EngineConfig(enable_prefix_caching=False)))
    assert "prefix cache: off" in summary(build_report(off))
    assert result.busy_seconds[PREFILL] < off.busy_seconds[PREFILL]


def png_height(path: Path) -> int:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int(struct.unpack(">I", data[20:24])[0])


def test_xpyd_sim_reports_prints_and_plots_the_hits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.unit.test_simulator import parse

    trace = FIXTURE_TRACES / "mooncake_synthetic_head50.jsonl"
    base = ("--trace", str(trace), "--profile", str(H200_PROFILE), "--report", str(tmp_path / "r.json"),
            "--plot", str(tmp_path / "r.png"))
    args = parse(*base)
    assert args.func(args) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    cache = report["prefix_cache"][PREFILL]
    assert cache["cached_tokens"] > 0 and report["config"]["block_size"] == 16
    assert f"prefix cache: prefill hit {cache['hit_rate']:.1%}" in capsys.readouterr().out
    assert png_height(tmp_path / "r.png") == 12 * 110        # the fifth panel: hit rates over time
    args = parse(*base, "--no-enable-prefix-caching", "--block-size", "32")
    assert args.func(args) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["prefix_cache"][PREFILL]["cached_tokens"] == 0 and report["config"]["block_size"] == 32
    assert "prefix cache: off" in capsys.readouterr().out
    assert png_height(tmp_path / "r.png") == 10 * 110
