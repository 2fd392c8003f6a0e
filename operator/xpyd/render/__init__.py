"""Rendering: a validated DisaggregatedServing in, every desired child object out. Pure: no I/O.

The shape of each object lives in a jinja2 template under `xpyd/templates/`; the values that
depend on the connector, role and vLLM version are computed in `engine` and `kvconfig`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import jinja2
import yaml

from xpyd import __version__
from xpyd.api import naming
from xpyd.api.models import (
    LMCACHE_PD_PEER_ALLOC_PORT,
    LMCACHE_PD_PEER_INIT_PORT,
    MAX_PROXY_DRAIN_SECONDS,
    MAX_PROXY_FINISH_SECONDS,
    Connector,
    DisaggregatedServingSpec,
)
from xpyd.api.naming import Role
from xpyd.common.args import last_flag_value
from xpyd.common.jsontypes import JSON
from xpyd.render import engine, kvaware
from xpyd.render.compat import compat_hash

DEFAULT_OPERATOR_IMAGE: Final = f"ghcr.io/xpyd-operator/xpyd-operator:{__version__}"
#: After SIGTERM the proxy fails readiness and serves on this long, while the pod leaves the Service
#: (readiness probe every 2 s, 2 failures, then endpoint propagation to kube-proxy and ingresses).
PROXY_DRAIN_SECONDS: Final = 10
#: Then the requests in flight (long streams included) get this long before they are cut.
PROXY_FINISH_SECONDS: Final = 45
#: Between the end of that and SIGKILL: the proxy's own exit.
PROXY_EXIT_MARGIN_SECONDS: Final = 5

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("xpyd", "templates"),
    undefined=jinja2.StrictUndefined,
    autoescape=False,
    keep_trailing_newline=True,
    auto_reload=False,  # the templates are part of the package: no stat of each file per render
)
#: libyaml's parser where PyYAML was built with it (the same documents, several times faster).
_YAML_LOADER: Final = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# JSON is YAML: every structured value goes into the templates as JSON, so quoting is never wrong.
_ENV.filters["json"] = lambda value: json.dumps(value, separators=(", ", ": "))


@dataclass(frozen=True)
class RenderOptions:
    """What the operator adds to the spec: its own image (for the proxy), replica counts decided by
    the autoscaler (when absent, the spec's replicas) and the roles whose Deployment keeps its old
    pods while the other role rolls to the same KV revision (`controller.rollout`)."""

    operator_image: str = DEFAULT_OPERATOR_IMAGE
    replicas: Mapping[Role, int] = field(default_factory=dict)
    held: frozenset[Role] = frozenset()


def _render(template: str, **values: Any) -> list[JSON]:
    text = _ENV.get_template(template).render(**values)
    return [doc for doc in yaml.load_all(text, Loader=_YAML_LOADER) if doc]


def proxy_host(name: str, namespace: str) -> str:
    """DNS name of the proxy Service (engines of P2pNcclConnector register with it)."""
    return f"{naming.child_name(name, 'proxy')}.{namespace}.svc"


def endpoint(name: str, namespace: str, spec: DisaggregatedServingSpec) -> str:
    """The in-cluster URL clients use."""
    return f"http://{naming.child_name(name, 'proxy')}.{namespace}:{spec.proxy.port}"


def _engine_objects(name: str, namespace: str, spec: DisaggregatedServingSpec, role: Role,
                    options: RenderOptions) -> list[JSON]:
    """An engine pool: its workload (a Deployment, or a LeaderWorkerSet for multi-node replicas),
    its headless Service and its disruption budget."""
    role_spec = getattr(spec, role)
    common = {
        "name": naming.child_name(name, role),
        "namespace": namespace,
        "labels": naming.labels(name, role),
        "selector": naming.selector_labels(name, role),
    }
    values = {
        **common,
        "role": role_spec,
        "replicas": options.replicas.get(role, role_spec.replicas),
        "connector": spec.kv_transfer.connector.value,
        "transport": engine.transport(spec),
    }
    if role_spec.multi_node:
        workload = _render("engine-leaderworkerset.yaml.j2", **values,
                           leader_template=_engine_pod(name, namespace, spec, role, "leader"),
                           worker_template=_engine_pod(name, namespace, spec, role, "worker"))
    else:
        workload = _render("engine-deployment.yaml.j2", **values,
                           min_ready_seconds=engine.rollout_hold_seconds(spec) if role in options.held else 0,
                           progress_deadline_seconds=engine.progress_deadline_seconds(spec),
                           pod_template=_engine_pod(name, namespace, spec, role, None))
    ports = engine.ports(spec, role, "leader" if role_spec.multi_node else None)
    service_ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
                     for p in ports]
    return (workload
            + _render("engine-service.yaml.j2", **common, ports=service_ports, multi_node=role_spec.multi_node)
            + _render("pdb.yaml.j2", **common))


def _engine_pod(name: str, namespace: str, spec: DisaggregatedServingSpec, role: Role,
                node: engine.NodeRole | None) -> JSON:
    """The pod template of a pool: of its Deployment (`node` None), or of a multi-node replica's
    leader or workers."""
    role_spec = getattr(spec, role)
    vols, mounts = engine.volumes(spec, role)
    (pod,) = _render(
        "engine-pod.yaml.j2",
        pod_labels={**naming.labels(name, role), naming.KV_COMPAT_LABEL: compat_hash(spec)},
        role=role_spec,
        engine=spec.engine,
        serving=node != "worker",
        capabilities=engine.capabilities(spec),
        command=engine.command(spec),
        args=engine.args(spec, role, proxy_host(name, namespace), node),
        env=engine.env(spec, role, proxy_host(name, namespace)),
        ports=engine.ports(spec, role, node),
        resources=engine.resources(spec, role),
        volumes=vols,
        volume_mounts=mounts,
        tolerations=engine.tolerations(spec, role_spec),
        node_selector=engine.node_selector(role_spec),
        image_pull_secrets=[s.to_wire() for s in spec.engine.image_pull_secrets],
        drain_command=engine.drain_command(spec, role) if node != "worker" else engine.worker_drain_command(spec, role),
        termination_grace_seconds=engine.termination_grace_seconds(spec, role),
        startup_failure_threshold=engine.startup_failure_threshold(role_spec),
    )
    return pod


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
        *kvaware.proxy_args(spec),
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


def _proxy_objects(name: str, namespace: str, spec: DisaggregatedServingSpec,
                   options: RenderOptions) -> list[JSON]:
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
        _render("proxy-rbac.yaml.j2", **common)
        + _render(
            "proxy-deployment.yaml.j2",
            **common,
            proxy=spec.proxy,
            image=spec.proxy.image or options.operator_image,
            args=args,
            termination_grace_seconds=proxy_termination_grace_seconds(args),
            env=proxy_env,
            resources={"requests": requests, "limits": limits},
        )
        + _render("proxy-service.yaml.j2", **common, proxy=spec.proxy)
        + _render("pdb.yaml.j2", **common)
    )


def render(name: str, namespace: str, spec: DisaggregatedServingSpec,
           options: RenderOptions | None = None) -> list[JSON]:
    """Every child object of a DisaggregatedServing, in apply order (RBAC before the pods using it)."""
    options = options or RenderOptions()
    objects: list[JSON] = []
    for role in naming.ROLES:
        objects += _engine_objects(name, namespace, spec, role, options)
    return objects + _proxy_objects(name, namespace, spec, options)
