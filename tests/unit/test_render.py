"""Rendering: golden files per sample, tables of what each connector, option and vLLM version
renders, and every object valid against the Kubernetes 1.37 schemas.

Regenerate goldens after an intended change with `XPYD_UPDATE_GOLDEN=1 pytest tests/unit/test_render.py`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.servings import serving
from xpyd import vllm
from xpyd.api.load import SpecError, load_servings, parse_serving
from xpyd.api.models import ENGINE_DRAIN_QUIET_SECONDS, LMCACHE_PD_PROXY_PORT
from xpyd.cli import main
from xpyd.proxy.pool import Pool
from xpyd.render import RenderOptions, drain, render
from xpyd.render.lmcache import pd_config_problems

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))
GOLDEN = ROOT / "tests" / "golden"
K8S_VERSION = "1.37"


def render_file(path: Path) -> str:
    objects = []
    for s in load_servings(path.read_text(), str(path)):
        objects += render(s.metadata.name, s.metadata.namespace, s.spec)
    return yaml.safe_dump_all(objects, sort_keys=False, width=1000)


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.stem for s in SAMPLES])
def test_sample_matches_golden(sample: Path) -> None:
    golden = GOLDEN / f"{sample.stem}.yaml"
    rendered = render_file(sample)
    if os.environ.get("XPYD_UPDATE_GOLDEN"):
        golden.write_text(rendered)
    assert golden.exists(), f"no golden for {sample.name}: run with XPYD_UPDATE_GOLDEN=1"
    assert rendered == golden.read_text()


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.stem for s in SAMPLES])
def test_sample_objects_are_valid_kubernetes(sample: Path) -> None:
    """Against Kubernetes' schemas; a LeaderWorkerSet (a CRD's kind: the e2e tests apply it to the API
    server, which checks it against the CRD) through its two pod templates."""
    for obj in yaml.safe_load_all(render_file(sample)):
        if obj["kind"] == "LeaderWorkerSet":
            group = obj["spec"]["leaderWorkerTemplate"]
            for part in ("leaderTemplate", "workerTemplate"):
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": part},
                                              "template": group[part]}, K8S_VERSION, strict=True)
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


#: One release of each range the boundaries in xpyd.vllm cut (and both sides of each boundary).
RELEASES = ["0.10", "0.12", "0.13", "0.15", "0.16", "0.17", "0.18", "0.22", "0.23", "0.24", "0.31", "0.32",
            "0.33"]


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.stem for s in SAMPLES])
def test_sample_renders_for_every_release_it_allows(sample: Path) -> None:
    allowed = []
    for version in RELEASES:
        try:
            servings = load_servings(sample.read_text(), str(sample), vllm_version=version)
        except SpecError:
            continue
        allowed.append(version)
        for s in servings:
            for obj in render(s.metadata.name, s.metadata.namespace, s.spec):
                if obj["kind"] in ("Deployment", "Service"):  # what the release changes
                    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    # The release the sample names is among them.
    own = load_servings(sample.read_text())[0].spec.engine.vllm_version
    assert vllm.format_version(vllm.parse_version(own)) in allowed


def test_every_connector_has_a_sample() -> None:
    connectors = {s.spec.kv_transfer.connector for p in SAMPLES for s in load_servings(p.read_text())}
    assert {c.value for c in connectors} == {"NixlConnector", "NixlPushConnector", "MooncakeConnector",
                                             "LMCacheConnectorV1", "P2pNcclConnector"}


# ------------------------------------------------------------------------------------------------
# Tables over options


def objects_of(spec: dict[str, Any], options: RenderOptions | None = None) -> dict[tuple[str, str], Any]:
    s = parse_serving(serving(spec))
    return {(o["kind"], o["metadata"]["name"]): o for o in render(s.metadata.name, "ns", s.spec, options)}


def engine(spec: dict[str, Any], role: str = "prefill") -> dict[str, Any]:
    return objects_of(spec)[("Deployment", f"llama-{role}")]  # type: ignore[no-any-return]


def container(spec: dict[str, Any], role: str = "prefill") -> dict[str, Any]:
    return engine(spec, role)["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def kv_config(spec: dict[str, Any], role: str = "prefill") -> dict[str, Any]:
    (arg,) = [a for a in container(spec, role)["args"] if a.startswith("--kv-transfer-config=")]
    return json.loads(arg.split("=", 1)[1])  # type: ignore[no-any-return]


def env_of(spec: dict[str, Any], role: str = "prefill") -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(spec, role)["env"]}


REMOVED_IN_0_32 = {"kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip"}


@pytest.mark.parametrize("connector", ["NixlConnector", "MooncakeConnector", "LMCacheConnectorV1"])
@pytest.mark.parametrize("version", ["0.32", "0.33", "1.0"])
def test_no_removed_kv_fields_from_0_32(connector: str, version: str) -> None:
    extra = {"lmcache": {"configMapRef": {"name": "c"}}} if connector == "LMCacheConnectorV1" else {}
    spec = {"kvTransfer": {"connector": connector, **extra}, "engine": {"vllmVersion": version}}
    for role in ("prefill", "decode"):
        assert REMOVED_IN_0_32.isdisjoint(kv_config(spec, role))


@pytest.mark.parametrize(("connector", "role", "expected"), [
    ("NixlConnector", "prefill", {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                                  "kv_connector_extra_config": {"backends": ["UCX"]}}),
    ("NixlConnector", "decode", {"kv_role": "kv_consumer"}),
    ("NixlPushConnector", "decode", {"kv_connector": "NixlPushConnector", "kv_role": "kv_consumer"}),
    ("MooncakeConnector", "prefill", {"kv_connector_extra_config": {"mooncake_protocol": "rdma"}}),
    ("LMCacheConnectorV1", "prefill", {"kv_connector_extra_config": {"discard_partial_chunks": False,
                                                                     "lmcache_rpc_port": "producer1"}}),
    ("LMCacheConnectorV1", "decode", {"kv_connector_extra_config": {"discard_partial_chunks": False,
                                                                    "lmcache_rpc_port": "consumer1"}}),
])
def test_kv_transfer_config_per_connector(connector: str, role: str, expected: dict[str, Any]) -> None:
    extra = {"lmcache": {"configMapRef": {"name": "c"}}} if connector == "LMCacheConnectorV1" else {}
    config = kv_config({"kvTransfer": {"connector": connector, **extra}}, role)
    assert {key: config[key] for key in expected} == expected


@pytest.mark.parametrize(("parallel", "ranks"), [
    ({}, 1), ({"tensorParallelSize": 4}, 4), ({"tensorParallelSize": 2, "pipelineParallelSize": 2}, 4),
    ({"tensorParallelSize": 2, "dataParallelSize": 2}, 4),
])
def test_p2p_nccl_declares_one_zmq_port_per_rank(parallel: dict[str, Any], ranks: int) -> None:
    spec = {"kvTransfer": {"connector": "P2pNcclConnector"}, "engine": {"vllmVersion": "0.23"},
            "prefill": parallel, "decode": parallel}
    for role in ("prefill", "decode"):
        zmq = [p for p in container(spec, role)["ports"] if p["name"].startswith("p2p-zmq-")]
        assert zmq == [{"name": f"p2p-zmq-{r}", "containerPort": 14579 + r, "protocol": "TCP"} for r in range(ranks)]


def test_gpu_nic_mapping_renders_both_variables() -> None:
    mapping = [{"gpu": "0000:18:00.0", "nic": "0000:19:00.0"}, {"gpu": "2a:00.0", "nic": "2b:00.1"}]
    spec = {"kvTransfer": {"rdma": {"gpuNicMapping": mapping}}}
    for role in ("prefill", "decode"):
        env = env_of(spec, role)
        assert env["VLLM_GPU_NIC_PCIE_MAPPING"] == "0000:18:00.0=0000:19:00.0,2a:00.0=2b:00.1"
        assert env["VLLM_NIC_SELECTION_VARS"] == "UCX_NET_DEVICES:1"
    custom = {"kvTransfer": {"rdma": {"gpuNicMapping": mapping,
                                      "nicSelectionVars": ["UCX_NET_DEVICES:1", "NCCL_IB_HCA"]}}}
    assert env_of(custom)["VLLM_NIC_SELECTION_VARS"] == "UCX_NET_DEVICES:1,NCCL_IB_HCA"
    # Neither without a mapping: vLLM refuses one without the other.
    assert {"VLLM_GPU_NIC_PCIE_MAPPING", "VLLM_NIC_SELECTION_VARS"}.isdisjoint(env_of({"kvTransfer": {"rdma": {}}}))


def test_nixl_backends_as_nixl_names_its_plugins() -> None:
    config = kv_config({"kvTransfer": {"nixl": {"backends": ["Mooncake", "UCX"]}}})
    assert config["kv_connector_extra_config"] == {"backends": ["Mooncake", "UCX"]}


def test_p2p_nccl_config_on_0_23() -> None:
    spec = {"kvTransfer": {"connector": "P2pNcclConnector", "p2pNccl": {"bufferSize": "8G"}},
            "engine": {"vllmVersion": "0.23"}}
    prefill, decode = kv_config(spec, "prefill"), kv_config(spec, "decode")
    assert decode["kv_buffer_size"] == 8_000_000_000 and prefill["kv_buffer_size"] == 10
    assert prefill["kv_port"] == decode["kv_port"] == 14579
    assert prefill["kv_connector_extra_config"] == {
        "proxy_ip": "llama-proxy.ns.svc", "proxy_port": "30001", "http_port": "8000",
        "send_type": "PUT_ASYNC", "nccl_num_channels": "16"}
    pulling = {**spec, "kvTransfer": {**spec["kvTransfer"], "p2pNccl": {"sendType": "GET", "bufferSize": "1Gi"}}}
    assert kv_config(pulling, "prefill")["kv_buffer_size"] == 2**30


@pytest.mark.parametrize(("version", "policy_rendered", "shutdown_rendered"), [
    ("0.10", False, False), ("0.11", False, False), ("0.12", False, False), ("0.13", True, False),
    ("0.17", True, False), ("0.18", True, True), ("0.33", True, True),
])
def test_version_boundaries(version: str, policy_rendered: bool, shutdown_rendered: bool) -> None:
    spec = {"engine": {"vllmVersion": version}, "kvTransfer": {"loadFailurePolicy": "recompute"}}
    config = kv_config(spec, "decode")
    assert ("kv_load_failure_policy" in config) == policy_rendered
    if policy_rendered:
        assert config["kv_load_failure_policy"] == "recompute"
    args = container(spec, "decode")["args"]
    assert any(a.startswith("--shutdown-timeout=") for a in args) == shutdown_rendered


def test_user_extra_config_overrides_rendered() -> None:
    config = kv_config({"kvTransfer": {"extraConfig": {"backends": ["LIBFABRIC"], "kv_lease_duration": 60}}})
    assert config["kv_connector_extra_config"] == {"backends": ["LIBFABRIC"], "kv_lease_duration": 60}
    # The prefill drain holds the engine for the lease the user set.
    assert engine({"kvTransfer": {"extraConfig": {"kv_lease_duration": 60}}})["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"] == 60 + 60 + 30


def grace(spec: dict[str, Any], role: str = "prefill") -> int:
    return engine(spec, role)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]  # type: ignore[no-any-return]


def hold(spec: dict[str, Any]) -> int:
    return int(container(spec)["lifecycle"]["preStop"]["exec"]["command"][-1])


@pytest.mark.parametrize(("version", "extra", "env", "expected_hold"), [
    # 0.23+: NIXL's kv_lease_duration (default 30 s); VLLM_NIXL_ABORT_REQUEST_TIMEOUT is gone.
    ("0.33", {}, [], 30),
    ("0.23", {"kv_lease_duration": 45}, [{"name": "VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "value": "100"}], 45),
    # Before: un-pulled blocks are freed after VLLM_NIXL_ABORT_REQUEST_TIMEOUT (default 480 s).
    ("0.22", {}, [], 480),
    ("0.13", {"kv_lease_duration": 45}, [], 480),
    ("0.18", {}, [{"name": "VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "value": "120"}], 120),
])
def test_prefill_hold_follows_the_release_kv_timeout(version: str, extra: dict[str, Any], env: list[Any],
                                                      expected_hold: int) -> None:
    spec = {"engine": {"vllmVersion": version, "env": env}, "kvTransfer": {"extraConfig": extra}}
    assert hold(spec) == expected_hold
    assert grace(spec) == 60 + expected_hold + 30
    assert grace(spec, "decode") == 60 + 30
    # The key is rendered only for releases that have it.
    assert ("kv_lease_duration" in kv_config(spec)["kv_connector_extra_config"]) == (
        "kv_lease_duration" in extra and vllm.parse_version(version) >= vllm.NIXL_KV_LEASE_ADDED)


METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 3.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 5.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 2.0
vllm:request_success_created{engine="0",finished_reason="stop",model_name="m"} 1.7e9
"""


