"""The `DisaggregatedServing` API (xpyd.io/v1alpha1): spec and status models.

These models are the one source of truth: the CRD under `crds/` is generated from them
(`xpyd crd`), rendering consumes them, and the operator writes status through them. Every field
carries a description because `kubectl explain` shows it.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

from pydantic import BeforeValidator, Field, WithJsonSchema, model_validator

from xpyd import vllm
from xpyd.api.base import APIModel, Rule, StatusModel

GROUP: Final = "xpyd.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "DisaggregatedServing"
PLURAL: Final = "disaggregatedservings"
SINGULAR: Final = "disaggregatedserving"
SHORT_NAMES: Final = ("xpyd", "dsv")

# Kubernetes resource.Quantity, as the API server's own schemas spell it.
QUANTITY_PATTERN: Final = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
Quantity = Annotated[
    str,
    BeforeValidator(lambda v: str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v),
    Field(pattern=QUANTITY_PATTERN),
    WithJsonSchema(
        {"anyOf": [{"type": "integer"}, {"type": "string"}], "pattern": QUANTITY_PATTERN,
         "x-kubernetes-int-or-string": True}
    ),
]
IntOrPercent = Annotated[
    int | str,
    Field(union_mode="left_to_right"),
    WithJsonSchema(
        {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
    ),
]
# Free-form Kubernetes structures the operator passes through untouched (their schema is the API
# server's own, and it validates them when the child objects are applied).
FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]
Port = Annotated[int, Field(ge=1, le=65535)]
Name = Annotated[str, Field(min_length=1, max_length=253)]
#: A label key: an optional DNS-subdomain prefix and `/`, then a name of at most 63 characters.
LABEL_KEY_PATTERN: Final = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                            r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LabelName = Annotated[str, Field(min_length=1, max_length=317, pattern=LABEL_KEY_PATTERN)]


# ---------------------------------------------------------------------------------------------
# Shared small types

#: The most data-parallel ranks one engine pod may run (`dataParallelSize`; the proxy bounds its flag by it).
MAX_DATA_PARALLEL = 64
#: The most tensor-parallel ranks of one engine (`tensorParallelSize`; the proxy bounds
#: `--decode-tensor-parallel-size` by it).
MAX_TENSOR_PARALLEL = 64
#: The most nodes one multi-node replica may span (`nodesPerReplica`).
MAX_NODES_PER_REPLICA = 64
#: The most seconds a stopping proxy keeps serving while it fails readiness (`--drain-seconds`), and the
#: most its requests in flight get afterwards (`--finish-timeout`): a stopping proxy must not hold its
#: pod for long. The proxy refuses longer values; the render caps what it passes by them.
MAX_PROXY_DRAIN_SECONDS = 300.0
MAX_PROXY_FINISH_SECONDS = 3600.0
#: The longest a proxy holds a request while its pool has no ready prefill and decode pair
#: (`--wait-timeout`, rendered from `autoscaling.scaleToZero.waitSeconds`).
MAX_PROXY_WAIT_SECONDS = 86400.0
#: A terminating engine pod's preStop drain ends only after its engine has been idle (nothing running,
#: waiting or finished) this long, so the engine still takes new requests until then; the proxy sends a
#: terminating instance new requests (when its role has no other instance) only within this time, less
#: a margin, of the engine's last answer to it. vLLM aborts new requests once it gets SIGTERM, which
#: follows the drain.
ENGINE_DRAIN_QUIET_SECONDS = 5
#: An engine pod's grace period is its drain timeout, its KV hold and this margin for vLLM's own
#: shutdown. So a drain that runs into its timeout ends, and the engine gets SIGTERM, no earlier than
#: this long before the pod's deletionTimestamp: the proxy's fallback to a terminating pod ends then.
ENGINE_SHUTDOWN_MARGIN_SECONDS = 30


class EnvVar(APIModel):
    """An environment variable for a container, as in a Pod spec."""

    name: Name = Field(description="Name of the environment variable.")
    value: str | None = Field(default=None, description="Literal value. Exclusive with valueFrom.")
    value_from: FreeForm | None = Field(
        default=None,
        description="Source of the value (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef), "
        "as in a Pod spec.",
    )

    rules = (
        Rule(
            cel="!(has(self.value) && has(self.valueFrom))",
            message="set either value or valueFrom, not both",
            check=lambda e: e.value is None or e.value_from is None,
        ),
    )


class Toleration(APIModel):
    """A toleration, as in a Pod spec."""

    key: str | None = Field(default=None, description="Taint key the toleration applies to; empty matches all.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal (the default on the server: Equal)."
    )
    value: str | None = Field(default=None, description="Taint value to match when operator is Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        default=None, description="For NoExecute: how long the pod stays bound after the taint appears."
    )


class SecretKeyRef(APIModel):
    """A key in a Secret of the same namespace."""

    name: Name = Field(description="Name of the Secret.")
    key: str = Field(default="token", min_length=1, description="Key inside the Secret.")


class LocalObjectReference(APIModel):
    """A reference to an object in the same namespace."""

    name: Name = Field(description="Name of the referenced object.")


# ---------------------------------------------------------------------------------------------
# Model


class PVCSource(APIModel):
    """Model weights on a PersistentVolumeClaim, mounted read-only into every engine."""

    claim_name: Name = Field(description="Name of the PersistentVolumeClaim holding the weights.")
    path: str = Field(
        default="",
        max_length=1024,
        description="Directory of the model inside the volume; vLLM loads from /models/<path>.",
    )


class HubSource(APIModel):
    """Model weights downloaded from the Hugging Face Hub by each engine at start-up."""

    revision: str | None = Field(default=None, description="Branch, tag or commit to download (--revision).")
    cache_size_limit: Quantity | None = Field(
        default=None, description="Size limit of the emptyDir the weights are downloaded into."
    )


class ModelSource(APIModel):
    """Where engines load the model weights from: exactly one of pvc or hub."""

    pvc: PVCSource | None = Field(default=None, description="Load from a PersistentVolumeClaim.")
    hub: HubSource | None = Field(default=None, description="Download from the Hugging Face Hub.")

    rules = (
        Rule(
            cel="has(self.pvc) != has(self.hub)",
            message="model.source needs exactly one of pvc or hub",
            check=lambda s: (s.pvc is None) != (s.hub is None),
        ),
    )


class ModelSpec(APIModel):
    """The model every engine of the pool serves."""

    name: str = Field(
        min_length=1,
        max_length=256,
        description="Model name as vLLM takes it (Hugging Face id, e.g. meta-llama/Llama-3.1-8B-Instruct). "
        "Immutable: prefill and decode must serve the same weights for the KV cache to be valid.",
    )
    served_model_name: str | None = Field(
        default=None,
        max_length=256,
        description="Name clients use in requests (--served-model-name). Defaults to name.",
    )
    source: ModelSource = Field(
        default_factory=lambda: ModelSource(hub=HubSource()),
        description="Where the weights come from. Defaults to downloading from the Hub.",
    )
    hf_token_secret_ref: SecretKeyRef | None = Field(
        default=None, description="Secret key holding a Hugging Face token (HF_TOKEN) for gated models."
    )
    max_model_len: int | None = Field(
        default=None, ge=16, description="Maximum context length (--max-model-len); vLLM's default if unset."
    )

    rules = (
        Rule(
            cel="self.name == oldSelf.name",
            message="model.name is immutable: create a new DisaggregatedServing to serve another model",
            check_transition=lambda old, new: old.name == new.name,
            field_path=".name",
        ),
    )

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.name


# ---------------------------------------------------------------------------------------------
# Engine


#: What engines compute on, spelled as vLLM spells devices (kv_buffer_device).
Device = Literal["cuda", "cpu"]
#: VLLM_CPU_OMP_THREADS_BIND: auto, nobind, or CPU lists (`0-31`, `0,2,4`) one per local rank, split by `|`.
_CPU_LIST: Final = r"[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*"
THREADS_BIND_PATTERN: Final = rf"^(auto|nobind|{_CPU_LIST}([|]{_CPU_LIST})*)$"


class CPUEngineSpec(APIModel):
    """Settings of vLLM's CPU backend (engine.device cpu), rendered as its environment variables."""

    kv_cache_space_gib: int = Field(
        default=4,
        ge=1,
        le=65536,
        alias="kvCacheSpaceGiB",
        description="VLLM_CPU_KVCACHE_SPACE: host memory for each engine's KV cache, in whole GiB (vLLM takes no "
        "fractions). Count it in the pod's memory request with the weights.",
    )
    threads_bind: str = Field(
        default="auto",
        max_length=1024,
        pattern=THREADS_BIND_PATTERN,
        description="VLLM_CPU_OMP_THREADS_BIND: auto binds each rank's OpenMP threads to the CPUs the pod may "
        "use on one NUMA node (with the kubelet's static CPU manager, a pod whose integer CPU request equals "
        "its limit gets exclusive cores); nobind leaves threads unbound; or CPU lists such as 0-31 or "
        "0-15|16-31, one per local rank.",
    )


