"""Facts about vLLM releases that decide what the operator renders and accepts.

Each boundary is checked against the vLLM source; see docs/connectors.md for the references.
"""

from __future__ import annotations

import re
from typing import Final

VersionTuple = tuple[int, int]

#: `major.minor` or `major.minor.patch`; the patch level never changes what is rendered.
VERSION_PATTERN: Final = r"^[0-9]+[.][0-9]+([.][0-9]+)?$"

#: The newest release the templates were checked against (the default engine).
LATEST: Final[VersionTuple] = (0, 33)
#: The oldest release whose V1 engine has the KV-connector API the operator renders for.
OLDEST_SUPPORTED: Final[VersionTuple] = (0, 10)
#: P2pNcclConnector was removed in 0.24: it exists up to and including 0.23.
P2P_NCCL_LAST: Final[VersionTuple] = (0, 23)
#: `kv_buffer_size`, `kv_rank`, `kv_parallel_size` and `kv_ip` were removed in 0.32; the config
#: classes forbid unknown keys, so sending them to 0.32+ fails at start-up.
LEGACY_KV_FIELDS_REMOVED: Final[VersionTuple] = (0, 32)
#: `kv_load_failure_policy` first appears in 0.13 (vllm/config/kv_transfer.py of the 0.13.0 wheel;
#: absent from 0.12, whose config classes silently drop unknown keys). Its default is `recompute` up
#: to 0.16 and `fail` from 0.18 (0.17 not checked): the operator always renders the user's choice.
LOAD_FAILURE_POLICY_ADDED: Final[VersionTuple] = (0, 13)
#: NIXL's `kv_lease_duration` extra-config key (default 30 s) exists from 0.23 on
#: (vllm/distributed/kv_transfer/kv_connector/v1/nixl/scheduler.py of the 0.23.0 wheel). Before,
#: prefill frees un-pulled blocks after env VLLM_NIXL_ABORT_REQUEST_TIMEOUT (vllm/envs.py of 0.13.0,
#: 0.16.0 and 0.18.0; default 480 s; gone in 0.23). 0.19-0.22 were not checked: the boundary is 0.23.
NIXL_KV_LEASE_ADDED: Final[VersionTuple] = (0, 23)
#: NIXL's default kv_lease_duration (0.23+) and VLLM_NIXL_ABORT_REQUEST_TIMEOUT (before), seconds.
NIXL_KV_LEASE_DEFAULT_SECONDS: Final = 30
NIXL_ABORT_REQUEST_TIMEOUT_DEFAULT_SECONDS: Final = 480
#: MooncakeConnector's transfer_id + bootstrap (/register, /query) protocol, the one the proxy speaks,
#: exists from 0.16 (vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py and
#: mooncake_utils.py of the 0.16.0 wheel). 0.13's connector (v1/mooncake_connector.py) hands off with
#: remote_host/remote_port in prefill's answer instead.
MOONCAKE_BOOTSTRAP_ADDED: Final[VersionTuple] = (0, 16)
#: MooncakeConnector reads `device_name` from its extra config from 0.32 (v1/mooncake/mooncake_connector.py
#: of the 0.32.0 wheel); 0.16-0.24 pass "" to the transfer engine whatever is configured (0.25-0.31 not
#: checked: refused with the older releases).
MOONCAKE_DEVICE_NAME_ADDED: Final[VersionTuple] = (0, 32)
#: VLLM_GPU_NIC_PCIE_MAPPING and VLLM_NIC_SELECTION_VARS (vllm/v1/executor/vllm_net_devices.py of the
#: 0.23.0 wheel; absent from 0.18.0; 0.19-0.22 not checked).
GPU_NIC_MAPPING_ADDED: Final[VersionTuple] = (0, 23)
#: NixlPushConnector (PR #35264) was merged after the 0.23 release.
NIXL_PUSH_ADDED: Final[VersionTuple] = (0, 24)
#: The multiprocessing multi-node launch (`--nnodes`, `--node-rank`, `--master-addr`, `--master-port`;
#: `--headless` workers run the executor of their ranks) is new in the 0.12.0 wheel (arg_utils.py);
#: before it a replica spanning nodes needs a Ray cluster, which the operator does not run.
MULTI_NODE_ADDED: Final[VersionTuple] = (0, 12)
#: NixlConnector handles pipeline parallelism only from the 0.32.0 wheel (nixl/base_worker.py keys the
#: handshake by (pp_rank, tp_rank)), and there only on the producer: a kv_consumer with PP > 1 raises.
NIXL_PIPELINE_PARALLEL_ADDED: Final[VersionTuple] = (0, 32)
#: `--shutdown-timeout` (drain in-flight requests on SIGTERM) exists from 0.18 on.
SHUTDOWN_TIMEOUT_ADDED: Final[VersionTuple] = (0, 18)
#: On the CPU backend, NixlConnector's worker moves the thread that runs the model to the last core of
#: each NUMA node (`os.sched_setaffinity` on the host's topology; nixl_connector.py of the 0.18.0 wheel,
#: nixl/base_worker.py of 0.23-0.33; absent from 0.16), whatever VLLM_CPU_OMP_THREADS_BIND says. In a
#: cpuset without those cores, such as the exclusive cores the kubelet's static CPU manager gives a
#: Guaranteed pod, the call fails (EINVAL) and the engine never starts: seen with the 0.32 CPU build
#: (docs/cpu.md); vLLM issue #58033, fix proposed in PR #58036, in no release checked.
NIXL_CPU_KV_CORE_RESERVED: Final[VersionTuple] = (0, 18)

