"""An engine pool's objects (`objects`), and the parts of an engine pod that depend on the
connector, the role and the vLLM version."""

from __future__ import annotations

import ast
import inspect
import math
from typing import Any, Final, Literal

from xpyd import vllm
from xpyd.api import naming
from xpyd.api.models import (
    ENGINE_DRAIN_QUIET_SECONDS,
    ENGINE_SHUTDOWN_MARGIN_SECONDS,
    LMCACHE_PD_PROXY_PORT,
    Connector,
    DisaggregatedServingSpec,
    EnvVar,
    RoleSpec,
)
from xpyd.api.naming import Role
from xpyd.common.jsontypes import JSON
from xpyd.render import drain, kvaware, lmcache
from xpyd.render.kvconfig import P2P_NCCL_KV_PORT, kv_transfer_config
from xpyd.render.templates import documents

MODEL_MOUNT: Final = "/models"
HF_HOME: Final = "/cache/huggingface"
LMCACHE_MOUNT: Final = "/etc/lmcache"
#: The project's engine image (engine-image/): vLLM plus RDMA userspace and a transport check.
ENGINE_IMAGE_REPOSITORY: Final = "ghcr.io/xpyd-operator/vllm-engine"
ENGINE_ENTRYPOINT: Final = "/usr/local/bin/xpyd-engine-entrypoint"
#: The pods of a multi-node replica: the leader (vLLM's API server) or a worker (`--headless`).
NodeRole = Literal["leader", "worker"]
#: What LeaderWorkerSet's pod webhook puts in every container's env: the leader's DNS name (its
#: headless Service) and the pod's index in its group (0 for the leader). The kubelet expands
#: `$(NAME)` in args from the container's env.
LWS_LEADER_ADDRESS: Final = "$(LWS_LEADER_ADDRESS)"
LWS_WORKER_INDEX: Final = "$(LWS_WORKER_INDEX)"
#: The pod's own IP (the engine container's first env var, from the downward API).
POD_IP: Final = "$(POD_IP)"
#: Besides the slower role's start-up budget, what a held Deployment waits for it: scheduling and
#: pulling the image on a node that does not have it (`controller.rollout`).
ROLLOUT_HOLD_MARGIN_SECONDS: Final = 600
#: A Deployment without progress for longer than its pods may take to start (and be held) is stuck.
PROGRESS_DEADLINE_MARGIN_SECONDS: Final = 600
#: vLLM's defaults (ParallelConfig): the torch.distributed master of a multi-node engine, and the
#: ZMQ port of data-parallel coordination; both on the leader, dialled by every worker.
MASTER_PORT: Final = 29501
DATA_PARALLEL_RPC_PORT: Final = 29550


def _compact_source(module: object) -> str:
    """The module's code without docstrings: it is embedded in every engine pod spec."""
    tree = ast.parse(inspect.getsource(module))  # type: ignore[arg-type]
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            del body[0]
    return ast.unparse(tree)


_DRAIN_SOURCE: Final = _compact_source(drain)


def _env(name: str, value: str) -> JSON:
    return {"name": name, "value": value}


def _field_env(name: str, field_path: str) -> JSON:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def _user_env(env: list[EnvVar]) -> list[JSON]:
    return [var.to_wire() for var in env]


def transport(spec: DisaggregatedServingSpec) -> str:
    """The KV transport the rendered configuration asks for: RDMA or TCP."""
    kv = spec.kv_transfer
    if kv.connector == Connector.MOONCAKE:
        return "RDMA" if kv.mooncake_settings.protocol == "rdma" else "TCP"
    return "RDMA" if kv.rdma is not None else "TCP"


def ucx_tls(spec: DisaggregatedServingSpec) -> str:
    """UCX_TLS: RDMA transports when RDMA is requested, so a missing device fails instead of
    silently falling back to TCP (which is orders of magnitude slower). GPU pools add UCX's CUDA
    transports; a CPU pool's KV is in host memory and its nodes have no CUDA driver."""
    if spec.kv_transfer.ucx.tls:
        return spec.kv_transfer.ucx.tls
    network = "rc" if spec.kv_transfer.rdma else "tcp"
    return network if spec.on_cpu else f"{network},cuda_copy,cuda_ipc"