class EngineSpec(APIModel):
    """The vLLM engine image and settings shared by prefill and decode."""

    image: str = Field(
        default="vllm/vllm-openai:v0.33.0",
        min_length=1,
        description="Engine container image (an official vLLM image or the one in engine-image/).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy of the engine containers."
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=16, description="Secrets for pulling the engine image."
    )
    vllm_version: str = Field(
        default=vllm.format_version(vllm.LATEST),
        pattern=vllm.VERSION_PATTERN,
        max_length=16,
        description="vLLM release of the image (MAJOR.MINOR). Decides the kv-transfer-config fields "
        "and connectors that are valid; must match the image.",
    )
    port: Port = Field(default=8000, description="HTTP port of the OpenAI-compatible server in each engine.")
    extra_args: list[str] = Field(
        default_factory=list, max_length=128, description="Extra `vllm serve` arguments for both roles."
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=128, description="Extra environment variables for both roles."
    )

    device: Device = Field(
        default="cuda",
        description="What the engines compute on: cuda (NVIDIA GPUs), or cpu (vLLM's CPU backend on x86 or Arm "
        "nodes without GPUs; the image must be a vLLM CPU build, e.g. "
        "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo). A cpu pool requests no GPUs, stages the KV cache in "
        "host memory (kvTransfer.bufferDevice cpu) and needs a NIXL connector: docs/cpu.md.",
    )
    cpu: CPUEngineSpec | None = Field(
        default=None, description="vLLM CPU backend settings (device cpu only; defaults apply when unset)."
    )

    rules = (
        Rule(
            cel="!has(self.cpu) || self.device == 'cpu'",
            message="engine.cpu applies only to engine.device cpu",
            check=lambda e: e.cpu is None or e.device == "cpu",
            field_path=".cpu",
        ),
        Rule(
            cel=f"!self.vllmVersion.matches('{vllm.BEFORE_OLDEST_REGEX}')",
            message=f"engine.vllmVersion must be at least {vllm.format_version(vllm.OLDEST_SUPPORTED)}: older "
            "releases lack the V1 KV-connector API the operator renders for",
            check=lambda e: vllm.parse_version(e.vllm_version) >= vllm.OLDEST_SUPPORTED,
            field_path=".vllmVersion",
        ),
    )


# ---------------------------------------------------------------------------------------------
# KV transfer


class Connector(StrEnum):
    NIXL = "NixlConnector"
    NIXL_PUSH = "NixlPushConnector"
    MOONCAKE = "MooncakeConnector"
    LMCACHE = "LMCacheConnectorV1"
    P2P_NCCL = "P2pNcclConnector"

    @property
    def is_nixl(self) -> bool:
        return self in (Connector.NIXL, Connector.NIXL_PUSH)


#: A PCI address as vLLM's vllm_net_devices.normalize_pci reads it: [domain:]bus:device.function (hex).
PCI_BDF_PATTERN: Final = r"^(0[xX])?([0-9a-fA-F]{1,8}:)?[0-9a-fA-F]{1,2}:[01]?[0-9a-fA-F][.][0-7]$"
#: An entry of VLLM_NIC_SELECTION_VARS: an environment variable name, optionally `:<suffix>`.
NIC_SELECTION_VAR_PATTERN: Final = r"^[A-Za-z_][A-Za-z0-9_]*(:[^,]*)?$"


class GPUNICPair(APIModel):
    """One GPU and the NIC its worker should use, by PCI address."""

    gpu: str = Field(pattern=PCI_BDF_PATTERN, max_length=20,
                     description="PCI address of the GPU, e.g. 0000:18:00.0 (domain optional).")
    nic: str = Field(pattern=PCI_BDF_PATTERN, max_length=20,
                     description="PCI address of the RDMA NIC, e.g. 0000:19:00.0 (domain optional).")


class RDMASpec(APIModel):
    """RDMA devices for the KV transfer. When set, engines request the device resource, get the
    IPC_LOCK capability and UCX is told to use RDMA transports."""

    resource_name: str = Field(
        default="rdma/ib",
        min_length=1,
        max_length=253,
        description="Extended resource of the RDMA device plugin on your nodes (e.g. rdma/ib, "
        "rdma/roce_gdr, nvidia.com/hostdev).",
    )
    per_replica: int = Field(default=1, ge=1, le=64, description="RDMA devices requested by each engine pod.")
    gpu_nic_mapping: list[GPUNICPair] = Field(
        default_factory=list,
        max_length=64,
        description="Which NIC each GPU of a node uses (vLLM 0.23 and later): rendered as "
        "VLLM_GPU_NIC_PCIE_MAPPING, and each engine worker then sets the variables of nicSelectionVars "
        "to its GPU's RDMA device. PCI addresses are per node type: read them with `nvidia-smi topo -m` "
        "and `lspci`. Empty: every worker uses the same devices (ucx.netDevices or UCX's choice).",
    )
    nic_selection_vars: list[Annotated[str, Field(pattern=NIC_SELECTION_VAR_PATTERN, max_length=256)]] = Field(
        default_factory=lambda: ["UCX_NET_DEVICES:1"],
        min_length=1,
        max_length=16,
        description="VLLM_NIC_SELECTION_VARS, with gpuNicMapping: the variables each worker sets to its "
        "GPU's RDMA device, each NAME or NAME:<suffix> (the suffix is appended to the device name: "
        "UCX_NET_DEVICES:1 selects port 1 for UCX, which NIXL and LMCache use).",
    )

    rules = (
        Rule(
            cel="self.gpuNicMapping.all(m, self.gpuNicMapping.exists_one(n, n.gpu == m.gpu))",
            message="kvTransfer.rdma.gpuNicMapping lists a GPU more than once",
            check=lambda r: len({m.gpu.lower() for m in r.gpu_nic_mapping}) == len(r.gpu_nic_mapping),
            field_path=".gpuNicMapping",
        ),
    )


class UCXSpec(APIModel):
    """UCX settings for NIXL-based transfers."""

    tls: str | None = Field(
        default=None,
        max_length=256,
        description="UCX_TLS. Defaults to rc,cuda_copy,cuda_ipc with RDMA and to tcp,cuda_copy,cuda_ipc "
        "without (so a missing RDMA device fails loudly instead of silently using TCP).",
    )
    net_devices: str | None = Field(
        default=None, max_length=256, description="UCX_NET_DEVICES (e.g. mlx5_0:1). UCX picks when unset."
    )


#: NIXL plugin names, as NIXL spells them: vLLM passes `backends` to NIXL unchanged, and NIXL's
#: Mooncake plugin is `Mooncake` (a plugin name NIXL does not know fails the agent's creation).
NixlBackend = Literal["UCX", "LIBFABRIC", "GDS", "Mooncake"]


class NixlSpec(APIModel):
    """Settings of NixlConnector and NixlPushConnector."""

    backends: list[NixlBackend] = Field(
        default_factory=lambda: list[NixlBackend](["UCX"]),
        min_length=1,
        max_length=4,
        description="NIXL backends, in order, spelled as NIXL names its plugins: UCX, LIBFABRIC, GDS, Mooncake.",
    )
    side_channel_port: Port = Field(
        default=5600,
        description="VLLM_NIXL_SIDE_CHANNEL_PORT: the handshake port on every engine (plus the "
        "data-parallel rank).",
    )


class MooncakeSpec(APIModel):
    """Settings of MooncakeConnector."""

    protocol: Literal["rdma", "tcp"] = Field(default="rdma", description="Mooncake transfer protocol.")
    device_name: str | None = Field(
        default=None, max_length=256, description="RDMA device(s) Mooncake uses (auto-detected when unset)."
    )
    num_workers: int | None = Field(default=None, ge=1, le=256, description="Transfer worker threads.")
    bootstrap_port: Port = Field(
        default=8998, description="VLLM_MOONCAKE_BOOTSTRAP_PORT on prefill engines (the decode side dials it)."
    )


#: LMCache P/D (enable_pd): the port the prefillers' senders notify (pd_proxy_port), on the proxy
#: Service. The render points prefill engines at it and the proxy listens on it: one number for both.
LMCACHE_PD_PROXY_PORT: Final = 7500
#: The first ports of a decode engine's LMCache receiver (pd_peer_init_port, pd_peer_alloc_port): one
#: of each per tensor-parallel rank, counting up from these (the values of vLLM's LMCache P/D example).
LMCACHE_PD_PEER_INIT_PORT: Final = 7300
LMCACHE_PD_PEER_ALLOC_PORT: Final = 7400


class LMCacheSpec(APIModel):
    """Settings of LMCacheConnectorV1."""

    config_map_ref: LocalObjectReference = Field(
        description="ConfigMap with the LMCache configuration: key prefill.yaml for prefill engines and "
        "decode.yaml for decode engines (mounted as LMCACHE_CONFIG_FILE). For P/D they need enable_pd, "
        "transfer_channel, pd_role, pd_buffer_size and pd_buffer_device; decode.yaml also pd_peer_init_port "
        "and pd_peer_alloc_port (one per tensor-parallel rank from 7300 and 7400). The hosts and the proxy "
        "port are rendered as LMCACHE_* variables (docs/connectors.md)."
    )
    python_hash_seed: str = Field(
        default="0",
        pattern=r"^[0-9]+$",
        max_length=10,
        description="PYTHONHASHSEED on both roles: LMCache keys must hash the same on prefill and decode.",
    )


class P2pNcclSpec(APIModel):
    """Settings of P2pNcclConnector (vLLM <= 0.23)."""

    send_type: Literal["PUT", "GET", "PUT_ASYNC"] = Field(
        default="PUT_ASYNC", description="NCCL send mode: PUT and PUT_ASYNC push from prefill, GET pulls."
    )
    proxy_port: Port = Field(default=30001, description="ZMQ port of the proxy instances register with.")
    buffer_size: Quantity = Field(
        default="8G",
        description="kv_buffer_size of decode engines (and of prefill engines with sendType GET): GPU "
        "memory reserved for received KV.",
    )
    nccl_num_channels: int = Field(default=16, ge=1, le=64, description="NCCL channels per transfer.")


