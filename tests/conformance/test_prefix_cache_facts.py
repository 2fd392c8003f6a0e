"""The prefix-cache and KV-event facts `xpyd.vllm` and `xpyd.kvcache.events` record, read from each
release's own code (the unpacked wheels of `RELEASES`, `bash e2e/build/vllm-wheels.sh`; `ast` and
plain text, nothing of vLLM imported): the flags `xpyd engine-sim` takes as vLLM's, the hash
algorithms and their default, the default block sizes, where `NONE_HASH` stopped being random, the
KV events' fields per release and when they became tagged maps, the replay's topic frame and the
integer hashes' default."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conformance.vllm_release import RELEASES, release_root, serve_flags
from xpyd import vllm
from xpyd.kvcache import events
from xpyd.sim.emulator.main import build_parser

pytestmark = pytest.mark.integration


def version(release: str) -> tuple[int, int]:
    major, minor, _ = release.split(".")
    return int(major), int(minor)


def tree(release: str, rel: str) -> ast.Module:
    path = release_root(release) / rel
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def text(release: str, rel: str) -> str:
    return Path(release_root(release) / rel).read_text(encoding="utf-8")


def class_def(module: ast.Module, name: str) -> ast.ClassDef:
    found = [node for node in ast.walk(module) if isinstance(node, ast.ClassDef) and node.name == name]
    assert len(found) == 1, name
    return found[0]


def fields(cls: ast.ClassDef) -> list[tuple[str, bool]]:
    """A struct's fields in order, each with whether it is required (no default)."""
    return [(item.target.id, item.value is None) for item in cls.body
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)]


def literal(module: ast.Module, name: str) -> tuple[object, ...]:
    for node in module.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            assert isinstance(node.value, ast.Subscript)
            return tuple(ast.literal_eval(node.value.slice))
    raise AssertionError(f"no {name}")


def default(cls: ast.ClassDef, name: str) -> object:
    for item in cls.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id == name:
            assert item.value is not None
            return ast.literal_eval(item.value)
    raise AssertionError(f"{cls.name} has no {name}")


@pytest.mark.parametrize("release", RELEASES)
def test_the_emulators_prefix_cache_flags_are_each_releases(release: str) -> None:
    ours = {flag for action in build_parser()._actions for flag in action.option_strings}
    flags = {"--enable-prefix-caching", "--no-enable-prefix-caching", "--block-size", "--prefix-caching-hash-algo",
             "--num-gpu-blocks-override", "--kv-events-config", "--enable-prompt-tokens-details",
             "--data-parallel-rank"}
    assert flags <= ours
    assert flags <= serve_flags(release), sorted(flags - serve_flags(release))


@pytest.mark.parametrize("release", RELEASES)
def test_hash_algorithms_and_prefix_caching_defaults(release: str) -> None:
    cache = tree(release, "vllm/config/cache.py")
    config = class_def(cache, "CacheConfig")
    assert literal(cache, "PrefixCachingHashAlgo") == vllm.PREFIX_CACHING_HASH_ALGOS
    assert default(config, "prefix_caching_hash_algo") == vllm.PREFIX_CACHING_HASH_ALGOS[0]
    assert default(config, "enable_prefix_caching") is vllm.PREFIX_CACHING_DEFAULT
    if version(release) < vllm.ANY_BLOCK_SIZE_ADDED:
        assert literal(cache, "BlockSize") == vllm.BLOCK_SIZES_BEFORE_0_18
        assert "cache_config.block_size = 16" in text(release, "vllm/platforms/cuda.py")
    else:
        assert "BlockSize" not in {t.id for n in cache.body if isinstance(n, ast.Assign)
                                   for t in n.targets if isinstance(t, ast.Name)}
        gpu = vllm.DEFAULT_BLOCK_SIZE_GPU
        assert f"DEFAULT_BLOCK_SIZE: ClassVar[int] = {gpu}" in text(release, "vllm/config/cache.py")
    cpu = text(release, "vllm/platforms/cpu.py")
    assert (f"cache_config.block_size = {vllm.DEFAULT_BLOCK_SIZE_CPU}" in cpu
            or f"backend_classes, {vllm.DEFAULT_BLOCK_SIZE_CPU}, vllm_config" in cpu)
    attention = release_root(release) / "vllm/v1/attention/backends/cpu_attn.py"
    multiple = 32 if version(release) >= vllm.CPU_BLOCK_MULTIPLE_OF_32_ADDED else 16
    declared = f"return [MultipleOf({multiple})]" in attention.read_text() if attention.is_file() else False
    assert declared is (version(release) >= (0, 23))


@pytest.mark.parametrize("release", RELEASES)
def test_none_hash_and_the_published_hashes(release: str) -> None:
    utils = text(release, "vllm/v1/core/kv_cache_utils.py")
    fixed = "def resolve_none_hash_seed" in utils and 'DEFAULT_NONE_HASH_SEED = "vllm-none-hash"' in utils
    assert fixed == (version(release) >= vllm.FIXED_NONE_HASH_ADDED)
    if not fixed:
        assert "NONE_HASH = BlockHash(os.urandom(32))" in utils
    assert "int.from_bytes(hash_bytes, byteorder=\"big\") & ((1 << 64) - 1)" in utils
    default_on = 'os.getenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")' in text(release, "vllm/envs.py")
    assert default_on is vllm.KV_EVENTS_INT_BLOCK_HASHES_DEFAULT


@pytest.mark.parametrize("release", RELEASES)
def test_kv_event_fields_and_encoding_per_release(release: str) -> None:
    module = tree(release, "vllm/distributed/kv_events.py")
    at = version(release)
    for name, ours in (("BlockStored", events.STORED_FIELDS), ("BlockRemoved", events.REMOVED_FIELDS)):
        theirs = fields(class_def(module, name))
        assert theirs == [(field, required) for field, added, required in ours if added <= at], name
    keywords = {k.arg: ast.literal_eval(k.value) for k in class_def(module, "KVCacheEvent").keywords}
    assert keywords.get("tag") is True and keywords.get("omit_defaults") is True
    assert keywords.get("array_like", False) is (at < vllm.KV_EVENTS_TAGGED_MAPS)
    batch = {k.arg: ast.literal_eval(k.value) for k in class_def(module, "EventBatch").keywords}
    assert batch.get("array_like") is True
    assert fields(class_def(module, "EventBatch")) == [("ts", True), ("events", True), ("data_parallel_rank", False)]
    source = text(release, "vllm/distributed/kv_events.py")
    assert f'MEDIUM_GPU = "{events.MEDIUM_GPU}"' in source
    with_topic = '(client_id, b"", self._topic_bytes, seq.to_bytes(8, "big"), buf)' in source
    assert with_topic is (at >= vllm.KV_EVENTS_REPLAY_TOPIC_ADDED)
    assert 'END_SEQ = (-1).to_bytes(8, "big", signed=True)' in source
    assert 'seq_bytes = seq.to_bytes(8, "big")' in source
    assert "self._pub.send_multipart((self._topic_bytes, seq_bytes, payload))" in source
    assert ("if base_port == 0:" in source) is (at >= (0, 32))