def _env_value(spec: DisaggregatedServingSpec, role: Role, name: str) -> str | None:
    """The literal value the user gives `name` in the engine's env (the role's wins), if any; None
    also when it comes from a Secret or ConfigMap (valueFrom), which the render cannot read."""
    role_spec: RoleSpec = getattr(spec, role)
    value = None
    for var in [*spec.engine.env, *role_spec.env]:
        if var.name == name:
            value = var.value
    return value


def kv_lease_seconds(spec: DisaggregatedServingSpec, role: Role = "prefill") -> int:
    """How long a prefill engine keeps KV blocks for decode after answering (NIXL only): the
    `kv_lease_duration` of the extra config from vLLM 0.23, VLLM_NIXL_ABORT_REQUEST_TIMEOUT before."""
    if not spec.kv_transfer.connector.is_nixl:
        return 0
    lease: object
    if vllm.parse_version(spec.engine.vllm_version) >= vllm.NIXL_KV_LEASE_ADDED:
        default = vllm.NIXL_KV_LEASE_DEFAULT_SECONDS
        lease = spec.kv_transfer.extra_config.get("kv_lease_duration", default)
    else:
        default = vllm.NIXL_ABORT_REQUEST_TIMEOUT_DEFAULT_SECONDS
        lease = _env_value(spec, role, "VLLM_NIXL_ABORT_REQUEST_TIMEOUT")
    try:
        seconds = float(lease)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # None (unset) or a value vLLM refuses at start-up
        return default
    return max(0, math.ceil(seconds)) if math.isfinite(seconds) else default


def command(spec: DisaggregatedServingSpec) -> list[str]:
    """`vllm serve`, behind the transport check when the image is the project's engine image."""
    serve = ["vllm", "serve"]
    if spec.engine.image.startswith(ENGINE_IMAGE_REPOSITORY + ":"):
        return [ENGINE_ENTRYPOINT, *serve]
    return serve


def args(spec: DisaggregatedServingSpec, role: Role, proxy_host: str, node: NodeRole | None = None) -> list[str]:
    """`vllm serve` arguments (after `vllm serve`); `node` for a pod of a multi-node replica."""
    role_spec: RoleSpec = getattr(spec, role)
    version = vllm.parse_version(spec.engine.vllm_version)
    pvc = spec.model.source.pvc
    model = f"{MODEL_MOUNT}/{pvc.path.strip('/')}".rstrip("/") if pvc else spec.model.name
    result = [
        model,
        f"--served-model-name={spec.model.served_name}",
        f"--port={spec.engine.port}",
        f"--tensor-parallel-size={role_spec.tensor_parallel_size}",
    ]
    if role_spec.pipeline_parallel_size > 1:
        result.append(f"--pipeline-parallel-size={role_spec.pipeline_parallel_size}")
    if role_spec.data_parallel_size > 1:
        result.append(f"--data-parallel-size={role_spec.data_parallel_size}")
    if spec.model.max_model_len:
        result.append(f"--max-model-len={spec.model.max_model_len}")
    if spec.model.source.hub and spec.model.source.hub.revision:
        result.append(f"--revision={spec.model.source.hub.revision}")
    if version >= vllm.SHUTDOWN_TIMEOUT_ADDED:
        result.append(f"--shutdown-timeout={role_spec.drain_timeout_seconds}")
    if spec.kv_transfer.connector == Connector.LMCACHE:
        # vLLM's LMCache P/D example runs both roles without vLLM's own prefix cache.
        result.append("--no-enable-prefix-caching")
    if node is not None:
        result += multi_node_args(role_spec, node)
    result += kvaware.engine_args(spec)
    result.append(f"--kv-transfer-config={kv_transfer_config(spec, role, proxy_host).to_json()}")
    return result + list(spec.engine.extra_args) + list(role_spec.extra_args)