def test_the_drain_reads_running_waiting_and_finished_requests() -> None:
    assert drain.activity(METRICS) == (6.0, 7.0)
    assert drain.activity("") == (0.0, 0.0)


@pytest.mark.parametrize(("previous", "current", "since"), [
    (drain.NOT_POLLED, (0.0, 0.0), 10.0),  # the first poll starts the spell
    ((0.0, 7.0), (0.0, 7.0), 4.0),       # nothing ran or finished since: the spell goes on
    ((0.0, 7.0), (1.0, 7.0), 10.0),      # a request is running
    ((0.0, 7.0), (0.0, 8.0), 10.0),      # one arrived and finished between two polls
    ((2.0, 7.0), (0.0, 9.0), 10.0),
])
def test_the_drain_waits_for_an_idle_spell(previous: tuple[float, float], current: tuple[float, float],
                                           since: float) -> None:
    assert drain.idle_since(4.0, previous, current, 10.0) == since


def test_the_proxy_uses_a_terminating_pod_only_within_its_drain() -> None:
    command = container({})["lifecycle"]["preStop"]["exec"]["command"]
    assert command[-2] == str(ENGINE_DRAIN_QUIET_SECONDS)
    # The proxy's fallback ends before the drain can: a request it sends reaches the engine in time.
    assert 0 < Pool.fallback_seconds <= ENGINE_DRAIN_QUIET_SECONDS - 1


