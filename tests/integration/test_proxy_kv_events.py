"""The proxy's direct reading of KV event batches (`kvevents.index_update`) against the codec's full
decoder, in every release's encoding; and benchmarks/kv_events_bench.py end to end on a small slice."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import msgpack
import pytest

from tests.integration.test_engine_sim_kv_blocks import random_event
from xpyd.kvcache import events
from xpyd.proxy.kvevents import CLEAR, REMOVE, STORE, _update_of, index_update

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RELEASES = [(0, 13), (0, 16), (0, 18), (0, 23), (0, 24), (0, 32), (0, 33)]


@pytest.mark.parametrize("version", RELEASES, ids=[f"{a}.{b}" for a, b in RELEASES])
def test_a_batch_reads_as_the_full_decoder_reads_it(version: events.Version) -> None:
    rng = random.Random(version[1])
    for _ in range(200):
        batch = events.EventBatch(rng.choice([1.25, 1_700_000_000.5, 3]),
                                  [random_event(rng) for _ in range(rng.randint(0, 20))], rng.choice([None, 1]))
        payload = events.encode_batch(batch, version)
        assert index_update(payload) == _update_of(events.decode_batch(payload))


def test_the_changes_the_index_takes() -> None:
    batch = events.EventBatch(5.0, [
        events.BlockStored(block_hashes=[1, b"\x00" * 24 + (2).to_bytes(8, "big")], parent_block_hash=None,
                           token_ids=[0] * 32, block_size=16),
        events.BlockRemoved(block_hashes=[b"\xff" * 24 + (3).to_bytes(8, "big")], medium="CPU"),
        events.AllBlocksCleared()])
    update = index_update(events.encode_batch(batch))
    assert update.ts == 5.0
    assert update.changes == [(STORE, [1, 2], 16, "GPU"), (REMOVE, [3], None, "CPU"), (CLEAR, [], None, None)]


@pytest.mark.parametrize("payload", [
    b"not msgpack \xc1",
    msgpack.packb({"ts": 1}),
    msgpack.packb([1.0, [{"type": "BlockEvicted", "block_hashes": [1]}], None]),
    msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": ["one"]}], None]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}], None]),
    msgpack.packb([1.0, [["BlockRemoved"]], None]),
    msgpack.packb(["now", [], None]),
], ids=["garbage", "a-map", "unknown-tag", "a-string-hash", "no-block-size", "short-array", "a-string-ts"])
def test_what_the_full_decoder_refuses_is_refused(payload: bytes) -> None:
    with pytest.raises(events.DecodeError):
        events.decode_batch(payload)
    with pytest.raises(events.DecodeError):
        index_update(payload)


def test_the_benchmark_runs(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import kv_events_bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out = tmp_path / "figures.json"
    assert kv_events_bench.main(["--requests", "16", "--speedup", "40", "--time-scale", "40", "--prefill", "2",
                                 "--sample-s", "0.3", "--gc-freeze", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["requests"] == 16 and figures["failed"] == 0
    assert figures["agreement"]["after"] == 1.0
    assert figures["lag_ms"]["prefill"]["batches"] > 0
