"""The local cluster's pure parts: the loopback guard, pod IP allocation, how pods become
processes, node objects and certificates. (The control plane itself is exercised by e2e/.)"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from xpyd.cli import build_parser
from xpyd.cluster import lws, pki
from xpyd.cluster.binaries import VllmCpu
from xpyd.cluster.controlplane import ClusterError, ClusterState, ControlPlane
from xpyd.cluster.nodes import DEFAULT_NODES, node_object
from xpyd.cluster.runtime import (
    POD_SUBCOMMANDS,
    VLLM_CLI_MODULE,
    PodProcess,
    PodRuntime,
    ProcessPlan,
    Unresolved,
    Unrunnable,
    expand,
    hook_argv,
    image_release,
    pod_dns_name,
    remap_paths,
)
from xpyd.common.netguard import NonLoopbackAddress, require_loopback, require_loopback_url

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("address", ["127.0.0.1", "127.14.3.9", "127.255.255.254", "localhost"])
def test_loopback_addresses_pass(address: str) -> None:
    assert require_loopback(address) == address


# The wildcard, private ranges, public addresses, IPv4-mapped IPv6 and names (nothing resolves them).
@pytest.mark.parametrize("address", ["10.0.0.1", "0.0.0.0", "192.168.1.1", "8.8.8.8", "[::ffff:127.0.0.1]", "::1x",
                                     "example.com", "kubernetes.default.svc", ""])
def test_everything_else_is_refused(address: str) -> None:
    with pytest.raises(NonLoopbackAddress, match="refusing"):
        require_loopback(address)


def test_urls_are_checked_by_host() -> None:
    assert require_loopback_url("http://127.3.0.2:8000/v1/models")
    with pytest.raises(NonLoopbackAddress):
        require_loopback_url("https://10.0.0.1:443/api")


class FakeKube:
    """Only what planning calls: the token request, and reads of the objects in `objects`."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str | None, str], dict[str, Any]] = {}

    def service_account_token(self, namespace: str, account: str, seconds: int = 3600) -> str:
        return f"token-of-{namespace}-{account}"

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, namespace, name))


@pytest.fixture
def runtime(tmp_path: Path) -> PodRuntime:
    (tmp_path / "pki").mkdir()
    (tmp_path / "pki" / "ca.crt").write_text("")
    state = ClusterState(state_dir=str(tmp_path), apiserver_port=6443, etcd_port=2379, pod_ip_octet=77)
    return PodRuntime(FakeKube(), state, [n.name for n in DEFAULT_NODES])  # type: ignore[arg-type]


def pod(image: str, command: list[str], args: list[str], env: list[dict[str, Any]] | None = None,
        **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {"nodeName": "cpu-0", "serviceAccountName": "sa", **spec,
                     "containers": [{"name": "c", "image": image, "command": command, "args": args, "env": env or [],
                                     "ports": [{"name": "health", "containerPort": 8080}],
                                     "readinessProbe": {"httpGet": {"path": "/healthz", "port": "health"}}}]}}


def test_pod_ips_are_loopback_unique_and_skip_taken_ports(runtime: PodRuntime) -> None:
    first = runtime.allocate_ip("cpu-0", [])
    second = runtime.allocate_ip("gpu-h200-0", [])
    assert first == "127.77.8.2" and second == "127.77.0.2"  # cpu-0 is the ninth node
    with socket.socket() as taken:
        taken.bind(("127.77.8.3", 8080))
        assert runtime.allocate_ip("cpu-0", [8080]) == "127.77.8.4"


