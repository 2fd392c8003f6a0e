"""vLLM's KV events on the wire: the three events, their batches, and the ZMQ frames around them.

With `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'` an engine
publishes what its block pool does (`vllm/distributed/kv_events.py`, `vllm/v1/core/block_pool.py`):

- `BlockStored`: blocks became cached (a prompt's full blocks once their tokens are scheduled, or once
  a KV transfer landed; a decode's blocks of generated tokens as they fill): their hashes in order,
  the hash of the block before the first (`parent_block_hash`; None when the first is the request's
  first block), their token ids, the block size, and the request's LoRA adapter, medium, extra keys
  and session.
- `BlockRemoved`: a cached block was evicted (one event per block, in eviction order).
- `AllBlocksCleared`: the prefix cache was reset (`reset_prefix_cache`).

Each scheduler step's events go out as one `EventBatch` `[ts, events, data_parallel_rank]`, msgpack
encoded by msgspec, on a ZMQ PUB socket as three frames: the topic (`topic` of the config, UTF-8),
the batch's sequence number (8 bytes big-endian, from 0), the payload. An optional ROUTER socket
(`replay_endpoint`) answers a request for the batches from a sequence number on out of the last
`buffer_steps` it kept (`replay_reply`). With data parallelism each rank publishes on the endpoint's
port plus its rank (`offset_endpoint_port`).

Per release (the unpacked wheels of 0.13, 0.16, 0.18, 0.23, 0.24, 0.32 and 0.33; tests/conformance
decodes what `encode_batch` writes with each release's own classes):

- The events are msgspec structs tagged with their class name. Up to 0.23 they are `array_like`:
  `["BlockStored", field, field, ...]`, every field of the release in order (msgspec writes an array
  whole, defaults included). From 0.24 they are maps, `{"type": "BlockStored", field: value, ...}`,
  without the fields that hold their default (`omit_defaults`); required fields are always there.
  The `EventBatch` stays an array in every release.
- Fields only ever get appended, so an array's positions mean the same in every release
  (`STORED_FIELDS`, `REMOVED_FIELDS`: each field with the release that added it).
- Block hashes (`ExternalBlockHash = bytes | int`) are the low 64 bits of vLLM's hash as an integer
  (`int.from_bytes(hash, "big") & (2**64 - 1)`) unless the engine runs with
  VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, which publishes the hash's bytes (`external_block_hash`);
  `block_hash_key` makes either, or a digest, the 64-bit integer a router keys its index with.
- The replay socket's answers carry the topic frame from 0.32 on.

`decode_batch` takes every release's encoding (arrays or maps, integer or byte hashes), which is
what a KV-aware router subscribing to engines of any of these releases needs.

msgpack (a dependency of the package) is imported when a batch is first encoded or decoded, so the
codec's framing and dataclasses load without it; `encode_batch` and `decode_batch` raise RuntimeError
where it is missing.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

Version = tuple[int, int]
ExternalBlockHash = bytes | int
"""A block hash as vLLM publishes it: an integer (the default) or the hash's bytes."""

MEDIUM_GPU: Final = "GPU"
"""`medium` of the engine's own (device) block pool; vLLM's offloading tiers publish CPU or STORAGE."""
TAG_FIELD: Final = "type"
"""The tag's key in a map-encoded event (msgspec's default `tag_field`)."""
TAGGED_MAPS: Final[Version] = (0, 24)
"""The first release whose events are maps (`xpyd.vllm.KV_EVENTS_TAGGED_MAPS`)."""
REPLAY_TOPIC: Final[Version] = (0, 32)
"""The first release whose replay answers carry the topic frame (`xpyd.vllm.KV_EVENTS_REPLAY_TOPIC_ADDED`)."""
OLDEST: Final[Version] = (0, 13)
LATEST: Final[Version] = (0, 33)
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
"""The sequence number of the replay's end marker."""
HASH_MASK: Final = (1 << 64) - 1
"""A block hash as vLLM publishes it by default: the low 64 bits of its digest."""

#: BlockStored's fields in order, each with the release that added it and whether it has a default
#: (None) or is required.
STORED_FIELDS: Final[tuple[tuple[str, Version, bool], ...]] = (
    ("block_hashes", OLDEST, True),
    ("parent_block_hash", OLDEST, True),
    ("token_ids", OLDEST, True),
    ("block_size", OLDEST, True),
    ("lora_id", OLDEST, True),
    ("medium", OLDEST, True),
    ("lora_name", (0, 16), True),
    ("extra_keys", (0, 18), False),
    ("group_idx", (0, 23), False),
    ("kv_cache_spec_kind", (0, 23), False),
    ("kv_cache_spec_sliding_window", (0, 23), False),
    ("locality", (0, 32), False),
    ("ownership", (0, 32), False),
    ("session_id", (0, 32), False),
    ("lookahead_token_ids", (0, 33), False),
)
#: BlockRemoved's fields, likewise.
REMOVED_FIELDS: Final[tuple[tuple[str, Version, bool], ...]] = (
    ("block_hashes", OLDEST, True),
    ("medium", OLDEST, True),
    ("group_idx", (0, 23), False),
    ("locality", (0, 32), False),
    ("ownership", (0, 32), False),
)


