"""`xpyd engine-sim`'s prefix cache on the wire: its token ids, its hits (the metrics vLLM exposes,
`usage.prompt_tokens_details`, `remote_prefill_cached_tokens`), its flags, and its KV events on ZMQ
(PUB and replay), checked against vLLM's hashes of the same token ids and the block pool's rules; and
`xpyd bench`'s prompts for a Mooncake trace hit exactly where the trace's `hash_ids` say."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from tests.integration.enginesim import HOST, KV_BYTES, PERF, client_session, post, prefill_leg, token_prompt
from tests.integration.test_engine_sim import scrape, stream
from tests.paths import TRACES
from xpyd.bench.load import build_prompt, trace_arrivals
from xpyd.cluster.controlplane import free_port
from xpyd.common.netguard import NonLoopbackAddress
from xpyd.kvcache.chains import TraceKeys
from xpyd.kvcache.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    external_block_hash,
    parse_published,
    replay_request,
)
from xpyd.kvcache.hashing import BlockHasher
from xpyd.kvcache.pool import BlockPool
from xpyd.sim.emulator import tokens
from xpyd.sim.emulator.config import EmulatorConfig, KVEventsConfig
from xpyd.sim.emulator.http import EmulatorServer, start_server
from xpyd.sim.emulator.main import config_from_args
from xpyd.traces import read_trace

pytestmark = pytest.mark.integration

NAME = "llama-8b"
HASHER = BlockHasher(16)


@contextlib.asynccontextmanager
async def engine(**overrides: Any) -> AsyncIterator[EmulatorServer]:
    settings: dict[str, Any] = {"served_model_names": (NAME,), "host": HOST, "port": 0, "side_channel_port": 0,
                                "time_scale": 100.0, "kv_bytes_per_token": KV_BYTES, "seed": 1,
                                "enable_prompt_tokens_details": True}
    settings.update(overrides)
    server = await start_server(EmulatorConfig(**settings), PERF)
    try:
        yield server
    finally:
        await server.close()


def events_config(**overrides: Any) -> KVEventsConfig:
    settings: dict[str, Any] = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0",
                                "replay_endpoint": "tcp://*:0", "topic": "kv"}
    settings.update(overrides)
    return KVEventsConfig(**settings)


async def complete(session: Any, server: EmulatorServer, prompt: Any, **body: Any) -> dict[str, Any]:
    status, answer = await post(session, f"{server.url}/v1/completions",
                                {"prompt": prompt, "max_tokens": 1, **body})
    assert status == 200, answer
    return dict(answer)


async def replay(endpoint: str, start: int = 0) -> list[tuple[str, int, EventBatch]]:
    """Every batch the engine still holds from `start` on, through its replay socket."""
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    try:
        socket.connect(endpoint)
        await socket.send_multipart([b"", replay_request(start)])
        out = []
        while True:
            frames = await asyncio.wait_for(socket.recv_multipart(), timeout=5)
            assert frames[0] == b""
            if frames[2] == END_SEQ:
                assert frames[1:] == [b"", END_SEQ, b""]
                return out
            out.append(parse_published(frames[1:]))
    finally:
        socket.close(linger=0)
        context.term()


def flat(batches: list[tuple[str, int, EventBatch]]) -> list[KVEvent]:
    return [event for _, _, batch in batches for event in batch.events]


# --- token ids ------------------------------------------------------------------------------------

def test_text_is_cut_into_four_character_tokens_and_a_chat_is_framed_as_llama_3s() -> None:
    assert tokens.text_ids("abcdefghi") == [tokens.chunk_id("abcd"), tokens.chunk_id("efgh"), tokens.chunk_id("i")]
    assert tokens.prompt_ids("") == [tokens.BOS]
    assert all(0 <= token < tokens.TEXT_VOCAB for token in tokens.text_ids("x" * 400 + " the and"))
    assert tokens.chunk_id(" tok") == tokens.GENERATED == 21_602   # stable across processes and releases
    chat = tokens.chat_ids([("user", "x" * 3920)])
    assert len(chat) == 1 + 5 + 980 + 4
    assert chat[:5] == [tokens.BOS, tokens.START_HEADER, tokens.chunk_id("user"), tokens.END_HEADER,
                        tokens.NEWLINES]
    assert chat[-5:] == [tokens.EOT, tokens.START_HEADER, tokens.chunk_id("assistant"), tokens.END_HEADER,
                         tokens.NEWLINES]


# --- hits -------------------------------------------------------------------------------------------

async def test_a_repeated_prompt_hits_all_but_its_last_block_and_the_metrics_say_so() -> None:
    async with engine() as server, client_session() as session:
        text = "abcd" * 100                                   # 100 tokens: 6 full blocks of 16
        first = await complete(session, server, text)
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": None,
                                                           "multimodal_tokens": None}
        again = await complete(session, server, text)         # at most prompt - 1 tokens hit: 96
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        longer = await complete(session, server, text + "efgh" * 40)   # shares the 6 full blocks
        assert longer["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        ids = await complete(session, server, tokens.text_ids(text))   # the same tokens as ids
        assert ids["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        metrics = await scrape(session, server)
        assert metrics.value("vllm:prefix_cache_queries_total") == 100 + 100 + 140 + 100
        assert metrics.value("vllm:prefix_cache_hits_total") == 3 * 96
        assert metrics.value("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 3 * 96
        assert metrics.value("vllm:prompt_tokens_by_source_total", source="local_compute") == 440 - 3 * 96
        assert metrics.value("vllm:prompt_tokens_cached_total") == 3 * 96
        assert metrics.value("vllm:prompt_tokens_cached_by_source_total", source="device") == 3 * 96
        assert metrics.value("vllm:external_prefix_cache_queries_total") == 0   # no KV connector


async def test_a_salt_keys_the_first_block_and_chat_reports_what_it_wrote_to_the_cache() -> None:
    async with engine() as server, client_session() as session:
        text = "abcd" * 64
        await complete(session, server, text, cache_salt="tenant-a")
        salted = await complete(session, server, text, cache_salt="tenant-a")
        other = await complete(session, server, text, cache_salt="tenant-b")
        assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        status, answer = await post(session, f"{server.url}/v1/completions",
                                    {"prompt": text, "cache_salt": "a/b", "max_tokens": 1})
        assert status == 400 and answer["error"]["param"] == "cache_salt"
        chat = {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 2}   # 110 tokens
        status, answer = await post(session, f"{server.url}/v1/chat/completions", chat)
        assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": 96,
                                                            "multimodal_tokens": None}
        result = await stream(session, f"{server.url}/v1/chat/completions",
                              {**chat, "stream_options": {"include_usage": True}})
        assert result.usage is not None
        assert result.usage["prompt_tokens_details"] == {"cached_tokens": 96, "created_cache_tokens": 0}
        result = await stream(session, f"{server.url}/v1/completions",
                              {"prompt": text, "cache_salt": "tenant-a", "max_tokens": 2,
                               "stream_options": {"include_usage": True}})
        assert result.usage is not None and result.usage["prompt_tokens_details"] == {"cached_tokens": 48}


async def test_without_prefix_caching_nothing_hits_and_details_need_their_flag() -> None:
    async with engine(enable_prefix_caching=False) as off, engine(enable_prompt_tokens_details=False) as plain, \
            client_session() as session:
        for _ in range(2):
            answer = await complete(session, off, "abcd" * 100)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        metrics = await scrape(session, off)
        assert metrics.value("vllm:prefix_cache_queries_total") == metrics.value("vllm:prefix_cache_hits_total") == 0
        assert metrics.value("vllm:prompt_tokens_by_source_total", source="local_compute") == 200
        for _ in range(2):
            answer = await complete(session, plain, "abcd" * 100)
        assert answer["usage"]["prompt_tokens_details"] is None   # vLLM adds them only when asked
        assert (await scrape(session, plain)).value("vllm:prefix_cache_hits_total") == 96


async def test_prefill_reports_its_hits_and_decode_loads_only_what_it_lacks() -> None:
    async with engine(kv_role="kv_producer") as prefill, engine(kv_role="kv_consumer") as decode, \
            client_session() as session:
        body = {"prompt": token_prompt(400), "max_tokens": 4}
        for attempt in range(2):
            params = await prefill_leg(session, prefill.url, body, f"r{attempt}")
            assert params["remote_prefill_cached_tokens"] == (0 if attempt == 0 else 384)
            status, answer = await post(session, f"{decode.url}/v1/completions", {**body, "kv_transfer_params": params})
            assert status == 200
            # The decode leg reports the prefill engine's hits, as vLLM 0.32+ does.
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == params["remote_prefill_cached_tokens"]
        metrics = await scrape(session, decode)
        # The second time the decode engine holds the prompt's first 384 tokens and pulls only 16.
        assert metrics.value("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 400 + 16
        assert metrics.value("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 384
        assert metrics.value("vllm:prefix_cache_hits_total") == 384
        assert metrics.value("vllm:external_prefix_cache_queries_total") == 800 - 384
        assert metrics.value("vllm:external_prefix_cache_hits_total") == 416
        assert metrics.value("vllm:prompt_tokens_cached_by_source_total", source="p2p") == 416


async def test_bench_prompts_of_a_mooncake_trace_hit_where_its_hash_ids_say() -> None:
    """`xpyd bench`'s prompts for 30 requests of the trace that share prefixes (the first ten under 40,000
    tokens of each of the four most common first blocks, in arrival order), one at a time to an engine
    that never evicts: each request finds cached exactly the blocks a pool keyed by the trace's hash ids
    (the simulator's keys) finds, partial trace blocks included."""
    trace = read_trace(TRACES / "mooncake_synthetic.jsonl")
    common = [first for first, _ in Counter(r.prefix_blocks[0] for r in trace if r.prefix_blocks).most_common(4)]
    taken: Counter[int] = Counter()
    requests = []
    for request in trace:
        first = request.prefix_blocks[0] if request.prefix_blocks else None
        if first in common and taken[first] < 10 and request.isl < 40_000:
            taken[first] += 1
            requests.append(request)
    arrivals = trace_arrivals(requests)
    keys = TraceKeys([r.prefix_blocks for r in requests], [r.isl for r in requests], 16)
    pool = BlockPool(10_000_000 // 16)
    expected = []
    for index, request in enumerate(requests):
        held = pool.admit(keys.keys(index), (request.isl - 1) // 16, (request.isl + 1) // 16)
        found = keys.keys(index)
        if found is not None:
            pool.cache(held, found, request.isl // 16)
        pool.free(held)
        expected.append(held.hit * 16)
    assert len(requests) == 30 and sum(expected) > 0.8 * sum(r.isl for r in requests)
    assert any(hit % 512 for hit in expected)
    async with engine(max_kv_tokens=10_000_000, time_scale=1000.0) as server, client_session() as session:
        found_cached = []
        for arrival in arrivals:
            answer = await complete(session, server, build_prompt(arrival))
            assert answer["usage"]["prompt_tokens"] == arrival.isl
            found_cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert found_cached == expected


# --- KV events ---------------------------------------------------------------------------------------

def stored(tokens_: list[int], start: int, end: int, salt: str | None = None, as_int: bool = True) -> BlockStored:
    """The BlockStored vLLM publishes when blocks `start` to `end - 1` of a prompt become cached."""
    hashes = [external_block_hash(h, as_int) for h in HASHER.hashes(tokens_, salt)]
    return BlockStored(hashes[start:end], hashes[start - 1] if start else None, tokens_[start * 16:end * 16], 16,
                       extra_keys=[(salt,) if i == 0 and salt else None for i in range(start, end)], group_idx=0,
                       kv_cache_spec_kind="full_attention")


def removed(tokens_: list[int], block: int) -> BlockRemoved:
    return BlockRemoved([external_block_hash(HASHER.hashes(tokens_)[block])], group_idx=0)


async def test_kv_events_are_vllms_for_what_the_pool_caches_evicts_and_clears(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    a = token_prompt(64)
    b = a[:32] + [1000 + t for t in range(32)]
    c = [2000 + t for t in range(96)]
    # 8 blocks of 16 (128 tokens): C's 6 blocks evict A's and B's tails.
    async with engine(max_kv_tokens=128, max_model_len=128, kv_events=events_config()) as server, \
            client_session() as session:
        publisher = server.engine.publisher
        assert publisher is not None and publisher.replay_endpoint is not None
        assert publisher.endpoint.startswith(f"tcp://{HOST}:")          # the wildcard is bound on --host only
        context = zmq.asyncio.Context()
        sub = context.socket(zmq.SUB)
        sub.connect(publisher.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        await asyncio.sleep(0.3)                                         # ZMQ's subscription reaches the PUB
        for prompt, session_id in ((a, None), (b, "chat-7"), (c, None)):
            await complete(session, server, prompt, **({"session_id": session_id} if session_id else {}))
        async with session.post(f"{server.url}/reset_prefix_cache") as response:
            assert await response.json() == {"success": True}
        await complete(session, server, a, cache_salt="s")
        replayed = await replay(publisher.replay_endpoint)
        live = [parse_published(await asyncio.wait_for(sub.recv_multipart(), timeout=5)) for _ in replayed]
        sub.close(linger=0)
        context.term()
        await asyncio.sleep(0)
        from_three = await replay(publisher.replay_endpoint, 3)
    assert [seq for _, seq, _ in replayed] == [0, 1, 2, 3]
    assert [(topic, seq) for topic, seq, _ in live] == [("kv", seq) for seq in range(4)]
    assert [batch.events for _, _, batch in live] == [batch.events for _, _, batch in replayed]
    assert [seq for _, seq, _ in from_three] == [3]
    assert all(batch.data_parallel_rank == 0 and batch.ts > 0 for _, _, batch in replayed)
    b_stored = stored(b, 2, 4)
    b_stored.session_id = "chat-7"
    # One batch a step: A's blocks; B's after its hit on A's first two; C's after evicting the least
    # recently freed (A's and B's tails, a request's last block first); the reset goes out with the next
    # step's batch, as vLLM's scheduler takes it.
    assert [batch.events for _, _, batch in replayed] == [
        [stored(a, 0, 4)],
        [b_stored],
        [removed(a, 3), removed(a, 2), removed(b, 3), removed(b, 2), stored(c, 0, 6)],
        [AllBlocksCleared(), stored(a, 0, 4, salt="s")],
    ]


async def test_kv_events_with_byte_hashes_on_a_data_parallel_ranks_port() -> None:
    port = free_port()
    config = events_config(endpoint=f"tcp://*:{port}", replay_endpoint=None, topic="")
    async with engine(kv_events=config, kv_events_int_hashes=False, data_parallel_rank=1) as server, \
            client_session() as session:
        publisher = server.engine.publisher
        assert publisher is not None and publisher.endpoint == f"tcp://{HOST}:{port + 1}"
        assert publisher.replay_endpoint is None
        context = zmq.asyncio.Context()
        sub = context.socket(zmq.SUB)
        sub.connect(publisher.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        await asyncio.sleep(0.3)
        await complete(session, server, token_prompt(40))
        topic, seq, batch = parse_published(await asyncio.wait_for(sub.recv_multipart(), timeout=5))
        sub.close(linger=0)
        context.term()
    assert (topic, seq, batch.data_parallel_rank) == ("", 0, 1)
    assert batch.events == [stored(token_prompt(40), 0, 2, as_int=False)]


async def test_events_off_or_null_publish_nothing_and_reset_needs_dev_mode() -> None:
    async with engine(kv_events=events_config(publisher="null")) as null, engine() as plain, \
            client_session() as session:
        assert null.engine.publisher is None and null.engine.kv_events is not None
        assert plain.engine.kv_events is None
        await complete(session, null, token_prompt(40))
        assert null.engine.kv_events.pending == []                      # taken and dropped each step
        async with session.post(f"{plain.url}/reset_prefix_cache") as response:
            assert response.status == 404                               # VLLM_SERVER_DEV_MODE is not set
    assert null.engine.kv_events.tracked == 0                            # nothing kept after the requests


async def test_without_prefix_caching_the_sockets_are_there_and_nothing_is_published() -> None:
    async with engine(enable_prefix_caching=False, kv_events=events_config()) as server, client_session() as session:
        publisher = server.engine.publisher
        assert publisher is not None and publisher.replay_endpoint is not None and server.engine.kv_events is None
        await complete(session, server, token_prompt(64))
        assert await replay(publisher.replay_endpoint) == []
        assert server.engine.reset_prefix_cache()   # nothing to reset: vLLM's pool without caching succeeds


async def test_a_reset_fails_while_requests_hold_kv() -> None:
    async with engine(kv_role="kv_producer", kv_events=events_config(publisher="null")) as prefill, \
            client_session() as session:
        await prefill_leg(session, prefill.url, {"prompt": token_prompt(64), "max_tokens": 4}, "held")
        assert not prefill.engine.reset_prefix_cache()                  # its KV waits for a decode engine
        assert not prefill.engine.reset_prefix_cache(reset_running_requests=True)


def test_the_flags_are_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    config, _, ignored = config_from_args([
        "--no-enable-prefix-caching", "--block-size", "32", "--prefix-caching-hash-algo", "sha256_cbor",
        "--num-gpu-blocks-override", "101", "--enable-prompt-tokens-details", "-dpn", "2",
        '--kv-events-config={"enable_kv_cache_events": true, "endpoint": "tcp://*:6000"}',
        "--kv-events-config.topic", "t", "--kv-events-config.buffer_steps=5"])
    assert not ignored and not config.enable_prefix_caching and config.block_size == 32
    assert config.prefix_caching_hash_algo == "sha256_cbor" and config.max_kv_tokens == 100 * 32
    assert config.enable_prompt_tokens_details and config.data_parallel_rank == 2
    assert config.kv_events == KVEventsConfig(True, "zmq", "tcp://*:6000", None, 5, 100_000, 100_000, "t")
    assert not config.kv_events_int_hashes
    default, _, _ = config_from_args([])
    assert default.enable_prefix_caching and default.block_size == 16 and default.prefix_caching_hash_algo == "sha256"
    assert default.kv_events == KVEventsConfig() and not default.kv_events.publishes
    assert default.kv_events.publisher == "null"
    with pytest.raises(ValueError, match="unknown field"):
        config_from_args(['--kv-events-config={"enable_kv_cache_events": true, "port": 1}'])
    with pytest.raises(ValueError, match="publisher"):
        config_from_args(['--kv-events-config={"publisher": "kafka"}'])
    with pytest.raises(NonLoopbackAddress):
        config_from_args(['--kv-events-config={"enable_kv_cache_events": true, "endpoint": "tcp://10.0.0.1:5557"}'])
    with pytest.raises(SystemExit):
        config_from_args(["--prefix-caching-hash-algo", "md5"])
    try:
        import xxhash  # noqa: F401
    except ImportError:   # as vLLM, the xxhash algorithms need the package
        with pytest.raises(ValueError, match="xxhash is required"):
            config_from_args(["--prefix-caching-hash-algo", "xxhash_cbor"])
    config_from_args(["--prefix-caching-hash-algo", "xxhash", "--no-enable-prefix-caching"])   # never hashes
