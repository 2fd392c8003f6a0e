"""`xpyd cluster up|down|status`: a real Kubernetes control plane on loopback.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok and the LeaderWorkerSet
controller run as local processes from binaries built by `e2e/build/build.sh`; fake GPU nodes are
registered through kwok; the pod process runtime (`xpyd cluster runtime`) runs the pods.
Everything binds 127.0.0.1, RBAC is on, and the admin kubeconfig is written to `<state>/kubeconfig`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from xpyd.cluster import lws, pki
from xpyd.cluster.binaries import Binaries, locate_binaries
from xpyd.cluster.nodes import DEFAULT_NODES, NodeSpec, node_object
from xpyd.cluster.pidfiles import kill_leftover_pods
from xpyd.common.netguard import require_loopback
from xpyd.kube import Kube
from xpyd.kube.pods import condition

HOST = "127.0.0.1"
SERVICE_CIDR = "10.0.0.0/16"  # a label on Service objects only: nothing routes or dials it (room for many pools)
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
# Controllers that cannot work on loopback (Endpoints and EndpointSlices refuse 127/8), node IPAM
# (pod IPs come from the runtime), and node lifecycle: fake nodes have no kubelet whose silence
# should evict pods. (1.37 has no cloud controllers in kube-controller-manager to disable.)
DISABLED_CONTROLLERS = ("endpoints-controller", "endpointslice-controller", "endpointslice-mirroring-controller",
                        "node-ipam-controller", "node-lifecycle-controller")


def default_state_dir() -> Path:
    return Path(os.environ.get("XPYD_CLUSTER_DIR", Path.home() / ".cache" / "xpyd" / "cluster"))


@dataclass
class ClusterState:
    """What `up` started, persisted as `<state>/state.json` for `down` and `status`."""

    state_dir: str
    apiserver_port: int
    etcd_port: int
    prometheus_port: int = 0
    #: Second octet of this cluster's pod IPs (127.<octet>.x.y): random, so two clusters on one
    #: machine rarely share addresses (the runtime also skips addresses whose ports are taken).
    pod_ip_octet: int = 0
    pids: dict[str, int] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)
    started_at: float = 0.0

    @property
    def kubeconfig(self) -> Path:
        return Path(self.state_dir) / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://{HOST}:{self.apiserver_port}"

    @property
    def prometheus_url(self) -> str | None:
        return f"http://{HOST}:{self.prometheus_port}" if self.prometheus_port else None

    def save(self) -> None:
        (Path(self.state_dir) / "state.json").write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, state_dir: Path) -> ClusterState | None:
        path = state_dir / "state.json"
        if not path.exists():
            return None
        return cls(**json.loads(path.read_text()))


class ClusterError(RuntimeError):
    """A step of `up` failed; the message names the step and the log to read."""


#: Start-ups of the API server, each on a newly chosen port, before `up` gives up on a port taken.
APISERVER_ATTEMPTS = 3


def free_ports(count: int) -> list[int]:
    """`count` distinct free TCP ports on loopback (all held open until every one is chosen)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((HOST, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    return free_ports(1)[0]


def _alive(pid: int) -> bool:
    try:
        # Reap it first if it is our own exited child (else it lingers as a zombie that "exists").
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_kubeconfig(path: Path, server: str, ca: Path, *, cert: Path | None = None, key: Path | None = None,
                     token: str | None = None, user: str = "admin") -> None:
    require_loopback(server.split("//", 1)[1].rsplit(":", 1)[0], "API server")
    credentials: dict[str, Any] = {"token": token} if token else {"client-certificate": str(cert),
                                                                   "client-key": str(key)}
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "xpyd-local",
        "clusters": [{"name": "xpyd-local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "xpyd-local", "context": {"cluster": "xpyd-local", "user": user}}],
    }))
    path.chmod(0o600)


class ControlPlane:
    """Starts, inspects and stops one local cluster rooted at a state directory."""

    def __init__(self, state_dir: Path | None = None, binaries: Binaries | None = None) -> None:
        self.state_dir = (state_dir or default_state_dir()).resolve()
        self._binaries = binaries
        self.logs = self.state_dir / "logs"

    @property
    def binaries(self) -> Binaries:
        if self._binaries is None:
            self._binaries = locate_binaries()
        return self._binaries

    # -- processes -----------------------------------------------------------------------------

    def _spawn(self, state: ClusterState, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = (self.logs / f"{name}.log").open("ab")
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, start_new_session=True, cwd=self.state_dir)
        state.pids[name] = process.pid
        state.save()

    def _wait(self, state: ClusterState, name: str, check: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _alive(state.pids[name]):
                raise ClusterError(f"{name} exited during start-up; read {self.logs / (name + '.log')}")
            try:
                if check():
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise ClusterError(f"{name} not ready after {timeout:.0f}s; read {self.logs / (name + '.log')}")

    # -- lifecycle -----------------------------------------------------------------------------

    def up(self, nodes: tuple[NodeSpec, ...] = DEFAULT_NODES, runtime: bool = True,
           progress: Any = print) -> ClusterState:
        """Start everything and return once the API server is ready and every node is Ready."""
        existing = ClusterState.load(self.state_dir)
        if existing is not None and all(_alive(pid) for pid in existing.pids.values()):
            progress(f"cluster already running (state {self.state_dir})")
            return existing
        if existing is not None:
            self.down(progress=lambda _: None)
        started = time.monotonic()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        bins = self.binaries
        files = pki.generate(self.state_dir / "pki")
        state = ClusterState(state_dir=str(self.state_dir), apiserver_port=free_port(), etcd_port=free_port(),
                             started_at=time.time(), pod_ip_octet=random.randint(16, 250))
        state.save()
        try:
            self._start_etcd(state, bins)
            progress(f"etcd ready ({time.monotonic() - started:.1f}s)")
            self._start_apiserver(state, bins, files)
            progress(f"kube-apiserver ready at {state.server} ({time.monotonic() - started:.1f}s)")
            self._start_controllers(state, bins, files)
            self._start_kwok(state, bins)
            self._register_nodes(state, nodes)
            progress(f"{len(nodes)} fake nodes Ready ({time.monotonic() - started:.1f}s)")
            self._start_lws(state, bins, files)
            progress(f"LeaderWorkerSet controller and webhooks ready ({time.monotonic() - started:.1f}s)")
            if bins.prometheus is not None:
                self._start_prometheus(state, bins.prometheus)
                progress(f"prometheus ready at {state.prometheus_url} ({time.monotonic() - started:.1f}s)")
            if runtime:
                self._spawn(state, "runtime", [sys.executable, "-m", "xpyd.cli", "cluster", "runtime",
                                                "--state-dir", str(self.state_dir)])
                self._wait(state, "runtime", lambda: (self.state_dir / "runtime.ready").exists(), 30)
                progress(f"pod runtime running ({time.monotonic() - started:.1f}s)")
        except BaseException:
            self.down(progress=lambda _: None, keep_logs=True)
            raise
        progress(f"cluster up in {time.monotonic() - started:.1f}s; export KUBECONFIG={state.kubeconfig}")
        return state

    def _start_etcd(self, state: ClusterState, bins: Binaries) -> None:
        peer = free_port()
        data = self.state_dir / "etcd"
        self._spawn(state, "etcd", [
            str(bins.etcd), "--name=node0", f"--data-dir={data}",
            f"--listen-client-urls=http://{HOST}:{state.etcd_port}",
            f"--advertise-client-urls=http://{HOST}:{state.etcd_port}",
            f"--listen-peer-urls=http://{HOST}:{peer}", f"--initial-advertise-peer-urls=http://{HOST}:{peer}",
            f"--initial-cluster=node0=http://{HOST}:{peer}", "--unsafe-no-fsync=true",
            f"--listen-metrics-urls=http://{HOST}:{free_port()}",
        ])
        self._wait(state, "etcd", lambda: urllib.request.urlopen(
            f"http://{HOST}:{state.etcd_port}/health", timeout=1).status == 200, 30)

    def _start_apiserver(self, state: ClusterState, bins: Binaries, files: pki.Files) -> None:
        """Start the API server on a port chosen just before (and the kubeconfig pointing at it); a
        port taken meanwhile (a free port is free only when it is chosen: etcd's and the checks'
        outgoing connections take ephemeral ports too) is chosen again, twice at most."""
        for attempt in range(APISERVER_ATTEMPTS):
            state.apiserver_port = free_port()
            state.save()
            write_kubeconfig(state.kubeconfig, state.server, files.ca_cert, cert=files.admin_cert, key=files.admin_key)
            try:
                self._spawn_apiserver(state, bins, files)
                return
            except ClusterError:
                if attempt + 1 == APISERVER_ATTEMPTS or not self._lost_its_port("kube-apiserver"):
                    raise

    def _lost_its_port(self, name: str) -> bool:
        """Whether `name`'s last start-up failed because its port was taken (the end of its log)."""
        log = self.logs / f"{name}.log"
        with log.open("rb") as handle:
            handle.seek(max(0, log.stat().st_size - 4096))
            return b"address already in use" in handle.read()

    def _spawn_apiserver(self, state: ClusterState, bins: Binaries, files: pki.Files) -> None:
        self._spawn(state, "kube-apiserver", [
            str(bins.kube_apiserver), f"--etcd-servers=http://{HOST}:{state.etcd_port}",
            f"--bind-address={HOST}", f"--secure-port={state.apiserver_port}", f"--advertise-address={HOST}",
            "--endpoint-reconciler-type=none",
            f"--tls-cert-file={files.server_cert}", f"--tls-private-key-file={files.server_key}",
            f"--client-ca-file={files.ca_cert}", "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={files.sa_pub}", f"--service-account-signing-key-file={files.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true",
        ])
        context = ssl.create_default_context(cafile=str(files.ca_cert))
        context.load_cert_chain(str(files.admin_cert), str(files.admin_key))

        def ready() -> bool:
            with urllib.request.urlopen(f"{state.server}/readyz", timeout=2, context=context) as response:
                return bool(response.status == 200)

        self._wait(state, "kube-apiserver", ready, 60)

    def _start_controllers(self, state: ClusterState, bins: Binaries, files: pki.Files) -> None:
        controllers = ",".join(["*", *(f"-{name}" for name in DISABLED_CONTROLLERS)])
        ports = {"kube-controller-manager": free_port(), "kube-scheduler": free_port()}
        self._spawn(state, "kube-controller-manager", [
            str(bins.kube_controller_manager), f"--kubeconfig={state.kubeconfig}", f"--bind-address={HOST}",
            f"--secure-port={ports['kube-controller-manager']}", "--leader-elect=false",
            "--use-service-account-credentials=true", f"--service-account-private-key-file={files.sa_key}",
            f"--root-ca-file={files.ca_cert}", f"--controllers={controllers}",
        ])
        self._spawn(state, "kube-scheduler", [
            str(bins.kube_scheduler), f"--kubeconfig={state.kubeconfig}", f"--bind-address={HOST}",
            f"--secure-port={ports['kube-scheduler']}", "--leader-elect=false",
        ])
        # Their serving certificates are self-signed: verification adds nothing on loopback.
        insecure = ssl._create_unverified_context()
        for name, port in ports.items():
            def healthy(port: int = port) -> bool:
                with urllib.request.urlopen(f"https://{HOST}:{port}/healthz", timeout=2, context=insecure) as r:
                    return bool(r.status == 200)

            self._wait(state, name, healthy, 60)

    def _start_kwok(self, state: ClusterState, bins: Binaries) -> None:
        home = self.state_dir / "kwok-home"  # kwok always reads ~/.kwok/kwok.yaml: give it an empty home
        home.mkdir(exist_ok=True)
        stages = Path(__file__).with_name("kwok-stages.yaml")
        self._spawn(state, "kwok", [
            str(bins.kwok), f"--kubeconfig={state.kubeconfig}", f"--config={stages}",
            "--manage-all-nodes=false", f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
            f"--node-ip={HOST}", f"--server-address={HOST}:{free_port()}", "--cidr=127.64.0.0/10",
        ], env={"HOME": str(home)})

    def _start_lws(self, state: ClusterState, bins: Binaries, files: pki.Files) -> None:
        """The LWS CRDs, then its controller with the webhook server on loopback, then the webhook
        configurations pointing at it (registered last: until it serves, they would refuse pods)."""
        admin = Kube.from_kubeconfig(state.kubeconfig)
        definitions = lws.crds(bins.lws_crds)
        for crd in definitions:
            admin.apply(crd)
        directory = self.state_dir / "lws"
        cert_dir = directory / "certs"
        pki.issue_serving_cert(files, cert_dir, "lws-webhook")
        webhook_port, health_port = free_ports(2)
        config = directory / "config.yaml"
        config.write_text(yaml.safe_dump(lws.controller_config(HOST, webhook_port, health_port, cert_dir)))
        deadline = time.monotonic() + 30
        while not all(lws.established(admin.get(crd["apiVersion"], crd["kind"], None, crd["metadata"]["name"]))
                      for crd in definitions):
            if time.monotonic() > deadline:
                raise ClusterError("LeaderWorkerSet CRDs not Established after 30s")
            time.sleep(0.2)
        self._spawn(state, "lws-controller", [str(bins.lws_controller), f"--config={config}"],
                    env={"KUBECONFIG": str(state.kubeconfig)})

        def serving() -> bool:
            with urllib.request.urlopen(f"http://{HOST}:{health_port}/readyz", timeout=2) as response:
                ready = response.status == 200
            with socket.create_connection((HOST, webhook_port), timeout=1):
                return bool(ready)

        self._wait(state, "lws-controller", serving, 60)
        for configuration in lws.webhook_configurations(HOST, webhook_port, files.ca_cert.read_bytes()):
            admin.apply(configuration)

    def _start_prometheus(self, state: ClusterState, binary: Path) -> None:
        """Prometheus scraping the pods the runtime lists in file_sd (the Debian build has no
        Kubernetes discovery), and itself."""
        directory = self.state_dir / "prometheus"
        directory.mkdir(exist_ok=True)
        targets = directory / "targets.json"
        if not targets.exists():
            targets.write_text("[]")
        state.prometheus_port = state.prometheus_port or free_port()  # a restart keeps its address
        address = f"{HOST}:{state.prometheus_port}"
        config = directory / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
            "scrape_configs": [
                {"job_name": "pods", "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "5s"}]},
                {"job_name": "prometheus", "static_configs": [{"targets": [address]}]},
            ],
        }))
        self._spawn(state, "prometheus", [
            str(binary), f"--config.file={config}", f"--web.listen-address={address}",
            f"--storage.tsdb.path={directory / 'data'}", "--storage.tsdb.retention.time=1d",
        ])
        self._wait(state, "prometheus", lambda: urllib.request.urlopen(
            f"http://{address}/-/ready", timeout=1).status == 200, 60)

    def _register_nodes(self, state: ClusterState, nodes: tuple[NodeSpec, ...]) -> None:
        admin = Kube.from_kubeconfig(state.kubeconfig)
        deadline = time.monotonic() + 60
        for node in nodes:
            obj = node_object(node)
            admin.delete("v1", "Node", None, node.name)
            admin.create(obj)
            # Capacity lives in status, which a create ignores.
            admin.patch("v1", "Node", None, node.name, {"status": obj["status"]}, subresource="status")
        state.nodes = [node.name for node in nodes]
        state.save()
        while time.monotonic() < deadline:
            ready = [n for n in state.nodes if _node_ready(admin.get("v1", "Node", None, n))]
            if len(ready) == len(nodes):
                # Admission tainted the new nodes not-ready; node lifecycle (off here) would lift it.
                for node in nodes:
                    admin.patch("v1", "Node", None, node.name, {"spec": {"taints": node_object(node)["spec"].get(
                        "taints", [])}})
                return
            if not _alive(state.pids["kwok"]):
                raise ClusterError(f"kwok exited; read {self.logs / 'kwok.log'}")
            time.sleep(0.3)
        raise ClusterError(f"fake nodes not Ready after 60s; read {self.logs / 'kwok.log'}")

    def stop_prometheus(self) -> None:
        """Stop Prometheus alone (failure drills: the autoscaler must hold without metrics)."""
        state = self._loaded()
        pid = state.pids.pop("prometheus", None)
        if pid is not None:
            _terminate(pid)
        state.save()

    def start_prometheus(self) -> None:
        """Start Prometheus again at the same address, with the data it had."""
        state = self._loaded()
        if self.binaries.prometheus is None:
            raise ClusterError("no Prometheus binary (run e2e/build/prometheus.sh)")
        if "prometheus" not in state.pids or not _alive(state.pids["prometheus"]):
            self._start_prometheus(state, self.binaries.prometheus)

    def _loaded(self) -> ClusterState:
        state = ClusterState.load(self.state_dir)
        if state is None:
            raise ClusterError(f"no cluster in {self.state_dir}")
        return state

    def down(self, progress: Any = print, keep_logs: bool = False) -> None:
        """Stop every process of the cluster and remove its state."""
        state = ClusterState.load(self.state_dir)
        if state is not None:
            # Reverse start order: the runtime first (it stops the pod processes), etcd last.
            for name, pid in reversed(list(state.pids.items())):
                _terminate(pid)
                progress(f"stopped {name}")

        if self.state_dir.exists() and (killed := kill_leftover_pods(self.state_dir)):
            progress(f"killed {killed} pod process(es) the runtime left behind")
        if self.state_dir.exists():
            for child in self.state_dir.iterdir():
                if keep_logs and child.name == "logs":
                    continue
                _remove(child)
        progress(f"removed {self.state_dir}" if not keep_logs else f"logs kept in {self.logs}")

    def status(self) -> dict[str, Any]:
        state = ClusterState.load(self.state_dir)
        if state is None:
            return {"running": False, "state_dir": str(self.state_dir)}
        processes = {name: {"pid": pid, "alive": _alive(pid)} for name, pid in state.pids.items()}
        return {"running": all(p["alive"] for p in processes.values()), "state_dir": str(self.state_dir),
                "server": state.server, "prometheus": state.prometheus_url, "kubeconfig": str(state.kubeconfig),
                "processes": processes,
                "nodes": state.nodes, "uptime_seconds": round(time.time() - state.started_at)}


def _node_ready(node: dict[str, Any] | None) -> bool:
    return condition(node, "Ready").get("status") == "True"


def _terminate(pid: int, grace: float = 10.0) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        for child in path.iterdir():
            _remove(child)
        path.rmdir()
    else:
        path.unlink(missing_ok=True)
