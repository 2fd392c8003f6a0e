"""vLLM's block keys for real token ids: `hash_block_tokens` and a request's block hashes.

As vLLM 0.32 and 0.33 compute them (`vllm/v1/core/kv_cache_utils.py`, `vllm/utils/hashing.py`):

- A block's hash is `hash_fn((parent_hash, tuple(block_token_ids), extra_keys))`; the first block's
  parent is `NONE_HASH`. Only full blocks are hashed.
- `--prefix-caching-hash-algo` picks `hash_fn` (`hash_function`): `sha256` (the default) is SHA-256
  of the tuple pickled with the highest protocol; `sha256_cbor` is SHA-256 of its canonical CBOR;
  `xxhash` and `xxhash_cbor` are xxHash's 128-bit XXH3 of the same bytes (they need the `xxhash`
  package, as vLLM does). The values every release from 0.13 to 0.33 accepts are listed once, with
  the other facts checked against vLLM's source: `xpyd.vllm.PREFIX_CACHING_HASH_ALGOS` (a leaf beside
  this one; the packages above use it).
- `NONE_HASH` is `hash_fn(seed)` (`none_hash_seed`): the seed is `PYTHONHASHSEED` when it is set;
  otherwise "vllm-none-hash" for the cryptographic algorithms, so independent engines with the same
  settings hash alike, and random bytes (as hex) per process for the xxhash ones, so their hashes are
  never reproducible without `PYTHONHASHSEED`. Releases before 0.32 take 32 random bytes as
  `NONE_HASH` itself unless `PYTHONHASHSEED` is set, whatever the algorithm (`xpyd.vllm`).
- Extra keys are None for plain text. A request's `cache_salt` adds `("cache_salt", salt)` to its
  first block's (LoRA adapters, multi-modal inputs and prompt embeddings add others; not modelled).
  Releases before 0.32 put the bare salt there (untagged), so their salted hashes differ.

`BlockHasher` is the per-engine form: its algorithm and `NONE_HASH` fixed once.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import pickle
import struct
from collections.abc import Callable, Sequence

CRYPTOGRAPHIC_HASH_ALGOS = ("sha256", "sha256_cbor")
"""The algorithms whose `NONE_HASH` is the same in every process without `PYTHONHASHSEED`."""
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""vLLM's `NONE_HASH` seed for cryptographic hash algorithms without `PYTHONHASHSEED`."""

ExtraKeys = tuple[tuple[str, str], ...] | None


def sha256(value: object) -> bytes:
    """vLLM's `sha256`: SHA-256 of the value pickled with the highest protocol."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(value: object) -> bytes:
    """vLLM's `sha256_cbor`: SHA-256 of the value's canonical CBOR (`cbor2.dumps(value, canonical=True)`)."""
    return hashlib.sha256(cbor(value)).digest()


def xxhash(value: object) -> bytes:
    """vLLM's `xxhash`: xxHash's XXH3 128-bit digest of the value pickled with the highest protocol."""
    return _xxh3_128(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor(value: object) -> bytes:
    """vLLM's `xxhash_cbor`: xxHash's XXH3 128-bit digest of the value's canonical CBOR."""
    return _xxh3_128(cbor(value))


def _xxh3_128(data: bytes) -> bytes:
    try:
        module = importlib.import_module("xxhash")
    except ImportError:
        module = None
    if module is None or not hasattr(module, "xxh3_128_digest"):
        raise ModuleNotFoundError("xxhash is required for the 'xxhash' prefix caching hash algorithms. "
                                  "Install it via `pip install xxhash`.")
    digest: bytes = module.xxh3_128_digest(data)
    return digest


def hash_function(algo: str) -> Callable[[object], bytes]:
    """The hash function of a `--prefix-caching-hash-algo` value."""
    functions: dict[str, Callable[[object], bytes]] = {
        "sha256": sha256, "sha256_cbor": sha256_cbor, "xxhash": xxhash, "xxhash_cbor": xxhash_cbor}
    try:
        return functions[algo]
    except KeyError:
        raise ValueError(f"Unsupported hash function: {algo} (vLLM's are {', '.join(functions)})") from None