_CONNECTOR_BLOCKS: Final = {
    "nixl": (Connector.NIXL, Connector.NIXL_PUSH),
    "mooncake": (Connector.MOONCAKE,),
    "lmcache": (Connector.LMCACHE,),
    "p2pNccl": (Connector.P2P_NCCL,),
}


def _block_rule(block: str, connectors: tuple[Connector, ...]) -> Rule:
    allowed = " || ".join(f"self.connector == '{c.value}'" for c in connectors)
    names = " or ".join(c.value for c in connectors)
    attr = {"p2pNccl": "p2p_nccl"}.get(block, block)
    return Rule(
        cel=f"!has(self.{block}) || {allowed}",
        message=f"kvTransfer.{block} applies only to {names}",
        check=lambda k: getattr(k, attr) is None or k.connector in connectors,
        field_path=f".{block}",
    )


class KVTransferSpec(APIModel):
    """How prefill hands the KV cache to decode (vLLM's --kv-transfer-config)."""

    connector: Connector = Field(
        default=Connector.NIXL,
        description="KV connector. NixlConnector (pull) suits most clusters; P2pNcclConnector exists only "
        "up to vLLM 0.23. Immutable: pools of different connectors cannot exchange KV.",
    )
    buffer_device: Device | None = Field(
        default=None,
        description="kv_buffer_device: cuda transfers from GPU memory; cpu stages through host memory "
        "(NIXL host-buffer mode). Defaults to engine.device; a cpu pool takes only cpu.",
    )
    load_failure_policy: Literal["fail", "recompute"] = Field(
        default="fail",
        description="kv_load_failure_policy: what decode does when the KV cannot be loaded: fail the "
        "request, or recompute the prompt locally (slower, counted in metrics).",
    )
    extra_config: FreeForm = Field(
        default_factory=dict,
        description="Merged last into kv_connector_extra_config (overrides what the operator renders).",
    )
    rdma: RDMASpec | None = Field(default=None, description="RDMA devices for the transfer; TCP when unset.")
    ucx: UCXSpec = Field(default_factory=UCXSpec, description="UCX settings (NIXL connectors).")
    nixl: NixlSpec | None = Field(default=None, description="NIXL settings (NIXL connectors only).")
    mooncake: MooncakeSpec | None = Field(default=None, description="Mooncake settings (MooncakeConnector only).")
    lmcache: LMCacheSpec | None = Field(
        default=None, description="LMCache settings; required with LMCacheConnectorV1."
    )
    p2p_nccl: P2pNcclSpec | None = Field(
        default=None, alias="p2pNccl", description="P2pNccl settings (P2pNcclConnector only)."
    )

    rules = (
        Rule(
            cel="self.connector == oldSelf.connector",
            message="kvTransfer.connector is immutable: running pools cannot switch connectors in place; "
            "create a new DisaggregatedServing",
            check_transition=lambda old, new: old.connector == new.connector,
            field_path=".connector",
        ),
        Rule(
            cel="self.connector != 'LMCacheConnectorV1' || has(self.lmcache)",
            message="LMCacheConnectorV1 needs kvTransfer.lmcache.configMapRef",
            check=lambda k: k.connector != Connector.LMCACHE or k.lmcache is not None,
            field_path=".lmcache",
        ),
        Rule(
            cel="!has(self.bufferDevice) || self.bufferDevice == 'cuda' || self.connector == 'NixlConnector' "
            "|| self.connector == 'NixlPushConnector'",
            message="bufferDevice cpu (host-buffer mode) is supported only by the NIXL connectors",
            check=lambda k: k.buffer_device != "cpu" or k.connector.is_nixl,
            field_path=".bufferDevice",
        ),
        *(_block_rule(block, connectors) for block, connectors in _CONNECTOR_BLOCKS.items()),
    )

    @property
    def nixl_settings(self) -> NixlSpec:
        return self.nixl or NixlSpec()

    @property
    def mooncake_settings(self) -> MooncakeSpec:
        return self.mooncake or MooncakeSpec()

    @property
    def p2p_nccl_settings(self) -> P2pNcclSpec:
        return self.p2p_nccl or P2pNcclSpec()


# ---------------------------------------------------------------------------------------------
# Roles


class GPUSpec(APIModel):
    """GPUs of one engine pod."""

    resource_name: str = Field(
        default="nvidia.com/gpu", min_length=1, max_length=253, description="Extended resource of the GPUs."
    )
    count: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="GPUs per pod. Defaults to tensorParallelSize x pipelineParallelSize x "
        "dataParallelSize; when set it must equal that product.",
    )
    product: str | None = Field(
        default=None,
        max_length=128,
        description="GPU model to run on, matched against the node label nvidia.com/gpu.product "
        "(e.g. NVIDIA-H200).",
    )


class ComputeResources(APIModel):
    """CPU and memory of a container (requests; memory is also the limit)."""

    cpu: Quantity | None = Field(default=None, description="CPU request.")
    memory: Quantity | None = Field(default=None, description="Memory request and limit.")


class ProbeSpec(APIModel):
    """Health-check budgets of engine pods (all probes use GET /health)."""

    startup_timeout_seconds: int = Field(
        default=1800,
        ge=30,
        le=14400,
        description="How long an engine may take to load the model before it is restarted. vLLM serves "
        "HTTP only after loading, which takes minutes for large models.",
    )
    period_seconds: int = Field(default=10, ge=1, le=300, description="Probe period.")
    failure_threshold: int = Field(
        default=3, ge=1, le=30, description="Consecutive failures after start-up before liveness restarts."
    )


class UpdateStrategySpec(APIModel):
    """Rolling update of a GPU pool."""

    max_surge: IntOrPercent = Field(
        default=1,
        description="Extra pods during a rollout. 1 by default, with maxUnavailable 0: each replacement is Ready "
        "before the pod it replaces stops, so a pool of one never goes without a serving pod. Without a spare "
        "GPU the replacement waits Pending while the old pods serve on; maxSurge 0 with maxUnavailable 1 rolls "
        "in place instead, one pod down at a time.",
    )
    max_unavailable: IntOrPercent = Field(
        default=0, description="Pods that may be down during a rollout (see maxSurge)."
    )