@dataclass
class BlockStored:
    """Blocks that became cached (the fields of the newest release; older ones have a prefix of them)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None   # one entry per block (0.18+)
    group_idx: int | None = None                             # the KV-cache group (0.23+)
    kv_cache_spec_kind: str | None = None                    # e.g. "full_attention" (0.23+)
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None                              # LOCAL or REMOTE (0.32+)
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None       # 0.33+


@dataclass
class BlockRemoved:
    """A cached block evicted (vLLM sends one hash per event)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass
class AllBlocksCleared:
    """The prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class EventBatch:
    """One scheduler step's events."""

    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


@functools.cache
def msgpack_module() -> Any:
    """The msgpack module (untyped), imported the first time events are encoded or decoded."""
    try:
        return importlib.import_module("msgpack")
    except ImportError as error:
        raise RuntimeError(f"KV events need the msgpack package ({error})") from None


def external_block_hash(block_hash: bytes, as_int: bool = True) -> ExternalBlockHash:
    """vLLM's `maybe_convert_block_hash`: the hash's low 64 bits as an integer, or its bytes."""
    return block_hash_key(block_hash) if as_int else block_hash


def block_hash_key(block_hash: ExternalBlockHash) -> int:
    """A block hash as a 64-bit integer whichever way it comes: a digest (vLLM's own, or as published
    with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) as its low 64 bits, which is what vLLM publishes by
    default, and a published integer as it is. The one key a router's index and its prompts share."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash, "big") & HASH_MASK
    return block_hash & HASH_MASK


# --- encoding --------------------------------------------------------------------------------------

_CLASS_FIELDS: Final[dict[type, tuple[tuple[str, Version, bool], ...]]] = {
    BlockStored: STORED_FIELDS, BlockRemoved: REMOVED_FIELDS, AllBlocksCleared: ()}
"""Each event's fields, in the order of its array encoding."""


def _fields(event: KVEvent) -> tuple[tuple[str, Version, bool], ...]:
    return _CLASS_FIELDS[type(event)]


def _wire(value: Any) -> Any:
    """A value as msgspec writes it: tuples as arrays (lists), the rest as it is."""
    if isinstance(value, tuple | list):
        return [_wire(item) for item in value]
    return value


def event_object(event: KVEvent, version: Version) -> list[Any] | dict[str, Any]:
    """An event as release `version` writes it, before msgpack: an array up to 0.23, a map from 0.24.
    Fields the release does not have are left out."""
    tag = type(event).__name__
    present = [(name, required) for name, added, required in _fields(event) if added <= version]
    if version < TAGGED_MAPS:
        return [tag, *(_wire(getattr(event, name)) for name, _ in present)]
    out: dict[str, Any] = {TAG_FIELD: tag}
    for name, required in present:
        value = getattr(event, name)
        if required or value is not None:
            out[name] = _wire(value)
    return out


def encode_batch(batch: EventBatch, version: Version = LATEST) -> bytes:
    """An `EventBatch` as release `version` publishes it (msgpack, as msgspec encodes it)."""
    payload = [float(batch.ts), [event_object(event, version) for event in batch.events], batch.data_parallel_rank]
    data: bytes = msgpack_module().packb(payload, use_bin_type=True)
    return data


# --- decoding (every release's encoding) -------------------------------------------------------------

class DecodeError(ValueError):
    """A payload that is not a KV `EventBatch` of any release."""


