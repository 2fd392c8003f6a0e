"""The KV compatibility hash of an engine pool: what a prefill and a decode engine must agree on for
the KV cache of one to be read by the other. Pure.

Both roles' pods carry it as the label `naming.KV_COMPAT_LABEL`; the proxy pairs a prefill with a
decode instance only when their labels are equal, so during a rollout new prefill pairs with new
decode and old with old, never across (docs/connectors.md, "The KV compatibility hash").

What it covers, and why:

- The engine image and the vLLM version: the connector's code and wire format (vLLM's own NIXL
  handshake refuses a different vLLM version outright).
- The model: its name, where its weights come from (PVC claim and path, Hub revision) and the
  vLLM flags that change the weights, the tokenizer, the KV cache's shape or dtype, or its blocks
  (`MUST_MATCH_FLAGS`), and the environment variables that change the KV cache's layout
  (`MUST_MATCH_ENV`), as each role's pod sets them. Both roles' values go into one hash, which
  both roles' pods carry: the hash names a revision of the pool's KV settings, so a setting
  changed on one role rolls both roles and the old pods of each pair only with each other. (A
  hash per role would split a pool whose roles set a must-match flag differently, e.g. one role
  spelling out a default, into two halves that never pair: an outage where the engines may well
  agree. Whether they do is the engines' to say.)
- The connector and the settings both ends must share: the buffer device, NIXL's backends,
  Mooncake's protocol, LMCache's PYTHONHASHSEED (its chunk keys), P2pNccl's send type, and the
  user's extra connector config (unknown keys count: a key the operator cannot judge is assumed
  to matter), except `kv_lease_duration` (how long prefill holds blocks: prefill's alone).

What it leaves out, because it differs legitimately between the roles or does not touch the KV:
tensor, pipeline and data parallel sizes (NIXL maps heterogeneous TP; the other connectors check
their own topology), replicas, resources, scheduling, probes, drain timeouts, the served model
name, --max-model-len, the transport (RDMA or TCP, UCX settings, NIC mapping: UCX negotiates it),
ports, and the load failure policy (decode's own behaviour). The contents of an LMCache ConfigMap
are not known to the render and not covered.

The values are hashed as written, so spelling out a default (`--dtype=auto`) is a new revision.
"""

from __future__ import annotations

import hashlib
import json
from typing import Final

from xpyd.api.models import Connector, DisaggregatedServingSpec, RoleSpec
from xpyd.api.naming import ROLES, Role
from xpyd.common.args import last_flag_value
from xpyd.common.jsontypes import JSON

#: Hex digits of the label value (64 bits: collisions between a pool's revisions are not a concern).
HASH_DIGITS: Final = 16

#: vLLM flags with a value that must be equal on both ends of a KV hand-off.
MUST_MATCH_FLAGS: Final = (
    "--dtype", "--quantization", "--kv-cache-dtype", "--block-size", "--revision", "--code-revision",
    "--tokenizer", "--tokenizer-revision", "--hf-overrides", "--speculative-config", "--attention-backend",
)
#: vLLM boolean flags (`--X` / `--no-X`, the last wins) that must be equal on both ends: the hybrid
#: KV cache manager changes how the KV cache is grouped (NIXL's own handshake compares it).
MUST_MATCH_SWITCHES: Final = ("--disable-hybrid-kv-cache-manager",)
#: Environment variables that change the KV cache's layout.
MUST_MATCH_ENV: Final = ("VLLM_KV_CACHE_LAYOUT", "VLLM_ATTENTION_BACKEND")
#: Keys of the user's extra connector config that only one side uses.
ROLE_LOCAL_EXTRA_KEYS: Final = frozenset({"kv_lease_duration"})


def _switch(args: list[str], flag: str) -> bool | None:
    """A boolean flag's value as argparse's BooleanOptionalAction keeps it; None if absent."""
    negative = "--no-" + flag.removeprefix("--")
    value = None
    for arg in args:
        if arg == flag:
            value = True
        elif arg == negative:
            value = False
    return value


def _connector_settings(spec: DisaggregatedServingSpec) -> JSON:
    kv = spec.kv_transfer
    settings: JSON = {
        "connector": kv.connector.value,
        "buffer_device": spec.kv_buffer_device,
        "extra_config": {k: v for k, v in kv.extra_config.items() if k not in ROLE_LOCAL_EXTRA_KEYS},
    }
    if kv.connector.is_nixl:
        settings["nixl_backends"] = list(kv.nixl_settings.backends)
    if kv.connector == Connector.MOONCAKE:
        settings["mooncake_protocol"] = kv.mooncake_settings.protocol
    if kv.connector == Connector.LMCACHE and kv.lmcache is not None:
        settings["lmcache_python_hash_seed"] = kv.lmcache.python_hash_seed
    if kv.connector == Connector.P2P_NCCL:
        settings["p2p_nccl_send_type"] = kv.p2p_nccl_settings.send_type
    return settings


def _role_settings(spec: DisaggregatedServingSpec, role: Role) -> JSON:
    role_spec: RoleSpec = getattr(spec, role)
    args = [*spec.engine.extra_args, *role_spec.extra_args]
    env = {var.name: var.to_wire() for var in [*spec.engine.env, *role_spec.env] if var.name in MUST_MATCH_ENV}
    return {
        "flags": {flag: last_flag_value(args, flag) for flag in MUST_MATCH_FLAGS},
        "switches": {flag: _switch(args, flag) for flag in MUST_MATCH_SWITCHES},
        "env": [env.get(name) for name in MUST_MATCH_ENV],
    }


def compat_inputs(spec: DisaggregatedServingSpec) -> JSON:
    """Everything the pool's hash covers (see the module docstring)."""
    source = spec.model.source
    return {
        "image": spec.engine.image,
        "vllm_version": spec.engine.vllm_version,
        "model": spec.model.name,
        "pvc": None if source.pvc is None else [source.pvc.claim_name, source.pvc.path.strip("/")],
        "hub_revision": None if source.hub is None else source.hub.revision,
        "roles": {role: _role_settings(spec, role) for role in ROLES},
        "kv_transfer": _connector_settings(spec),
    }


def compat_hash(spec: DisaggregatedServingSpec) -> str:
    """The KV compatibility hash of the pool (both roles'): a short hex digest of `compat_inputs`."""
    text = json.dumps(compat_inputs(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_DIGITS]
