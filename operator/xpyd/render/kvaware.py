"""KVAware routing's part of the render (`spec.proxy.routingPolicy: KVAware`, `spec.proxy.kvAware`).

The proxy hashes each prompt's token ids into vLLM's block hashes and looks them up in a per-engine
index (docs/proxy.md, "KV-aware routing"). The block size always matters (`--kv-block-size`): the
last `--block-size` of the engines' extra arguments (engine-wide, then the prefill role's), else
vLLM's default for the device (16 on GPUs, 128 on CPUs).

With the Events index the proxy's hashes must equal the engines', so it is also told:

- the hash algorithm (`--kv-hash-algo`): the last `--prefix-caching-hash-algo`, else vLLM's default,
  sha256. The API refuses xxhash and xxhash_cbor there: vLLM seeds them at random per process on
  purpose (not collision resistant: a seed others know lets them craft colliding blocks, vLLM #12621),
  so matching them would need a seed made public in the proxy's arguments.
- the seed of the first block's parent hash (`NONE_HASH`, `--kv-hash-seed`), only when the user sets
  PYTHONHASHSEED (a literal value in engine.env, as the API requires with Events). vLLM 0.32+ seeds
  sha256 and sha256_cbor with a fixed string without it, so independent engines and the proxy hash
  alike; older releases take random bytes per process, and the API refuses Events there unless the
  user sets PYTHONHASHSEED. The render never sets it itself: a seed it chose would be the same public
  value in every pool, and an integer PYTHONHASHSEED also turns off Python's hash randomisation in the
  engines' API server, which parses untrusted JSON.

The Routed index compares only the proxy's own hashes, so it is told neither: the proxy hashes
Routed with sha256 whatever the engines use.

With the Events index both roles' engines publish their KV events (`--kv-events-config`: ZMQ PUB on
`KV_EVENTS_PORT`, a replay ROUTER on `KV_EVENTS_REPLAY_PORT`, topic `KV_EVENTS_TOPIC`); vLLM offsets
both ports by the data-parallel rank (`ZmqEventPublisher.offset_endpoint_port`), so a pod with N ranks
listens on N ports of each, all declared in the pod spec, and the proxy subscribes to each rank
(`--kv-events-prefill-ranks`, `--kv-events-decode-ranks`). The encoding of each release (arrays up to
0.23, maps from 0.24; the replay's topic frame from 0.32) is the decoder's to tell apart
(`xpyd.kvcache.events`), so the proxy needs no release.
"""

from __future__ import annotations

import json
from typing import Final

from xpyd import vllm
from xpyd.api.models import (
    KV_EVENTS_PORT,
    KV_EVENTS_REPLAY_PORT,
    KV_EVENTS_TOPIC,
    PYTHONHASHSEED,
    DisaggregatedServingSpec,
    KVIndex,
    engine_extra_args,
    kv_aware_routing,
    kv_events_published,
)
from xpyd.api.naming import ROLES, Role
from xpyd.common.args import last_flag_value
from xpyd.common.jsontypes import JSON

DEFAULT_HASH_ALGO: Final = vllm.PREFIX_CACHING_HASH_ALGOS[0]


def block_size(spec: DisaggregatedServingSpec) -> int:
    """The prefill engines' tokens per KV block: their `--block-size`, else vLLM's default for the device.
    A value that is not an integer is vLLM's to refuse at start-up; the default stands in for it here."""
    value = last_flag_value(engine_extra_args(spec, "prefill"), "--block-size")
    try:
        size = int(value) if value is not None else 0
    except ValueError:
        size = 0
    if size > 0:
        return size
    return vllm.DEFAULT_BLOCK_SIZE_CPU if spec.on_cpu else vllm.DEFAULT_BLOCK_SIZE_GPU


def hash_algo(spec: DisaggregatedServingSpec) -> str:
    """The prefill engines' `--prefix-caching-hash-algo` (vLLM's default when unset)."""
    return last_flag_value(engine_extra_args(spec, "prefill"), "--prefix-caching-hash-algo") or DEFAULT_HASH_ALGO


def hash_seed(spec: DisaggregatedServingSpec) -> str | None:
    """The engines' PYTHONHASHSEED, which seeds their NONE_HASH and so the proxy's: the user's literal
    value, the last of engine.env then the prefill role's env, as the container gets it. None when it
    is unset (vLLM's fixed seed for sha256 and sha256_cbor from 0.32; before 0.32 the API refuses the
    Events index without it) or comes from valueFrom (refused with the Events index too)."""
    value = None
    for var in [*spec.engine.env, *spec.prefill.env]:
        if var.name == PYTHONHASHSEED:
            value = var.value
    return value


def events_config(spec: DisaggregatedServingSpec) -> str:
    """`--kv-events-config`: publish over ZMQ on the rendered ports (rank 0's; vLLM adds the rank)."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
              "replay_endpoint": f"tcp://*:{KV_EVENTS_REPLAY_PORT}", "topic": KV_EVENTS_TOPIC}
    return json.dumps(config, separators=(",", ":"))


def engine_args(spec: DisaggregatedServingSpec) -> list[str]:
    """The engines' flags for KVAware routing: the KV events, with the Events index."""
    return [f"--kv-events-config={events_config(spec)}"] if kv_events_published(spec) else []


def engine_ports(spec: DisaggregatedServingSpec, role: Role) -> list[JSON]:
    """The KV-event ports of each data-parallel rank (Events only)."""
    if not kv_events_published(spec):
        return []
    ranks = range(getattr(spec, role).data_parallel_size)
    return ([{"name": f"kv-events-{rank}", "containerPort": KV_EVENTS_PORT + rank, "protocol": "TCP"}
             for rank in ranks]
            + [{"name": f"kv-replay-{rank}", "containerPort": KV_EVENTS_REPLAY_PORT + rank, "protocol": "TCP"}
               for rank in ranks])


def _number(value: float) -> str:
    return f"{value:g}"


def routing_args(spec: DisaggregatedServingSpec) -> list[str]:
    """`xpyd proxy` flags of KVAware routing: its index, weights and the engines' block size, and, for the
    Events index, what the engines hash with and where and what they publish."""
    if not kv_aware_routing(spec):
        return []
    settings = spec.proxy.kv_aware
    result = [f"--kv-index={settings.index.value}", f"--kv-weight={_number(settings.kv_weight)}",
              f"--kv-decode-credit={_number(settings.decode_credit)}", f"--kv-index-blocks={settings.index_blocks}",
              f"--kv-block-size={block_size(spec)}"]
    if settings.index == KVIndex.ROUTED:   # the proxy's own hashes only: sha256, whatever the engines use
        result.append(f"--kv-ttl={settings.ttl_seconds}")
        return result
    result.append(f"--kv-hash-algo={hash_algo(spec)}")
    seed = hash_seed(spec)
    if seed is not None:
        result.append(f"--kv-hash-seed={seed}")
    result += [f"--kv-events-port={KV_EVENTS_PORT}", f"--kv-events-replay-port={KV_EVENTS_REPLAY_PORT}",
               f"--kv-events-topic={KV_EVENTS_TOPIC}"]
    for role in ROLES:
        ranks = getattr(spec, role).data_parallel_size
        if ranks > 1:
            result.append(f"--kv-events-{role}-ranks={ranks}")
    return result
