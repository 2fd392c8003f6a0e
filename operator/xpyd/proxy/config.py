"""What `xpyd proxy` is told on its command line (`ProxyConfig`), and the upstream timeouts it implies."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp

from xpyd.api.models import Connector, RoutingPolicy
from xpyd.proxy import protocol
from xpyd.proxy.kvaware import KVAwareSettings


@dataclass(frozen=True)
class ProxyConfig:
    """Everything `xpyd proxy` is told on its command line."""

    connector: Connector = Connector.NIXL
    routing_policy: RoutingPolicy = RoutingPolicy.LEAST_LOADED
    served_model_name: str | None = None
    api_key: str | None = None
    prefill_retries: int = 2
    decode_retries: int = 1
    prefill_timeout: float = 300.0
    decode_timeout: float = 3600.0
    stream_idle_timeout: float = 300.0
    connect_timeout: float = 2.0
    health_interval: float = 2.0
    health_timeout: float = 2.0
    #: Seconds between reads of the NIXL engines' failed KV transfers on their /metrics (0: never).
    kv_metrics_interval: float = 10.0
    breaker_threshold: int = 3
    breaker_cooldown: float = 2.0
    #: Idle upstream connections close after this many seconds: below uvicorn's 5 s keep-alive,
    #: so the proxy never reuses a connection the engine is closing (resets, 502s).
    upstream_idle_timeout: float = 4.0
    max_concurrency: int = 2048
    max_body_bytes: int = 32 * 1024 * 1024
    decode_only_fallback: bool = False
    #: The waiting room (`xpyd.proxy.waiting`): seconds a request is held while no prefill and decode
    #: pair is ready (0: off, no request is held), and the most requests and body bytes held at once.
    wait_timeout: float = 0.0
    wait_max_requests: int = 256
    wait_max_bytes: int = 64 * 1024 * 1024
    mooncake_bootstrap_port: int = protocol.MOONCAKE_BOOTSTRAP_PORT
    p2p_nccl_kv_port: int = protocol.P2P_NCCL_KV_PORT
    #: Data-parallel ranks per prefill server (NixlPushConnector learns and pins each rank's identity;
    #: Mooncake asks the bootstrap server instead).
    prefill_data_parallel_size: int = 1
    #: LMCacheConnectorV1 P/D: the decode engines' first LMCache init and alloc ports and their
    #: tensor-parallel size (one port of each per rank).
    lmcache_init_port: int = protocol.LMCACHE_INIT_PORT
    lmcache_alloc_port: int = protocol.LMCACHE_ALLOC_PORT
    decode_tensor_parallel_size: int = 1
    #: KVAware routing's index, weights and what the engines hash with (`--kv-*`).
    kv: KVAwareSettings = field(default_factory=KVAwareSettings)
    seed: int | None = None


def client_timeouts(config: ProxyConfig) -> dict[str, aiohttp.ClientTimeout]:
    """The upstream calls' timeouts: health probes, `/v1/models`, the prefill leg, an unstreamed and
    a streamed decode leg (a stream is bounded by its idle time, not its length)."""
    return {
        "probe": aiohttp.ClientTimeout(total=config.health_timeout),
        "models": aiohttp.ClientTimeout(total=config.health_timeout * 5),
        "prefill": aiohttp.ClientTimeout(total=config.prefill_timeout, sock_connect=config.connect_timeout),
        "decode": aiohttp.ClientTimeout(total=config.decode_timeout, sock_connect=config.connect_timeout),
        "stream": aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout,
                                        sock_read=config.stream_idle_timeout),
    }
