"""KVAware routing's precise index: every engine's own KV events, subscribed to over ZMQ.

An engine started with `--kv-events-config` (`xpyd.render.kvaware`) publishes each scheduler step's
cache changes as one numbered batch on a PUB socket (`tcp://<pod IP>:<events port + rank>`) and keeps
the last batches for a replay ROUTER socket (`<replay port + rank>`); the wire and every release's
encoding are `xpyd.kvcache.events`'. One `Subscriber` per engine rank keeps that rank's index in step:

- On connect it subscribes, then asks the replay socket for every batch from 0, applies them, and goes
  on with the live batches after the last one replayed (those the replay already gave are skipped).
  A replay that does not answer (no replay socket, an engine still starting) starts from the live
  batches: what was cached before is unknown, which only costs hits.
- A batch whose number is past the next one expected is a gap (the PUB socket drops batches beyond
  its high-water mark): the missing ones are asked for again. When the replay cannot give them all
  (they left its buffer, or it does not answer) the index is cleared, since a missed BlockRemoved
  would leave blocks the engine no longer holds, and rebuilt from the live batches.
- A batch numbered below the next expected and newer than the last applied is a restarted engine
  (numbers start at 0 again): the index is cleared and replayed from 0.
- BlockStored of the engine's own tier (`medium` GPU, or unset before 0.18) stores its hashes,
  BlockRemoved removes them, AllBlocksCleared clears the index. A batch of another block size than
  the proxy hashes with is skipped (its hashes could never match) with one warning per engine.
- Nothing here ends the proxy: a malformed message is counted and skipped (a gap follows if it was
  a batch), a broken socket is reopened after `RETRY_S`, and the index of an instance that leaves the
  pool goes with its subscribers (`Hub.update`).

A batch is read for what the index needs (`index_update`: each event's kind, hashes, block size and
medium), straight from the msgpack, not through `events.decode_batch`'s objects: a step that evicts
thousands of blocks publishes thousands of BlockRemoved events (one per block, as vLLM does), which
the full decoder takes about 6 µs each to build, holding the event loop (every other engine's events,
every request) for tens of milliseconds; read directly they cost under 1 µs. Anything the direct
reading does not expect goes through `events.decode_batch`, which takes every release's encoding and
refuses what is malformed.

`xpyd_proxy_kv_event_lag_seconds` is the time from the engine's step (the batch's `ts`) to the index
holding it; `xpyd_proxy_kv_event_gaps_total` counts gaps by outcome.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

import zmq
import zmq.asyncio

from xpyd.api.naming import Role
from xpyd.kvcache import events
from xpyd.kvcache.index import PrefixIndex
from xpyd.proxy.kvrouting import HASH_MASK, KVRouter, KVSettings, event_key
from xpyd.proxy.metrics import Counter, Histogram
from xpyd.proxy.pool import Instance, Pool
from xpyd.proxy.protocol import host_port

log = logging.getLogger(__name__)

#: Seconds between one frame of a replay and the next before the replay counts as unanswered.
REPLAY_TIMEOUT_S: Final = 2.0
#: Seconds before a subscriber whose sockets failed connects again.
RETRY_S: Final = 1.0
LAG_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_END: Final = -1

STORE: Final = 0
REMOVE: Final = 1
CLEAR: Final = 2
#: Where BlockStored's and BlockRemoved's fields are in an array-encoded event (the tag first).
_STORED_AT: Final = {name: position + 1 for position, (name, _, _) in enumerate(events.STORED_FIELDS)}
_REMOVED_AT: Final = {name: position + 1 for position, (name, _, _) in enumerate(events.REMOVED_FIELDS)}


@dataclass
class Update:
    """A batch as the index takes it: its timestamp, and per event (kind, block keys as `event_key`
    makes them, block size, medium); CLEAR's keys are empty."""

    ts: float
    changes: list[tuple[int, list[int], int | None, str | None]]


class _Unexpected(Exception):
    """What the direct reading does not expect: the full decoder takes over."""


def _keys(hashes: Any) -> list[int]:
    if type(hashes) is not list:
        raise _Unexpected
    out = []
    for value in hashes:
        kind = type(value)
        if kind is int:
            out.append(value & HASH_MASK)
        elif kind is bytes:
            out.append(int.from_bytes(value, "big") & HASH_MASK)
        else:
            raise _Unexpected
    return out


def _size(value: Any) -> int:
    if type(value) is not int:
        raise _Unexpected
    return int(value)