_CLASSES: Final[dict[str, type[BlockStored] | type[BlockRemoved] | type[AllBlocksCleared]]] = {
    "BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}


def _hash(value: Any, where: str) -> ExternalBlockHash:
    if isinstance(value, bytes) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise DecodeError(f"{where}: a block hash is bytes or an integer, not {type(value).__name__}")


def _event(raw: Any) -> KVEvent:
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise DecodeError("an array-encoded event starts with its tag")
        tag, values = raw[0], raw[1:]
        cls = _CLASSES.get(tag)
        if cls is None:
            raise DecodeError(f"unknown KV event {tag!r}")
        names = [name for name, _, _ in _CLASS_FIELDS[cls]]
        fields = dict(zip(names, values, strict=False))   # a newer release's extra fields are ignored
    elif isinstance(raw, dict):
        found = raw.get(TAG_FIELD)
        tag = found if isinstance(found, str) else repr(found)
        cls = _CLASSES.get(tag)
        if cls is None:
            raise DecodeError(f"unknown KV event {tag!r}")
        known = {name for name, _, _ in _CLASS_FIELDS[cls]}
        fields = {key: value for key, value in raw.items() if key in known}
    else:
        raise DecodeError(f"a KV event is an array or a map, not {type(raw).__name__}")
    if cls is AllBlocksCleared:
        return AllBlocksCleared()
    # Fields every release writes; one a later release added (lora_name) an older one's event lacks.
    required = [name for name, added, needed in _CLASS_FIELDS[cls] if needed and added == OLDEST]
    missing = [name for name in required if name not in fields]
    if missing:
        raise DecodeError(f"{tag} without {', '.join(missing)}")
    hashes = fields["block_hashes"]
    if not isinstance(hashes, list):
        raise DecodeError(f"{tag}.block_hashes is not an array")
    fields["block_hashes"] = [_hash(value, f"{tag}.block_hashes") for value in hashes]
    if cls is BlockStored:
        parent = fields["parent_block_hash"]
        fields["parent_block_hash"] = None if parent is None else _hash(parent, "BlockStored.parent_block_hash")
        if not isinstance(fields["token_ids"], list) or not isinstance(fields["block_size"], int):
            raise DecodeError("BlockStored needs token_ids (an array) and block_size (an integer)")
        extra = fields.get("extra_keys")
        if extra is not None:
            if not isinstance(extra, list) or not all(keys is None or isinstance(keys, list) for keys in extra):
                raise DecodeError("BlockStored.extra_keys is an array of arrays (or nil entries)")
            fields["extra_keys"] = [None if keys is None else tuple(keys) for keys in extra]
        return BlockStored(**fields)
    return BlockRemoved(**fields)


def decode_batch(payload: bytes) -> EventBatch:
    """An `EventBatch` payload of any release (0.13 to 0.33); DecodeError when it is none."""
    msgpack = msgpack_module()
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise DecodeError(f"not msgpack: {error}") from None
    if not isinstance(raw, list) or not 2 <= len(raw) <= 3:
        raise DecodeError("an EventBatch is an array [ts, events, data_parallel_rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not isinstance(events, list) \
            or not (rank is None or (isinstance(rank, int) and not isinstance(rank, bool))):
        raise DecodeError("an EventBatch is [ts (a number), events (an array), data_parallel_rank (an integer or nil)]")
    try:
        decoded = [_event(event) for event in events]
    except DecodeError:
        raise
    except (TypeError, ValueError) as error:   # a malformed field the checks above do not name
        raise DecodeError(f"a malformed KV event: {error}") from None
    return EventBatch(float(ts), decoded, rank)


# --- ZMQ framing --------------------------------------------------------------------------------------

def sequence_bytes(seq: int) -> bytes:
    """A batch's sequence number as its frame: 8 bytes, big-endian."""
    return seq.to_bytes(8, "big")


def publish_frames(topic: str, seq: int, payload: bytes) -> tuple[bytes, bytes, bytes]:
    """The PUB socket's message for one batch: (topic, sequence, payload)."""
    return topic.encode("utf-8"), sequence_bytes(seq), payload


def published_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """A PUB message's frames as (topic, sequence number, payload), neither decoded; DecodeError when
    they are not three with an 8-byte sequence number."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise DecodeError("a KV event message is three frames: topic, an 8-byte sequence number, the payload")
    return frames[0], int.from_bytes(frames[1], "big"), frames[2]


def parse_published(frames: Sequence[bytes]) -> tuple[str, int, EventBatch]:
    """A PUB message (topic, sequence, payload) as (topic, sequence number, batch)."""
    topic, seq, payload = published_frames(frames)
    return topic.decode("utf-8"), seq, decode_batch(payload)


def replay_request(start_seq: int) -> bytes:
    """What a client (REQ or DEALER, after the empty delimiter) sends the replay socket: the first
    sequence number it wants, 8 bytes big-endian."""
    return sequence_bytes(start_seq)


def parse_replay_request(frames: Sequence[bytes]) -> tuple[bytes, int] | None:
    """A ROUTER's request (client identity, empty delimiter, start sequence) as (identity, start);
    None for a malformed one (vLLM logs and drops it)."""
    if len(frames) != 3:
        return None
    identity, _, start = frames
    return identity, int.from_bytes(start, "big")


def replay_reply(version: Version, identity: bytes, topic: str,
                 buffered: Sequence[tuple[int, bytes]], start_seq: int) -> Iterator[tuple[bytes, ...]]:
    """The ROUTER's answer to `identity`: every buffered (sequence, payload) from `start_seq` on, then
    the end marker; with the topic frame from 0.32 on."""
    with_topic = version >= REPLAY_TOPIC
    topic_bytes = topic.encode("utf-8")
    for seq, payload in buffered:
        if seq >= start_seq:
            if with_topic:
                yield identity, b"", topic_bytes, sequence_bytes(seq), payload
            else:
                yield identity, b"", sequence_bytes(seq), payload
    yield (identity, b"", b"", END_SEQ, b"") if with_topic else (identity, b"", END_SEQ, b"")


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's `ZmqEventPublisher.offset_endpoint_port`: a tcp endpoint's port plus the data-parallel
    rank (a port of 0 stays 0, from 0.32), `_dp<rank>` after an inproc one; rank 0 leaves it as it is."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        if ":" in endpoint:
            base, _, port = endpoint.rpartition(":")
            if int(port) == 0:
                return endpoint
            return f"{base}:{int(port) + data_parallel_rank}"
        return endpoint
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")
