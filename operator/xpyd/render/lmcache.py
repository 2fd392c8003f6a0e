"""What LMCache P/D needs from the two files of `kvTransfer.lmcache.configMapRef`.

The operator renders the addresses only a pod knows (LMCACHE_PD_PROXY_HOST/PORT on prefill,
LMCACHE_PD_PEER_HOST on decode) and declares decode's receiver ports; the rest comes from the
user's files. `pd_config_problems` checks one file against that, for the ConfigMaps the operator
can see (a sample file, `xpyd render`); it never reads the cluster.
"""

from __future__ import annotations

from typing import Any, Final

import yaml

from xpyd.api.models import LMCACHE_PD_PEER_ALLOC_PORT, LMCACHE_PD_PEER_INIT_PORT, DisaggregatedServingSpec
from xpyd.api.naming import Role

PD_ROLE: Final[dict[Role, str]] = {"prefill": "sender", "decode": "receiver"}


def receiver_ports(spec: DisaggregatedServingSpec) -> dict[str, list[int]]:
    """pd_peer_init_port and pd_peer_alloc_port of a decode engine: one per tensor-parallel rank."""
    ranks = range(spec.decode.tensor_parallel_size)
    return {"pd_peer_init_port": [LMCACHE_PD_PEER_INIT_PORT + r for r in ranks],
            "pd_peer_alloc_port": [LMCACHE_PD_PEER_ALLOC_PORT + r for r in ranks]}


def _as_int_list(value: Any) -> list[int] | None:
    values = value if isinstance(value, list) else [value]
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        return None


def pd_config_problems(spec: DisaggregatedServingSpec, role: Role, text: str) -> list[str]:
    """What is missing or contradicts the render in `<role>.yaml`; empty when P/D can work."""
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        return [f"{role}.yaml is not valid YAML: {error}"]
    if not isinstance(config, dict):
        return [f"{role}.yaml is not a mapping"]
    problems = []
    if config.get("enable_pd") is not True:
        problems.append(f"{role}.yaml: enable_pd must be true")
    if config.get("pd_role") != PD_ROLE[role]:
        problems.append(f"{role}.yaml: pd_role must be {PD_ROLE[role]}")
    for key in ("transfer_channel", "pd_buffer_size", "pd_buffer_device"):
        if key not in config:
            problems.append(f"{role}.yaml: {key} is missing")
    if role == "decode":
        for key, ports in receiver_ports(spec).items():
            if _as_int_list(config.get(key)) != ports:
                problems.append(f"{role}.yaml: {key} must be {ports} (one per tensor-parallel rank, the ports "
                                "the decode pods declare)")
    return problems
