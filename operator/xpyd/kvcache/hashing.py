"""vLLM's block keys for real token ids: `hash_block_tokens` and a request's block hashes.

As vLLM 0.32 computes them (`vllm/v1/core/kv_cache_utils.py`, `vllm/utils/hashing.py`):

- A block's hash is `hash_fn((parent_hash, tuple(block_token_ids), extra_keys))`; the first block's
  parent is `NONE_HASH`. Only full blocks are hashed.
- `--prefix-caching-hash-algo` picks `hash_fn`: `sha256` (the default) is SHA-256 of the tuple
  pickled with the highest protocol; `sha256_cbor` is SHA-256 of its canonical CBOR.
- `NONE_HASH` is `hash_fn(seed)`: with these (cryptographic) algorithms the seed is "vllm-none-hash"
  unless `PYTHONHASHSEED` is set, in which case it is that variable's value. So independent engines
  with the same settings hash alike.
- Extra keys are None for plain text. A request's `cache_salt` adds `("cache_salt", salt)` to its
  first block's (LoRA adapters, multi-modal inputs and prompt embeddings add others; not modelled).

The `xxhash` algorithms are not offered: they need the xxhash package, and vLLM seeds them at random
per process unless `PYTHONHASHSEED` is set, so their hashes are not reproducible anyway.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence

HASH_ALGOS = ("sha256", "sha256_cbor")
"""The `--prefix-caching-hash-algo` values modelled; vLLM's default first."""
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""vLLM's `NONE_HASH` seed for cryptographic hash algorithms without `PYTHONHASHSEED`."""

ExtraKeys = tuple[tuple[str, str], ...] | None


def sha256(value: object) -> bytes:
    """vLLM's `sha256`: SHA-256 of the value pickled with the highest protocol."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(value: object) -> bytes:
    """vLLM's `sha256_cbor`: SHA-256 of the value's canonical CBOR (`cbor2.dumps(value, canonical=True)`)."""
    return hashlib.sha256(cbor(value)).digest()


def hash_function(algo: str) -> Callable[[object], bytes]:
    """The hash function of a `--prefix-caching-hash-algo` value."""
    if algo == "sha256":
        return sha256
    if algo == "sha256_cbor":
        return sha256_cbor
    raise ValueError(f"prefix-caching hash algorithm {algo!r} is not modelled (modelled: {', '.join(HASH_ALGOS)})")


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
    if block_size < 1:
        raise ValueError(f"a block has at least one token, not {block_size}")
    hash_fn = hash_function(algo)
    parent = hash_fn(seed)
    out: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra: ExtraKeys = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
        parent = hash_block_tokens(hash_fn, parent, token_ids[start:start + block_size], extra)
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
