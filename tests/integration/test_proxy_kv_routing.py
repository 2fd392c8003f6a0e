"""KVAware routing end to end, on loopback: a conversation's next turn goes to the prefill engine that
holds its prefix, with emulated engines (`xpyd engine-sim` processes) and with stub engines that
tokenize text four characters to a token (`/tokenize`); the Events index follows engines' KV events
over ZMQ (publishers written here with `xpyd.kvcache.events`, as vLLM's ZmqEventPublisher sends
them): stored blocks attract a prompt, removed and cleared ones stop doing so, a gap is replayed or,
when the replay has lost it, the index is rebuilt, and an engine's index goes when it leaves; a replay
that drops batches is asked again, a message past the size limit costs a gap and nothing else, and
blocks of another size than --kv-block-size give the role their size."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from typing import cast

import aiohttp
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from tests.eventually import eventually
from tests.integration.processes import HOST, kill, start_engine, start_proxy, wait_eligible, wait_for
from tests.integration.rig import rig
from xpyd.api.models import KVIndex, RoutingPolicy
from xpyd.cluster.controlplane import free_ports
from xpyd.kvcache import events
from xpyd.proxy.kvaware import KVAwareSettings, block_keys
from xpyd.proxy.pool import Endpoint
from xpyd.testing.ports import common_ports
from xpyd.testing.stubengine import StubEngine

pytestmark = pytest.mark.integration

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BLOCK = 16


def chunk_id(chunk: str) -> int:
    return int.from_bytes(hashlib.blake2b(chunk.encode(), digest_size=8).digest(), "big") % 128_000


class ChunkTokenizer(StubEngine):
    """A stub engine whose /tokenize cuts text (a prompt, or a chat's messages in order) into chunks of
    four characters, one token each: equal prefixes give equal ids."""

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        self.tokenized.append(body)
        text = body.get("prompt") if "prompt" in body else \
            "".join(f"<{m['role']}>{m['content']}" for m in body.get("messages", []))
        ids = [chunk_id(text[i:i + 4]) for i in range(0, len(text), 4)]
        return web.json_response({"count": len(ids), "max_model_len": 131072, "tokens": ids})


def served(engine: StubEngine) -> int:
    return sum(1 for seen in engine.seen if seen.path.endswith("completions"))


def turns(n: int, seed: int) -> Iterator[list[dict[str, str]]]:
    """The messages of a conversation's first `n` turns, each carrying the ones before."""
    messages: list[dict[str, str]] = [{"role": "system", "content": f"You are assistant {seed}. " * 20}]
    for turn in range(n):
        messages = [*messages, {"role": "user", "content": f"question {turn} of conversation {seed} " * 8}]
        yield messages
        messages = [*messages, {"role": "assistant", "content": f"answer {turn} " * 10}]


async def test_a_chats_next_turns_go_where_its_prefix_is() -> None:
    prefills: list[StubEngine] = [ChunkTokenizer(name=f"p{i}") for i in range(4)]
    settings = KVAwareSettings(index=KVIndex.ROUTED, block_size=BLOCK, kv_weight=1.0)
    async with rig(engines=(prefills, [StubEngine(name="d0")]), routing_policy=RoutingPolicy.KV_AWARE,
                   kv=settings) as r:
        for seed in range(3):
            homes = set()
            for messages in turns(4, seed):
                before = [served(p) for p in prefills]
                status, answer, _ = await r.post("/v1/chat/completions",
                                                 {"model": "m", "messages": messages, "max_tokens": 4})
                assert status == 200, answer
                homes |= {p.name for p, b in zip(prefills, before, strict=True) if served(p) > b}
            assert len(homes) == 1, f"conversation {seed}'s turns went to {homes}"
        assert sum(len(p.tokenized) for p in prefills) == 12        # one /tokenize per request
        assert r.proxy.kv is not None and r.proxy.kv.router.predicted_hits.value("prefill") > 0


async def test_engines_without_tokenize_cost_no_request() -> None:
    class NoTokenize(StubEngine):
        async def _tokenize(self, request: web.Request) -> web.Response:
            return web.json_response({"error": "not found"}, status=404)

    prefills: list[StubEngine] = [NoTokenize(name="p0"), NoTokenize(name="p1")]
    async with rig(engines=(prefills, [StubEngine(name="d0")]), routing_policy=RoutingPolicy.KV_AWARE,
                   kv=KVAwareSettings(index=KVIndex.ROUTED, block_size=BLOCK)) as r:
        for _ in range(4):
            status, answer, _ = await r.post("/v1/completions", {"model": "m", "prompt": "y" * 300, "max_tokens": 2})
            assert status == 200, answer
        assert r.proxy.kv is not None
        assert r.proxy.kv.router.tokenize_failures.value("http_4xx") == 4


# -- emulated engines --------------------------------------------------------------------------------------

@pytest.fixture
async def emulated() -> AsyncIterator[tuple[str, list[str]]]:
    ports = free_ports(9)
    side = iter(ports[5:])
    processes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        prefill = [f"http://{HOST}:{port}" for port in ports[:3]]
        for port in ports[:3]:
            processes[f"http://{HOST}:{port}"] = start_engine("prefill", port, next(side), "20")
        decode = f"http://{HOST}:{ports[3]}"
        processes[decode] = start_engine("decode", ports[3], next(side), "20")
        proxy = f"http://{HOST}:{ports[4]}"
        processes[proxy] = start_proxy(ports[4], prefill, [decode], "--routing-policy", "KVAware", "--kv-index",
                                       "Routed", "--kv-block-size", str(BLOCK))
        for url, process in processes.items():
            await wait_for(url + "/health", process)
        await wait_eligible(proxy, prefill=3, decode=1)
        yield proxy, prefill
    finally:
        kill(processes.values())


async def _successes(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


async def test_emulated_engines_get_a_conversations_turns_where_its_prefix_is(
        emulated: tuple[str, list[str]]) -> None:
    proxy, prefills = emulated
    async with aiohttp.ClientSession() as session:
        for conversation in range(3):
            tokens = [conversation * 10_000 + i for i in range(200)]
            homes = set()
            for turn in range(3):
                before = [await _successes(session, url) for url in prefills]
                body = {"model": MODEL, "prompt": tokens, "max_tokens": 8}
                async with session.post(proxy + "/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                after = [await _successes(session, url) for url in prefills]
                homes |= {url for url, b, a in zip(prefills, before, after, strict=True) if a > b}
                tokens = tokens + [7] * 8 + [conversation * 10_000 + 5000 + turn * 100 + i for i in range(64)]
            assert len(homes) == 1, f"conversation {conversation}'s turns went to {homes}"
        async with session.get(proxy + "/metrics") as response:
            page = await response.text()
    assert "xpyd_proxy_kv_predicted_hit_tokens_total" in page and "xpyd_proxy_kv_index_blocks" in page


# -- the Events index ---------------------------------------------------------------------------------------

class Publisher:
    """One engine's KV event sockets, as vLLM's ZmqEventPublisher binds them (PUB + replay ROUTER)."""

    def __init__(self, context: zmq.asyncio.Context, host: str, port: int, replay_port: int,
                 version: events.Version = events.LATEST) -> None:
        self.pub = context.socket(zmq.PUB)
        self.pub.bind(f"tcp://{host}:{port}")
        self.router = context.socket(zmq.ROUTER)
        self.router.bind(f"tcp://{host}:{replay_port}")
        self.version = version
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.replays = 0
        #: Batches the next replay leaves out, as a full ROUTER queue drops them before vLLM 0.33.
        self.drop_in_replay: set[int] = set()
        self.serving = asyncio.ensure_future(self._serve_replays())

    def publish(self, *batch_events: events.KVEvent, send: bool = True, ts: float | None = None) -> None:
        payload = events.encode_batch(events.EventBatch(ts if ts is not None else _now(), list(batch_events)),
                                      self.version)
        self.buffer.append((self.seq, payload))
        if send:
            self.pub.send_multipart(events.publish_frames("kv-events", self.seq, payload))
        self.seq += 1

    async def _serve_replays(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            request = events.parse_replay_request(frames)
            if request is None:
                continue
            self.replays += 1
            identity, start = request
            dropped, self.drop_in_replay = self.drop_in_replay, set()
            for reply in events.replay_reply(self.version, identity, "kv-events",
                                             [(seq, payload) for seq, payload in self.buffer if seq not in dropped],
                                             start):
                await self.router.send_multipart(list(reply))

    def close(self) -> None:
        self.serving.cancel()
        self.pub.close(linger=0)
        self.router.close(linger=0)


def _now() -> float:
    return time.time()


def _free_port_on(hosts: list[str]) -> int:
    """A port free on every one of `hosts`, with its replay port free too."""
    return common_ports(hosts, 1)[0]


def stored(hashes: list[events.ExternalBlockHash]) -> events.BlockStored:
    return events.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[0] * (BLOCK * len(hashes)),
                              block_size=BLOCK)


@pytest.mark.parametrize("version", [(0, 23), (0, 24), (0, 33)], ids=["arrays", "maps", "maps+replay-topic"])
async def test_the_events_index_follows_the_engines_caches(version: events.Version) -> None:
    hosts = ["127.0.0.2", "127.0.0.3"]
    port = _free_port_on(hosts)
    prefills = [StubEngine(name=f"p{i}") for i in range(2)]
    for engine, host in zip(prefills, hosts, strict=True):
        await engine.start(host)
    context = zmq.asyncio.Context()
    publishers = [Publisher(context, host, port, port + 100, version) for host in hosts]
    settings = KVAwareSettings(index=KVIndex.EVENTS, block_size=BLOCK, events_port=port, events_replay_port=port + 100)
    prompt = list(range(1, 20 * BLOCK + 2))
    keys = cast(list[events.ExternalBlockHash], block_keys(settings.hasher(), prompt).ids)
    publishers[1].publish(stored(keys[:10]), send=False)   # before the proxy listened: replayed on connect
    try:
        async with rig(engines=(prefills, [StubEngine(name="d0")]), routing_policy=RoutingPolicy.KV_AWARE,
                       kv=settings) as r:
            assert r.proxy.kv is not None
            router = r.proxy.kv.router
            b_url = prefills[1].url
            await eventually(lambda: router.blocks(b_url) == 10, what="the replayed blocks")
            publishers[1].publish(stored(keys[10:]))
            await eventually(lambda: router.blocks(b_url) == 20, what="the live blocks")
            for _ in range(4):
                status, answer, _ = await r.post("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2})
                assert status == 200, answer
            assert served(prefills[1]) == 4 and served(prefills[0]) == 0
            assert router.predicted_hits.value("prefill") == 4 * 20 * BLOCK
            # A gap the replay fills.
            publishers[1].publish(events.BlockRemoved(block_hashes=keys[15:]), send=False)
            publishers[1].publish(stored([1, 2, 3]))
            await eventually(lambda: router.blocks(b_url) == 18, what="the gap replayed")
            assert r.proxy.kv.hub is not None and r.proxy.kv.hub.metrics.gaps.value("replayed") == 1
            # A gap the replay has lost: the index is rebuilt from the live batches on.
            publishers[1].publish(stored([4]), send=False)
            publishers[1].buffer.clear()
            publishers[1].publish(stored([5, 6]))
            await eventually(lambda: router.blocks(b_url) == 2, what="the index rebuilt")
            assert r.proxy.kv.hub.metrics.gaps.value("lost") == 1
            # Everything cleared, then the engine leaves the pool with its index.
            publishers[0].publish(stored(keys[:3]))
            await eventually(lambda: router.blocks(prefills[0].url) == 3, what="the other engine's blocks")
            publishers[0].publish(events.AllBlocksCleared())
            await eventually(lambda: router.blocks(prefills[0].url) == 0, what="the cache cleared")
            r.proxy.set_endpoints("prefill", [Endpoint(url=prefills[0].url)])
            assert b_url not in router.indexes and (b_url, 0) not in r.proxy.kv.hub.tasks
            assert (prefills[0].url, 0) in r.proxy.kv.hub.tasks
            assert r.proxy.kv.hub.metrics.lag.count("prefill") >= 5
    finally:
        for publisher in publishers:
            publisher.close()
        context.destroy(linger=0)


async def test_a_restarted_engine_is_replayed_from_its_first_batch() -> None:
    host = "127.0.0.4"
    port = _free_port_on([host])
    engine = StubEngine(name="p0")
    await engine.start(host)
    context = zmq.asyncio.Context()
    publisher = Publisher(context, host, port, port + 100)
    settings = KVAwareSettings(index=KVIndex.EVENTS, block_size=BLOCK, events_port=port, events_replay_port=port + 100)
    try:
        async with rig(engines=([engine], [StubEngine(name="d0")]), routing_policy=RoutingPolicy.KV_AWARE,
                       kv=settings) as r:
            assert r.proxy.kv is not None
            router = r.proxy.kv.router
            await eventually(lambda: publisher.replays >= 1, what="the first replay")
            for n in range(3):
                publisher.publish(stored([100 + n]))
            await eventually(lambda: router.blocks(engine.url) == 3, what="three blocks")
            # The engine restarts: its numbers start again at 0, its cache is empty.
            publisher.seq, publisher.buffer = 0, []
            publisher.publish(stored([7]))
            await eventually(lambda: router.blocks(engine.url) == 1, what="the new engine's one block")
            assert r.proxy.kv.hub is not None and r.proxy.kv.hub.metrics.gaps.value("restart") == 1
    finally:
        publisher.close()
        context.destroy(linger=0)


async def events_rig(
        host: str, **settings: object) -> tuple[StubEngine, zmq.asyncio.Context, Publisher, KVAwareSettings]:
    port = _free_port_on([host])
    engine = StubEngine(name="p0")
    await engine.start(host)
    context = zmq.asyncio.Context()
    publisher = Publisher(context, host, port, port + 100)
    return engine, context, publisher, KVAwareSettings(index=KVIndex.EVENTS, block_size=BLOCK, events_port=port,
                                                       events_replay_port=port + 100, **settings)  # type: ignore[arg-type]


async def test_a_replay_that_drops_batches_is_asked_again_from_the_first_missing() -> None:
    engine, context, publisher, settings = await events_rig("127.0.0.9")
    for n in range(6):
        publisher.publish(stored([200 + n]), send=False)
    publisher.drop_in_replay = {2, 3}
    try:
        async with rig(engines=([engine], [StubEngine(name="d0")]), routing_policy=RoutingPolicy.KV_AWARE,
                       kv=settings) as r:
            assert r.proxy.kv is not None
            router = r.proxy.kv.router
            await eventually(lambda: router.blocks(engine.url) == 6, what="all six batches, the dropped ones again")
            assert publisher.replays == 2
            publisher.publish(stored([300]))
            await eventually(lambda: router.blocks(engine.url) == 7, what="the live batch after them")
    finally:
        publisher.close()
        context.destroy(linger=0)


async def test_the_sockets_queue_little_and_refuse_huge_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each SUB and replay socket queues at most RCVHWM messages of at most MAX_MESSAGE_BYTES. A longer
    message drops the connection, and ZMQ does not make one it dropped itself again: the subscriber
    sees it drop and starts over (replayed from 0, which stops at the same message), then the gap the
    replay cannot fill has the index rebuilt from the live batches; the proxy goes on."""
    from xpyd.proxy import kvevents

    monkeypatch.setattr(kvevents, "MAX_MESSAGE_BYTES", 4096)
    engine, context, publisher, settings = await events_rig("127.0.0.10")
    try:
        async with rig(engines=([engine], [StubEngine(name="d0")]), routing_policy=RoutingPolicy.KV_AWARE,
                       kv=settings) as r:
            assert r.proxy.kv is not None and r.proxy.kv.hub is not None
            router, hub = r.proxy.kv.router, r.proxy.kv.hub
            task = hub.tasks[(engine.url, 0)]
            await eventually(lambda: publisher.replays >= 1, what="the first replay")
            sockets = kvevents.Subscriber(router, engine.url, "prefill", 0, "127.0.0.10", hub.context, hub.metrics)
            probe = sockets._socket(zmq.SUB)
            assert (probe.getsockopt(zmq.RCVHWM), probe.getsockopt(zmq.MAXMSGSIZE)) == (kvevents.RCVHWM, 4096)
            probe.close(linger=0)
            publisher.publish(stored([1]))
            await eventually(lambda: router.blocks(engine.url) == 1, what="a small batch")
            publisher.publish(stored(list(range(10, 2000))))          # about 20 kB: over the limit
            for _ in range(20):                                       # ZMQ reconnects: the next ones come in
                publisher.publish(stored([5000]))
                await asyncio.sleep(0.1)
                if hub.metrics.gaps.value("lost"):
                    break
            await eventually(lambda: hub.metrics.gaps.value("lost") == 1, timeout=10, what="the gap lost")
            publisher.publish(stored([6000]))
            await eventually(lambda: router.blocks(engine.url) >= 1 and not task.done(), what="the index rebuilt")
            assert router.blocks(engine.url) <= 2             # 5000 and 6000 at most: 1 and the huge batch gone
    finally:
        publisher.close()
        context.destroy(linger=0)


async def test_blocks_of_another_size_give_the_role_their_size_and_prompts_hit() -> None:
    """The render guessed --kv-block-size 16 but the engines run 64-token blocks (an MLA backend's): the
    proxy learns 64 from the first BlockStored and routes on hits, instead of dropping every event."""
    engine, context, publisher, settings = await events_rig("127.0.0.11")
    other = StubEngine(name="p1")
    await other.start("127.0.0.12")
    prompt = list(range(1, 20 * BLOCK + 2))
    size = 4 * BLOCK
    hashes = cast(list[events.ExternalBlockHash], block_keys(settings.hasher(size), prompt).ids)
    publisher.publish(events.BlockStored(hashes, None, prompt[:len(hashes) * size], size), send=False)
    try:
        async with rig(engines=([engine, other], [StubEngine(name="d0")]), routing_policy=RoutingPolicy.KV_AWARE,
                       kv=settings) as r:
            assert r.proxy.kv is not None
            router = r.proxy.kv.router
            await eventually(lambda: router.blocks(engine.url) == len(hashes), what="the replayed blocks")
            assert router.block_size("prefill") == size and router.block_size_changes.value("prefill") == 1
            for _ in range(4):
                status, answer, _ = await r.post("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2})
                assert status == 200, answer
            assert served(engine) == 4 and served(other) == 0
            assert router.predicted_hits.value("prefill") == 4 * len(hashes) * size
    finally:
        publisher.close()
        context.destroy(linger=0)