class RoleSpec(APIModel):
    """One engine pool: prefill (kv_producer) or decode (kv_consumer)."""

    replicas: int = Field(
        default=1, ge=0, le=1024, description="Engine pods. Set by the autoscaler when autoscaling.mode is Auto."
    )
    tensor_parallel_size: int = Field(default=1, ge=1, le=MAX_TENSOR_PARALLEL, description="--tensor-parallel-size.")
    pipeline_parallel_size: int = Field(default=1, ge=1, le=64, description="--pipeline-parallel-size.")
    data_parallel_size: int = Field(
        default=1, ge=1, le=MAX_DATA_PARALLEL, description="--data-parallel-size, all ranks inside one pod."
    )
    gpu: GPUSpec = Field(default_factory=GPUSpec, description="GPUs of each pod.")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the pods must match (added to the GPU product label)."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=64, description="Tolerations (e.g. for a GPU node taint)."
    )
    affinity: FreeForm | None = Field(default=None, description="Affinity, as in a Pod spec.")
    resources: ComputeResources = Field(
        default_factory=ComputeResources, description="CPU and memory of the engine container."
    )
    shm_size: Quantity = Field(
        default="16Gi",
        description="Size of the memory-backed /dev/shm (NCCL and NIXL use shared memory).",
    )
    extra_args: list[str] = Field(
        default_factory=list, max_length=128, description="Extra `vllm serve` arguments for this role."
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=128, description="Extra environment variables for this role."
    )
    probes: ProbeSpec = Field(default_factory=ProbeSpec, description="Health-check budgets.")
    drain_timeout_seconds: int = Field(
        default=60,
        ge=0,
        le=3600,
        description="On pod deletion, the longest the engine keeps serving before vLLM is stopped; it stops "
        f"earlier once it has been idle for {ENGINE_DRAIN_QUIET_SECONDS} s (the proxy sends a terminating pod new "
        "requests only while its role has no other ready instance).",
    )
    update_strategy: UpdateStrategySpec = Field(
        default_factory=UpdateStrategySpec, description="Rolling update of this pool."
    )
    pod_annotations: dict[str, str] = Field(default_factory=dict, description="Extra annotations on the pods.")
    nodes_per_replica: int = Field(
        default=1, ge=1, le=MAX_NODES_PER_REPLICA,
        description="Nodes (pods) one replica spans. 1: a Deployment, one pod per replica. Above 1: a "
        "LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, which the cluster must serve), one group of pods per "
        "replica: the leader runs the API server and the workers join it; each pod gets tensorParallelSize x "
        "pipelineParallelSize x dataParallelSize / nodesPerReplica GPUs. With dataParallelSize 1 the "
        "tensor and pipeline ranks are spread over the nodes; above 1 the data-parallel ranks are.",
    )
    topology_key: LabelName | None = Field(
        default=None,
        description="With nodesPerReplica above 1: a node label (a rack, an NVLink domain, e.g. "
        "nvidia.com/gpu.clique) whose domains each hold one replica's pods, and only them (LeaderWorkerSet's "
        "exclusive placement). Unset: the pods of a replica may land anywhere.",
    )

    rules = (
        Rule(
            cel="!has(self.gpu.count) || self.gpu.count * self.nodesPerReplica == "
            "self.tensorParallelSize * self.pipelineParallelSize * self.dataParallelSize",
            message="gpu.count must equal tensorParallelSize x pipelineParallelSize x dataParallelSize / "
            "nodesPerReplica (the GPUs of each pod)",
            check=lambda r: r.gpu.count is None or r.gpu.count * r.nodes_per_replica == r.parallel_gpus,
            field_path=".gpu.count",
        ),
        Rule(
            cel="self.dataParallelSize > 1 ? self.dataParallelSize % self.nodesPerReplica == 0 : "
            "(self.tensorParallelSize * self.pipelineParallelSize) % self.nodesPerReplica == 0",
            message="nodesPerReplica must divide dataParallelSize (its ranks are spread over the nodes) or, with "
            "dataParallelSize 1, tensorParallelSize x pipelineParallelSize (vLLM requires the world size to "
            "divide by --nnodes)",
            check=lambda r: (r.data_parallel_size % r.nodes_per_replica == 0 if r.data_parallel_size > 1
                             else (r.tensor_parallel_size * r.pipeline_parallel_size) % r.nodes_per_replica == 0),
            field_path=".nodesPerReplica",
        ),
        Rule(
            cel="!has(self.topologyKey) || self.nodesPerReplica > 1",
            message="topologyKey places the pods of a multi-node replica: it needs nodesPerReplica above 1",
            check=lambda r: r.topology_key is None or r.nodes_per_replica > 1,
            field_path=".topologyKey",
        ),
    )

    @property
    def parallel_gpus(self) -> int:
        """GPUs of one replica's engine: its tensor x pipeline x data-parallel world."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def multi_node(self) -> bool:
        return self.nodes_per_replica > 1

    @property
    def gpus(self) -> int:
        """GPUs of each pod."""
        return self.gpu.count or self.parallel_gpus // self.nodes_per_replica

    @property
    def gpus_per_replica(self) -> int:
        """GPUs of one replica (all the pods of its group)."""
        return self.gpus * self.nodes_per_replica


# ---------------------------------------------------------------------------------------------
# Proxy


class RoutingPolicy(StrEnum):
    LEAST_LOADED = "LeastLoaded"
    POWER_OF_TWO = "PowerOfTwo"
    ROUND_ROBIN = "RoundRobin"
    KV_AWARE = "KVAware"


class KVIndex(StrEnum):
    """Where a KVAware proxy learns what each engine caches."""

    EVENTS = "Events"
    ROUTED = "Routed"


#: KVAware with the Events index: the engines publish their KV events on this port (plus the
#: data-parallel rank, as vLLM offsets it) and answer replays on the second (plus the rank). Clear of
#: NIXL's side channel (5600 + rank), LMCache's (7300/7400 + rank) and P2pNccl's (14579 + rank).
KV_EVENTS_PORT: Final = 7557
KV_EVENTS_REPLAY_PORT: Final = KV_EVENTS_PORT + 100
#: The topic the engines publish their KV events under and the proxy subscribes to.
KV_EVENTS_TOPIC: Final = "kv-events"
#: The first release whose KV events and block hashing were checked against the proxy's decoder and
#: hashing (vllm/config/kv_events.py, vllm/distributed/kv_events.py of the 0.13.0 wheel on).
KV_EVENTS_CHECKED_FROM: Final[vllm.VersionTuple] = (0, 13)
KV_EVENTS_BEFORE_REGEX: Final = r"^0[.]([0-9]|1[0-2])([.][0-9]+)?$"


class KVAwareSpec(APIModel):
    """KVAware routing: each prompt goes where most of its prefix is cached, weighed against load."""

    index: KVIndex = Field(
        default=KVIndex.EVENTS,
        description="What the proxy knows the engines cache: Events (each engine's own KV events, which the "
        "operator turns on: exact, and the same in every proxy replica; the engines must hash with sha256 or "
        "sha256_cbor, and before vLLM 0.32 need PYTHONHASHSEED in engine.env) or Routed (what this proxy sent "
        "where, forgotten ttlSeconds later: approximate, for engines that cannot publish events).",
    )
    kv_weight: float = Field(
        default=1.0, ge=0, le=1000,
        description="Prefill: an instance's score is its expected compute outstanding (prompt tokens sent "
        "less those expected cached) plus kvWeight times the prompt tokens it does not hold. 0 ignores "
        "the cache (least expected compute).",
    )
    decode_credit: float = Field(
        default=1.0, ge=0, le=1000,
        description="Decode: an instance's score is its outstanding requests less decodeCredit times the "
        "share of the prompt it holds (blocks it holds are not transferred).",
    )
    ttl_seconds: int = Field(
        default=600, ge=1, le=86400,
        description="Routed: a prompt's blocks are forgotten this long after the last request that sent them.",
    )
    index_blocks: int = Field(
        default=131072, ge=1024, le=16777216,
        description="Most blocks the proxy indexes per engine, and with the Events index per data-parallel rank "
        "of it (about 76 bytes a block with Events, 140 with Routed); the least recently seen are forgotten first.",
    )


class ProxySpec(APIModel):
    """The routing proxy: prefill first, then decode with the KV hand-off parameters."""

    replicas: int = Field(default=2, ge=0, le=64, description="Proxy pods.")
    port: Port = Field(default=8000, description="Port of the proxy Service and containers.")
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        default="ClusterIP", description="Type of the proxy Service."
    )
    routing_policy: RoutingPolicy = Field(
        default=RoutingPolicy.LEAST_LOADED,
        description="How instances are picked: LeastLoaded (fewest outstanding requests or prompt tokens, "
        "ties broken randomly), PowerOfTwo (least loaded of two random picks), RoundRobin, or KVAware "
        "(where the prompt's prefix is cached, weighed against load: see kvAware).",
    )
    kv_aware: KVAwareSpec = Field(
        default_factory=KVAwareSpec, description="KVAware routing's index and weights (used with that policy)."
    )
    image: str | None = Field(
        default=None, description="Proxy image. Defaults to the operator's own image (it runs `xpyd proxy`)."
    )
    api_key_secret_ref: SecretKeyRef | None = Field(
        default=None, description="Secret key holding an API key the proxy requires from clients."
    )
    resources: ComputeResources = Field(
        default_factory=lambda: ComputeResources(cpu="1", memory="512Mi"),
        description="CPU and memory of a proxy container.",
    )
    extra_args: list[str] = Field(default_factory=list, max_length=64, description="Extra `xpyd proxy` arguments.")


# ---------------------------------------------------------------------------------------------
# Autoscaling


class AutoscalingMode(StrEnum):
    OFF = "Off"
    RECOMMEND = "Recommend"
    AUTO = "Auto"


class CABundleRef(APIModel):
    """A key of a Secret or ConfigMap in the same namespace holding PEM-encoded CA certificates."""

    name: Name = Field(description="Name of the Secret (caSecretRef) or ConfigMap (caConfigMapRef).")
    key: str = Field(
        default="ca.crt",
        min_length=1,
        description="Key holding the PEM bundle (ca.crt in cert-manager Secrets and in the kube-root-ca.crt "
        "ConfigMap).",
    )


class PrometheusTLS(APIModel):
    """How the autoscaler verifies the certificate of an https Prometheus; without a CA, against the
    public CAs the operator ships (the Mozilla bundle of certifi). At most one of caSecretRef,
    caConfigMapRef and insecureSkipVerify."""

    ca_secret_ref: CABundleRef | None = Field(
        default=None, description="Secret key with the CA certificates the server's certificate must chain to."
    )
    ca_config_map_ref: CABundleRef | None = Field(
        default=None, description="ConfigMap key with the CA certificates the server's certificate must chain to."
    )
    insecure_skip_verify: bool = Field(
        default=False, description="Accept any server certificate (no verification): for testing only."
    )

    rules = (
        Rule(
            cel="(has(self.caSecretRef) ? 1 : 0) + (has(self.caConfigMapRef) ? 1 : 0) + "
            "(self.insecureSkipVerify ? 1 : 0) <= 1",
            message="autoscaling.prometheus.tls takes at most one of caSecretRef, caConfigMapRef and "
            "insecureSkipVerify",
            check=lambda t: sum((t.ca_secret_ref is not None, t.ca_config_map_ref is not None,
                                 t.insecure_skip_verify)) <= 1,
        ),
    )


class PrometheusSpec(APIModel):
    """Where the autoscaler reads engine metrics, and how it authenticates (Prometheus behind an
    authenticating proxy, Thanos Querier, a managed Prometheus)."""

    url: str = Field(
        default="",
        max_length=2048,
        description="Prometheus base URL (e.g. http://prometheus.monitoring:9090); required unless mode is Off.",
    )
    window_seconds: int = Field(
        default=60,
        ge=15,
        le=3600,
        description="Range of the rate() and histogram_quantile() windows the autoscaler reads; at least four "
        "scrape intervals.",
    )
    bearer_token_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding a token the autoscaler sends in an `Authorization: Bearer` header "
        "(surrounding whitespace is trimmed). The operator reads the Secret at every decision.",
    )
    tls: PrometheusTLS | None = Field(
        default=None,
        description="Verification of the server's certificate (only with an https url); without it, the "
        "certificate must chain to a public CA.",
    )

    rules = (
        Rule(
            cel="!has(self.tls) || self.url.startsWith('https://')",
            message="autoscaling.prometheus.tls needs an https:// url",
            check=lambda p: p.tls is None or p.url.startswith("https://"),
            field_path=".tls",
        ),
    )


class ProfileSpec(APIModel):
    """The engines' measured performance the autoscaler sizes replicas with (corrected online from what
    the pool delivers). At most one of name and configMap; neither: a roofline estimate from the model's
    shape and the GPU product (only for models and GPUs `xpyd plan` knows)."""

    name: str = Field(
        default="",
        max_length=253,
        pattern=r"^([a-z0-9][a-z0-9_.-]*)?$",
        description="A profile shipped with the operator, e.g. h200_llama31_8b_fp8_tp1.",
    )
    config_map: str = Field(
        default="",
        max_length=253,
        description="A ConfigMap in the object's namespace whose keys prefill.csv and decode.csv hold a measured "
        "profile (the format of `xpyd sim --profile`).",
    )
    max_kv_tokens: int | None = Field(
        default=None, ge=1, le=1 << 30,
        description="KV-cache capacity (tokens) of one engine while the profile was measured; default: the "
        "bundled profile's.",
    )

    rules = (
        Rule(
            cel="size(self.name) == 0 || size(self.configMap) == 0",
            message="autoscaling.profile takes at most one of name and configMap",
            check=lambda p: not (p.name and p.config_map),
        ),
    )


class SLOSpec(APIModel):
    """Latency targets the autoscaler keeps."""

    ttft_ms: int = Field(default=500, ge=1, le=600000, description="Time-to-first-token target, milliseconds.")
    tpot_ms: int = Field(default=50, ge=1, le=60000, description="Time-per-output-token target, milliseconds.")
    percentile: Literal[50, 90, 95, 99] = Field(
        default=90, description="Percentile the targets apply to (without an attainment target).")
    attainment: float | None = Field(
        default=None, ge=0.5, le=0.999,
        description="Target attainment: the share of requests that must meet both targets, e.g. 0.95. The "
        "autoscaler then sizes each target at this share (instead of percentile), holds the load headroom that "
        "reaches it, learnt from the attainment it measures, and paces scale-down by it. Unset: no learnt headroom.",
    )


class ReplicaBounds(APIModel):
    """Replica bounds of one role under autoscaling."""

    min_replicas: int = Field(default=1, ge=0, le=1024, description="Fewest replicas.")
    max_replicas: int = Field(default=8, ge=1, le=1024, description="Most replicas.")

    rules = (
        Rule(
            cel="self.minReplicas <= self.maxReplicas",
            message="minReplicas must not exceed maxReplicas",
            check=lambda b: b.min_replicas <= b.max_replicas,
        ),
    )


class ScalingRules(APIModel):
    """Pace of scaling in one direction."""

    stabilization_window_seconds: int | None = Field(
        default=None, ge=0, le=3600,
        description="Decisions act on the extreme recommendation over this window. Unset: 0 for scale-up; for "
        "scale-down 300, or with slo.attainment set, from 60 (attainment 0.80 and under) to 300 (0.95 and over): a "
        "looser target gives capacity back sooner.",
    )
    max_step: int = Field(ge=1, le=64, description="Most replicas one decision adds or removes per role.")


class ScalingBehavior(APIModel):
    """Fast up, slow down."""

    scale_up: ScalingRules = Field(
        default_factory=lambda: ScalingRules(stabilization_window_seconds=0, max_step=4),
        description="Scale-up pace.",
    )
    scale_down: ScalingRules = Field(
        default_factory=lambda: ScalingRules(max_step=1),
        description="Scale-down pace (its window follows slo.attainment unless set).",
    )


#: Waiting-room defaults of a pool that scales to zero (per proxy replica).
DEFAULT_MAX_WAITING_REQUESTS: Final = 256
DEFAULT_MAX_WAITING_BYTES: Final = 64 * 1024 * 1024


class ScaleToZeroSpec(APIModel):
    """Scaling a pool to zero and back, for a pool with minReplicas 0 on both roles (mode Auto): how
    long it must be idle first, and the waiting room in which each proxy holds requests while
    prefill and decode start again."""

    idle_seconds: int = Field(
        default=600, ge=10, le=86400,
        description="Seconds without any request arriving, running or waiting (measured from the first "
        "decision that sees the pool idle) before both roles go to zero; at least intervalSeconds.",
    )
    max_waiting_requests: int = Field(
        default=DEFAULT_MAX_WAITING_REQUESTS, ge=1, le=65536,
        description="Requests each proxy holds while no prefill and decode pair is ready; more get 429 at once.",
    )
    max_waiting_bytes: int = Field(
        default=DEFAULT_MAX_WAITING_BYTES, ge=1024, le=1 << 30,
        description="Request body bytes each proxy holds while no pair is ready; more get 429 at once.",
    )
    wait_seconds: int | None = Field(
        default=None, ge=1, le=86400,
        description="How long a held request waits for a ready prefill and decode pair before it gets 503 "
        "with Retry-After; more than startupSeconds. Default: 2 x startupSeconds + 60.",
    )


#: `autoscaling.reactSeconds`' default: the gauges are read every 5 s between decisions, as Dynamo's
#: load-based planner reads them (the simulator's `xpyd` policy reacts at the same cadence).
DEFAULT_REACT_SECONDS: Final = 5


class AutoscalingSpec(APIModel):
    """SLO-driven scaling of prefill and decode."""

    mode: AutoscalingMode = Field(
        default=AutoscalingMode.OFF,
        description="Off: spec replicas rule. Recommend: compute and report, never scale. Auto: the "
        "operator sets prefill and decode replicas.",
    )
    prometheus: PrometheusSpec = Field(default_factory=PrometheusSpec, description="Metrics source.")
    slo: SLOSpec = Field(default_factory=SLOSpec, description="Latency targets.")
    prefill: ReplicaBounds = Field(
        default_factory=lambda: ReplicaBounds(min_replicas=1, max_replicas=8), description="Prefill bounds."
    )
    decode: ReplicaBounds = Field(
        default_factory=lambda: ReplicaBounds(min_replicas=1, max_replicas=16), description="Decode bounds."
    )
    gpu_budget: int | None = Field(
        default=None, ge=1, le=65536, description="Most GPUs prefill and decode may use together."
    )
    interval_seconds: int = Field(default=30, ge=5, le=3600, description="Seconds between decisions.")
    react_seconds: int = Field(
        default=DEFAULT_REACT_SECONDS,
        ge=0,
        le=3599,
        description="Between decisions, how often the operator reads the engines' gauges (waiting and running "
        "requests, KV usage) and scales a role up at once when a backlog builds. 0, or intervalSeconds and "
        "more (the next decision comes first): only at decisions. Scale-down stays with the decisions.",
    )
    startup_seconds: int = Field(
        default=120,
        ge=0,
        le=7200,
        description="Expected time from a new replica to serving (model load); scale-ups look this far ahead.",
    )
    behavior: ScalingBehavior = Field(default_factory=ScalingBehavior, description="Pace of scaling.")
    profile: ProfileSpec = Field(default_factory=ProfileSpec, description="Engine performance the sizing starts "
                                 "from.")
    scale_to_zero: ScaleToZeroSpec = Field(
        default_factory=ScaleToZeroSpec,
        description="Used when minReplicas is 0 on both roles: the idle window before both go to zero, and the "
        "proxies' waiting room while they start again.",
    )

    rules = (
        Rule(
            cel="self.mode == 'Off' || size(self.prometheus.url) > 0",
            message="autoscaling.prometheus.url is required when mode is Recommend or Auto",
            check=lambda a: a.mode == AutoscalingMode.OFF or bool(a.prometheus.url),
            field_path=".prometheus.url",
        ),
        Rule(
            cel="(self.prefill.minReplicas == 0) == (self.decode.minReplicas == 0)",
            message="autoscaling: minReplicas 0 scales the pool to zero, which takes both roles (a prefill without "
            "a decode, or the reverse, serves nothing): set minReplicas 0 on prefill and decode, or on neither",
            check=lambda a: (a.prefill.min_replicas == 0) == (a.decode.min_replicas == 0),
        ),
        Rule(
            cel="self.scaleToZero.idleSeconds >= self.intervalSeconds",
            message="autoscaling.scaleToZero.idleSeconds must be at least intervalSeconds: idleness is judged once "
            "per decision",
            check=lambda a: a.scale_to_zero.idle_seconds >= a.interval_seconds,
            field_path=".scaleToZero.idleSeconds",
        ),
        Rule(
            cel="!has(self.scaleToZero.waitSeconds) || self.scaleToZero.waitSeconds > self.startupSeconds",
            message="autoscaling.scaleToZero.waitSeconds must exceed startupSeconds: a request held while the pool "
            "starts from zero would time out before a replica serves it",
            check=lambda a: a.scale_to_zero.wait_seconds is None or a.scale_to_zero.wait_seconds > a.startup_seconds,
            field_path=".scaleToZero.waitSeconds",
        ),
    )

    @property
    def scales_to_zero(self) -> bool:
        """Whether the pool may go to zero and come back: mode Auto and minReplicas 0 on both roles."""
        return (self.mode == AutoscalingMode.AUTO and self.prefill.min_replicas == 0
                and self.decode.min_replicas == 0)

    @property
    def wait_seconds(self) -> int:
        """How long the proxies hold a request for a ready pair (`scaleToZero.waitSeconds`, else its default)."""
        wait = self.scale_to_zero.wait_seconds
        return wait if wait is not None else 2 * self.startup_seconds + 60


# ---------------------------------------------------------------------------------------------
# Spec


def _tp_compatible(spec: DisaggregatedServingSpec) -> bool:
    p, d = spec.prefill.tensor_parallel_size, spec.decode.tensor_parallel_size
    if spec.kv_transfer.connector in (Connector.P2P_NCCL, Connector.LMCACHE):
        return p == d
    return p % d == 0 or d % p == 0


def _p2p_nccl_supported(spec: DisaggregatedServingSpec) -> bool:
    if spec.kv_transfer.connector != Connector.P2P_NCCL:
        return True
    return vllm.parse_version(spec.engine.vllm_version) <= vllm.P2P_NCCL_LAST


def _nixl_push_supported(spec: DisaggregatedServingSpec) -> bool:
    if spec.kv_transfer.connector != Connector.NIXL_PUSH:
        return True
    return vllm.parse_version(spec.engine.vllm_version) >= vllm.NIXL_PUSH_ADDED


def _mooncake_supported(spec: DisaggregatedServingSpec) -> bool:
    if spec.kv_transfer.connector != Connector.MOONCAKE:
        return True
    return vllm.parse_version(spec.engine.vllm_version) >= vllm.MOONCAKE_BOOTSTRAP_ADDED


def _mooncake_device_name_supported(spec: DisaggregatedServingSpec) -> bool:
    mooncake = spec.kv_transfer.mooncake
    if mooncake is None or mooncake.device_name is None:
        return True
    return vllm.parse_version(spec.engine.vllm_version) >= vllm.MOONCAKE_DEVICE_NAME_ADDED


def _gpu_nic_mapping_supported(spec: DisaggregatedServingSpec) -> bool:
    rdma = spec.kv_transfer.rdma
    if rdma is None or not rdma.gpu_nic_mapping:
        return True
    return vllm.parse_version(spec.engine.vllm_version) >= vllm.GPU_NIC_MAPPING_ADDED


def _multi_node_supported(spec: DisaggregatedServingSpec) -> bool:
    if not (spec.prefill.multi_node or spec.decode.multi_node):
        return True
    return (spec.kv_transfer.connector.is_nixl
            and vllm.parse_version(spec.engine.vllm_version) >= vllm.MULTI_NODE_ADDED)


def _nixl_pipeline_supported(spec: DisaggregatedServingSpec) -> bool:
    if not spec.kv_transfer.connector.is_nixl:
        return True
    if spec.decode.pipeline_parallel_size > 1:
        return False
    return (spec.prefill.pipeline_parallel_size == 1
            or vllm.parse_version(spec.engine.vllm_version) >= vllm.NIXL_PIPELINE_PARALLEL_ADDED)


def _cpu_role_rule(role: str) -> Rule:
    """A cpu pool's engines request no GPUs: neither a count nor a GPU model of `role`."""
    return Rule(
        cel=f"self.engine.device != 'cpu' || (!has(self.{role}.gpu.count) && !has(self.{role}.gpu.product))",
        message=f"engine.device cpu requests no GPUs: {role}.gpu.count and {role}.gpu.product must be unset",
        check=lambda s: s.engine.device != "cpu" or (getattr(s, role).gpu.count is None
                                                     and getattr(s, role).gpu.product is None),
        field_path=f".{role}.gpu",
    )