def multi_node_args(role_spec: RoleSpec, node: NodeRole) -> list[str]:
    """The launch of one pod of a multi-node replica (vLLM's multiprocessing multi-node launch, as
    arg_utils.py's `create_engine_config` reads it): every pod names the group's size, its own rank
    and the leader; the workers run no API server. With data parallelism vLLM infers from
    --node-rank the ranks a node runs (--data-parallel-size-local, --data-parallel-start-rank) and
    uses the master address for data-parallel coordination too."""
    # The leader binds ZMQ sockets on its master address (0.12-0.16) and libzmq binds no DNS name: it
    # names its own pod IP; the workers only connect, to the leader's name under the group's Service.
    master = POD_IP if node == "leader" else LWS_LEADER_ADDRESS
    result = [f"--nnodes={role_spec.nodes_per_replica}",
              f"--node-rank={'0' if node == 'leader' else LWS_WORKER_INDEX}",
              f"--master-addr={master}", f"--master-port={MASTER_PORT}"]
    if role_spec.data_parallel_size > 1:
        result.append(f"--data-parallel-rpc-port={DATA_PARALLEL_RPC_PORT}")
    if node == "worker":
        result.append("--headless")
    return result


def env(spec: DisaggregatedServingSpec, role: Role, proxy_host: str = "") -> list[JSON]:
    """Environment of the engine container: connector settings, then the user's (which win).
    `proxy_host` is the proxy Service's DNS name (LMCache's prefill senders notify it)."""
    kv = spec.kv_transfer
    # What the engine image's entrypoint compares with the devices the pod really has.
    result = [_field_env("POD_IP", "status.podIP"), _env("XPYD_EXPECT_TRANSPORT", transport(spec))]
    role_spec: RoleSpec = getattr(spec, role)
    if role_spec.multi_node:
        # get_ip(): where every node binds the sockets its peers dial (the workers' response queues,
        # from 0.18 the leader's broadcast queue). Its fallback asks the routing table for a route to
        # 8.8.8.8, which need not be the pod network.
        result.append(_field_env("VLLM_HOST_IP", "status.podIP"))
    if kv.connector.is_nixl:
        # NIXL's side channel defaults to localhost; decode dials it, so it must be the pod IP.
        result += [
            _field_env("VLLM_NIXL_SIDE_CHANNEL_HOST", "status.podIP"),
            _env("VLLM_NIXL_SIDE_CHANNEL_PORT", str(kv.nixl_settings.side_channel_port)),
        ]
    if kv.connector.is_nixl or kv.connector == Connector.LMCACHE:
        result.append(_env("UCX_TLS", ucx_tls(spec)))
        if kv.ucx.net_devices:
            result.append(_env("UCX_NET_DEVICES", kv.ucx.net_devices))
        # UCX logs the transport it picked per endpoint: the way to tell RDMA from TCP fallback.
        result.append(_env("UCX_PROTO_INFO", "y"))
    version = vllm.parse_version(spec.engine.vllm_version)
    if kv.rdma is not None and kv.rdma.gpu_nic_mapping and version >= vllm.GPU_NIC_MAPPING_ADDED:
        # Both or neither: vLLM refuses to start with one of them (vllm_net_devices.py).
        result += [
            _env("VLLM_GPU_NIC_PCIE_MAPPING", ",".join(f"{m.gpu}={m.nic}" for m in kv.rdma.gpu_nic_mapping)),
            _env("VLLM_NIC_SELECTION_VARS", ",".join(kv.rdma.nic_selection_vars)),
        ]
    if kv.connector == Connector.MOONCAKE and role == "prefill":
        result.append(_env("VLLM_MOONCAKE_BOOTSTRAP_PORT", str(kv.mooncake_settings.bootstrap_port)))
    if kv.lmcache is not None:
        result += [
            _env("LMCACHE_CONFIG_FILE", f"{LMCACHE_MOUNT}/{role}.yaml"),
            _env("PYTHONHASHSEED", kv.lmcache.python_hash_seed),
        ]
        # LMCache reads LMCACHE_<KEY> over its file: what only the pod knows goes here. Prefill's
        # sender notifies the proxy; every decode engine receives on its own address.
        if role == "prefill":
            result += [_env("LMCACHE_PD_PROXY_HOST", proxy_host),
                       _env("LMCACHE_PD_PROXY_PORT", str(LMCACHE_PD_PROXY_PORT))]
        else:
            result.append(_field_env("LMCACHE_PD_PEER_HOST", "status.podIP"))
    if spec.on_cpu:
        # vLLM's CPU backend (vllm/envs.py): the KV cache's host memory in GiB, and where each rank's
        # OpenMP threads run.
        cpu = spec.cpu_settings
        result += [_env("VLLM_CPU_KVCACHE_SPACE", str(cpu.kv_cache_space_gib)),
                   _env("VLLM_CPU_OMP_THREADS_BIND", cpu.threads_bind)]
    if spec.model.source.hub is not None:
        result.append(_env("HF_HOME", HF_HOME))
    if spec.model.hf_token_secret_ref is not None:
        ref = spec.model.hf_token_secret_ref
        result.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return _override(result, _user_env(spec.engine.env) + _user_env(role_spec.env))