def test_role_env_abort_timeout_wins_over_engine_env() -> None:
    spec = {"engine": {"vllmVersion": "0.16", "env": [{"name": "VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "value": "100"}]},
            "prefill": {"env": [{"name": "VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "value": "200"}]}}
    assert hold(spec) == 200


@pytest.mark.parametrize(("image", "command"), [
    ("vllm/vllm-openai:v0.33.0", ["vllm", "serve"]),
    ("ghcr.io/xpyd-operator/vllm-engine:0.33.0", ["/usr/local/bin/xpyd-engine-entrypoint", "vllm", "serve"]),
])
def test_engine_image_entrypoint_checks_transport(image: str, command: list[str]) -> None:
    spec = {"engine": {"image": image}, "kvTransfer": {"rdma": {}}}
    assert container(spec)["command"] == command
    assert env_of(spec)["XPYD_EXPECT_TRANSPORT"] == "RDMA"


def test_nixl_env_side_channel_on_pod_ip() -> None:
    env = env_of({})
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert env["UCX_TLS"] == "tcp,cuda_copy,cuda_ipc"


@pytest.mark.parametrize("rdma", [True, False])
def test_rdma_on_off(rdma: bool) -> None:
    spec: dict[str, Any] = {"kvTransfer": {"rdma": {"resourceName": "rdma/roce", "perReplica": 2}}} if rdma else {}
    c = container(spec)
    assert ("rdma/roce" in c["resources"]["limits"]) == rdma
    assert c["resources"]["requests"] == c["resources"]["limits"]
    assert c["securityContext"]["capabilities"].get("add") == (["IPC_LOCK"] if rdma else None)
    assert env_of(spec)["UCX_TLS"] == ("rc,cuda_copy,cuda_ipc" if rdma else "tcp,cuda_copy,cuda_ipc")
    assert engine(spec)["metadata"]["annotations"]["xpyd.io/kv-transport"] == ("RDMA" if rdma else "TCP")


def test_mooncake_bootstrap_port_only_on_prefill() -> None:
    spec = {"kvTransfer": {"connector": "MooncakeConnector"}}
    assert env_of(spec, "prefill")["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == "8998"
    assert "VLLM_MOONCAKE_BOOTSTRAP_PORT" not in env_of(spec, "decode")


@pytest.mark.parametrize("tp", [1, 2])
def test_lmcache_pd_addresses_and_ports(tp: int) -> None:
    spec = {"kvTransfer": {"connector": "LMCacheConnectorV1", "lmcache": {"configMapRef": {"name": "c"}}},
            "prefill": {"tensorParallelSize": tp}, "decode": {"tensorParallelSize": tp}}
    prefill, decode = env_of(spec, "prefill"), env_of(spec, "decode")
    # Prefill's sender notifies the proxy; each decode engine receives on its own address.
    assert prefill["LMCACHE_PD_PROXY_HOST"] == "llama-proxy.ns.svc"
    assert prefill["LMCACHE_PD_PROXY_PORT"] == str(LMCACHE_PD_PROXY_PORT) == "7500"
    assert decode["LMCACHE_PD_PEER_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert "LMCACHE_PD_PEER_HOST" not in prefill and "LMCACHE_PD_PROXY_HOST" not in decode
    ports = {p["name"]: p["containerPort"] for p in container(spec, "decode")["ports"]}
    assert {n: v for n, v in ports.items() if n.startswith("lmc-")} == {
        **{f"lmc-init-{r}": 7300 + r for r in range(tp)}, **{f"lmc-alloc-{r}": 7400 + r for r in range(tp)}}
    assert not any(p["name"].startswith("lmc-") for p in container(spec, "prefill")["ports"])
    for role in ("prefill", "decode"):
        assert "--no-enable-prefix-caching" in container(spec, role)["args"]
    # The proxy tells prefill where to push: the same first ports and the decode TP it spans.
    proxy_args = container(spec, "proxy")["args"]
    assert {"--lmcache-init-port=7300", "--lmcache-alloc-port=7400",
            f"--decode-tensor-parallel-size={tp}"} <= set(proxy_args)


def test_lmcache_same_hash_seed_and_role_config() -> None:
    spec = {"kvTransfer": {"connector": "LMCacheConnectorV1",
                           "lmcache": {"configMapRef": {"name": "cfg"}, "pythonHashSeed": "42"}}}
    prefill, decode = env_of(spec, "prefill"), env_of(spec, "decode")
    assert prefill["PYTHONHASHSEED"] == decode["PYTHONHASHSEED"] == "42"
    assert prefill["LMCACHE_CONFIG_FILE"] == "/etc/lmcache/prefill.yaml"
    assert decode["LMCACHE_CONFIG_FILE"] == "/etc/lmcache/decode.yaml"


@pytest.mark.parametrize(("prefill", "decode"), [({"tensorParallelSize": 2}, {"tensorParallelSize": 4}),
                                                 ({"tensorParallelSize": 4, "dataParallelSize": 2}, {})])
def test_multi_gpu_and_hetero_tp(prefill: dict[str, Any], decode: dict[str, Any]) -> None:
    spec = {"prefill": prefill, "decode": decode}
    for role, role_spec in (("prefill", prefill), ("decode", decode)):
        tp, dp = role_spec.get("tensorParallelSize", 1), role_spec.get("dataParallelSize", 1)
        c = container(spec, role)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == tp * dp
        assert f"--tensor-parallel-size={tp}" in c["args"]
        assert (f"--data-parallel-size={dp}" in c["args"]) == (dp > 1)


def test_gpu_product_selector_and_taint_toleration() -> None:
    pod = engine({"prefill": {"gpu": {"product": "NVIDIA-H200"}, "nodeSelector": {"pool": "a"}}})["spec"]["template"]
    assert pod["spec"]["nodeSelector"] == {"pool": "a", "nvidia.com/gpu.product": "NVIDIA-H200"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_replacement_is_surged_before_the_pod_it_replaces_stops(role: str) -> None:
    strategy = engine({}, role)["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    # A pool without spare GPUs can roll in place instead.
    in_place = {role: {"updateStrategy": {"maxSurge": 0, "maxUnavailable": 1}}}
    assert engine(in_place, role)["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert engine({role: {"updateStrategy": {"maxSurge": "25%"}}}, role)["spec"]["strategy"][
        "rollingUpdate"]["maxSurge"] == "25%"


def test_probes_budget_model_loading() -> None:
    c = container({"prefill": {"probes": {"startupTimeoutSeconds": 3600, "periodSeconds": 15}}})
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 3600
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"


def test_model_from_pvc_and_token_secret() -> None:
    spec = {"model": {"name": "m", "source": {"pvc": {"claimName": "models", "path": "/llama/"}},
                      "hfTokenSecretRef": {"name": "hf"}}}
    c = container(spec)
    assert c["args"][0] == "/models/llama"
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert env_of(spec)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}


def test_replicas_from_options_override_spec() -> None:
    objs = objects_of({"decode": {"replicas": 2}}, RenderOptions(replicas={"decode": 5}))
    assert objs[("Deployment", "llama-decode")]["spec"]["replicas"] == 5
    assert objs[("Deployment", "llama-prefill")]["spec"]["replicas"] == 1


def test_children_and_labels() -> None:
    objs = objects_of({})
    assert set(objs) == {
        (kind, f"llama-{c}") for c in ("prefill", "decode") for kind in ("Deployment", "Service", "PodDisruptionBudget")
    } | {(kind, "llama-proxy") for kind in ("Deployment", "Service", "PodDisruptionBudget", "ServiceAccount",
                                             "Role", "RoleBinding")}
    for (_, name), obj in objs.items():
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "xpyd-operator", name
        assert labels["app.kubernetes.io/instance"] == "llama" and labels["xpyd.io/serving"] == "llama"
        assert name.endswith(labels["xpyd.io/role"]) and labels["app.kubernetes.io/component"] == labels["xpyd.io/role"]
    assert objs[("Service", "llama-prefill")]["spec"]["clusterIP"] == "None"
    role = objs[("Role", "llama-proxy")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                             {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]}]
    proxy_env = objs[("Deployment", "llama-proxy")]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in proxy_env
    # One pod of a pool down at a time; a pod that is not Ready (a proxy without a usable engine, an
    # engine still loading) never blocks a node drain.
    for pool in ("prefill", "decode", "proxy"):
        budget = objs[("PodDisruptionBudget", f"llama-{pool}")]["spec"]
        assert (budget["maxUnavailable"], budget["unhealthyPodEvictionPolicy"]) == (1, "AlwaysAllow")


def test_proxy_gets_connector_and_selectors() -> None:
    proxy = objects_of({"kvTransfer": {"connector": "MooncakeConnector"}},
                       RenderOptions(operator_image="example/xpyd:1"))[("Deployment", "llama-proxy")]
    c = proxy["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "example/xpyd:1" and c["command"] == ["xpyd", "proxy"]
    assert "--connector=MooncakeConnector" in c["args"]
    assert "--prefill-selector=xpyd.io/serving=llama,xpyd.io/role=prefill" in c["args"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


def proxy_pod(spec: dict[str, Any]) -> dict[str, Any]:
    return objects_of(spec)[("Deployment", "llama-proxy")]["spec"]["template"]["spec"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(("port", "connector"), [(8998, "MooncakeConnector"), (9100, "MooncakeConnector"),
                                                  (9100, "NixlConnector")])
def test_the_mooncake_bootstrap_port_goes_to_engines_and_proxy_alike(port: int, connector: str) -> None:
    kv: dict[str, Any] = {"connector": connector}
    if connector == "MooncakeConnector":
        kv["mooncake"] = {"bootstrapPort": port}
    args = proxy_pod({"kvTransfer": kv})["containers"][0]["args"]
    flags = [a for a in args if a.startswith("--mooncake-bootstrap-port")]
    if connector == "MooncakeConnector":
        assert env_of({"kvTransfer": kv})["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == str(port)
        assert flags == [f"--mooncake-bootstrap-port={port}"]
    else:
        assert flags == []


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_the_proxy_knows_how_many_data_parallel_ranks_a_prefill_server_has(dp: int) -> None:
    args = proxy_pod({"kvTransfer": {"connector": "NixlPushConnector"}, "engine": {"vllmVersion": "0.33.0"},
                      "prefill": {"dataParallelSize": dp, "gpu": {"count": dp}}})["containers"][0]["args"]
    flags = [a for a in args if a.startswith("--prefill-data-parallel-size")]
    assert flags == ([f"--prefill-data-parallel-size={dp}"] if dp > 1 else [])


def test_proxy_probes_and_grace_fit_its_stop_sequence() -> None:
    pod = proxy_pod({})
    c = pod["containers"][0]
    # Readiness is the endpoint that fails on SIGTERM and without a usable engine; liveness stays up.
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    probe = c["readinessProbe"]
    drain = float(next(a for a in c["args"] if a.startswith("--drain-seconds=")).split("=")[1])
    finish = float(next(a for a in c["args"] if a.startswith("--finish-timeout=")).split("=")[1])
    # The probe sees the failure well within the drain period, and the grace period covers both.
    assert probe["periodSeconds"] * probe["failureThreshold"] < drain
    assert pod["terminationGracePeriodSeconds"] > drain + finish
    assert "lifecycle" not in c            # the proxy drains by itself: no preStop to add to the budget


@pytest.mark.parametrize(("extra", "grace"), [
    (["--finish-timeout=300"], 10 + 300 + 5),
    (["--drain-seconds", "20", "--finish-timeout", "100"], 20 + 100 + 5),
    (["--drain-seconds=0"], 45 + 5),
    (["--finish-timeout=oops"], 10 + 45 + 5),
    (["--drain-seconds=9999", "--finish-timeout=9999"], 300 + 3600 + 5),   # what the proxy would refuse
])
def test_proxy_grace_follows_the_users_stop_flags(extra: list[str], grace: int) -> None:
    pod = proxy_pod({"proxy": {"extraArgs": extra}})
    assert pod["terminationGracePeriodSeconds"] == grace
    assert pod["containers"][0]["args"][-len(extra):] == extra


# ------------------------------------------------------------------------------------------------
# The command


def test_render_command_prints_all_objects(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "-f", str(ROOT / "manifests/samples/nixl.yaml")]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert len(docs) == 12


def test_render_command_vllm_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "-f", str(ROOT / "manifests/samples/p2pnccl.yaml"), "--vllm-version", "0.24"]) == 1
    assert "P2pNcclConnector was removed in vLLM 0.24" in capsys.readouterr().err
    assert main(["render", "-f", str(ROOT / "manifests/samples/nixl.yaml"), "--vllm-version", "0.17"]) == 0
    assert "--shutdown-timeout" not in capsys.readouterr().out


@pytest.mark.parametrize(("content", "message"), [
    ("kind: DisaggregatedServing\napiVersion: xpyd.io/v1alpha1\nmetadata: {name: a}\nspec: {model: {name: m}, "
     "decode: {replicas: -2}}", "spec.decode.replicas: Input should be greater than or equal to 0"),
    ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}", "no DisaggregatedServing found"),
    ("a: [", "not valid YAML"),
    ("kind: DisaggregatedServing\napiVersion: xpyd.io/v1\nmetadata: {name: a}", "expected apiVersion xpyd.io/v1alpha1"),
])
def test_render_command_rejects_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str,
                                          message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    assert main(["render", "-f", str(path)]) == 1
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


# ------------------------------------------------------------------------------------------------
# LMCache P/D files


LMCACHE_SAMPLE = ROOT / "manifests" / "samples" / "lmcache.yaml"


def lmcache_files() -> dict[str, str]:
    (config_map,) = [d for d in yaml.safe_load_all(LMCACHE_SAMPLE.read_text()) if d["kind"] == "ConfigMap"]
    return config_map["data"]  # type: ignore[no-any-return]


def lmcache_spec(tp: int = 1) -> Any:
    return parse_serving(serving({"kvTransfer": {"connector": "LMCacheConnectorV1",
                                                 "lmcache": {"configMapRef": {"name": "lmcache-pd"}}},
                                  "prefill": {"tensorParallelSize": tp}, "decode": {"tensorParallelSize": tp}})).spec


def test_the_lmcache_sample_files_fit_pd_and_the_declared_ports() -> None:
    files, spec = lmcache_files(), lmcache_spec()
    for role in ("prefill", "decode"):
        assert pd_config_problems(spec, role, files[f"{role}.yaml"]) == []
    declared = {p["containerPort"] for p in container({"kvTransfer": {
        "connector": "LMCacheConnectorV1", "lmcache": {"configMapRef": {"name": "c"}}}}, "decode")["ports"]}
    config = yaml.safe_load(files["decode.yaml"])
    assert set(config["pd_peer_init_port"]) | set(config["pd_peer_alloc_port"]) <= declared


@pytest.mark.parametrize(("role", "edit", "problem"), [
    ("prefill", {"enable_pd": False}, "enable_pd must be true"),
    ("prefill", {"pd_role": "receiver"}, "pd_role must be sender"),
    ("decode", {"pd_role": "sender"}, "pd_role must be receiver"),
    ("decode", {"pd_buffer_size": None}, "pd_buffer_size is missing"),
    ("decode", {"pd_peer_init_port": 7301}, "pd_peer_init_port must be [7300]"),
    ("decode", {"pd_peer_alloc_port": None}, "pd_peer_alloc_port must be [7400]"),
])
def test_lmcache_file_problems(role: str, edit: dict[str, Any], problem: str) -> None:
    config = {**yaml.safe_load(lmcache_files()[f"{role}.yaml"]), **edit}
    config = {k: v for k, v in config.items() if v is not None}
    problems = pd_config_problems(lmcache_spec(), role, yaml.safe_dump(config))  # type: ignore[arg-type]
    assert any(problem in p for p in problems), problems


def test_lmcache_receiver_ports_per_tensor_parallel_rank() -> None:
    config = {**yaml.safe_load(lmcache_files()["decode.yaml"]), "pd_peer_init_port": [7300, 7301],
              "pd_peer_alloc_port": [7400, 7401]}
    assert pd_config_problems(lmcache_spec(tp=2), "decode", yaml.safe_dump(config)) == []
    assert pd_config_problems(lmcache_spec(tp=2), "decode", lmcache_files()["decode.yaml"]) != []


def test_render_command_checks_an_lmcache_configmap_in_the_same_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_text(LMCACHE_SAMPLE.read_text().replace("pd_role: receiver", "pd_role: sender"))
    assert main(["render", "-f", str(path)]) == 1
    captured = capsys.readouterr()
    assert "lmcache-pd: decode.yaml: pd_role must be receiver" in captured.err and captured.out == ""


# ---- multi-node replicas (LeaderWorkerSet) -------------------------------------------------------------

MULTI_NODE = {"kvTransfer": {"connector": "NixlConnector"},
              "decode": {"nodesPerReplica": 2, "tensorParallelSize": 8, "dataParallelSize": 2,
                         "topologyKey": "nvidia.com/gpu.clique", "replicas": 3}}


def group_templates(spec: dict[str, Any], role: str = "decode") -> tuple[dict[str, Any], dict[str, Any], Any]:
    lws = objects_of(spec)[("LeaderWorkerSet", f"llama-{role}")]
    group = lws["spec"]["leaderWorkerTemplate"]
    return group["leaderTemplate"], group["workerTemplate"], lws


def test_a_multi_node_role_is_a_leaderworkerset_of_groups() -> None:
    objects = objects_of(MULTI_NODE)
    assert ("Deployment", "llama-decode") not in objects and ("Deployment", "llama-prefill") in objects
    leader, worker, lws = group_templates(MULTI_NODE)
    assert lws["spec"]["replicas"] == 3 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    # vLLM serves only once every node joined: the workers must start with the leader, not after it is Ready.
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["metadata"]["annotations"]["leaderworkerset.sigs.k8s.io/exclusive-topology"] == "nvidia.com/gpu.clique"
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxSurge": 1, "maxUnavailable": 0}
    for template in (leader, worker):  # TP8 x DP2 over 2 nodes: 8 GPUs a pod
        resources = template["spec"]["containers"][0]["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == 8 and resources["requests"]["nvidia.com/gpu"] == 8
        assert template["metadata"]["labels"]["xpyd.io/role"] == "decode"
    # The Service of the role is the group's subdomain, and publishes pods before they are ready.
    service = objects[("Service", "llama-decode")]
    assert service["spec"]["publishNotReadyAddresses"] is True and service["spec"]["clusterIP"] == "None"
    assert "publishNotReadyAddresses" not in objects[("Service", "llama-prefill")]["spec"]


def test_leader_and_workers_launch_as_vllm_multi_node() -> None:
    leader, worker, _ = group_templates(MULTI_NODE)
    lead, work = (t["spec"]["containers"][0] for t in (leader, worker))
    launch = ["--nnodes=2", "--master-port=29501", "--data-parallel-size=2", "--data-parallel-rpc-port=29550"]
    assert set(launch) <= set(lead["args"]) and set(launch) <= set(work["args"])
    # The leader binds on its own IP (libzmq binds no DNS name); the workers dial the leader's name.
    assert {"--node-rank=0", "--master-addr=$(POD_IP)"} <= set(lead["args"]) and "--headless" not in lead["args"]
    assert {"--node-rank=$(LWS_WORKER_INDEX)", "--master-addr=$(LWS_LEADER_ADDRESS)", "--headless"} <= set(work["args"])
    assert [a for a in lead["args"] if a.startswith("--kv-transfer-config")] == [
        a for a in work["args"] if a.startswith("--kv-transfer-config")]
    # Every pod names its own IP for vLLM's sockets and its own NIXL side channel.
    for container in (lead, work):
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
        assert env["VLLM_HOST_IP"] == env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # Only the leader serves HTTP: probes, the drain and the http port are its alone.
    assert {"readinessProbe", "startupProbe", "livenessProbe"} <= set(lead)
    assert not {"readinessProbe", "startupProbe", "livenessProbe"} & set(work)
    # The leader drains; a worker stops only after its leader (or at the pod's grace period).
    lead_hook, work_hook = (c["lifecycle"]["preStop"]["exec"]["command"] for c in (lead, work))
    grace = str(worker["spec"]["terminationGracePeriodSeconds"])
    assert lead_hook[3] == "8000" and work_hook[3:] == ["--follow-leader", "8000", grace]
    assert {p["name"] for p in lead["ports"]} == {"http", "vllm-master", "vllm-dp-rpc", "nixl"}
    assert {p["name"] for p in work["ports"]} == {"nixl"}


def test_a_tensor_parallel_group_has_no_data_parallel_flags() -> None:
    spec = {"decode": {"nodesPerReplica": 2, "tensorParallelSize": 16}}
    leader, _, _ = group_templates(spec)
    args = leader["spec"]["containers"][0]["args"]
    assert "--tensor-parallel-size=16" in args and "--nnodes=2" in args
    assert not [a for a in args if a.startswith("--data-parallel")]
    assert leader["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8


def test_the_proxy_routes_only_to_group_leaders() -> None:
    proxy = objects_of(MULTI_NODE)[("Deployment", "llama-proxy")]
    args = proxy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--decode-selector=xpyd.io/serving=llama,xpyd.io/role=decode,leaderworkerset.sigs.k8s.io/worker-index=0" \
        in args
    assert "--prefill-selector=xpyd.io/serving=llama,xpyd.io/role=prefill" in args


def test_the_users_env_replaces_a_rendered_variable_of_its_name_once() -> None:
    """Server-side apply refuses a container env naming a variable twice: the user's value takes the
    rendered one's place, and the role's wins over the engine's."""
    spec = {"engine": {"env": [{"name": "UCX_TLS", "value": "tcp,sm"}, {"name": "A", "value": "1"}]},
            "prefill": {"env": [{"name": "UCX_TLS", "value": "tcp"}, {"name": "A", "value": "2"}]}}
    names = [e["name"] for e in container(spec)["env"]]
    assert len(names) == len(set(names)), names
    assert env_of(spec)["UCX_TLS"] == "tcp" and env_of(spec)["A"] == "2"
    assert env_of(spec, "decode")["UCX_TLS"] == "tcp,sm" and env_of(spec, "decode")["A"] == "1"
    assert names.index("UCX_TLS") < names.index("A")  # in the rendered variable's place


@pytest.mark.parametrize(("version", "connector", "limited"), [
    ("0.16", "NixlConnector", True),       # before NIXL's worker moved its model thread
    ("0.18", "NixlConnector", False),      # from 0.18 it does: an exclusive cpuset kills the engine
    ("0.33", "NixlConnector", False),
    ("0.33", "NixlPushConnector", False),
])
def test_a_cpu_pool_asks_for_exclusive_cores_only_where_vllm_can_start_in_them(
        version: str, connector: str, limited: bool) -> None:
    spec = {"engine": {"device": "cpu", "vllmVersion": version}, "kvTransfer": {"connector": connector},
            "prefill": {"resources": {"cpu": "4", "memory": "16Gi"}}}
    limits = container(spec)["resources"]["limits"]
    assert ("cpu" in limits) is limited, limits
    assert limits["memory"] == "16Gi"


def test_cpu_pool_renders_no_gpu_and_the_cpu_backend_settings() -> None:
    spec = {"engine": {"device": "cpu", "cpu": {"kvCacheSpaceGiB": 2, "threadsBind": "0-3"}},
            "prefill": {"resources": {"cpu": "4"}}}
    c = container(spec)
    assert c["resources"] == {"requests": {"cpu": "4"}, "limits": {}}  # Burstable: see the next test
    assert c["securityContext"]["capabilities"]["add"] == ["SYS_NICE"]
    assert kv_config(spec)["kv_buffer_device"] == "cpu"
    env = env_of(spec)
    assert (env["UCX_TLS"], env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("tcp", "2", "0-3")
    pod_spec = engine(spec)["spec"]["template"]["spec"]
    assert pod_spec["tolerations"] == [] and not pod_spec.get("nodeSelector")
    assert "nvidia.com/gpu" not in container(spec, "decode")["resources"].get("limits", {})
