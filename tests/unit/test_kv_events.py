"""vLLM's KV events (`xpyd.kvcache.events`): the per-release encoding, byte for byte as vLLM's own
msgspec classes write it (the payloads below were written by each release's `KVEventBatch`; the
conformance suite decodes the codec's output with those classes for every release), decoding any
release's, the ZMQ framing; and the block pool's listener, which must report what it caches and
evicts in the order vLLM's pool kept block by block does (`tests/kvcache_reference.py`)."""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence

import pytest

from tests.kvcache_reference import BlockByBlock, HeldBlocks, ReferencePool, RunTree
from xpyd import vllm
from xpyd.kvcache import events
from xpyd.kvcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventBatch,
    decode_batch,
    encode_batch,
    external_block_hash,
    offset_endpoint_port,
    parse_published,
    parse_replay_request,
    publish_frames,
    replay_reply,
)
from xpyd.kvcache.pool import BlockKeys, BlockPool, RequestBlocks

pytestmark = pytest.mark.unit

#: One batch written by each release's own `KVEventBatch` (msgspec 0.23): BlockStored(block_hashes=[123,
#: b"\x01"], parent_block_hash=None, token_ids=[1, 2], block_size=16, lora_id=None, medium="GPU",
#: lora_name=None, extra_keys=[None, None], group_idx=0), BlockRemoved(block_hashes=[5], medium="GPU",
#: group_idx=0), AllBlocksCleared(); ts=1.5, data_parallel_rank=0 (fields a release lacks left out).
WRITTEN_BY_VLLM = {
    (0, 13): "93cb3ff80000000000009397ab426c6f636b53746f726564927bc40101c092010210c0a347505593ac426c6f636b5265"
             "6d6f7665649105a347505591b0416c6c426c6f636b73436c656172656400",
    (0, 18): "93cb3ff80000000000009399ab426c6f636b53746f726564927bc40101c092010210c0a3475055c092c0c093ac426c6f"
             "636b52656d6f7665649105a347505591b0416c6c426c6f636b73436c656172656400",
    (0, 23): "93cb3ff8000000000000939cab426c6f636b53746f726564927bc40101c092010210c0a3475055c092c0c000c0c094ac"
             "426c6f636b52656d6f7665649105a34750550091b0416c6c426c6f636b73436c656172656400",
    (0, 24): "93cb3ff8000000000000938aa474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573927bc40101b1"
             "706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473920102aa626c6f636b5f73697a6510a76c6f72"
             "615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f7570"
             "5f6964780084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739105a66d656469756da3"
             "475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400",
}
WRITTEN_BY_VLLM[(0, 33)] = WRITTEN_BY_VLLM[(0, 24)]


def the_batch() -> EventBatch:
    return EventBatch(1.5, [BlockStored([123, b"\x01"], None, [1, 2], 16, extra_keys=[None, None], group_idx=0),
                            BlockRemoved([5], group_idx=0), AllBlocksCleared()], data_parallel_rank=0)


@pytest.mark.parametrize("version", sorted(WRITTEN_BY_VLLM))
def test_a_batch_is_written_as_each_release_writes_it(version: tuple[int, int]) -> None:
    assert encode_batch(the_batch(), version).hex() == WRITTEN_BY_VLLM[version]


@pytest.mark.parametrize("version", sorted(WRITTEN_BY_VLLM))
def test_every_releases_batch_decodes(version: tuple[int, int]) -> None:
    batch = decode_batch(bytes.fromhex(WRITTEN_BY_VLLM[version]))
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert isinstance(cleared, AllBlocksCleared)
    assert (batch.ts, batch.data_parallel_rank) == (1.5, 0)
    assert stored.block_hashes == [123, b"\x01"] and stored.token_ids == [1, 2] and stored.block_size == 16
    assert stored.medium == removed.medium == "GPU" and removed.block_hashes == [5]
    assert stored.extra_keys == (None if version < (0, 18) else [None, None])
    assert stored.group_idx == removed.group_idx == (None if version < (0, 23) else 0)


def test_the_codecs_release_boundaries_are_vllms_facts() -> None:
    assert events.TAGGED_MAPS == vllm.KV_EVENTS_TAGGED_MAPS
    assert events.REPLAY_TOPIC == vllm.KV_EVENTS_REPLAY_TOPIC_ADDED