def _gpu_budget_holds(spec: DisaggregatedServingSpec) -> bool:
    budget = spec.autoscaling.gpu_budget
    if budget is None:
        return True
    floor = (
        spec.autoscaling.prefill.min_replicas * spec.prefill.gpus_per_replica
        + spec.autoscaling.decode.min_replicas * spec.decode.gpus_per_replica
    )
    return floor <= budget


def kv_aware_routing(spec: DisaggregatedServingSpec) -> bool:
    """The proxy routes by the engines' prefix caches (routingPolicy KVAware)."""
    return spec.proxy.routing_policy == RoutingPolicy.KV_AWARE


def kv_events_published(spec: DisaggregatedServingSpec) -> bool:
    """The engines publish their KV events for a KVAware proxy (its Events index)."""
    return kv_aware_routing(spec) and spec.proxy.kv_aware.index == KVIndex.EVENTS


def engine_extra_args(spec: DisaggregatedServingSpec, *roles: str) -> list[str]:
    """The engines' extra arguments: engine-wide, then those of `roles`, in order."""
    return [*spec.engine.extra_args, *(arg for role in roles for arg in getattr(spec, role).extra_args)]


#: The `--prefix-caching-hash-algo` values vLLM seeds at random per process unless PYTHONHASHSEED is
#: set, on purpose: xxHash is not collision resistant, so a seed others know lets them make colliding
#: blocks offline (vLLM #12621, `resolve_none_hash_seed`). The Events index would need that seed public.
XXHASH_ALGOS: Final = ("xxhash", "xxhash_cbor")
_HASH_ALGO_FLAG: Final = "--prefix-caching-hash-algo"
#: Seeds vLLM's first block hash (`NONE_HASH`) when set, and Python's str hashing (`random`: at random).
PYTHONHASHSEED: Final = "PYTHONHASHSEED"
_FIXED_NONE_HASH: Final = vllm.format_version(vllm.FIXED_NONE_HASH_ADDED)


