"""The emulated engine's configuration: its constants, `EmulatorConfig` and the time-scaled performance model."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from xpyd import vllm
from xpyd.common.netguard import require_loopback
from xpyd.sim.core import EnginePerf

EMULATED_VLLM_VERSION = "0.33.0"
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DEFAULT_SIDE_CHANNEL_PORT = 5600
DEFAULT_LINK_GBPS = 100.0
BLOCK_SIZE = vllm.DEFAULT_BLOCK_SIZE_GPU
"""`--block-size` by default: vLLM's on GPUs (16)."""
KEEPALIVE_TIMEOUT_S = 5.0
"""uvicorn's idle keep-alive, which vLLM keeps: a proxy holding idle connections longer gets resets."""
MAX_LAG_S = 0.05
"""How far (wall seconds) the nominal schedule may trail the clock before it is reset to it."""
LAG_WARNING_INTERVAL_S = 10.0
SIDE_CHANNEL_TIMEOUT_S = 5.0
TIMER_SLACK_S = 0.001
"""The last part of a step the loop spins through instead of sleeping (asyncio's timer granularity)."""
TOKEN_TEXT = " tok"
COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_MESSAGE_FRAMING_TOKENS = 5
CHAT_ASSISTANT_HEADER_TOKENS = 4
FAILURE_POLICIES = ("fail", "recompute")
KV_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
KV_EVENTS_PUBLISHERS = ("null", "zmq")


def env_flag(name: str, default: bool) -> bool:
    """A boolean vLLM environment variable as vLLM reads it (`bool(int(value))`; a non-integer counts as unset)."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return bool(int(value))
    except ValueError:
        return default


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM 0.33's `KVEventsConfig` (`--kv-events-config`), field for field, with its defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None               # None: "zmq" when events are enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in KV_EVENTS_PUBLISHERS:
            raise ValueError(f"--kv-events-config publisher must be one of {', '.join(KV_EVENTS_PUBLISHERS)}, "
                             f"not {self.publisher!r}")
        if min(self.buffer_steps, self.hwm, self.max_queue_size) < 0:
            raise ValueError("--kv-events-config buffer_steps, hwm and max_queue_size must not be negative")

    @property
    def publishes(self) -> bool:
        """Events are made and sent over ZMQ."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @staticmethod
    def parse(value: dict[str, Any]) -> KVEventsConfig:
        """From `--kv-events-config` JSON: unknown keys and wrong types are refused, as vLLM's config
        class (extra="forbid") refuses them."""
        names = {f.name: f for f in fields(KVEventsConfig)}
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(unknown)} (vLLM's are "
                             f"{', '.join(names)})")
        kinds: dict[str, tuple[type, ...]] = {
            "enable_kv_cache_events": (bool,), "publisher": (str, type(None)), "endpoint": (str,),
            "replay_endpoint": (str, type(None)), "buffer_steps": (int,), "hwm": (int,), "max_queue_size": (int,),
            "topic": (str,)}
        for key, item in value.items():
            if not isinstance(item, kinds[key]) or (isinstance(item, bool) and bool not in kinds[key]):
                raise ValueError(f"--kv-events-config: {key} must be {' or '.join(k.__name__ for k in kinds[key])}, "
                                 f"not {item!r}")
        return KVEventsConfig(**value)


@dataclass(frozen=True)
class EmulatorConfig:
    """One emulated engine. Durations marked "modelled" are divided by `time_scale`."""

    model: str = DEFAULT_MODEL
    served_model_names: tuple[str, ...] = ()   # empty: the model
    host: str = "127.0.0.1"
    port: int = 8000
    kv_role: str | None = None                 # kv_producer | kv_consumer | kv_both; None: no KV connector
    kv_load_failure_policy: str = "fail"
    engine_id: str | None = None               # None: a random uuid, as vLLM does
    side_channel_host: str | None = None       # None: `host`
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    tensor_parallel_size: int = 1
    max_model_len: int = 131072
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_kv_tokens: int | None = None           # None: the performance model's
    kv_lease_s: float = 30.0                   # modelled
    kv_bytes_per_token: int | None = None      # sizes vllm:nixl_bytes_transferred
    time_scale: float = 1.0
    startup_delay_s: float = 0.0               # modelled
    shutdown_timeout_s: float = 0.0            # wall
    seed: int | None = None
    enable_prefix_caching: bool = vllm.PREFIX_CACHING_DEFAULT
    block_size: int = BLOCK_SIZE
    prefix_caching_hash_algo: str = vllm.PREFIX_CACHING_HASH_ALGOS[0]
    none_hash_seed: str | None = None          # None: vLLM's rule (PYTHONHASHSEED, else per algorithm)
    enable_prompt_tokens_details: bool = False
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    kv_events_int_hashes: bool = vllm.KV_EVENTS_INT_BLOCK_HASHES_DEFAULT   # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        if not self.time_scale > 0 or not math.isfinite(self.time_scale):
            raise ValueError(f"--time-scale must be a positive number, not {self.time_scale}")
        for name in ("startup_delay_s", "shutdown_timeout_s", "kv_lease_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must not be negative")
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, not {self.kv_role!r}")
        if self.kv_load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {', '.join(FAILURE_POLICIES)}, "
                             f"not {self.kv_load_failure_policy!r}")
        if min(self.max_model_len, self.max_num_batched_tokens, self.max_num_seqs, self.tensor_parallel_size) < 1:
            raise ValueError("--max-model-len, --max-num-batched-tokens, --max-num-seqs and "
                             "--tensor-parallel-size must be at least 1")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be a positive integer, not {self.block_size}")
        if self.prefix_caching_hash_algo not in vllm.PREFIX_CACHING_HASH_ALGOS:
            raise ValueError("--prefix-caching-hash-algo must be one of "
                             f"{', '.join(vllm.PREFIX_CACHING_HASH_ALGOS)}, "
                             f"not {self.prefix_caching_hash_algo!r}")
        if self.data_parallel_rank < 0:
            raise ValueError("--data-parallel-rank must not be negative")
        require_loopback(self.host, "--host")
        require_loopback(self.side_channel_host or self.host, "NIXL side-channel host")

    @property
    def model_name(self) -> str:
        """The name responses carry: the first served name."""
        return self.served_model_names[0] if self.served_model_names else self.model

    @property
    def role(self) -> str:
        """prefill, decode, both (kv_both) or none (no KV connector)."""
        return KV_ROLES[self.kv_role] if self.kv_role else "none"


class ScaledPerf:
    """A performance model run `time_scale` times faster than real time: every duration divided by it."""

    def __init__(self, perf: EnginePerf, time_scale: float) -> None:
        self.perf = perf
        self.time_scale = time_scale
        self.max_kv_tokens = perf.max_kv_tokens

    def prefill_seconds(self, batch_tokens: int) -> float:
        """The model's prefill step, scaled."""
        return self.perf.prefill_seconds(batch_tokens) / self.time_scale

    def decode_step_seconds(self, batch_size: int, kv_tokens: int) -> float:
        """The model's decode step, scaled."""
        return self.perf.decode_step_seconds(batch_size, kv_tokens) / self.time_scale

    def kv_transfer_seconds(self, tokens: int) -> float:
        """The model's KV hand-off, scaled."""
        return self.perf.kv_transfer_seconds(tokens) / self.time_scale