def test_maps_leave_out_defaults_and_arrays_keep_every_field() -> None:
    stored = BlockStored([1], 7, [3], 1, session_id="s", lookahead_token_ids=[[4]])
    array = events.event_object(stored, (0, 23))
    assert array == ["BlockStored", [1], 7, [3], 1, None, "GPU", None, None, None, None, None]
    assert events.event_object(stored, (0, 32)) == {
        "type": "BlockStored", "block_hashes": [1], "parent_block_hash": 7, "token_ids": [3], "block_size": 1,
        "lora_id": None, "medium": "GPU", "lora_name": None, "session_id": "s"}
    assert events.event_object(stored, (0, 33))["lookahead_token_ids"] == [[4]]   # type: ignore[call-overload]
    assert events.event_object(AllBlocksCleared(), (0, 13)) == ["AllBlocksCleared"]


def test_a_newer_releases_array_and_unknown_map_keys_decode() -> None:
    import msgpack

    longer = msgpack.packb([2.0, [["BlockRemoved", [9], "GPU", 0, "LOCAL", "x", "future"]], None])
    assert decode_batch(longer).events == [BlockRemoved([9], "GPU", 0, "LOCAL", "x")]
    mapped = msgpack.packb([2.0, [{"type": "BlockRemoved", "block_hashes": [b"h"], "medium": None, "new": 1}], 3])
    assert decode_batch(mapped).events == [BlockRemoved([b"h"], None)]


@pytest.mark.parametrize("payload", [
    b"\xc1", b"\x93\x01", b"\x92\xa1x\x90", b"\x93\xcb" + bytes(8) + b"\x91\x91\xa4Nope\xc0",
    b"\x93\xcb" + bytes(8) + b"\x91\x92\xacBlockRemoved\x90\xc0",   # no medium
    b"\x93\xcb" + bytes(8) + b"\x91\x93\xacBlockRemoved\x91\xa1x\xa3GPU\xc0",   # a hash that is a string
])
def test_what_is_no_batch_fails_to_decode(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_batch(payload)


@pytest.mark.parametrize("extra_keys", [[5], 7, ["salt"], [[1], 2]])
def test_malformed_extra_keys_fail_to_decode(extra_keys: object) -> None:
    import msgpack

    stored = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
              "block_size": 2, "lora_id": None, "medium": "GPU", "extra_keys": extra_keys}
    with pytest.raises(DecodeError, match="extra_keys"):
        decode_batch(msgpack.packb([1.0, [stored], None]))


def test_block_hashes_are_published_as_their_low_64_bits_or_their_bytes() -> None:
    digest = bytes(range(32))
    assert external_block_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert external_block_hash(digest, as_int=False) == digest


def test_frames_replay_and_data_parallel_ports() -> None:
    payload = encode_batch(EventBatch(3.0, [AllBlocksCleared()], 1))
    frames = publish_frames("kv", 258, payload)
    assert frames[:2] == (b"kv", b"\x00\x00\x00\x00\x00\x00\x01\x02")
    topic, seq, batch = parse_published(frames)
    assert (topic, seq, batch.data_parallel_rank, batch.events) == ("kv", 258, 1, [AllBlocksCleared()])
    assert parse_replay_request([b"id", b"", (5).to_bytes(8, "big")]) == (b"id", 5)
    assert parse_replay_request([b"id", (5).to_bytes(8, "big")]) is None
    buffered = [(4, b"a"), (5, b"b"), (6, b"c")]
    end = b"\xff" * 8
    assert list(replay_reply((0, 33), b"id", "kv", buffered, 5)) == [
        (b"id", b"", b"kv", (5).to_bytes(8, "big"), b"b"), (b"id", b"", b"kv", (6).to_bytes(8, "big"), b"c"),
        (b"id", b"", b"", end, b"")]
    assert list(replay_reply((0, 24), b"id", "kv", buffered, 6)) == [
        (b"id", b"", (6).to_bytes(8, "big"), b"c"), (b"id", b"", end, b"")]
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://127.0.0.1:0", 2) == "tcp://127.0.0.1:0"
    assert offset_endpoint_port("inproc://cache", 1) == "inproc://cache_dp1"
    with pytest.raises(ValueError, match="inproc"):
        offset_endpoint_port("ipc:///tmp/x", 1)


# --- the pool's listener -----------------------------------------------------------------------------

Event = tuple[str, Hashable | None]