def test_operator_image_runs_as_this_xpyd_with_its_own_token(runtime: PodRuntime, tmp_path: Path) -> None:
    plan = runtime.plan(pod("ghcr.io/xpyd-operator/xpyd-operator:0.1.0", ["xpyd", "operator"],
                            ["-A", "--liveness=http://0.0.0.0:8080/healthz"],
                            env=[{"name": "A", "value": "1"},
                                 {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]),
                        "127.77.4.9", tmp_path / "pod")
    assert plan is not None
    assert plan.argv == [sys.executable, "-m", "xpyd.cli", "operator", "-A",
                         "--liveness=http://127.77.4.9:8080/healthz"]  # 0.0.0.0 inside a pod is its own IP
    assert plan.env["A"] == "1" and plan.env["IP"] == "127.77.4.9"
    assert plan.env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    assert "token-of-ns-sa" in Path(plan.env["KUBECONFIG"]).read_text()
    assert plan.readiness == ("/healthz", 8080)


def test_serving_subcommands_bind_the_pod_ip(runtime: PodRuntime, tmp_path: Path) -> None:
    plan = runtime.plan(pod("ghcr.io/xpyd-operator/xpyd-operator:0.1.0", ["xpyd", "proxy"], ["--port=8000"]),
                        "127.77.4.9", tmp_path)
    assert plan is not None and plan.argv[3:] == ["proxy", "--host", "127.77.4.9", "--port=8000"]


def test_unknown_images_and_subcommands_run_no_process(runtime: PodRuntime, tmp_path: Path) -> None:
    assert runtime.plan(pod("nginx:1", ["nginx"], []), "127.77.4.9", tmp_path) is None
    assert runtime.plan(pod("ghcr.io/xpyd-operator/xpyd-operator:0.1.0", ["xpyd", "no-such-command"], []),
                        "127.77.4.9", tmp_path) is None
    engine = runtime.plan(pod("vllm/vllm-openai:v0.33.0", ["vllm", "serve"], ["m"]), "127.77.4.9", tmp_path)
    assert engine is not None and engine.argv[3:5] == ["engine-sim", "--host"]


def test_pod_subcommands_are_xpyd_subcommands() -> None:
    subcommands = next(action.choices for action in build_parser()._actions
                       if isinstance(getattr(action, "choices", None), dict))
    assert set(subcommands) >= POD_SUBCOMMANDS


@pytest.mark.parametrize(("text", "env", "expected"), [
    ("--node-rank=$(RANK)", {"RANK": "1"}, "--node-rank=1"),
    ("$(A)-$(B)", {"A": "x", "B": "y"}, "x-y"),
    ("$(MISSING)", {}, "$(MISSING)"),          # an unknown name stays as written
    ("$$(A)", {"A": "x"}, "$(A)"),             # $$ escapes
    ("cost: $5", {}, "cost: $5"),
])
def test_references_expand_as_the_kubelet_expands_them(text: str, env: dict[str, str], expected: str) -> None:
    assert expand(text, env) == expected


def lws_pod(name: str, leader: str, *, uid: str) -> dict[str, Any]:
    """A LeaderWorkerSet pod as its webhook leaves it: the leader's name in LWS_LEADER_ADDRESS."""
    obj = pod("vllm/vllm-openai:v0.33.0", ["vllm", "serve"],
              ["m", "--node-rank=$(LWS_WORKER_INDEX)", "--master-addr=$(LWS_LEADER_ADDRESS)"],
              env=[{"name": "LWS_LEADER_ADDRESS", "value": f"{leader}.grp.ns"},
                   {"name": "LWS_WORKER_INDEX", "value": "1" if name != leader else "0"}],
              subdomain="grp", hostname=name)
    obj["metadata"].update({"name": name, "uid": uid})
    obj["spec"]["nodeName"] = "gpu-h100-0"
    return obj


def test_a_worker_waits_for_its_leader_and_then_dials_its_ip(runtime: PodRuntime,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PodProcess, "start", lambda self: None)  # planning only: no process
    worker, leader = lws_pod("grp-0-1", "grp-0", uid="w"), lws_pod("grp-0", "grp-0", uid="l")
    assert pod_dns_name(leader) == "grp-0.grp.ns"
    assert runtime._admit(worker) is None  # the leader has no IP yet: no process, its address kept
    waiting_ip = runtime._reserved["w"]
    runner = runtime._admit(leader)
    assert runner is not None and runner.plan is not None
    assert f"--master-addr={runner.ip}" in runner.plan.argv  # the leader names itself
    again = runtime._admit(worker)
    assert again is not None and again.plan is not None and again.ip == waiting_ip
    assert f"--master-addr={runner.ip}" in again.plan.argv and "--node-rank=1" in again.plan.argv
    # The leader's pod goes: its name no longer resolves (a recreated leader gets a new IP).
    runtime._forget(runtime.pods.pop("l"))
    assert "grp-0.grp.ns" not in runtime.dns


def test_names_outside_known_subdomains_are_left_alone(runtime: PodRuntime, tmp_path: Path) -> None:
    plan = runtime.plan(pod("vllm/vllm-openai:v0.33.0", ["vllm", "serve"], ["$(M)"],
                            env=[{"name": "M", "value": "deepseek-ai/DeepSeek-V3.1"}]), "127.77.4.9", tmp_path)
    assert plan is not None and plan.argv[-1] == "deepseek-ai/DeepSeek-V3.1"
    runtime.subdomains.add("grp.ns")
    with pytest.raises(Unresolved):
        runtime._resolve("grp-0.grp.ns.svc.cluster.local")


def test_lws_webhooks_call_the_controller_by_url_and_only_for_group_pods() -> None:
    mutating, validating = lws.webhook_configurations("127.0.0.1", 9443, b"PEM")
    assert (mutating["kind"], validating["kind"]) == ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
    for hook in [*mutating["webhooks"], *validating["webhooks"]]:
        assert hook["clientConfig"]["url"].startswith("https://127.0.0.1:9443/")  # never a Service address
        assert hook["failurePolicy"] == "Fail" and hook["clientConfig"]["caBundle"] == "UEVN"
        if hook["rules"][0]["resources"] == ["pods"]:
            assert hook["objectSelector"]["matchExpressions"][0]["key"] == lws.POD_LABEL
    config = lws.controller_config("127.0.0.1", 9443, 8081, Path("/c"))
    assert config["webhook"] == {"host": "127.0.0.1", "port": 9443, "certDir": "/c"}
    assert config["internalCertManagement"] == {"enable": False} and config["metrics"] == {"bindAddress": "0"}


def test_no_token_without_automount(runtime: PodRuntime, tmp_path: Path) -> None:
    plan = runtime.plan(pod("ghcr.io/xpyd-operator/xpyd-operator:0.1.0", ["xpyd", "operator"], [],
                            automountServiceAccountToken=False), "127.77.4.9", tmp_path)
    assert plan is not None and "KUBECONFIG" not in plan.env


def test_gpu_nodes_look_like_a_gpu_cloud() -> None:
    nodes = {n.name: node_object(n) for n in DEFAULT_NODES}
    h200 = nodes["gpu-h200-0"]
    assert h200["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H200"
    assert h200["status"]["capacity"]["nvidia.com/gpu"] == "8" and h200["status"]["capacity"]["rdma/ib"] == "8"
    assert h200["spec"]["taints"] == [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    assert h200["metadata"]["annotations"] == {"kwok.x-k8s.io/node": "fake"}
    assert "taints" not in nodes["cpu-0"]["spec"] and "nvidia.com/gpu" not in nodes["cpu-0"]["status"]["capacity"]
    products = [n.gpu_product for n in DEFAULT_NODES if n.gpu_product]
    assert products.count("NVIDIA-H200") == 2 and products.count("NVIDIA-L40S") == 2


def test_certificates_name_loopback_only(tmp_path: Path) -> None:
    files = pki.generate(tmp_path)
    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "10.0.0.1"}
    admin = x509.load_pem_x509_certificate(files.admin_cert.read_bytes())
    assert admin.subject.rfc4514_string() == "O=system:masters,CN=xpyd-admin"
    assert oct(files.ca_key.stat().st_mode & 0o777) == "0o600"


def test_down_kills_pod_processes_a_dead_runtime_left_behind(tmp_path: Path) -> None:
    """A runtime killed before it stopped its pods leaves them running in their own sessions; the
    pid files it wrote let `down` find them (and a reused pid of some other program is left alone)."""
    import signal
    import subprocess
    import sys

    from xpyd.cluster.pidfiles import PID_FILE, kill_leftover_pods

    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # xpyd pod"],
                            start_new_session=True)
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        for name, process in (("ns_ours", ours), ("ns_other", other)):
            (tmp_path / "pods" / name).mkdir(parents=True)
            (tmp_path / "pods" / name / PID_FILE).write_text(str(process.pid))
        (tmp_path / "pods" / "ns_gone").mkdir()
        (tmp_path / "pods" / "ns_gone" / PID_FILE).write_text("999999999")
        assert kill_leftover_pods(tmp_path) == 1
        assert ours.wait(timeout=5) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for process in (ours, other):
            process.kill()
            process.wait()


def test_python_pre_stop_hooks_run_as_this_python_and_reach_the_pod_ip() -> None:
    def with_hook(command: list[str]) -> dict[str, Any]:
        return {"name": "c", "lifecycle": {"preStop": {"exec": {"command": command}}}}

    meta = {"metadata": {"name": "p", "namespace": "ns"}}
    assert hook_argv(meta, with_hook(["python3", "-c", "urlopen('http://127.0.0.1:8000/metrics')", "8000"]),
                     "127.77.4.9") == [sys.executable, "-c", "urlopen('http://127.77.4.9:8000/metrics')", "8000"]
    wildcard = hook_argv(meta, with_hook(["python", "-c", "bind('0.0.0.0')"]), "127.77.4.9")
    assert wildcard is not None and wildcard[1:] == ["-c", "bind('127.77.4.9')"]
    assert hook_argv(meta, with_hook(["/bin/sh", "-c", "sleep 5"]), "127.77.4.9") is None  # would run on this machine
    assert hook_argv(meta, {"name": "c"}, "127.77.4.9") is None


def test_a_deleted_pod_runs_its_pre_stop_hook_to_the_end_before_sigterm(tmp_path: Path) -> None:
    """The hook runs while the process still serves (the process sees no signal until it ends), and a
    hook longer than the grace period is cut at it."""
    marker = tmp_path / "marker"
    serve = [sys.executable, "-c", "import signal, sys, time\n"
             f"signal.signal(signal.SIGTERM, lambda *_: (open({str(marker)!r}, 'a').write('term '), sys.exit(0)))\n"
             "time.sleep(60)"]
    hook = [sys.executable, "-c", f"import time; time.sleep(0.5); open({str(marker)!r}, 'a').write('hook ')"]
    runner = PodProcess(uid="u", namespace="ns", name="p", ip="127.0.0.1", directory=tmp_path,
                        plan=ProcessPlan(argv=serve, env={"PATH": "/usr/bin:/bin"}, readiness=None, pre_stop=hook))
    runner.start()
    time.sleep(0.3)  # its SIGTERM handler is installed
    runner.pre_stop(budget=10)
    assert runner.process is not None and runner.process.poll() is None
    runner.stop(grace=5)
    assert marker.read_text() == "hook term "

    marker.unlink()
    runner.plan = ProcessPlan(argv=serve, env={"PATH": "/usr/bin:/bin"}, readiness=None,
                              pre_stop=[sys.executable, "-c", "import time; time.sleep(60)"])
    runner.start()
    started = time.monotonic()
    runner.pre_stop(budget=0.5)
    assert time.monotonic() - started < 5
    runner.stop(grace=5)


CPU_IMAGE = "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0"


def vllm_cpu(tmp_path: Path) -> VllmCpu:
    return VllmCpu(version="0.32.0", python=tmp_path / "venv" / "bin" / "python",
                   preload=tmp_path / "venv" / "lib" / "libiomp5.so", tiny_model=tmp_path / "model")


def engine_pod(image: str = CPU_IMAGE, command: list[str] | None = None, claim: str = "weights") -> dict[str, Any]:
    obj = pod(image, ["vllm", "serve"] if command is None else command,
              ["/models/tiny", "--port=8000", '--kv-transfer-config={"kv_role":"kv_producer"}'],
              env=[{"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                   {"name": "HF_HOME", "value": "/cache/huggingface"}],
              volumes=[{"name": "model", "persistentVolumeClaim": {"claimName": claim}},
                       {"name": "model-cache", "emptyDir": {}},
                       {"name": "dshm", "emptyDir": {"medium": "Memory"}}])
    obj["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "model", "mountPath": "/models"}, {"name": "model-cache", "mountPath": "/cache/huggingface"},
        {"name": "dshm", "mountPath": "/dev/shm"}]
    return obj


def bind_claim(kube: FakeKube, path: Path, claim: str = "weights") -> None:
    kube.objects[("PersistentVolumeClaim", "ns", claim)] = {"spec": {"volumeName": "pv-1"},
                                                             "status": {"phase": "Bound"}}
    kube.objects[("PersistentVolume", None, "pv-1")] = {"spec": {"hostPath": {"path": str(path)}}}


@pytest.mark.parametrize(("image", "release"), [
    (CPU_IMAGE, "0.32"), ("repo:0.33", "0.33"), ("repo:v1.0.2", "1.0"), ("repo:latest", None), ("repo", None)])
def test_image_tags_name_a_release(image: str, release: str | None) -> None:
    assert image_release(image) == release


def test_paths_under_a_mount_are_remapped_alone_or_after_an_equals_sign() -> None:
    mounts = {"/models": "/data/w", "/models/big": "/data/big"}
    assert remap_paths("/models/tiny", mounts) == "/data/w/tiny"
    assert remap_paths("--model=/models/big/x", mounts) == "--model=/data/big/x"  # the longer mount wins
    assert remap_paths("/models", mounts) == "/data/w"
    assert remap_paths("/modelsx/y", mounts) == "/modelsx/y" and remap_paths("a/models/b", mounts) == "a/models/b"


def test_the_cpu_image_runs_the_installed_vllm_with_the_pods_own_command(runtime: PodRuntime, tmp_path: Path) -> None:
    runtime.vllm = vllm_cpu(tmp_path)
    (tmp_path / "weights").mkdir()
    bind_claim(runtime.kube, tmp_path / "weights")  # type: ignore[arg-type]
    plan = runtime.vllm_plan(engine_pod(), engine_pod()["spec"]["containers"][0], "127.77.8.5", tmp_path / "pod")
    assert plan.argv == [str(runtime.vllm.python), "-m", VLLM_CLI_MODULE, "serve", f"{tmp_path}/weights/tiny",
                         "--port=8000", '--kv-transfer-config={"kv_role":"kv_producer"}', "--host=127.77.8.5"]
    assert plan.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == plan.env["VLLM_HOST_IP"] == "127.77.8.5"
    assert plan.env["UCX_NET_DEVICES"] == "lo"
    assert plan.env["LD_PRELOAD"] == str(runtime.vllm.preload)
    assert plan.env["HF_HOME"] == str(tmp_path / "pod" / "volumes" / "model-cache")
    assert plan.env["PATH"].startswith(f"{runtime.vllm.python.parent}:")
    assert plan.readiness == ("/healthz", 8080)


@pytest.mark.parametrize(("change", "message"), [
    ({"image": "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.33.0"}, "vLLM 0.33 is not installed here"),
    ({"command": ["bash", "-c", "vllm serve"]}, "command 'bash' is not one the image has"),
    ({"vllm": None}, "no vLLM CPU build is installed here"),
    ({"claim_path": "missing"}, "does not exist on this machine"),
])
def test_a_cpu_image_this_machine_cannot_run_says_why(runtime: PodRuntime, tmp_path: Path, change: dict[str, Any],
                                                      message: str) -> None:
    runtime.vllm = None if "vllm" in change else vllm_cpu(tmp_path)
    (tmp_path / "weights").mkdir()
    bind_claim(runtime.kube, tmp_path / change.get("claim_path", "weights"))  # type: ignore[arg-type]
    obj = engine_pod(image=change.get("image", CPU_IMAGE), command=change.get("command"))
    with pytest.raises(Unrunnable, match=message):
        runtime.vllm_plan(obj, obj["spec"]["containers"][0], "127.77.8.5", tmp_path / "pod")


def test_an_unbound_claim_waits_and_an_unrunnable_pod_is_never_ready(runtime: PodRuntime, tmp_path: Path) -> None:
    runtime.vllm = vllm_cpu(tmp_path)
    obj = engine_pod()
    with pytest.raises(Unresolved, match="not bound yet"):
        runtime.vllm_plan(obj, obj["spec"]["containers"][0], "127.77.8.5", tmp_path / "pod")
    runner = PodProcess(uid="u", namespace="ns", name="p", ip="127.77.8.5", plan=None, directory=tmp_path,
                        unrunnable="no vLLM")
    assert not runner.probe()
    status = runtime._status(obj, runner)
    assert status["phase"] == "Pending"
    assert status["containerStatuses"][0]["state"] == {"waiting": {"reason": "ErrImageNeverPull",
                                                                   "message": "no vLLM"}}


def test_the_api_server_starts_again_on_a_new_port_when_its_port_was_taken(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A free port is free only when chosen: one taken before the API server binds it is chosen
    again (and the kubeconfig follows); any other failure, or a third taken port, is raised."""
    plane = ControlPlane(state_dir=tmp_path)
    files = pki.generate(tmp_path / "pki")
    state = ClusterState(state_dir=str(tmp_path), apiserver_port=1, etcd_port=2, started_at=0.0)
    tried: list[int] = []

    def failing(times: int, message: bytes) -> Any:
        def spawn(state: ClusterState, bins: Any, files: Any) -> None:
            tried.append(state.apiserver_port)
            if len(tried) <= times:
                plane.logs.mkdir(parents=True, exist_ok=True)
                with (plane.logs / "kube-apiserver.log").open("ab") as log:
                    log.write(b"E run.go:72] \"command failed\" err=\"" + message + b"\"\n")
                raise ClusterError("kube-apiserver exited during start-up")
        return spawn

    monkeypatch.setattr(plane, "_spawn_apiserver", failing(2, b"bind: address already in use"))
    plane._start_apiserver(state, None, files)  # type: ignore[arg-type]
    assert len(tried) == 3 and state.apiserver_port == tried[-1]
    assert f"127.0.0.1:{tried[-1]}" in state.kubeconfig.read_text()
    tried.clear()
    monkeypatch.setattr(plane, "_spawn_apiserver", failing(3, b"bind: address already in use"))
    with pytest.raises(ClusterError):
        plane._start_apiserver(state, None, files)  # type: ignore[arg-type]
    assert len(tried) == 3
    tried.clear()
    (plane.logs / "kube-apiserver.log").unlink()
    monkeypatch.setattr(plane, "_spawn_apiserver", failing(1, b"unable to load server certificate"))
    with pytest.raises(ClusterError):
        plane._start_apiserver(state, None, files)  # type: ignore[arg-type]
    assert len(tried) == 1