def none_hash_seed(algo: str, pythonhashseed: str | None = None) -> str:
    """The seed of vLLM's `NONE_HASH` (0.32 and later, `resolve_none_hash_seed`): `PYTHONHASHSEED` when
    set, else the fixed default for the cryptographic algorithms and 32 random bytes as hex for xxhash."""
    if pythonhashseed is not None:
        return pythonhashseed
    if algo in CRYPTOGRAPHIC_HASH_ALGOS:
        return DEFAULT_NONE_HASH_SEED
    hash_function(algo)   # an unknown algorithm fails here
    return os.urandom(32).hex()


def none_hash(algo: str = "sha256", seed: str = DEFAULT_NONE_HASH_SEED) -> bytes:
    """vLLM's `NONE_HASH`, the first block's parent (pass `PYTHONHASHSEED` as `seed` when an engine has it)."""
    return hash_function(algo)(seed)


def hash_block_tokens(hash_fn: Callable[[object], bytes], parent: bytes, token_ids: Sequence[int],
                      extra_keys: ExtraKeys = None) -> bytes:
    """vLLM's `hash_block_tokens` (`parent`: the previous block's hash, or `NONE_HASH` for the first)."""
    return hash_fn((parent, tuple(token_ids), extra_keys))


def request_block_hashes(token_ids: Sequence[int], block_size: int, algo: str = "sha256", *,
                         cache_salt: str | None = None, seed: str = DEFAULT_NONE_HASH_SEED) -> list[bytes]:
    """The hashes of a request's full blocks, in order (vLLM's `request_block_hasher`)."""
    return BlockHasher(block_size, algo, seed).hashes(token_ids, cache_salt)


class BlockHasher:
    """One engine's block hashing: its block size, `--prefix-caching-hash-algo` and `NONE_HASH`
    (`seed`: see `none_hash_seed`)."""

    def __init__(self, block_size: int, algo: str = "sha256", seed: str = DEFAULT_NONE_HASH_SEED) -> None:
        if block_size < 1:
            raise ValueError(f"a block has at least one token, not {block_size}")
        self.block_size = block_size
        self.algo = algo
        self.hash_fn = hash_function(algo)
        self.none_hash = self.hash_fn(seed)   # the xxhash algorithms without their package fail here

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The hashes of the full blocks of `token_ids`, in order (vLLM's `request_block_hasher`)."""
        hash_fn = self.hash_fn
        size = self.block_size
        parent = self.none_hash
        out: list[bytes] = []
        for start in range(0, len(token_ids) - size + 1, size):
            extra: ExtraKeys = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
            parent = hash_fn((parent, tuple(token_ids[start:start + size]), extra))
            out.append(parent)
        return out


def cbor(value: object) -> bytes:
    """Canonical CBOR (RFC 8949 core deterministic encoding, as cbor2's `canonical=True` writes it) of
    None, booleans, integers (64-bit), byte and text strings, and tuples or lists of them."""
    if value is None:
        return b"\xf6"
    if value is True:
        return b"\xf5"
    if value is False:
        return b"\xf4"
    if isinstance(value, int):
        return _head(0, value) if value >= 0 else _head(1, -1 - value)
    if isinstance(value, bytes):
        return _head(2, len(value)) + value
    if isinstance(value, str):
        encoded = value.encode("utf-8")
        return _head(3, len(encoded)) + encoded
    if isinstance(value, tuple | list):
        return _head(4, len(value)) + b"".join(cbor(item) for item in value)
    raise TypeError(f"no CBOR encoding here for {type(value).__name__}")


def _head(major: int, argument: int) -> bytes:
    """A CBOR item's head: major type and argument in the shortest form."""
    if argument < 24:
        return bytes([major << 5 | argument])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if argument < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, argument)
    raise ValueError(f"{argument} does not fit a 64-bit CBOR argument")