class Recorder:
    """A `PoolListener` writing one entry per block: ("stored", key) and ("removed", key)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def stored(self, keys: BlockKeys, start: int, end: int) -> None:
        self.events += [("stored", key) for key in keys.per_block()[start:end]]

    def removed(self, run: Hashable | None, lo: int, hi: int) -> None:
        self.events += [("removed", None if run is None else (run, index)) for index in range(hi - 1, lo - 1, -1)]

    def cleared(self) -> None:
        self.events.append(("cleared", None))


class RecordingBlocks(BlockByBlock):
    """The reference pool, block by block, with what it caches and evicts written down."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.events: list[Event] = []

    def cache(self, held: HeldBlocks, keys: Sequence[Hashable], full_blocks: int) -> None:
        before = len(held.cached)
        super().cache(held, keys, full_blocks)
        self.events += [("stored", block.key) for block in held.cached[before:]]

    def _evict(self) -> None:
        excess = self.num_cached_free - (self.num_blocks - self.in_use)
        if excess > 0:
            self.events += [("removed", key) for key in self.cached_free_keys()[:excess]]
        super()._evict()


def test_the_listener_hears_a_hand_computed_sequence() -> None:
    pool = BlockPool(3)
    heard = Recorder()
    pool.listener = heard
    a = pool.admit(BlockKeys.of(["a", "b"]), 2, 2)
    pool.cache(a, BlockKeys.of(["a", "b"]), 1)
    pool.cache(a, BlockKeys.of(["a", "b"]), 2)
    pool.free(a)                                       # b, then a, join the free list
    c = pool.admit(BlockKeys.of(["c", "d"]), 2, 3)     # three new blocks: b and a are evicted, in that order
    pool.cache(c, BlockKeys.of(["c", "d"]), 2)
    assert heard.events == [("stored", ("a", 0)), ("stored", ("b", 0)), ("removed", ("b", 0)),
                            ("removed", ("a", 0)), ("stored", ("c", 0)), ("stored", ("d", 0))]
    assert not pool.reset()                            # c holds blocks
    pool.free(c)
    assert pool.reset() and pool.num_cached_free == 0 and pool.lookup(BlockKeys.of(["c"]), 1) == 0
    assert heard.events[-1] == ("cleared", None)
    d = pool.admit(BlockKeys.of(["c"]), 1, 3)          # nothing cached, nothing to evict
    assert d.hit == 0 and heard.events[-1] == ("cleared", None)


def test_a_run_evicted_from_its_tail_is_heard_block_by_block() -> None:
    pool = BlockPool(8)
    heard = Recorder()
    pool.listener = heard
    held = pool.admit(BlockKeys(["r"], [6]), 6, 6)
    pool.cache(held, BlockKeys(["r"], [6]), 6)
    pool.free(held)
    pool.admit(None, 0, 5)                             # 5 new blocks: 2 free ones, then r's last 3
    assert heard.events[-3:] == [("removed", ("r", 5)), ("removed", ("r", 4)), ("removed", ("r", 3))]


@pytest.mark.parametrize("seed", range(30))
def test_the_listener_hears_what_vllms_pool_caches_and_evicts_block_by_block(seed: int) -> None:
    """Random requests over a tree of runs (as tests/unit/test_kvcache.py drives the two pools): after
    every operation the runs pool's listener has heard the very blocks, in the very order, that the
    block-by-block pool cached and evicted."""
    rng = random.Random(seed)
    num_blocks = rng.choice([4, 8, 16, 40])
    per_run = rng.choice([1, 2, 3, 8])
    fast, reference = BlockPool(num_blocks), ReferencePool(num_blocks)
    recording = RecordingBlocks(num_blocks)
    reference.blocks = recording
    heard = Recorder()
    fast.listener = heard
    prompt = RunTree(rng, per_run, 4).prompt

    live: list[tuple[BlockKeys, RequestBlocks, RequestBlocks]] = []
    for _ in range(250):
        choice = rng.random()
        if choice < 0.4 or not live:
            keys = prompt()
            blocks = keys.blocks + rng.randint(0, 2)
            if fast.in_use + blocks > num_blocks:
                continue
            cap = rng.randint(0, blocks)
            live.append((keys, fast.admit(keys, cap, blocks), reference.admit(keys, cap, blocks)))
        elif choice < 0.75:
            keys, a, b = rng.choice(live)
            full = a.cached + rng.randint(0, keys.blocks)
            fast.cache(a, keys, full)
            reference.cache(b, keys, full)
        else:
            keys, a, b = live.pop(rng.randrange(len(live)))
            generated = rng.randint(0, a.count - a.cached)
            fast.free(a, generated)
            reference.free(b, generated)
        assert heard.events == recording.events
    assert any(kind == "removed" for kind, _ in heard.events) or num_blocks >= 40