# --- the prefix cache and its KV events (vllm/config/cache.py, vllm/config/kv_events.py,
# vllm/distributed/kv_events.py, vllm/v1/core/block_pool.py and kv_cache_utils.py of each wheel checked) ---

#: `--prefix-caching-hash-algo` values, the default first: the same in every release checked (0.13-0.33).
#: The one list of them; `xpyd.kvcache.hashing.hash_function` computes each.
PREFIX_CACHING_HASH_ALGOS: Final = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
#: `--enable-prefix-caching` is on by default for models that support it (every decoder-only LLM) in
#: every release checked; `--no-enable-prefix-caching` turns it off.
PREFIX_CACHING_DEFAULT: Final = True
#: `--block-size` when none is given: `CacheConfig.DEFAULT_BLOCK_SIZE` (16; the CUDA platform's fixed 16
#: before 0.18) unless the attention backend prefers another; on CPUs 128 in every release (set by the
#: platform up to 0.32, the backends' preferred size with 128 as the fallback in 0.33).
DEFAULT_BLOCK_SIZE_GPU: Final = 16
DEFAULT_BLOCK_SIZE_CPU: Final = 128
#: The CPU attention backend's kernel block sizes (`get_supported_kernel_block_sizes` in
#: v1/attention/backends/cpu_attn.py): multiples of 16 in 0.23 and 0.24, of 32 from 0.32 (none declared
#: before 0.23). The platform code only warns about a block size that is not a multiple of 32; the 0.32
#: CPU build refuses `--block-size 16` at start-up ("No common block size for 16 (CPU_ATTN:
#: [MultipleOf(32)])").
CPU_BLOCK_MULTIPLE_OF_32_ADDED: Final[VersionTuple] = (0, 32)
#: Up to 0.16 `--block-size` is one of these (`BlockSize` Literal); from 0.18 any positive integer.
BLOCK_SIZES_BEFORE_0_18: Final = (1, 8, 16, 32, 64, 128, 256)
ANY_BLOCK_SIZE_ADDED: Final[VersionTuple] = (0, 18)
#: The first block's parent hash (`NONE_HASH`): from 0.32 `hash_fn(PYTHONHASHSEED or "vllm-none-hash")`
#: for sha256 and sha256_cbor (engines with the same settings hash alike), a random seed for the xxhash
#: algorithms unless PYTHONHASHSEED is set. Before (0.13-0.24 checked) it is 32 random bytes per process
#: whatever the algorithm, unless PYTHONHASHSEED is set: no two engines share block hashes then.
FIXED_NONE_HASH_ADDED: Final[VersionTuple] = (0, 32)
#: KV events (`--kv-events-config`, publisher "zmq"): `BlockStored`, `BlockRemoved` and
#: `AllBlocksCleared` are msgspec arrays (`array_like`, the tag first) up to 0.23 and tagged maps
#: (`{"type": "BlockStored", ...}`) from 0.24; the `EventBatch` around them stays an array. The fields
#: each release adds, and the rest of the wire, are in `xpyd.kvcache.events`.
KV_EVENTS_TAGGED_MAPS: Final[VersionTuple] = (0, 24)
#: The replay socket's answers carry the publisher's topic frame from 0.32 on (before: only the
#: sequence number and the payload).
KV_EVENTS_REPLAY_TOPIC_ADDED: Final[VersionTuple] = (0, 32)
#: Block hashes are published as the low 64 bits of the hash, big-endian, as an integer unless
#: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (then the hash's bytes): the default in every release checked.
KV_EVENTS_INT_BLOCK_HASHES_DEFAULT: Final = True

#: CEL regex for "vLLM version <= 0.23", i.e. P2pNcclConnector's lifetime; its negation is
#: "NixlPushConnector exists". A unit test keeps it in step with the two constants above.
UP_TO_0_23_REGEX: Final = r"^0[.]([0-9]|1[0-9]|2[0-3])([.][0-9]+)?$"

#: CEL regex for "vLLM version < 0.23": no kv_lease_duration, no GPU-to-NIC mapping.
BEFORE_0_23_REGEX: Final = r"^0[.]([0-9]|1[0-9]|2[0-2])([.][0-9]+)?$"

#: CEL regex for "vLLM version < 0.16": MooncakeConnector without the bootstrap protocol.
BEFORE_0_16_REGEX: Final = r"^0[.]([0-9]|1[0-5])([.][0-9]+)?$"

#: CEL regex for "vLLM version < 0.32": MooncakeConnector ignores `device_name`.
BEFORE_0_32_REGEX: Final = r"^0[.]([0-9]|[12][0-9]|3[01])([.][0-9]+)?$"

#: CEL regex for "vLLM version < 0.12": no multiprocessing multi-node launch.
BEFORE_0_12_REGEX: Final = r"^0[.]([0-9]|1[01])([.][0-9]+)?$"

#: CEL regex for "vLLM version < 0.10" (older than OLDEST_SUPPORTED).
BEFORE_OLDEST_REGEX: Final = r"^0[.][0-9]([.][0-9]+)?$"

_VERSION_RE: Final = re.compile(VERSION_PATTERN)


def parse_version(text: str) -> VersionTuple:
    """`"0.33"` or `"0.33.1"` -> `(0, 33)`; raises ValueError on anything else."""
    if not _VERSION_RE.match(text):
        raise ValueError(f"vLLM version {text!r} is not of the form MAJOR.MINOR[.PATCH]")
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def format_version(version: VersionTuple) -> str:
    return f"{version[0]}.{version[1]}"