def _override(rendered: list[JSON], user: list[JSON]) -> list[JSON]:
    """`rendered` with each of the user's variables in place of the rendered one of its name (the last
    of a name wins), the others appended in order: a container's env must not name a variable twice
    (server-side apply refuses duplicate keys)."""
    result = list(rendered)
    for var in user:
        names = [v["name"] for v in result]
        if var["name"] in names:
            result[names.index(var["name"])] = var
        else:
            result.append(var)
    return result


def ports(spec: DisaggregatedServingSpec, role: Role, node: NodeRole | None = None) -> list[JSON]:
    """Container ports: HTTP plus the connector's listening ports (documentation and policies). A
    multi-node leader adds the ports its workers dial; a worker serves no HTTP."""
    kv = spec.kv_transfer
    role_spec: RoleSpec = getattr(spec, role)
    result: list[JSON] = []
    if node != "worker":
        result.append({"name": "http", "containerPort": spec.engine.port, "protocol": "TCP"})
    if node == "leader":
        result.append({"name": "vllm-master", "containerPort": MASTER_PORT, "protocol": "TCP"})
        if role_spec.data_parallel_size > 1:
            result.append({"name": "vllm-dp-rpc", "containerPort": DATA_PARALLEL_RPC_PORT, "protocol": "TCP"})
    if kv.connector.is_nixl:
        result.append({"name": "nixl", "containerPort": kv.nixl_settings.side_channel_port, "protocol": "TCP"})
    if kv.connector == Connector.P2P_NCCL:
        # Each rank binds a ZMQ ROUTER on kv_port + its world rank (p2p_nccl_connector.py passes
        # get_world_group().rank as port_offset), and the world spans TP x PP x DP in one pod.
        result += [{"name": f"p2p-zmq-{rank}", "containerPort": P2P_NCCL_KV_PORT + rank, "protocol": "TCP"}
                   for rank in range(role_spec.parallel_gpus)]
    if kv.connector == Connector.LMCACHE and role == "decode":
        # The receiver of each tensor-parallel rank listens on its own init and alloc ports.
        for key, prefix in (("pd_peer_init_port", "lmc-init"), ("pd_peer_alloc_port", "lmc-alloc")):
            result += [{"name": f"{prefix}-{rank}", "containerPort": port, "protocol": "TCP"}
                       for rank, port in enumerate(lmcache.receiver_ports(spec)[key])]
    if kv.connector == Connector.MOONCAKE and role == "prefill":
        result.append(
            {"name": "mooncake", "containerPort": kv.mooncake_settings.bootstrap_port, "protocol": "TCP"}
        )
    if node != "worker":
        result += kvaware.engine_ports(spec, role)
    return result


def resources(spec: DisaggregatedServingSpec, role: Role) -> JSON:
    """GPU (and RDMA) requests equal to limits, as extended resources require. A CPU pool requests no
    GPU, and its CPU limit equals its request where it asks for cores of its own (`exclusive_cores`)."""
    role_spec: RoleSpec = getattr(spec, role)
    limits: dict[str, Any] = {} if spec.on_cpu else {role_spec.gpu.resource_name: role_spec.gpus}
    if spec.kv_transfer.rdma:
        limits[spec.kv_transfer.rdma.resource_name] = spec.kv_transfer.rdma.per_replica
    requests = dict(limits)
    if role_spec.resources.cpu:
        requests["cpu"] = role_spec.resources.cpu
        if exclusive_cores(spec):
            limits["cpu"] = role_spec.resources.cpu
    if role_spec.resources.memory:
        requests["memory"] = limits["memory"] = role_spec.resources.memory
    return {"requests": requests, "limits": limits}


