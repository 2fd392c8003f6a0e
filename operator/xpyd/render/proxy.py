"""The proxy's objects: its RBAC, Deployment, Service and disruption budget, and the arguments of
`xpyd proxy` (where the pools are, how to talk to them and how to stop)."""

from __future__ import annotations

import math
from typing import Final

from xpyd.api import naming
from xpyd.api.models import (
    LMCACHE_PD_PEER_ALLOC_PORT,
    LMCACHE_PD_PEER_INIT_PORT,
    MAX_PROXY_DRAIN_SECONDS,
    MAX_PROXY_FINISH_SECONDS,
    Connector,
    DisaggregatedServingSpec,
)
from xpyd.common.args import last_flag_value
from xpyd.common.jsontypes import JSON
from xpyd.render import kvaware
from xpyd.render.templates import documents

#: After SIGTERM the proxy fails readiness and serves on this long, while the pod leaves the Service
#: (readiness probe every 2 s, 2 failures, then endpoint propagation to kube-proxy and ingresses).
PROXY_DRAIN_SECONDS: Final = 10
#: Then the requests in flight (long streams included) get this long before they are cut.
PROXY_FINISH_SECONDS: Final = 45
#: Between the end of that and SIGKILL: the proxy's own exit.
PROXY_EXIT_MARGIN_SECONDS: Final = 5


def proxy_host(name: str, namespace: str) -> str:
    """DNS name of the proxy Service (engines of P2pNcclConnector register with it)."""
    return f"{naming.child_name(name, 'proxy')}.{namespace}.svc"


def proxy_args(name: str, namespace: str, spec: DisaggregatedServingSpec) -> list[str]:
    """`xpyd proxy` arguments: where the pools are, how to talk to them and how to stop. The
    user's extra arguments come last (the proxy's parser keeps the last value of a flag)."""
    kv = spec.kv_transfer
    connector: list[str] = []
    if kv.connector == Connector.MOONCAKE:
        # Decode dials prefill's bootstrap server at this port; the proxy asks it for the engine ids.
        connector.append(f"--mooncake-bootstrap-port={kv.mooncake_settings.bootstrap_port}")
    if kv.connector == Connector.LMCACHE:
        # Prefill pushes each request's KV to the decode pod picked: its LMCache ports, one per TP rank.
        connector += [f"--lmcache-init-port={LMCACHE_PD_PEER_INIT_PORT}",
                      f"--lmcache-alloc-port={LMCACHE_PD_PEER_ALLOC_PORT}",
                      f"--decode-tensor-parallel-size={spec.decode.tensor_parallel_size}"]
    if kv.connector == Connector.NIXL_PUSH and spec.prefill.data_parallel_size > 1:
        # It learns each rank's identity and pins prefill legs to ranks (Mooncake asks /query instead).
        connector.append(f"--prefill-data-parallel-size={spec.prefill.data_parallel_size}")
    return [
        f"--port={spec.proxy.port}",
        f"--connector={kv.connector.value}",
        f"--namespace={namespace}",
        f"--prefill-selector={naming.serving_selector_string(name, 'prefill', spec.prefill.multi_node)}",
        f"--decode-selector={naming.serving_selector_string(name, 'decode', spec.decode.multi_node)}",
        f"--engine-port={spec.engine.port}",
        f"--routing-policy={spec.proxy.routing_policy.value}",
        *kvaware.routing_args(spec),
        f"--served-model-name={spec.model.served_name}",
        *connector,
        *_waiting_room_args(spec),
        f"--drain-seconds={PROXY_DRAIN_SECONDS}",
        f"--finish-timeout={PROXY_FINISH_SECONDS}",
        *spec.proxy.extra_args,
    ]


def _waiting_room_args(spec: DisaggregatedServingSpec) -> list[str]:
    """A pool that scales to zero: the proxies hold requests while no prefill and decode pair is
    ready (`autoscaling.scaleToZero`), rather than answering 503 at once."""
    autoscaling = spec.autoscaling
    if not autoscaling.scales_to_zero:
        return []
    room = autoscaling.scale_to_zero
    return [f"--wait-timeout={autoscaling.wait_seconds}", f"--wait-max-requests={room.max_waiting_requests}",
            f"--wait-max-bytes={room.max_waiting_bytes}"]


def proxy_termination_grace_seconds(args: list[str]) -> int:
    """terminationGracePeriodSeconds of the proxy pod: its drain period plus the time it gives
    requests in flight plus a margin, from the values its arguments set (the user's included)."""
    total = float(PROXY_EXIT_MARGIN_SECONDS)
    for flag, default, most in (("--drain-seconds", PROXY_DRAIN_SECONDS, MAX_PROXY_DRAIN_SECONDS),
                                ("--finish-timeout", PROXY_FINISH_SECONDS, MAX_PROXY_FINISH_SECONDS)):
        value = last_flag_value(args, flag)
        try:
            seconds = float(value) if value is not None else float(default)
        except ValueError:  # the proxy refuses it at start-up; the default keeps the pod spec valid
            seconds = float(default)
        total += min(seconds, most) if math.isfinite(seconds) and seconds > 0 else 0.0
    return math.ceil(total)


def objects(name: str, namespace: str, spec: DisaggregatedServingSpec, image: str) -> list[JSON]:
    """The proxy's objects, RBAC first; `image` is the operator's unless the spec names one."""
    common = {
        "name": naming.child_name(name, "proxy"),
        "namespace": namespace,
        "labels": naming.labels(name, "proxy"),
        "selector": naming.selector_labels(name, "proxy"),
    }
    # Its own pod's name: the proxy keeps its KV-transfer health there (`xpyd.proxy.podreport`).
    proxy_env: list[JSON] = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    if spec.proxy.api_key_secret_ref is not None:
        ref = spec.proxy.api_key_secret_ref
        proxy_env.append({"name": "XPYD_PROXY_API_KEY",
                          "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    resources = spec.proxy.resources
    requests = {k: v for k, v in (("cpu", resources.cpu), ("memory", resources.memory)) if v}
    limits = {"memory": resources.memory} if resources.memory else {}
    args = proxy_args(name, namespace, spec)
    return (
        documents("proxy-rbac.yaml.j2", **common)
        + documents(
            "proxy-deployment.yaml.j2",
            **common,
            proxy=spec.proxy,
            image=spec.proxy.image or image,
            args=args,
            termination_grace_seconds=proxy_termination_grace_seconds(args),
            env=proxy_env,
            resources={"requests": requests, "limits": limits},
        )
        + documents("proxy-service.yaml.j2", **common, proxy=spec.proxy)
        + documents("pdb.yaml.j2", **common)
    )
