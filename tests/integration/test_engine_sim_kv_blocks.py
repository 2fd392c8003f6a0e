"""What `xpyd engine-sim` says its prefix cache holds (`GET /xpyd/kv/blocks`, to check a router's index
against), and its KV events' encoding (`encode_latest`, the same bytes as `kvcache.events.encode_batch`
writes for 0.33, without its per-field walk)."""

from __future__ import annotations

import asyncio
import random
import sys
from array import array
from typing import Any

import pytest

from tests.integration.enginesim import client_session, post
from tests.integration.test_engine_sim_prefix_cache import HASHER, engine, events_config
from xpyd.kvcache.events import (
    LATEST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    encode_batch,
    external_block_hash,
)
from xpyd.sim.emulator.kvevents import encode_latest

pytestmark = pytest.mark.integration


def random_event(rng: random.Random) -> KVEvent:
    def block_hash() -> int | bytes:
        return rng.getrandbits(64) if rng.random() < 0.7 else rng.randbytes(32)

    kind = rng.random()
    if kind < 0.45:
        blocks = rng.randint(1, 4)
        return BlockStored(
            block_hashes=[block_hash() for _ in range(blocks)],
            parent_block_hash=rng.choice([None, block_hash()]),
            token_ids=[rng.randrange(128_000) for _ in range(16 * blocks)], block_size=16,
            lora_id=rng.choice([None, 3]), medium=rng.choice([None, "GPU", "CPU"]),
            lora_name=rng.choice([None, "adapter"]),
            extra_keys=rng.choice([None, [("salt",)] + [None] * (blocks - 1)]),
            group_idx=rng.choice([None, 0]), kv_cache_spec_kind=rng.choice([None, "full_attention"]),
            kv_cache_spec_sliding_window=rng.choice([None, 4096]), locality=rng.choice([None, "LOCAL"]),
            ownership=rng.choice([None, "OWNED"]), session_id=rng.choice([None, "s1"]),
            lookahead_token_ids=rng.choice([None, [[1, 2]]]))
    if kind < 0.95:
        return BlockRemoved(block_hashes=[block_hash()], medium=rng.choice([None, "GPU"]),
                            group_idx=rng.choice([None, 0]), locality=rng.choice([None, "REMOTE"]),
                            ownership=rng.choice([None, "SHARED"]))
    return AllBlocksCleared()


def test_encode_latest_writes_encode_batchs_bytes() -> None:
    rng = random.Random(29)
    for _ in range(300):
        batch = EventBatch(rng.choice([1.5, 1_700_000_000.25, 7]),
                           [random_event(rng) for _ in range(rng.randint(0, 30))], rng.choice([None, 0, 3]))
        assert encode_latest(batch) == encode_batch(batch, LATEST)


def prompt(first: int, blocks: int) -> list[int]:
    return list(range(first, first + 16 * blocks + 5))   # 5 tokens past the last full block


async def blocks_of(session: Any, url: str) -> tuple[dict[str, Any], set[int]]:
    async with session.get(url + "/xpyd/kv/blocks") as response:
        answer = await response.json()
    async with session.get(url + "/xpyd/kv/blocks", params={"format": "u64"}) as response:
        assert response.content_type == "application/octet-stream"
        keys = array("Q", await response.read())
        if sys.byteorder == "little":
            keys.byteswap()
        assert int(response.headers["X-KV-Batches"]) == answer["batches"]
        assert int(response.headers["X-KV-Duplicated"]) == answer["duplicated"]
    return answer, set(keys)


async def test_the_cached_blocks_are_the_prompts_blocks_as_the_events_name_them() -> None:
    async with engine(kv_events=events_config()) as server, client_session() as session:
        answer, keys = await blocks_of(session, server.url)
        assert answer == {"blocks": [], "duplicated": 0, "batches": 0} and keys == set()
        first, second = prompt(1, 3), prompt(1000, 2)
        for ids in (first, second, first):
            status, body = await post(session, f"{server.url}/v1/completions", {"prompt": ids, "max_tokens": 2})
            assert status == 200, body
        await asyncio.sleep(0.05)   # the last step's batch
        expected = {external_block_hash(h) for ids in (first, second) for h in HASHER.hashes(ids)}
        answer, keys = await blocks_of(session, server.url)
        assert set(answer["blocks"]) == keys == expected and len(answer["blocks"]) == 5
        assert answer["duplicated"] == 0 and answer["batches"] == server.engine.kv_batches_published >= 2


async def test_blocks_with_byte_hashes() -> None:
    async with engine(kv_events=events_config(), kv_events_int_hashes=False) as server, client_session() as session:
        ids = prompt(1, 2)
        status, body = await post(session, f"{server.url}/v1/completions", {"prompt": ids, "max_tokens": 2})
        assert status == 200, body
        answer, keys = await blocks_of(session, server.url)
    digests = HASHER.hashes(ids)
    assert sorted(answer["blocks"]) == sorted(d.hex() for d in digests)
    assert keys == {external_block_hash(d) for d in digests}
