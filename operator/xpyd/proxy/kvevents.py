"""KVAware routing's precise index: every engine's own KV events, subscribed to over ZMQ.

An engine started with `--kv-events-config` (`xpyd.render.kvaware`) publishes each scheduler step's
cache changes as one numbered batch on a PUB socket (`tcp://<pod IP>:<events port + rank>`) and keeps
the last batches for a replay ROUTER socket (`<replay port + rank>`); the wire and every release's
encoding are `xpyd.kvcache.events`'. One `Subscriber` per engine rank keeps that rank's index in step:

- On connect it subscribes, then asks the replay socket for every batch from 0, applies them, and goes
  on with the live batches after the last one replayed (those the replay already gave are skipped).
  A replay that does not answer (no replay socket, an engine still starting) starts from the live
  batches: what was cached before is unknown, which only costs hits. A replay that skips batches
  (before 0.33 the engine's replay socket drops what a slow reader has not taken) is asked again
  from the first one missing.
- A batch whose number is past the next one expected is a gap (the PUB socket drops batches beyond
  its high-water mark): the missing ones are asked for again. When the replay cannot give them all
  (they left its buffer, or it does not answer) the index is cleared, since a missed BlockRemoved
  would leave blocks the engine no longer holds, and rebuilt from the live batches.
- A batch numbered below the next expected and newer than the last applied is a restarted engine
  (numbers start at 0 again): the index is cleared and replayed from 0.
- BlockStored of the engine's own tier (`medium` GPU, or unset before 0.18) stores its hashes,
  BlockRemoved removes them, AllBlocksCleared clears the index.
- Of a hybrid model's KV-cache groups (0.23+ name each event's `group_idx`) one full-attention group
  is followed (`FULL_ATTENTION_KINDS`, which 0.23+ write in each BlockStored's `kv_cache_spec_kind`;
  group 0 until one is named; events without a group always): a sliding-window group evicts blocks
  the full-attention group still holds, under the same hashes, and vLLM's hit is never longer than
  the full-attention group's.
- The block size is learnt from the events: vLLM may pick another than `--block-size` or the
  render's guess (an MLA attention backend takes 64, say). The first BlockStored of another size
  than its role hashes at, while no engine of the role has a block indexed, gives the role that size
  (`KVAwareRouter.learn_block_size`: counted, logged); one of another size after that is skipped (the
  role's engines disagree), with one warning per engine rank.
- Memory: each SUB and replay socket queues at most `RCVHWM` messages of at most `MAX_MESSAGE_BYTES`;
  the engine's PUB socket queues the rest, and what it drops is a gap. A longer message drops the
  connection, which ZMQ does not make again (nor one it dropped for a peer speaking no ZMTP): the
  subscriber watches its socket's disconnections and starts over. The index's own cost is in
  docs/proxy.md.
- Nothing here ends the proxy: a malformed message is counted and skipped (a gap follows if it was
  a batch), a broken socket is reopened after `RETRY_S`, and the index of an instance that leaves the
  pool goes with its subscribers (`Hub.update`).

A batch is read for what the index needs (`index_update`: each event's kind, hashes, block size,
medium and group), straight from the msgpack, not through `events.decode_batch`'s objects: a step
that evicts thousands of blocks publishes thousands of BlockRemoved events (one per block, as vLLM
does), which the full decoder takes about 6 µs each to build, holding the event loop (every other
engine's events, every request) for tens of milliseconds; read directly they cost under 1.5 µs.
Anything the direct reading does not expect goes through `events.decode_batch`, which takes every
release's encoding and refuses what is malformed.

`xpyd_proxy_kv_event_lag_seconds` is the time from the engine's step (the batch's `ts`) to the index
holding it; `xpyd_proxy_kv_event_gaps_total` counts gaps by outcome,
`xpyd_proxy_kv_events_skipped_total` the stores and removals left out by reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Final

import zmq
import zmq.asyncio

from xpyd.api.naming import Role
from xpyd.kvcache import events
from xpyd.kvcache.events import HASH_MASK, block_hash_key, msgpack_module
from xpyd.kvcache.index import PrefixIndex
from xpyd.proxy.kvaware import KVAwareRouter, KVAwareSettings
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
#: Messages a SUB or replay socket queues before ZMQ leaves the rest to the engine's side (low: a gap
#: is replayed).
RCVHWM: Final = 64
#: The longest message taken; a batch is a scheduler step's events (typically kilobytes: about 3 bytes
#: per token id of the blocks stored, 10 per hash): 16 MiB holds several million tokens' blocks.
MAX_MESSAGE_BYTES: Final = 16 << 20
#: Times a replay that skipped batches is asked again from the first missing before it counts as failed.
REPLAY_ATTEMPTS: Final = 3
#: `kv_cache_spec_kind`s of full-attention KV-cache groups (vLLM's `KVCacheSpecKind` of a
#: `FullAttentionSpec`, MLA and sink attention included).
FULL_ATTENTION_KINDS: Final = ("full_attention", "mla_attention", "sink_full_attention")

STORE: Final = 0
REMOVE: Final = 1
CLEAR: Final = 2
#: Where BlockStored's and BlockRemoved's fields are in an array-encoded event (the tag first).
_STORED_AT: Final = {name: position + 1 for position, (name, _, _) in enumerate(events.STORED_FIELDS)}
_REMOVED_AT: Final = {name: position + 1 for position, (name, _, _) in enumerate(events.REMOVED_FIELDS)}
_STORED_GROUP: Final = _STORED_AT["group_idx"]
_STORED_SPEC: Final = _STORED_AT["kv_cache_spec_kind"]
_REMOVED_GROUP: Final = _REMOVED_AT["group_idx"]


Group = tuple[int | None, str | None]


@dataclass
class Update:
    """A batch as the index takes it: its timestamp, and per event (kind, block keys as
    `events.block_hash_key` makes them, block size, medium); CLEAR's keys are empty. `groups`: per
    event, its KV-cache group and the group's kind (BlockStored's `kv_cache_spec_kind`), None where the
    release or the event has none (empty: none for every event)."""

    ts: float
    changes: list[tuple[int, list[int], int | None, str | None]]
    groups: list[Group] = field(default_factory=list)


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


def _group(group: Any, spec: Any) -> Group:
    """An event's group as `Update.groups` has it: an integer and a string, or None; any other value
    a group never followed."""
    return (group if group is None or (type(group) is int) else -1,
            spec if spec is None or type(spec) is str else "?")


_NO_GROUP: Final[Group] = (None, None)


def _change(raw: Any, groups: list[Group]) -> tuple[int, list[int], int | None, str | None]:
    """One event as `Update.changes` has it; its group appended to `groups`."""
    kind = type(raw)
    if kind is dict:
        tag = raw.get(events.TAG_FIELD)
        if tag == "BlockRemoved":
            group = raw.get("group_idx")
            groups.append(_NO_GROUP if group is None else (group, None) if type(group) is int else _group(group, None))
            return REMOVE, _keys(raw["block_hashes"]), None, raw.get("medium", events.MEDIUM_GPU)
        if tag == "BlockStored":
            groups.append(_group(raw.get("group_idx"), raw.get("kv_cache_spec_kind")))
            return (STORE, _keys(raw["block_hashes"]), _size(raw["block_size"]),
                    raw.get("medium", events.MEDIUM_GPU))
    elif kind is list and raw:
        tag = raw[0]
        length = len(raw)
        if tag == "BlockRemoved":
            group = raw[_REMOVED_GROUP] if length > _REMOVED_GROUP else None
            groups.append(_NO_GROUP if group is None else (group, None) if type(group) is int else _group(group, None))
            return REMOVE, _keys(raw[_REMOVED_AT["block_hashes"]]), None, raw[_REMOVED_AT["medium"]]
        if tag == "BlockStored":
            group = raw[_STORED_GROUP] if length > _STORED_GROUP else None
            spec = raw[_STORED_SPEC] if length > _STORED_SPEC else None
            groups.append(_group(group, spec))
            return (STORE, _keys(raw[_STORED_AT["block_hashes"]]), _size(raw[_STORED_AT["block_size"]]),
                    raw[_STORED_AT["medium"]])
    if (raw.get(events.TAG_FIELD) if kind is dict else raw[0] if kind is list and raw else None) \
            == "AllBlocksCleared":
        groups.append(_NO_GROUP)
        return CLEAR, [], None, None
    raise _Unexpected


def _update_of(batch: events.EventBatch) -> Update:
    changes: list[tuple[int, list[int], int | None, str | None]] = []
    groups: list[Group] = []
    for event in batch.events:
        if isinstance(event, events.BlockStored):
            changes.append((STORE, [block_hash_key(h) for h in event.block_hashes], event.block_size,
                            event.medium))
            groups.append(_group(event.group_idx, event.kv_cache_spec_kind))
        elif isinstance(event, events.BlockRemoved):
            changes.append((REMOVE, [block_hash_key(h) for h in event.block_hashes], None, event.medium))
            groups.append(_group(event.group_idx, None))
        else:
            changes.append((CLEAR, [], None, None))
            groups.append(_NO_GROUP)
    return Update(batch.ts, changes, groups)


def index_update(payload: bytes) -> Update:
    """A batch's payload as the index takes it (see the module docstring); DecodeError when it is no
    `EventBatch` of any release, as `events.decode_batch` says."""
    msgpack = msgpack_module()
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        if type(raw) is not list or not 2 <= len(raw) <= 3 or type(raw[1]) is not list:
            raise _Unexpected
        ts = raw[0]
        if type(ts) is not float and type(ts) is not int:
            raise _Unexpected
        groups: list[Group] = []
        changes = [_change(event, groups) for event in raw[1]]
        return Update(float(ts), changes, groups)
    except (_Unexpected, KeyError, IndexError, TypeError, ValueError, msgpack.UnpackException):
        return _update_of(events.decode_batch(payload))


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
        self.skipped = Counter("xpyd_proxy_kv_events_skipped_total", "BlockStored and BlockRemoved events the index "
                               "left out, by role and reason: group (a hybrid model's KV-cache group other than the "
                               "full-attention one followed), block_size (blocks of another size than the role's, "
                               "whose engines disagree).", ("role", "reason"))

    def collectors(self) -> list[Counter | Histogram]:
        return [self.batches, self.gaps, self.malformed, self.lag, self.skipped]


class Subscriber:
    """One engine rank's KV events into its index (see the module docstring)."""

    def __init__(self, router: KVAwareRouter, url: str, role: Role, rank: int, host: str,
                 context: zmq.asyncio.Context, metrics: EventMetrics) -> None:
        settings = router.settings
        self.router, self.url, self.role, self.rank = router, url, role, rank
        self.context, self.metrics = context, metrics
        self.topic = settings.events_topic.encode()
        self.address = "tcp://" + host_port(host, settings.events_port + rank)
        self.replay_address = "tcp://" + host_port(host, settings.events_replay_port + rank)
        self.next_seq: int | None = None   # the number of the next batch to apply
        self.last_ts = float("-inf")        # the newest batch applied (engine time)
        self.followed_group: int | None = None   # the full-attention KV-cache group followed, once named
        self.dropped = False                       # the connection dropped while following (`follow`)
        self.warned = False

    @property
    def index(self) -> PrefixIndex:
        return self.router.index(self.url, self.role, self.rank)

    def reset(self) -> None:
        """Forget what the index holds (its events can no longer be trusted)."""
        self.index.clear()
        self.next_seq = None
        self.last_ts = float("-inf")
        self.followed_group = None

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        socket = self.context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, RCVHWM)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if self.address.startswith("tcp://["):
            socket.setsockopt(zmq.IPV6, 1)
        return socket

    async def run(self) -> None:
        """Forever: subscribe and follow; after any failure, start over (index cleared) `RETRY_S` later."""
        while True:
            try:
                await self.follow()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not (self.dropped and task is not None and task.uncancel() == 0):
                    raise                       # cancelled from outside (the instance left, the proxy stops)
                log.warning("KV events of %s rank %d: the connection dropped; reconnecting", self.url, self.rank)
            except Exception as error:  # a socket error, say: never the proxy's end
                log.warning("KV events of %s rank %d: %s; reconnecting", self.url, self.rank, error)
            self.reset()
            await asyncio.sleep(RETRY_S)

    async def follow(self) -> None:
        """Subscribe, replay from 0, then apply live batches, filling gaps from the replay socket, until
        the connection drops: ZMQ makes a dropped connection again by itself, but not one it dropped
        itself (a message over MAX_MESSAGE_BYTES, a peer speaking no ZMTP), which would leave the socket
        deaf, and batches may be lost either way. The socket's monitor then cancels this task (`dropped`
        set), which `run` takes for a failure: watched aside, the receiving costs nothing more."""
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        watching = asyncio.ensure_future(monitor.recv_multipart())
        task = asyncio.current_task()
        armed = True
        self.dropped = False

        def on_drop(future: asyncio.Future[list[bytes]]) -> None:
            if armed and task is not None and not future.cancelled() and future.exception() is None:
                self.dropped = True
                task.cancel()

        watching.add_done_callback(on_drop)
        sub.connect(self.address)
        try:
            await self.replay(0)
            while True:
                frames = await sub.recv_multipart()
                try:
                    _, seq, payload = events.published_frames(frames)
                    batch = index_update(payload)
                except (events.DecodeError, UnicodeDecodeError, ValueError) as error:
                    self.metrics.malformed.inc(self.role)
                    log.warning("KV events of %s rank %d: a malformed message skipped: %s", self.url, self.rank, error)
                    continue
                await self.receive(seq, batch)
        finally:
            armed = False
            watching.cancel()
            sub.disable_monitor()
            monitor.close(linger=0)
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
        its buffer starts later. A replay that skipped batches is asked again from the first missing;
        when it keeps skipping, the index is reset (it misses batches) and False returned."""
        for _ in range(REPLAY_ATTEMPTS):
            outcome = await self._replay_from(start)
            if isinstance(outcome, bool):
                return outcome
            start = outcome
        log.warning("KV events of %s rank %d: the replay keeps skipping batches; its index is rebuilt from now on",
                    self.url, self.rank)
        self.reset()
        return False

    async def _replay_from(self, start: int) -> bool | int:
        """One replay from `start`: True or False as `replay` says, or the number of the first batch it
        skipped (dropped on the way: the batches before it are applied)."""
        dealer = self._socket(zmq.DEALER)
        dealer.connect(self.replay_address)
        first: int | None = None
        expected = start
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
                elif seq != expected:
                    return expected           # batches dropped on the way (the engine's send queue was full)
                expected = seq + 1
                try:
                    batch = index_update(frames[1])
                except events.DecodeError:
                    self.metrics.malformed.inc(self.role)
                    return False
                if self.next_seq is None or seq >= self.next_seq:
                    self.apply(seq, batch)
        finally:
            dealer.close(linger=0)

    def _follows(self, group: int, spec: str | None, kind: int) -> bool:
        """Whether the index takes a store or removal of KV-cache group `group` (see the module
        docstring): the first group a BlockStored names full attention is followed, group 0 until then."""
        followed = self.followed_group
        if kind == STORE and spec is not None:
            if spec not in FULL_ATTENTION_KINDS:
                return False
            if followed is None:
                self.followed_group = followed = group
                if group != 0:
                    log.info("KV events of %s rank %d: KV-cache group %d is full attention; the index follows it",
                             self.url, self.rank, group)
            return group == followed
        return group == (0 if followed is None else followed)

    def _learn(self, size: int) -> bool:
        """A BlockStored of `size` tokens a block, not the role's: True when the role takes it."""
        role = self.role
        before = self.router.block_size(role)
        if self.router.learn_block_size(role, size):
            log.warning("KV events of %s rank %d: blocks of %d tokens; %s prompts are hashed in blocks of %d from now "
                        "on, not %d (vLLM chose that size; --block-size in the engines' extra arguments tells the "
                        "proxy at start-up)", self.url, self.rank, size, role, size, before)
            return True
        if not self.warned:
            self.warned = True
            log.warning("KV events of %s rank %d: blocks of %d tokens, but %s prompts are hashed in blocks of %d, "
                        "which other engines of the role publish: its blocks of %d are skipped", self.url, self.rank,
                        size, role, before, size)
        return False

    def apply(self, seq: int, batch: Update) -> None:
        """A batch's events into the index, in order."""
        index = self.index
        now = time.monotonic()
        block_size = self.router.block_size(self.role)
        skipped_group = skipped_size = 0
        refused: int | None = None   # a block size the role did not take (not asked again in this batch)
        followed = self.followed_group
        groups = batch.groups or repeat(_NO_GROUP)   # as many as changes when there are any
        for (kind, keys, size, medium), (group, spec) in zip(batch.changes, groups, strict=False):
            if kind == CLEAR:
                index.clear()
                continue
            if medium is not None and medium != events.MEDIUM_GPU:
                continue
            if group is not None and group != followed:   # the group followed needs no more look
                if not self._follows(group, spec, kind):
                    skipped_group += 1
                    continue
                followed = self.followed_group
            if kind == STORE:
                if size != block_size:
                    if size is None or size == refused or not self._learn(size):
                        refused = size
                        skipped_size += 1
                        continue
                    block_size = size
                for key in keys:
                    index.store(key, now)
            else:
                for key in keys:
                    index.remove(key)
        self.next_seq = seq + 1
        self.last_ts = max(self.last_ts, batch.ts)
        metrics = self.metrics
        metrics.batches.inc(self.role)
        metrics.lag.observe(max(0.0, time.time() - batch.ts), self.role)
        if skipped_group:
            metrics.skipped.inc(self.role, "group", amount=skipped_group)
        if skipped_size:
            metrics.skipped.inc(self.role, "block_size", amount=skipped_size)


class Hub:
    """The subscribers of every listed engine rank: started as instances appear, stopped (and their
    indexes dropped) as they leave."""

    def __init__(self, router: KVAwareRouter, settings: KVAwareSettings) -> None:
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
