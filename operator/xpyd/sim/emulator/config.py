"""The emulated engine's configuration: its constants, `EmulatorConfig` and the time-scaled performance model."""

from __future__ import annotations

import math
from dataclasses import dataclass

from xpyd.common.netguard import require_loopback
from xpyd.sim.core import EnginePerf

EMULATED_VLLM_VERSION = "0.33.0"
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DEFAULT_SIDE_CHANNEL_PORT = 5600
DEFAULT_LINK_GBPS = 100.0
BLOCK_SIZE = 16
"""Tokens per KV block (vLLM's default on CUDA): sizes the synthetic `remote_block_ids`."""
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