def _change(raw: Any) -> tuple[int, list[int], int | None, str | None]:
    kind = type(raw)
    if kind is dict:
        tag = raw.get(events.TAG_FIELD)
        if tag == "BlockRemoved":
            return REMOVE, _keys(raw["block_hashes"]), None, raw.get("medium", events.MEDIUM_GPU)
        if tag == "BlockStored":
            return (STORE, _keys(raw["block_hashes"]), _size(raw["block_size"]),
                    raw.get("medium", events.MEDIUM_GPU))
    elif kind is list and raw:
        tag = raw[0]
        if tag == "BlockRemoved":
            return REMOVE, _keys(raw[_REMOVED_AT["block_hashes"]]), None, raw[_REMOVED_AT["medium"]]
        if tag == "BlockStored":
            return (STORE, _keys(raw[_STORED_AT["block_hashes"]]), _size(raw[_STORED_AT["block_size"]]),
                    raw[_STORED_AT["medium"]])
    if (raw.get(events.TAG_FIELD) if kind is dict else raw[0] if kind is list and raw else None) \
            == "AllBlocksCleared":
        return CLEAR, [], None, None
    raise _Unexpected


def _update_of(batch: events.EventBatch) -> Update:
    changes: list[tuple[int, list[int], int | None, str | None]] = []
    for event in batch.events:
        if isinstance(event, events.BlockStored):
            changes.append((STORE, [event_key(h) for h in event.block_hashes], event.block_size, event.medium))
        elif isinstance(event, events.BlockRemoved):
            changes.append((REMOVE, [event_key(h) for h in event.block_hashes], None, event.medium))
        else:
            changes.append((CLEAR, [], None, None))
    return Update(batch.ts, changes)


def index_update(payload: bytes) -> Update:
    """A batch's payload as the index takes it (see the module docstring); DecodeError when it is no
    `EventBatch` of any release, as `events.decode_batch` says."""
    msgpack = _msgpack()
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        if type(raw) is not list or not 2 <= len(raw) <= 3 or type(raw[1]) is not list:
            raise _Unexpected
        ts = raw[0]
        if type(ts) is not float and type(ts) is not int:
            raise _Unexpected
        return Update(float(ts), [_change(event) for event in raw[1]])
    except (_Unexpected, KeyError, IndexError, TypeError, ValueError, msgpack.UnpackException):
        return _update_of(events.decode_batch(payload))


@functools.cache
def _msgpack() -> Any:
    return importlib.import_module("msgpack")   # a dependency, untyped


class EventMetrics:
    """The subscribers' metrics (registered with the proxy's)."""

    def __init__(self) -> None:
        self.batches = Counter("xpyd_proxy_kv_event_batches_total", "KV event batches applied to the index, by "
                               "role.", ("role",))
        self.gaps = Counter("xpyd_proxy_kv_event_gaps_total", "Gaps in an engine's KV event numbers, by outcome: "
                            "replayed, or lost (the engine's index cleared and rebuilt), or restart.", ("outcome",))
        self.malformed = Counter("xpyd_proxy_kv_event_malformed_total", "KV event messages that could not be "
                                 "decoded (skipped), by role.", ("role",))
        self.lag = Histogram("xpyd_proxy_kv_event_lag_seconds", "From an engine's scheduler step (the batch's "
                             "timestamp) to its events in the proxy's index, by role.", ("role",), buckets=LAG_BUCKETS)

    def collectors(self) -> list[Counter | Histogram]:
        return [self.batches, self.gaps, self.malformed, self.lag]


