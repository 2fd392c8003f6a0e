"""The `--kv-transfer-config` of each role, as a typed model per connector and vLLM version.

vLLM's own config classes forbid unknown keys, so a key a release does not know (or no longer
knows: `kv_buffer_size`, `kv_rank`, `kv_parallel_size`, `kv_ip` were removed in 0.32) stops the
engine at start-up. `KVTransferConfig` therefore refuses to carry a key outside the release's
field set, and each connector fills in only what it needs.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from xpyd import vllm
from xpyd.api.models import Connector, DisaggregatedServingSpec
from xpyd.api.naming import Role

KV_ROLE: dict[Role, Literal["kv_producer", "kv_consumer"]] = {"prefill": "kv_producer", "decode": "kv_consumer"}

#: P2pNcclConnector's first ZMQ port (one per rank at kv_port + rank); vLLM's default.
P2P_NCCL_KV_PORT = 14579
#: kv_buffer_size of a prefill engine that pushes (PUT, PUT_ASYNC): it receives nothing.
P2P_NCCL_PUSHER_BUFFER_BYTES = 10

_BINARY_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DECIMAL_SUFFIXES = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity_to_bytes(quantity: str) -> int:
    """`"1Gi"` -> 1073741824. Only the forms a byte size takes (integer with an optional suffix)."""
    for suffixes in (_BINARY_SUFFIXES, _DECIMAL_SUFFIXES):
        for suffix, factor in suffixes.items():
            if quantity.endswith(suffix):
                return int(float(quantity[: -len(suffix)]) * factor)
    return int(float(quantity))


class KVTransferConfig(BaseModel):
    """vLLM's KVTransferConfig, restricted to what the operator sets."""

    model_config = ConfigDict(extra="forbid")

    version: vllm.VersionTuple
    kv_connector: str
    kv_role: Literal["kv_producer", "kv_consumer"]
    kv_buffer_device: Literal["cuda", "cpu"] = "cuda"
    kv_load_failure_policy: Literal["fail", "recompute"] | None = None
    kv_connector_extra_config: dict[str, Any] = {}
    # Only P2pNcclConnector (<= 0.23) uses these; kv_buffer_size is gone from 0.32 on.
    kv_buffer_size: int | None = None
    kv_port: int | None = None

    @model_validator(mode="after")
    def _fields_exist_in_release(self) -> KVTransferConfig:
        if self.version >= vllm.LEGACY_KV_FIELDS_REMOVED and self.kv_buffer_size is not None:
            raise ValueError("kv_buffer_size does not exist in vLLM >= 0.32")
        if self.kv_load_failure_policy is not None and self.version < vllm.LOAD_FAILURE_POLICY_ADDED:
            raise ValueError(
                "kv_load_failure_policy does not exist before vLLM "
                + vllm.format_version(vllm.LOAD_FAILURE_POLICY_ADDED)
            )
        if self.version < vllm.NIXL_KV_LEASE_ADDED and "kv_lease_duration" in self.kv_connector_extra_config:
            raise ValueError("kv_lease_duration does not exist before vLLM "
                             + vllm.format_version(vllm.NIXL_KV_LEASE_ADDED))
        return self

    def to_json(self) -> str:
        """Compact JSON for `--kv-transfer-config`, keys in a stable order."""
        body = self.model_dump(exclude={"version"}, exclude_none=True)
        return json.dumps(body, separators=(",", ":"), sort_keys=True)


def _extra_config(spec: DisaggregatedServingSpec, role: Role, proxy_host: str) -> dict[str, Any]:
    kv = spec.kv_transfer
    match kv.connector:
        case Connector.NIXL | Connector.NIXL_PUSH:
            return {"backends": list(kv.nixl_settings.backends)}
        case Connector.MOONCAKE:
            mooncake = kv.mooncake_settings
            extra: dict[str, Any] = {"mooncake_protocol": mooncake.protocol}
            if mooncake.device_name:
                extra["device_name"] = mooncake.device_name
            if mooncake.num_workers:
                extra["num_workers"] = mooncake.num_workers
            return extra
        case Connector.LMCACHE:
            return {
                "discard_partial_chunks": False,
                "lmcache_rpc_port": "producer1" if role == "prefill" else "consumer1",
            }
        case Connector.P2P_NCCL:
            p2p = kv.p2p_nccl_settings
            return {
                "proxy_ip": proxy_host,
                "proxy_port": str(p2p.proxy_port),
                "http_port": str(spec.engine.port),
                "send_type": p2p.send_type,
                "nccl_num_channels": str(p2p.nccl_num_channels),
            }


def _p2p_nccl_buffer_bytes(spec: DisaggregatedServingSpec, role: Role) -> int:
    """The receiving side needs the buffer: decode always, prefill only when decode pulls (GET).
    A pushing prefill gets a token buffer, as vLLM's own P2pNccl example does."""
    p2p = spec.kv_transfer.p2p_nccl_settings
    if role == "decode" or p2p.send_type == "GET":
        return quantity_to_bytes(p2p.buffer_size)
    return P2P_NCCL_PUSHER_BUFFER_BYTES


def _without_unknown_keys(extra: dict[str, Any], version: vllm.VersionTuple) -> dict[str, Any]:
    """Drops `kv_lease_duration` before 0.23: the release ignores it (its prefill times out
    un-pulled blocks after VLLM_NIXL_ABORT_REQUEST_TIMEOUT instead, which the drain follows)."""
    if version < vllm.NIXL_KV_LEASE_ADDED:
        return {k: v for k, v in extra.items() if k != "kv_lease_duration"}
    return extra


def kv_transfer_config(spec: DisaggregatedServingSpec, role: Role, proxy_host: str) -> KVTransferConfig:
    """The kv-transfer-config of `role`; `proxy_host` is the proxy Service's DNS name (P2pNccl only)."""
    kv = spec.kv_transfer
    version = vllm.parse_version(spec.engine.vllm_version)
    p2p_nccl = kv.connector == Connector.P2P_NCCL
    return KVTransferConfig(
        version=version,
        kv_connector=kv.connector.value,
        kv_role=KV_ROLE[role],
        kv_buffer_device=spec.kv_buffer_device,
        kv_load_failure_policy=kv.load_failure_policy if version >= vllm.LOAD_FAILURE_POLICY_ADDED else None,
        kv_connector_extra_config=_without_unknown_keys(
            {**_extra_config(spec, role, proxy_host), **kv.extra_config}, version),
        kv_buffer_size=_p2p_nccl_buffer_bytes(spec, role) if p2p_nccl else None,
        kv_port=P2P_NCCL_KV_PORT if p2p_nccl else None,
    )