def exclusive_cores(spec: DisaggregatedServingSpec) -> bool:
    """Whether a CPU pool's engines ask for cores of their own: a CPU limit equal to the request, which
    with an integer count makes the pod Guaranteed, and the kubelet's static CPU manager then gives it
    exclusive cores that vLLM's `auto` thread binding uses (a CPU engine's threads spin; shared cores
    would be taken from its neighbours). Not with NixlConnector on the releases whose worker moves its
    model thread to the last core of each NUMA node (`vllm.NIXL_CPU_KV_CORE_RESERVED`): in an exclusive
    cpuset without those cores the engine dies at start, so the pod stays Burstable, in the shared pool
    that holds them."""
    if not spec.on_cpu:
        return False
    nixl_moves_threads = (spec.kv_transfer.connector.is_nixl
                          and vllm.parse_version(spec.engine.vllm_version) >= vllm.NIXL_CPU_KV_CORE_RESERVED)
    return not nixl_moves_threads


def volumes(spec: DisaggregatedServingSpec, role: Role) -> tuple[list[JSON], list[JSON]]:
    """(volumes, volumeMounts) of the engine pod."""
    role_spec: RoleSpec = getattr(spec, role)
    vols: list[JSON] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": role_spec.shm_size}}]
    mounts: list[JSON] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    source = spec.model.source
    if source.pvc is not None:
        vols.append({"name": "model", "persistentVolumeClaim": {"claimName": source.pvc.claim_name,
                                                                "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    elif source.hub is not None:
        empty_dir: JSON = {"sizeLimit": source.hub.cache_size_limit} if source.hub.cache_size_limit else {}
        vols.append({"name": "model-cache", "emptyDir": empty_dir})
        mounts.append({"name": "model-cache", "mountPath": HF_HOME})
    lmcache = spec.kv_transfer.lmcache
    if lmcache is not None:
        vols.append({"name": "lmcache-config", "configMap": {"name": lmcache.config_map_ref.name,
                                                             "items": [{"key": f"{role}.yaml",
                                                                        "path": f"{role}.yaml"}]}})
        mounts.append({"name": "lmcache-config", "mountPath": LMCACHE_MOUNT, "readOnly": True})
    return vols, mounts


def capabilities(spec: DisaggregatedServingSpec) -> list[str]:
    """Linux capabilities the engine container adds to none: IPC_LOCK when RDMA registers (pins)
    memory; SYS_NICE on CPU, where vLLM binds its threads and memory to NUMA nodes (mbind and
    set_mempolicy, which the runtime's default seccomp profile allows only with CAP_SYS_NICE; vLLM's
    CPU guide runs its image with --cap-add SYS_NICE)."""
    result = []
    if spec.kv_transfer.rdma is not None:
        result.append("IPC_LOCK")
    if spec.on_cpu:
        result.append("SYS_NICE")
    return result


def tolerations(spec: DisaggregatedServingSpec, role_spec: RoleSpec) -> list[JSON]:
    """The user's tolerations, plus (on GPU pools) one for the taint GPU nodes carry under the GPU
    resource's name (the ExtendedResourceToleration convention)."""
    result = [t.to_wire() for t in role_spec.tolerations]
    if spec.on_cpu:
        return result
    gpu_taint = {"key": role_spec.gpu.resource_name, "operator": "Exists", "effect": "NoSchedule"}
    if gpu_taint not in result:
        result.append(gpu_taint)
    return result


def node_selector(role_spec: RoleSpec) -> dict[str, str]:
    selector = dict(role_spec.node_selector)
    if role_spec.gpu.product:
        selector["nvidia.com/gpu.product"] = role_spec.gpu.product
    return selector


def drain_command(spec: DisaggregatedServingSpec, role: Role) -> list[str]:
    role_spec: RoleSpec = getattr(spec, role)
    hold = kv_lease_seconds(spec, role) if role == "prefill" else 0
    return ["python3", "-c", _DRAIN_SOURCE, str(spec.engine.port), str(role_spec.drain_timeout_seconds),
            str(ENGINE_DRAIN_QUIET_SECONDS), str(hold)]


def worker_drain_command(spec: DisaggregatedServingSpec, role: Role) -> list[str]:
    """A multi-node worker's preStop: it stops only once its leader has (or at its own grace)."""
    return ["python3", "-c", _DRAIN_SOURCE, "--follow-leader", str(spec.engine.port),
            str(termination_grace_seconds(spec, role))]


def termination_grace_seconds(spec: DisaggregatedServingSpec, role: Role) -> int:
    role_spec: RoleSpec = getattr(spec, role)
    hold = kv_lease_seconds(spec, role) if role == "prefill" else 0
    return role_spec.drain_timeout_seconds + hold + ENGINE_SHUTDOWN_MARGIN_SECONDS


def startup_failure_threshold(role_spec: RoleSpec) -> int:
    return max(1, math.ceil(role_spec.probes.startup_timeout_seconds / role_spec.probes.period_seconds))


def rollout_hold_seconds(spec: DisaggregatedServingSpec) -> int:
    """`minReadySeconds` of a Deployment held while the other role rolls to the same KV revision
    (`controller.rollout`): as long as the slower role's pod may take to be scheduled and start."""
    return max(spec.prefill.probes.startup_timeout_seconds,
               spec.decode.probes.startup_timeout_seconds) + ROLLOUT_HOLD_MARGIN_SECONDS


def progress_deadline_seconds(spec: DisaggregatedServingSpec) -> int:
    """`progressDeadlineSeconds` of the engine Deployments: above the hold (the API requires it) and
    above any pod's start-up budget, so a slow model load is not reported as a failed rollout."""
    return rollout_hold_seconds(spec) + PROGRESS_DEADLINE_MARGIN_SECONDS


def objects(name: str, namespace: str, spec: DisaggregatedServingSpec, role: Role, *, replicas: int, held: bool,
            compat: str, proxy_host: str) -> list[JSON]:
    """An engine pool: its workload (a Deployment, or a LeaderWorkerSet for multi-node replicas),
    its headless Service and its disruption budget. `held`: the Deployment keeps its old pods
    while the other role rolls (`controller.rollout`); `compat`: the KV compatibility hash
    (`xpyd.render.compat`); `proxy_host`: the proxy Service's DNS name."""
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
        "replicas": replicas,
        "connector": spec.kv_transfer.connector.value,
        "transport": transport(spec),
    }
    if role_spec.multi_node:
        workload = documents("engine-leaderworkerset.yaml.j2", **values,
                             leader_template=_pod(name, spec, role, "leader", compat, proxy_host),
                             worker_template=_pod(name, spec, role, "worker", compat, proxy_host))
    else:
        workload = documents("engine-deployment.yaml.j2", **values,
                             min_ready_seconds=rollout_hold_seconds(spec) if held else 0,
                             progress_deadline_seconds=progress_deadline_seconds(spec),
                             pod_template=_pod(name, spec, role, None, compat, proxy_host))
    service_ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
                     for p in ports(spec, role, "leader" if role_spec.multi_node else None)]
    return (workload
            + documents("engine-service.yaml.j2", **common, ports=service_ports, multi_node=role_spec.multi_node)
            + documents("pdb.yaml.j2", **common))


def _pod(name: str, spec: DisaggregatedServingSpec, role: Role, node: NodeRole | None, compat: str,
         proxy_host: str) -> JSON:
    """The pod template of a pool: of its Deployment (`node` None), or of a multi-node replica's
    leader or workers."""
    role_spec = getattr(spec, role)
    vols, mounts = volumes(spec, role)
    (pod,) = documents(
        "engine-pod.yaml.j2",
        pod_labels={**naming.labels(name, role), naming.KV_COMPAT_LABEL: compat},
        role=role_spec,
        engine=spec.engine,
        serving=node != "worker",
        capabilities=capabilities(spec),
        command=command(spec),
        args=args(spec, role, proxy_host, node),
        env=env(spec, role, proxy_host),
        ports=ports(spec, role, node),
        resources=resources(spec, role),
        volumes=vols,
        volume_mounts=mounts,
        tolerations=tolerations(spec, role_spec),
        node_selector=node_selector(role_spec),
        image_pull_secrets=[s.to_wire() for s in spec.engine.image_pull_secrets],
        drain_command=drain_command(spec, role) if node != "worker" else worker_drain_command(spec, role),
        termination_grace_seconds=termination_grace_seconds(spec, role),
        startup_failure_threshold=startup_failure_threshold(role_spec),
    )
    return pod