class Subscriber:
    """One engine rank's KV events into its index (see the module docstring)."""

    def __init__(self, router: KVRouter, url: str, role: Role, rank: int, host: str,
                 context: zmq.asyncio.Context, metrics: EventMetrics) -> None:
        settings = router.settings
        self.router, self.url, self.role, self.rank = router, url, role, rank
        self.context, self.metrics = context, metrics
        self.topic = settings.events_topic.encode()
        self.endpoint = "tcp://" + host_port(host, settings.events_port + rank)
        self.replay_endpoint = "tcp://" + host_port(host, settings.events_replay_port + rank)
        self.next_seq: int | None = None   # the number of the next batch to apply
        self.last_ts = float("-inf")        # the newest batch applied (engine time)
        self.warned = False

    @property
    def index(self) -> PrefixIndex:
        return self.router.index(self.url, self.role, self.rank)

    def reset(self) -> None:
        """Forget what the index holds (its events can no longer be trusted)."""
        self.index.clear()
        self.next_seq = None
        self.last_ts = float("-inf")

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        socket = self.context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        if self.endpoint.startswith("tcp://["):
            socket.setsockopt(zmq.IPV6, 1)
        return socket

    async def run(self) -> None:
        """Forever: subscribe and follow; after any failure, start over (index cleared) `RETRY_S` later."""
        while True:
            try:
                await self.follow()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a socket error, say: never the proxy's end
                log.warning("KV events of %s rank %d: %s; reconnecting", self.url, self.rank, error)
            self.reset()
            await asyncio.sleep(RETRY_S)

    async def follow(self) -> None:
        """Subscribe, replay from 0, then apply live batches, filling gaps from the replay socket."""
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            await self.replay(0)
            while True:
                frames = await sub.recv_multipart()
                try:
                    if len(frames) != 3 or len(frames[1]) != 8:
                        raise events.DecodeError("a KV event message is three frames: topic, an 8-byte sequence "
                                                 "number, the payload")
                    seq, batch = int.from_bytes(frames[1], "big"), index_update(frames[2])
                except (events.DecodeError, UnicodeDecodeError, ValueError) as error:
                    self.metrics.malformed.inc(self.role)
                    log.warning("KV events of %s rank %d: a malformed message skipped: %s", self.url, self.rank, error)
                    continue
                await self.receive(seq, batch)
        finally:
            sub.close(linger=0)

    async def receive(self, seq: int, batch: Update) -> None:
        """A live batch: applied in order, after the ones a gap missed (or the index rebuilt)."""
        expected = self.next_seq
        if expected is not None and seq < expected:
            if batch.ts <= self.last_ts:
                return                          # already applied (the replay gave it)
            self.metrics.gaps.inc("restart")   # numbers start again: a new engine
            log.info("KV events of %s rank %d start again at %d: the engine restarted", self.url, self.rank, seq)
            self.reset()
            await self.replay(0)
            if self.next_seq is not None and seq < self.next_seq:
                return
        elif expected is not None and seq > expected:
            if await self.replay(expected):
                self.metrics.gaps.inc("replayed")
            else:
                self.metrics.gaps.inc("lost")
                log.warning("KV events of %s rank %d: batches %d to %d are lost; its index is rebuilt from now on",
                            self.url, self.rank, expected, seq - 1)
                self.reset()
            if self.next_seq is not None and seq < self.next_seq:
                return
        self.apply(seq, batch)

    async def replay(self, start: int) -> bool:
        """Ask the replay socket for every batch from `start` on and apply those not applied yet; True
        when it gave them all from `start` (or had none from there), False when it did not answer or
        its buffer starts later."""
        dealer = self._socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        first: int | None = None
        try:
            await dealer.send_multipart([b"", events.replay_request(start)])
            while True:
                try:
                    frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                except TimeoutError:
                    return False
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:        # 0.32+: topic, sequence, payload
                    frames = frames[1:]
                if len(frames) != 2 or len(frames[0]) != 8:
                    self.metrics.malformed.inc(self.role)
                    return False
                seq = int.from_bytes(frames[0], "big", signed=True)
                if seq == _END:
                    return first is None or first <= start
                if seq < start:
                    continue
                if first is None:
                    first = seq
                    if seq > start and self.next_seq is not None:
                        return False          # the buffer no longer holds the gap: it cannot be filled
                try:
                    batch = index_update(frames[1])
                except events.DecodeError:
                    self.metrics.malformed.inc(self.role)
                    return False
                if self.next_seq is None or seq >= self.next_seq:
                    self.apply(seq, batch)
        finally:
            dealer.close(linger=0)

    def apply(self, seq: int, batch: Update) -> None:
        """A batch's events into the index, in order."""
        index = self.index
        now = time.monotonic()
        block_size = self.router.settings.block_size
        for kind, keys, size, medium in batch.changes:
            if kind == CLEAR:
                index.clear()
                continue
            if medium is not None and medium != events.MEDIUM_GPU:
                continue
            if kind == STORE:
                if size != block_size:
                    if not self.warned:
                        self.warned = True
                        log.warning("KV events of %s: blocks of %d tokens, but the proxy hashes blocks of %d "
                                    "(--kv-block-size): they are skipped", self.url, size, block_size)
                    continue
                for key in keys:
                    index.store(key, now)
            else:
                for key in keys:
                    index.remove(key)
        self.next_seq = seq + 1
        self.last_ts = max(self.last_ts, batch.ts)
        self.metrics.batches.inc(self.role)
        self.metrics.lag.observe(max(0.0, time.time() - batch.ts), self.role)


class Hub:
    """The subscribers of every listed engine rank: started as instances appear, stopped (and their
    indexes dropped) as they leave."""

    def __init__(self, router: KVRouter, settings: KVSettings) -> None:
        self.router = router
        self.settings = settings
        self.metrics = EventMetrics()
        self.context = zmq.asyncio.Context()
        self.tasks: dict[tuple[str, int], asyncio.Task[None]] = {}

    def update(self, pools: Iterable[Pool]) -> None:
        """Follow the engines the pools list now (called whenever discovery changes them)."""
        wanted: dict[tuple[str, int], tuple[Instance, int]] = {}
        for pool in pools:
            for instance in pool.instances.values():
                if instance.host:
                    for rank in range(self.router.ranks(pool.role)):
                        wanted[(instance.url, rank)] = (instance, rank)
        for key in [key for key in self.tasks if key not in wanted]:
            self.tasks.pop(key).cancel()
        self.router.keep_only({url for url, _ in wanted})
        for key, (instance, rank) in wanted.items():
            if key not in self.tasks:
                subscriber = Subscriber(self.router, instance.url, instance.role, rank, instance.host, self.context,
                                        self.metrics)
                self.tasks[key] = asyncio.ensure_future(subscriber.run())

    async def close(self) -> None:
        """Stop every subscriber and the ZMQ context."""
        tasks = list(self.tasks.values())
        self.tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.context.destroy(linger=0)
