"""The emulated engine's KV events, as vLLM 0.33 publishes them with `--kv-events-config`.

`KVEventRecorder` listens to the engine's block pool (`kvcache.pool.PoolListener`) and turns what it
hears into vLLM's events (`kvcache.events`): a `BlockStored` per caching of a request's blocks (their
hashes, the parent hash, their token ids, the block size, the salt as extra keys, KV-cache group 0 of
kind "full_attention", the request's session), a `BlockRemoved` per evicted block, `AllBlocksCleared`
after a reset. The engine takes them once per step (`take`), as vLLM's scheduler does after each
forward pass, and hands the batch to the publisher.

`ZmqPublisher` is vLLM's `ZmqEventPublisher`: a PUB socket sending (topic, sequence, payload), the last
`buffer_steps` payloads kept for the ROUTER replay socket, both on the endpoint's port plus the
data-parallel rank. An endpoint vLLM binds (a wildcard `*` or `::` host, ipc, inproc) is bound here
on the engine's `--host` instead of every interface (the emulator listens only on loopback); any other
tcp endpoint is connected to, as vLLM does, and must be a loopback address. Sends never block: a
subscriber that falls behind `hwm` messages loses them (ZMQ's PUB), as with vLLM. vLLM puts batches on
an in-process queue of `max_queue_size` before its publishing thread sends them; the emulator sends at
once, so that bound is accepted and not used.

Encoding: vLLM's publisher encodes with msgspec, in C, on its own thread, after stamping the batch's
`ts`; `kvcache.events.encode_batch` walks every field of every event in Python (about 4 µs per
BlockRemoved, 60 ms for a step that evicts 12,000 blocks), which would count in a subscriber's
event-to-index lag as time vLLM does not spend. `encode_latest` writes the same bytes for 0.33 with
msgpack's own walk (tests/integration/test_engine_sim_kv_blocks.py holds it to `encode_batch`).

Blocks of generated tokens: vLLM caches (and announces) them as decode fills them; the engine model
caches them only when the request ends, as anonymous blocks no prompt can hit (`sim.core`), so they
are neither announced nor, when evicted, removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from xpyd.common.netguard import require_loopback
from xpyd.kvcache.events import (
    LATEST,
    REMOVED_FIELDS,
    STORED_FIELDS,
    TAG_FIELD,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    external_block_hash,
    msgpack_module,
    offset_endpoint_port,
    parse_replay_request,
    publish_frames,
    replay_reply,
)
from xpyd.kvcache.pool import BlockKeys
from xpyd.sim.emulator.config import KVEventsConfig

log = logging.getLogger(__name__)

KV_CACHE_SPEC_KIND = "full_attention"
"""What vLLM's KV-cache manager stamps on a dense model's `BlockStored` (0.23+)."""


#: Per event class, its fields in 0.33's order with whether they are always written (required).
_FIELDS: dict[type, tuple[tuple[str, bool], ...]] = {
    BlockStored: tuple((name, required) for name, added, required in STORED_FIELDS if added <= LATEST),
    BlockRemoved: tuple((name, required) for name, added, required in REMOVED_FIELDS if added <= LATEST),
    AllBlocksCleared: ()}


def encode_latest(batch: EventBatch) -> bytes:
    """`kvcache.events.encode_batch(batch, LATEST)`, byte for byte: each event a map of its tag and the
    fields 0.33 writes (the required ones, and the others when set); msgpack writes tuples as arrays
    itself, so values go in as they are."""
    objects: list[dict[str, Any]] = []
    for event in batch.events:
        cls = type(event)
        out: dict[str, Any] = {TAG_FIELD: cls.__name__}
        for name, required in _FIELDS[cls]:
            value = getattr(event, name)
            if required or value is not None:
                out[name] = value
        objects.append(out)
    data: bytes = msgpack_module().packb([float(batch.ts), objects, batch.data_parallel_rank], use_bin_type=True)
    return data


@dataclass(frozen=True)
class RequestTokens:
    """What a `BlockStored` of a request needs beyond its keys: its prompt, salt and session."""

    token_ids: list[int]
    cache_salt: str | None
    session_id: str | None


class KVEventRecorder:
    """A `PoolListener` collecting vLLM's KV events. The engine `track`s each request's keys (whose
    run ids are its block hashes, one block a run) while it may cache, and `forget`s them after."""

    def __init__(self, block_size: int, int_hashes: bool = True) -> None:
        self.block_size = block_size
        self.int_hashes = int_hashes
        self.pending: list[KVEvent] = []
        self._requests: dict[BlockKeys, RequestTokens] = {}

    def track(self, keys: BlockKeys, tokens: RequestTokens) -> None:
        self._requests[keys] = tokens

    def forget(self, keys: BlockKeys | None) -> None:
        if keys is not None:
            self._requests.pop(keys, None)

    @property
    def tracked(self) -> int:
        """Requests whose keys are tracked."""
        return len(self._requests)

    def _hash(self, run: Hashable) -> int | bytes:
        assert isinstance(run, bytes)
        return external_block_hash(run, self.int_hashes)

    # --- the pool's listener ---

    def stored(self, keys: BlockKeys, start: int, end: int) -> None:
        tokens = self._requests.get(keys)
        if tokens is None:
            log.error("BlockStored for untracked keys: not published")
            return
        ids = keys.ids
        size = self.block_size
        salt = tokens.cache_salt
        self.pending.append(BlockStored(
            block_hashes=[self._hash(run) for run in ids[start:end]],
            parent_block_hash=self._hash(ids[start - 1]) if start > 0 else None,
            token_ids=tokens.token_ids[start * size:end * size], block_size=size,
            extra_keys=[(salt,) if index == 0 and salt else None for index in range(start, end)],
            group_idx=0, kv_cache_spec_kind=KV_CACHE_SPEC_KIND, session_id=tokens.session_id))

    def removed(self, run: Hashable | None, lo: int, hi: int) -> None:
        if run is None:   # blocks of generated tokens: never announced (see the module docstring)
            return
        for _ in range(hi - 1, lo - 1, -1):   # a key hashed from token ids is a run of one block
            self.pending.append(BlockRemoved(block_hashes=[self._hash(run)], group_idx=0))

    def cleared(self) -> None:
        self.pending.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """The events since the last take (vLLM's `take_events`)."""
        out, self.pending = self.pending, []
        return out


def local_endpoint(endpoint: str, host: str) -> tuple[str, bool]:
    """Where to bind or connect for a vLLM endpoint: (endpoint, bind?). A wildcard host becomes `host`;
    a tcp endpoint vLLM connects to must be loopback."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint, True
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"KV events endpoint {endpoint!r}: only tcp://, ipc:// and inproc:// are emulated")
    address, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not address or not port.isdigit():
        raise ValueError(f"KV events endpoint {endpoint!r} has no host:port")
    bracketed = f"[{host}]" if ":" in host else host
    if address in ("*", "::", "[::]", "[*]"):   # every interface: the engine's address here
        return f"tcp://{bracketed}:{port}", True
    require_loopback(address.strip("[]"), "KV events endpoint")
    return endpoint, "*" in endpoint or "::" in endpoint   # vLLM binds an IPv6 address, connects to the rest


class ZmqPublisher:
    """vLLM's `ZmqEventPublisher` on asyncio (see the module docstring). Needs pyzmq."""

    def __init__(self, config: KVEventsConfig, host: str, data_parallel_rank: int = 0) -> None:
        try:
            self._zmq: Any = importlib.import_module("zmq")
            zmq_asyncio: Any = importlib.import_module("zmq.asyncio")
        except ImportError as error:
            raise RuntimeError(f"--kv-events-config needs pyzmq ({error})") from None
        zmq = self._zmq
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.topic = config.topic
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = itertools.count()
        self.published = 0
        self._context = zmq.Context()
        self._async_context = zmq_asyncio.Context()
        self._replay: Any = None
        self._replay_task: asyncio.Task[None] | None = None
        self.endpoint = ""
        self.replay_endpoint: str | None = None
        self._pub = self._context.socket(zmq.PUB)
        try:
            self._pub.set_hwm(config.hwm)
            endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
            assert endpoint is not None
            self.endpoint = self._open(self._pub, endpoint, host)
            replay = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
            if replay is not None:
                self._replay = self._async_context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self.replay_endpoint = self._bind(self._replay, local_endpoint(replay, host)[0])
        except zmq.ZMQError as error:
            self.close()
            raise OSError(f"KV events: {error}") from None
        except BaseException:
            self.close()
            raise

    def _open(self, socket: Any, endpoint: str, host: str) -> str:
        local, bind = local_endpoint(endpoint, host)
        if bind:
            return self._bind(socket, local)
        socket.connect(local)
        return local

    def _bind(self, socket: Any, endpoint: str) -> str:
        if endpoint.startswith("tcp://["):
            socket.setsockopt(self._zmq.IPV6, 1)
        socket.bind(endpoint)
        bound: str = socket.getsockopt_string(self._zmq.LAST_ENDPOINT)
        return bound

    def start(self) -> None:
        """Serve replay requests (from inside the event loop)."""
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay(), name="kv-events replay")

    def publish(self, events: list[KVEvent]) -> None:
        """Send one step's events as the next batch."""
        batch = EventBatch(time.time(), events, self.data_parallel_rank)
        seq = next(self._seq)
        payload = encode_latest(batch)
        try:
            self._pub.send_multipart(publish_frames(self.topic, seq, payload), flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            log.warning("KV events batch %d dropped: the PUB socket is at its high-water mark", seq)
        self._buffer.append((seq, payload))
        self.published += 1

    async def _serve_replay(self) -> None:
        replay = self._replay
        while True:
            frames = await replay.recv_multipart()
            request = parse_replay_request(frames)
            if request is None:
                log.warning("invalid KV events replay request: %s", frames)
                continue
            identity, start = request
            for reply in replay_reply(LATEST, identity, self.topic, list(self._buffer), start):
                await replay.send_multipart(reply)

    async def stop(self) -> None:
        """Stop serving replays and close the sockets."""
        task, self._replay_task = self._replay_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.close()

    def close(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()
        self._async_context.term()