def _xxhash_arg(arg: str) -> bool:
    """An engine argument choosing an xxhash algorithm: `--prefix-caching-hash-algo=xxhash...`, or the
    value of `--prefix-caching-hash-algo xxhash` (any argument that is one: CEL cannot pair an argument
    with the next)."""
    return arg in XXHASH_ALGOS or arg.startswith(f"{_HASH_ALGO_FLAG}=xxhash")


def _xxhash_cel(field: str) -> str:
    values = " || ".join(f"a == '{algo}'" for algo in XXHASH_ALGOS)
    return f"{field}.exists(a, {values} || a.startsWith('{_HASH_ALGO_FLAG}=xxhash'))"


def _seeds_only_in_engine_env(spec: DisaggregatedServingSpec) -> bool:
    """PYTHONHASHSEED, where set, is a literal value of engine.env (so both roles' engines share it and
    the render can pass it to the proxy)."""
    return (not any(var.name == PYTHONHASHSEED for var in [*spec.prefill.env, *spec.decode.env])
            and all(var.value is not None for var in spec.engine.env if var.name == PYTHONHASHSEED))


def _seeded_where_needed(spec: DisaggregatedServingSpec) -> bool:
    """Before 0.32 the engines' NONE_HASH is random per process unless PYTHONHASHSEED is set."""
    return (vllm.parse_version(spec.engine.vllm_version) >= vllm.FIXED_NONE_HASH_ADDED
            or any(var.name == PYTHONHASHSEED for var in spec.engine.env))


_KV_AWARE_CEL: Final = "self.proxy.routingPolicy != 'KVAware'"
_KV_EVENTS_CEL: Final = f"({_KV_AWARE_CEL} || self.proxy.kvAware.index != 'Events')"
_KV_AWARE_RULES: Final = (
    # LMCache's P/D engines run without vLLM's prefix cache (render.engine): nothing to route on, and
    # LMCache's own store is reached by every engine alike.
    Rule(
        cel=f"{_KV_AWARE_CEL} || self.kvTransfer.connector != 'LMCacheConnectorV1'",
        message="proxy.routingPolicy KVAware routes on vLLM's prefix cache, which LMCacheConnectorV1 pools run "
        "without (--no-enable-prefix-caching): use LeastLoaded, PowerOfTwo or RoundRobin",
        check=lambda s: not kv_aware_routing(s) or s.kv_transfer.connector != Connector.LMCACHE,
        field_path=".proxy.routingPolicy",
    ),
    Rule(
        cel=f"{_KV_AWARE_CEL} || !(self.engine.extraArgs.exists(a, a == '--no-enable-prefix-caching') || "
        "self.prefill.extraArgs.exists(a, a == '--no-enable-prefix-caching'))",
        message="proxy.routingPolicy KVAware routes on the prefill engines' prefix cache, which "
        "--no-enable-prefix-caching in engine.extraArgs or prefill.extraArgs turns off",
        check=lambda s: not kv_aware_routing(s) or "--no-enable-prefix-caching" not in engine_extra_args(s, "prefill"),
        field_path=".proxy.routingPolicy",
    ),
    Rule(
        cel=f"{_KV_EVENTS_CEL} || !self.engine.vllmVersion.matches('{KV_EVENTS_BEFORE_REGEX}')",
        message=f"proxy.kvAware.index Events needs engine.vllmVersion >= {vllm.format_version(KV_EVENTS_CHECKED_FROM)} "
        "(the releases whose KV events and block hashes the proxy was checked against): use index Routed",
        check=lambda s: (not kv_events_published(s)
                         or vllm.parse_version(s.engine.vllm_version) >= KV_EVENTS_CHECKED_FROM),
        field_path=".proxy.kvAware.index",
    ),
    Rule(
        cel=f"{_KV_EVENTS_CEL} || (self.prefill.nodesPerReplica == 1 && self.decode.nodesPerReplica == 1)",
        message="proxy.kvAware.index Events needs nodesPerReplica 1 on both roles: the proxy subscribes to each "
        "engine pod, and a multi-node replica's ranks publish from its worker pods: use index Routed",
        check=lambda s: not kv_events_published(s) or not (s.prefill.multi_node or s.decode.multi_node),
        field_path=".proxy.kvAware.index",
    ),
    Rule(
        cel=f"{_KV_EVENTS_CEL} || !(self.engine.extraArgs.exists(a, a.startsWith('--kv-events-config')) || "
        "self.prefill.extraArgs.exists(a, a.startsWith('--kv-events-config')) || "
        "self.decode.extraArgs.exists(a, a.startsWith('--kv-events-config')))",
        message="proxy.kvAware.index Events renders the engines' --kv-events-config (the endpoints the proxy "
        "subscribes to): remove it from engine.extraArgs, prefill.extraArgs and decode.extraArgs",
        check=lambda s: not kv_events_published(s) or not any(
            a.startswith("--kv-events-config") for a in engine_extra_args(s, "prefill", "decode")),
        field_path=".proxy.kvAware.index",
    ),
    # The proxy hashes each prompt as the engines do, NONE_HASH's seed included; the operator never
    # renders a seed of its own (a fixed one would be public, and PYTHONHASHSEED=<integer> also turns off
    # Python's hash randomisation in the API server, which parses untrusted JSON).
    Rule(
        cel=f"{_KV_EVENTS_CEL} || !({_xxhash_cel('self.engine.extraArgs')} || "
        f"{_xxhash_cel('self.prefill.extraArgs')} || {_xxhash_cel('self.decode.extraArgs')})",
        message="proxy.kvAware.index Events needs the engines' --prefix-caching-hash-algo sha256 (the default) or "
        "sha256_cbor: vLLM seeds xxhash and xxhash_cbor at random per process, since a seed others know lets "
        "them craft colliding blocks, so the proxy cannot hash as the engines do: remove xxhash from "
        "engine.extraArgs, prefill.extraArgs and decode.extraArgs, or use index Routed",
        check=lambda s: (not kv_events_published(s)
                         or not any(_xxhash_arg(a) for a in engine_extra_args(s, "prefill", "decode"))),
        field_path=".proxy.kvAware.index",
    ),
    Rule(
        cel=f"{_KV_EVENTS_CEL} || (!self.prefill.env.exists(e, e.name == '{PYTHONHASHSEED}') && "
        f"!self.decode.env.exists(e, e.name == '{PYTHONHASHSEED}') && "
        f"self.engine.env.all(e, e.name != '{PYTHONHASHSEED}' || has(e.value)))",
        message="proxy.kvAware.index Events hashes prompts with the engines' PYTHONHASHSEED, which the proxy is "
        "given and both roles must share: set it, if at all, as a literal value in engine.env, not with "
        "valueFrom and not in prefill.env or decode.env",
        check=lambda s: not kv_events_published(s) or _seeds_only_in_engine_env(s),
        field_path=".proxy.kvAware.index",
    ),
    Rule(
        cel=f"{_KV_EVENTS_CEL} || !self.engine.vllmVersion.matches('{vllm.BEFORE_0_32_REGEX}') || "
        f"self.engine.env.exists(e, e.name == '{PYTHONHASHSEED}')",
        message=f"proxy.kvAware.index Events on engine.vllmVersion < {_FIXED_NONE_HASH} needs PYTHONHASHSEED in "
        "engine.env: these releases seed the first block's hash at random per process without it, so no two "
        "engines hash alike. Set it yourself (PYTHONHASHSEED=random keeps Python's hash randomisation; "
        f"docs/proxy.md), or use engine.vllmVersion >= {_FIXED_NONE_HASH} or index Routed",
        check=lambda s: not kv_events_published(s) or _seeded_where_needed(s),
        field_path=".proxy.kvAware.index",
    ),
)


_GPUS_CEL: Final = (  # GPUs of one replica
    "(has(self.{role}.gpu.count) ? self.{role}.gpu.count * self.{role}.nodesPerReplica : "
    "self.{role}.tensorParallelSize * self.{role}.pipelineParallelSize * self.{role}.dataParallelSize)"
)


class DisaggregatedServingSpec(APIModel):
    """Desired state of a prefill/decode-disaggregated vLLM serving pool."""

    model: ModelSpec = Field(description="The model to serve.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="vLLM engine image and shared settings.")
    kv_transfer: KVTransferSpec = Field(
        default_factory=KVTransferSpec, description="KV-cache hand-off from prefill to decode."
    )
    prefill: RoleSpec = Field(default_factory=RoleSpec, description="The prefill pool (kv_producer).")
    decode: RoleSpec = Field(default_factory=RoleSpec, description="The decode pool (kv_consumer).")
    proxy: ProxySpec = Field(default_factory=ProxySpec, description="The routing proxy and its Service.")
    autoscaling: AutoscalingSpec = Field(
        default_factory=AutoscalingSpec, description="SLO-driven autoscaling of prefill and decode."
    )

    rules = (
        Rule(
            cel="self.kvTransfer.connector == 'P2pNcclConnector' || self.kvTransfer.connector == "
            "'LMCacheConnectorV1' ? self.prefill.tensorParallelSize == self.decode.tensorParallelSize : "
            "(self.prefill.tensorParallelSize % self.decode.tensorParallelSize == 0 || "
            "self.decode.tensorParallelSize % self.prefill.tensorParallelSize == 0)",
            message="prefill and decode tensorParallelSize are incompatible with the connector: NIXL and "
            "Mooncake need one to divide the other, P2pNccl and LMCache need them equal",
            check=_tp_compatible,
        ),
        Rule(
            cel=f"self.kvTransfer.connector != 'P2pNcclConnector' || "
            f"self.engine.vllmVersion.matches('{vllm.UP_TO_0_23_REGEX}')",
            message=f"P2pNcclConnector was removed in vLLM 0.24: it needs engine.vllmVersion <= "
            f"{vllm.format_version(vllm.P2P_NCCL_LAST)} (use NixlConnector on newer versions)",
            check=_p2p_nccl_supported,
        ),
        Rule(
            cel=f"self.kvTransfer.connector != 'NixlPushConnector' || "
            f"!self.engine.vllmVersion.matches('{vllm.UP_TO_0_23_REGEX}')",
            message=f"NixlPushConnector needs engine.vllmVersion >= {vllm.format_version(vllm.NIXL_PUSH_ADDED)}",
            check=_nixl_push_supported,
        ),
        # MooncakeConnector before 0.16 (v1/mooncake_connector.py of the 0.13.0 wheel) hands off with
        # remote_host/remote_port in prefill's answer; the proxy speaks only the transfer_id and
        # bootstrap (/register, /query) protocol of v1/mooncake/ in the 0.16.0 wheel.
        Rule(
            cel=f"self.kvTransfer.connector != 'MooncakeConnector' || "
            f"!self.engine.vllmVersion.matches('{vllm.BEFORE_0_16_REGEX}')",
            message=f"MooncakeConnector needs engine.vllmVersion >= "
            f"{vllm.format_version(vllm.MOONCAKE_BOOTSTRAP_ADDED)}: older releases hand off with "
            "remote_host/remote_port instead of the transfer id and bootstrap server the proxy uses",
            check=_mooncake_supported,
        ),
        # MooncakeConnector reads extra config `device_name` only from 0.32 (the conformance suite found
        # 0.16-0.24 passing "" to the transfer engine): refused where it would be silently ignored.
        Rule(
            cel="!has(self.kvTransfer.mooncake) || !has(self.kvTransfer.mooncake.deviceName) || "
            f"!self.engine.vllmVersion.matches('{vllm.BEFORE_0_32_REGEX}')",
            message=f"kvTransfer.mooncake.deviceName needs engine.vllmVersion >= "
            f"{vllm.format_version(vllm.MOONCAKE_DEVICE_NAME_ADDED)}: older MooncakeConnectors ignore it",
            check=_mooncake_device_name_supported,
        ),
        # VLLM_GPU_NIC_PCIE_MAPPING is read by vllm/v1/executor/vllm_net_devices.py, new in the 0.23.0 wheel.
        Rule(
            cel="!has(self.kvTransfer.rdma) || !has(self.kvTransfer.rdma.gpuNicMapping) || "
            "size(self.kvTransfer.rdma.gpuNicMapping) == 0 || "
            f"!self.engine.vllmVersion.matches('{vllm.BEFORE_0_23_REGEX}')",
            message=f"kvTransfer.rdma.gpuNicMapping needs engine.vllmVersion >= "
            f"{vllm.format_version(vllm.GPU_NIC_MAPPING_ADDED)} (VLLM_GPU_NIC_PCIE_MAPPING is new in it)",
            check=_gpu_nic_mapping_supported,
        ),
        Rule(
            cel="(self.prefill.nodesPerReplica == 1 && self.decode.nodesPerReplica == 1) || "
            "((self.kvTransfer.connector == 'NixlConnector' || self.kvTransfer.connector == 'NixlPushConnector') "
            f"&& !self.engine.vllmVersion.matches('{vllm.BEFORE_0_12_REGEX}'))",
            message=f"nodesPerReplica above 1 needs a NIXL connector and engine.vllmVersion >= "
            f"{vllm.format_version(vllm.MULTI_NODE_ADDED)}: older releases span nodes only on Ray, and the other "
            "connectors' per-rank ports are not reachable on a worker node",
            check=_multi_node_supported,
        ),
        Rule(
            cel="!(self.kvTransfer.connector == 'NixlConnector' || self.kvTransfer.connector == "
            "'NixlPushConnector') || (self.decode.pipelineParallelSize == 1 && "
            "(self.prefill.pipelineParallelSize == 1 || "
            f"!self.engine.vllmVersion.matches('{vllm.BEFORE_0_32_REGEX}')))",
            message="NIXL connectors take no pipeline parallelism on decode (vLLM's kv_consumer refuses it), and "
            f"on prefill only from engine.vllmVersion {vllm.format_version(vllm.NIXL_PIPELINE_PARALLEL_ADDED)} "
            "(older releases key the hand-off by tensor rank alone)",
            check=_nixl_pipeline_supported,
        ),
        # vLLM's CPU backend: the KV cache lives in host memory, and only NIXL has a host-buffer mode.
        Rule(
            cel="self.engine.device != 'cpu' || !has(self.kvTransfer.bufferDevice) || "
            "self.kvTransfer.bufferDevice == 'cpu'",
            message="engine.device cpu keeps the KV cache in host memory: kvTransfer.bufferDevice must be cpu "
            "(or unset)",
            check=lambda s: s.engine.device != "cpu" or s.kv_transfer.buffer_device in (None, "cpu"),
            field_path=".kvTransfer.bufferDevice",
        ),
        Rule(
            cel="self.engine.device != 'cpu' || self.kvTransfer.connector == 'NixlConnector' || "
            "self.kvTransfer.connector == 'NixlPushConnector'",
            message="engine.device cpu needs kvTransfer.connector NixlConnector or NixlPushConnector: only NIXL "
            "hands the KV over from host memory (Mooncake, LMCache and P2pNccl move GPU memory)",
            check=lambda s: s.engine.device != "cpu" or s.kv_transfer.connector.is_nixl,
            field_path=".kvTransfer.connector",
        ),
        _cpu_role_rule("prefill"),
        _cpu_role_rule("decode"),
        Rule(
            cel="self.engine.device != 'cpu' || !has(self.autoscaling.gpuBudget)",
            message="autoscaling.gpuBudget counts GPUs, and engine.device cpu runs on none: leave it unset",
            check=lambda s: s.engine.device != "cpu" or s.autoscaling.gpu_budget is None,
            field_path=".autoscaling.gpuBudget",
        ),
        Rule(
            cel="!has(self.autoscaling.gpuBudget) || self.autoscaling.prefill.minReplicas * "
            + _GPUS_CEL.format(role="prefill")
            + " + self.autoscaling.decode.minReplicas * "
            + _GPUS_CEL.format(role="decode")
            + " <= self.autoscaling.gpuBudget",
            message="autoscaling.gpuBudget is below the GPUs the minimum replicas of both roles need",
            check=_gpu_budget_holds,
        ),
        *_KV_AWARE_RULES,
    )

    @property
    def on_cpu(self) -> bool:
        """The engines run vLLM's CPU backend (no GPUs)."""
        return self.engine.device == "cpu"

    @property
    def kv_buffer_device(self) -> Device:
        """kv_buffer_device as rendered: the user's, else the engines' own device."""
        return self.kv_transfer.buffer_device or self.engine.device

    @property
    def cpu_settings(self) -> CPUEngineSpec:
        return self.engine.cpu or CPUEngineSpec()


# ---------------------------------------------------------------------------------------------
# Status


class Condition(StatusModel):
    """A condition in the metav1.Condition shape."""

    type: str = Field(description="Condition type: Ready, Progressing, Degraded or ScalingActive.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        max_length=1024,
        description="CamelCase reason for the last transition.",
    )
    message: str = Field(default="", max_length=32768, description="Human-readable detail.")
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation the condition was computed for."
    )
    last_transition_time: str = Field(description="When status last changed (RFC 3339).")


class RoleStatus(StatusModel):
    """Observed state of one pool."""

    replicas: int = Field(default=0, description="Replicas of the pool's workload: pods of its Deployment, or "
                          "groups of its LeaderWorkerSet (multi-node replicas).")
    ready_replicas: int = Field(default=0, description="Replicas that serve: pods passing their readiness probe "
                                "(a group: its leader's, which serves once every node joined).")
    desired_replicas: int = Field(default=0, description="Replicas the operator asks for.")
    updated_replicas: int = Field(default=0, description="Replicas on the current template.")
    ready: str = Field(default="0/0", description="ready/desired, for kubectl get.")
    nodes_per_replica: int = Field(default=1, description="Pods (nodes) of one replica.")
    gpus: int = Field(default=0, description="GPUs the desired replicas request (all pods of each).")


class DecisionStatus(StatusModel):
    """An autoscaler decision."""

    time: str = Field(description="When it was made (RFC 3339).")
    prefill: int = Field(description="Prefill replicas decided.")
    decode: int = Field(description="Decode replicas decided.")
    reason: str = Field(description="CamelCase reason (which signal and formula term).")
    message: str = Field(default="", description="Human-readable detail.")


class ObservedLoad(StatusModel):
    """What the autoscaler last read from Prometheus."""

    request_rate: float | None = Field(default=None, description="Arrivals per second.")
    isl: float | None = Field(default=None, description="Mean input (prompt) length, tokens.")
    osl: float | None = Field(default=None, description="Mean output length, tokens.")
    ttft_ms: float | None = Field(default=None, description="TTFT at the sizing percentile (the target attainment's "
                                  "share, else slo.percentile), milliseconds.")
    tpot_ms: float | None = Field(default=None, description="Inter-token latency at the sizing percentile, ms.")
    prefill_queue: float | None = Field(default=None, description="Requests waiting on prefill engines.")
    decode_queue: float | None = Field(default=None, description="Requests waiting on decode engines.")
    kv_cache_usage: float | None = Field(default=None, description="Mean decode KV-cache usage, 0-1.")
    arrival_prompt_tokens: dict[str, float] | None = Field(
        default=None, description="How prompt work bunches on arrival: per slot length in seconds (\"0.25\", "
        "\"1\", \"4\"), the prompt tokens arriving in the same slot as a request at the sizing percentile, in the "
        "engines' tokens across the proxies (the proxies' xpyd_proxy_arrival_prompt_tokens); unset without it.")
    held_requests: int | None = Field(
        default=None, description="Requests the proxies hold for a ready prefill and decode pair (their pods' "
        "xpyd.io/RequestsWaiting condition), a pool at zero's demand.")


class AttainmentStatus(StatusModel):
    """The share of requests meeting both SLOs, and the headroom the autoscaler holds for its target."""

    target: float | None = Field(default=None, description="autoscaling.slo.attainment, when set.")
    last_hour: float | None = Field(
        default=None, description="Share of the last hour's requests that met both targets (from the TTFT and TPOT "
        "histograms), 0-1; unset before any was measured.")
    headroom: float = Field(default=0.0, description="Load headroom held now: demand is sized for (1 + headroom) "
                            "times the forecast load.")


class AutoscalerStatus(StatusModel):
    """What the autoscaler saw and decided."""

    last_decision: DecisionStatus | None = Field(default=None, description="The latest decision.")
    observed: ObservedLoad | None = Field(default=None, description="The latest observation.")
    recommended_ratio: str | None = Field(default=None, description="Recommended P:D, e.g. 1:3.")
    profile: str | None = Field(default=None, description="The performance model the sizing uses.")
    attainment: AttainmentStatus | None = Field(
        default=None, description="The attainment measured over the last hour and the headroom held now.")
    state: FreeForm | None = Field(
        default=None, description="The decision state (forecasts, stabilisation windows, bursts) the next "
        "decision starts from, so that it survives an operator restart; versioned, written by the operator.")


class ProxyStatus(StatusModel):
    """Observed state of the proxy."""

    replicas: int = Field(default=0, description="Proxy pods.")
    ready_replicas: int = Field(default=0, description="Proxy pods that are ready.")


class DisaggregatedServingStatus(StatusModel):
    """Observed state, written by the operator."""

    observed_generation: int | None = Field(default=None, description="Generation of the spec last acted on.")
    conditions: list[Condition] = Field(default_factory=list, description="Ready, Progressing, Degraded, "
                                        "ScalingActive.")
    prefill: RoleStatus | None = Field(default=None, description="The prefill pool.")
    decode: RoleStatus | None = Field(default=None, description="The decode pool.")
    proxy: ProxyStatus | None = Field(default=None, description="The proxy.")
    endpoint: str | None = Field(default=None, description="In-cluster URL of the proxy Service.")
    kv_transport: str | None = Field(
        default=None, description="Transport the rendered configuration asks for: RDMA or TCP."
    )
    autoscaler: AutoscalerStatus | None = Field(default=None, description="Autoscaler state.")


# ---------------------------------------------------------------------------------------------
# The object

#: Child names append up to 8 characters ("-prefill") and Service names are DNS labels (63).
MAX_NAME_LENGTH: Final = 55

_NAME_RE: Final = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def valid_name(name: str) -> bool:
    return len(name) <= MAX_NAME_LENGTH and bool(_NAME_RE.match(name))


#: Applied to the root object in the CRD; in Python, ObjectMeta checks the name.
NAME_RULE: Final = Rule(
    cel=f"size(self.metadata.name) <= {MAX_NAME_LENGTH} && "
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
    message=f"metadata.name must be a DNS label of at most {MAX_NAME_LENGTH} characters (lowercase letters, "
    "digits and '-', starting with a letter): child Services are named <name>-prefill and so on",
    check=lambda obj: valid_name(obj.metadata.name),
)


class ObjectMeta(StatusModel):
    """The parts of metadata the operator reads."""

    name: str = Field(description="Object name.")
    namespace: str = Field(default="default", description="Namespace.")
    uid: str | None = Field(default=None, description="Object UID.")
    generation: int | None = Field(default=None, description="Spec generation.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels.")

    @model_validator(mode="after")
    def _check_name(self) -> ObjectMeta:
        if not valid_name(self.name):
            raise ValueError(NAME_RULE.message)
        return self


class DisaggregatedServing(StatusModel):
    """A whole DisaggregatedServing object (as read from a file or the API server)."""

    api_version: Literal["xpyd.io/v1alpha1"] = Field(description="API version.")
    kind: Literal["DisaggregatedServing"] = Field(description="Kind.")
    metadata: ObjectMeta = Field(description="Metadata.")
    spec: DisaggregatedServingSpec = Field(description="Desired state.")
    status: DisaggregatedServingStatus = Field(default_factory=DisaggregatedServingStatus, description="Status.")
