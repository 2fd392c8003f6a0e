"""The operator at scale, on the local control plane: N DisaggregatedServings applied at once, then
left idle, then drift, then deleted.

    python benchmarks/operator_scale.py [--pools 100 200 1000] [--idle-seconds 60] [--workers 8] [--no-floor]

One local cluster (real etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok nodes;
no pod runtime: pods are created and scheduled but never run, so the cluster holds thousands of
them) and the operator run out of cluster as `xpyd operator -A`, with the chart's RBAC, as the
chart's ServiceAccount. Per round (a namespace of its own, the nixl sample copied N times):

- apply: `kubectl create` of the N objects (one request each); its wall time;
- children: for each pool, the time from its DisaggregatedServing appearing to every child it
  renders (Deployments, Services, PDBs, ServiceAccount, Role, RoleBinding) existing, p50/p99/max,
  and the time after the create returned until the last pool was complete (times come from a
  watch of the benchmark's own);
- idle (after the operator has written nothing for 5 s): for `--idle-seconds`, the API requests the
  kube-apiserver dispatched for the operator's ServiceAccount (its own
  `apiserver_flowcontrol_dispatched_requests_total`, through a FlowSchema matching only that
  account: watch (re)starts included), the operator's own count of requests other than watches
  (`xpyd_operator_api_requests_total`), its writes, CPU (share of one core) and RSS;
- drift: a child Deployment deleted, another scaled to 9 replicas: seconds until the operator
  restored each, from the event;
- delete: the N objects deleted; seconds until their children were garbage-collected.

The floor (first, on a cluster of its own, unless `--no-floor`): the same rounds' create and
convergence with no operator, the children written by a `FloorWriter` that renders and applies them
as the operator's reconcile does and does nothing else, and the garbage collector's clean-up. On
two cores the control plane's own work bounds the convergence: the floor is the time these writes
take on this machine, and the operator is judged by its ratio to it (printed at the end).

Exits 1 when a pool does not converge, drift is not repaired, or the idle operator wrote anything.
The figures are for comparison between versions on one machine (the control plane, the operator
and the benchmark share its cores).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from procstats import cpu_seconds, rss_kib

from xpyd.api import models
from xpyd.api.load import parse_serving
from xpyd.api.naming import SERVING_LABEL
from xpyd.cluster.binaries import Binaries, locate_binaries
from xpyd.cluster.controlplane import ClusterState, ControlPlane, free_port, write_kubeconfig
from xpyd.common.jsontypes import JSON
from xpyd.common.stats import percentile
from xpyd.controller.reconcile import apply_in_waves, desired_children
from xpyd.controller.watches import CHILD_KINDS
from xpyd.kube import Kube
from xpyd.kube.cache import Cache, Kind
from xpyd.render import RenderOptions, render

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "manifests" / "samples" / "nixl.yaml"
CRD = ROOT / "crds" / "xpyd.io_disaggregatedservings.yaml"
CHART = ROOT / "charts" / "xpyd-operator"
OPERATOR_NAMESPACE = "xpyd-system"
OPERATOR_SA = "xpyd-operator"
FLOW_SCHEMA = "xpyd-operator-bench"
WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class BenchError(RuntimeError):
    pass


# ---- the cluster and the operator ------------------------------------------------------------------


@dataclass
class Setup:
    plane: ControlPlane
    binaries: Binaries
    state: ClusterState
    admin: Kube
    kubeconfig: Path
    operator_kubeconfig: Path
    workdir: Path

    def kubectl(self, *args: str, stdin: str | None = None, timeout: float = 600) -> str:
        result = subprocess.run([str(self.binaries.kubectl), *args], input=stdin, capture_output=True, text=True,
                                env={**os.environ, "KUBECONFIG": str(self.kubeconfig)}, timeout=timeout, check=False)
        if result.returncode != 0:
            raise BenchError(f"kubectl {' '.join(args[:3])} failed: {result.stderr.strip()[:2000]}")
        return result.stdout


def start_cluster(workdir: Path) -> Setup:
    """The cluster, the CRD, the chart's RBAC and a kubeconfig of the operator's ServiceAccount (the
    cluster is stopped again if any of it fails)."""
    binaries = locate_binaries()
    plane = ControlPlane(workdir / "cluster", binaries)
    state = plane.up(runtime=False, progress=lambda message: None)
    plane.stop_prometheus()  # nothing here needs it, and it would scrape the pods
    setup = Setup(plane, binaries, state, Kube.from_kubeconfig(state.kubeconfig), state.kubeconfig,
                  workdir / "operator.kubeconfig", workdir)
    try:
        install(setup)
    except BaseException:
        plane.down(progress=lambda message: None)
        raise
    return setup


def install(setup: Setup) -> None:
    state, binaries = setup.state, setup.binaries
    setup.kubectl("apply", "--server-side", "-f", str(CRD))
    deadline = time.monotonic() + 60
    while not any(c["type"] == "Established" and c["status"] == "True" for c in (json.loads(
            setup.kubectl("get", "crd/disaggregatedservings.xpyd.io", "-o", "json")).get("status") or {}).get(
            "conditions") or []):
        if time.monotonic() > deadline:
            raise BenchError("the CRD was not established within 60 s")
        time.sleep(0.2)
    setup.kubectl("create", "namespace", OPERATOR_NAMESPACE)
    # The chart's RBAC and ServiceAccount (not its Deployment: the operator runs here, out of cluster).
    helm = subprocess.run([str(binaries.helm), "template", "xpyd-operator", str(CHART), "--namespace",
                           OPERATOR_NAMESPACE], capture_output=True, text=True, check=True, timeout=120)
    rbac = [doc for doc in yaml.safe_load_all(helm.stdout)
            if doc and doc["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")]
    setup.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(rbac))
    setup.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(flow_schema()))
    token = setup.kubectl("create", "token", OPERATOR_SA, "-n", OPERATOR_NAMESPACE, "--duration=6h").strip()
    write_kubeconfig(setup.operator_kubeconfig, state.server, Path(state.state_dir) / "pki" / "ca.crt",
                     token=token, user=OPERATOR_SA)


def flow_schema() -> dict[str, Any]:
    """A FlowSchema matching only the operator's ServiceAccount, so the API server counts its requests
    apart (`apiserver_flowcontrol_dispatched_requests_total{flow_schema=...}`)."""
    return {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema", "metadata": {"name": FLOW_SCHEMA},
        "spec": {
            "matchingPrecedence": 100, "priorityLevelConfiguration": {"name": "workload-high"},
            "distinguisherMethod": {"type": "ByUser"},
            "rules": [{
                "subjects": [{"kind": "ServiceAccount",
                              "serviceAccount": {"name": OPERATOR_SA, "namespace": OPERATOR_NAMESPACE}}],
                "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"], "clusterScope": True,
                                   "namespaces": ["*"]}],
                "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
            }],
        },
    }


class OperatorProcess:
    """`xpyd operator -A` as the chart's ServiceAccount, with its /metrics on a local port."""

    def __init__(self, setup: Setup, workers: int) -> None:
        self.port = free_port()
        self.log = (setup.workdir / "operator.log").open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "xpyd.cli", "operator", "-A", "--liveness", "",
             "--metrics", f"http://127.0.0.1:{self.port}/metrics", "--workers", str(workers)],
            env={**os.environ, "KUBECONFIG": str(setup.operator_kubeconfig)}, stdout=self.log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while not self.synced():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"the operator did not start; read {setup.workdir / 'operator.log'}")
            time.sleep(0.2)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as response:
            return str(response.read().decode())

    def synced(self) -> bool:
        try:
            text = self.metrics()
        except OSError:
            return False
        values = re.findall(r'^xpyd_operator_cache_synced\{kind="[^"]+"\} (\S+)$', text, re.M)
        return bool(values) and all(float(v) == 1 for v in values)

    def requests(self) -> dict[tuple[str, str], float]:
        """The operator's own request counts by (verb, resource)."""
        counts: dict[tuple[str, str], float] = {}
        for labels, value in re.findall(r'^xpyd_operator_api_requests_total\{([^}]*)\} (\S+)$', self.metrics(), re.M):
            found = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            key = (found["verb"], found["resource"])
            counts[key] = counts.get(key, 0.0) + float(value)
        return counts

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.process.pid)

    def rss_mb(self) -> float:
        return rss_kib(self.process.pid) / 1024

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def control_plane_cpu(setup: Setup) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in setup.state.pids.items()
            if name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")}


def apiserver_dispatched(setup: Setup) -> float:
    """The API server's count of requests dispatched for the operator's FlowSchema."""
    text = setup.kubectl("get", "--raw", "/metrics")
    return sum(float(v) for v in re.findall(
        rf'^apiserver_flowcontrol_dispatched_requests_total\{{[^}}]*flow_schema="{FLOW_SCHEMA}"[^}}]*\}} (\S+)$',
        text, re.M))


# ---- what the benchmark sees ---------------------------------------------------------------------


class Observer:
    """A watch of the benchmark's own on the pools and their children: when each appeared, changed
    or went."""

    def __init__(self, kube: Kube, namespace: str, on_pool: Callable[[JSON], None] | None = None) -> None:
        self.on_pool = on_pool  # called with each DisaggregatedServing when it first appears
        self.seen: dict[tuple[str, str, str], float] = {}  # (kind, namespace, name) -> first ADDED
        self.events: list[tuple[float, str, str, str, str, JSON | None]] = []
        self.lock = threading.Lock()
        kinds = [Kind(models.API_VERSION, models.KIND), *(Kind(av, k, SERVING_LABEL) for av, k in CHILD_KINDS)]
        self.cache = Cache(kube, kinds, [namespace], on_change=self._changed)
        self.cache.start()
        if self.cache.wait_synced(60):
            raise BenchError("the benchmark's own watch did not list")

    def _changed(self, kind: Kind, old: JSON | None, new: JSON | None) -> None:
        now = time.monotonic()
        obj = new or old or {}
        meta = obj.get("metadata", {})
        what = "DELETED" if new is None else "ADDED" if old is None else "MODIFIED"
        with self.lock:
            if what == "ADDED":
                self.seen.setdefault((kind.kind, meta.get("namespace", ""), meta.get("name", "")), now)
            self.events.append((now, what, kind.kind, meta.get("namespace", ""), meta.get("name", ""), new))
        if what == "ADDED" and kind.kind == models.KIND and self.on_pool is not None and new is not None:
            self.on_pool(new)

    def first_seen(self, kind: str, namespace: str, name: str) -> float | None:
        with self.lock:
            return self.seen.get((kind, namespace, name))

    def wait_for(self, check: Any, timeout: float, what: str) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return time.monotonic()
            time.sleep(0.05)
        raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}")

    def stop(self) -> None:
        self.cache.stop()


class FloorWriter:
    """The floor the operator is judged against: each pool's children rendered and applied exactly
    as the operator's reconcile does (the same render, two waves of server-side applies sent
    together, `workers` pools at once), as soon as the benchmark's watch sees the pool, by a writer
    that does nothing else (no caches to feed, no status, no Events, no pod watch). It writes as the
    operator's ServiceAccount, so authorisation costs the API server the same."""

    def __init__(self, kube: Kube, workers: int) -> None:
        self.kube = kube
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="floor")
        self.futures: list[Future[None]] = []

    def pool_added(self, body: JSON) -> None:
        self.futures.append(self.executor.submit(self._write, body))

    def _write(self, body: JSON) -> None:
        apply_in_waves(self.kube, desired_children(body, parse_serving(body), RenderOptions()))

    def check(self) -> None:
        """Raise the first failure among the writes finished so far (as a BenchError)."""
        for future in list(self.futures):
            if future.done() and (error := future.exception()) is not None:
                raise BenchError(f"the floor writer could not write a pool's children: {error}") from error

    def stop(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


def pools(count: int, namespace: str) -> list[JSON]:
    sample = yaml.safe_load(SAMPLE.read_text())
    result = []
    for index in range(count):
        obj = copy.deepcopy(sample)
        obj["metadata"] = {"name": f"pool-{index:04d}", "namespace": namespace}
        result.append(obj)
    return result


def children_of(obj: JSON) -> list[tuple[str, str]]:
    """(kind, name) of every child the operator renders for `obj`."""
    meta = obj["metadata"]
    serving = parse_serving({**obj, "status": {}})
    return [(child["kind"], child["metadata"]["name"])
            for child in render(meta["name"], meta["namespace"], serving.spec)]


# ---- one round -------------------------------------------------------------------------------------


@dataclass
class Round:
    pools: int
    #: Who wrote the children: "operator", or "floor" (a FloorWriter, no operator running).
    writer: str = "operator"
    create_s: float = 0.0
    children_s: list[float] = field(default_factory=list)
    last_after_create_s: float = 0.0
    converge_dispatched: float = 0.0
    converge_requests: float = 0.0
    converge_by_kind: dict[tuple[str, str], float] = field(default_factory=dict)
    #: CPU seconds each control-plane process and the operator used from the create until the
    #: last child existed: what bounds the convergence time from below on this machine.
    converge_cpu: dict[str, float] = field(default_factory=dict)
    idle_s: float = 0.0
    idle_dispatched: float = 0.0
    idle_requests: dict[tuple[str, str], float] = field(default_factory=dict)
    idle_cpu_s: float = 0.0
    rss_mb: float = 0.0
    drift_delete_s: float = 0.0
    drift_scale_s: float = 0.0
    cleanup_s: float = 0.0

    @property
    def idle_writes(self) -> float:
        return sum(n for (verb, _), n in self.idle_requests.items() if verb in WRITE_VERBS)

    @property
    def idle_non_watch(self) -> float:
        return sum(n for (verb, _), n in self.idle_requests.items() if verb != "WATCH")


def delta(after: dict[tuple[str, str], float], before: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items() if value - before.get(key, 0.0) > 0}


def quiesce(operator: OperatorProcess, quiet_s: float = 5.0, timeout: float = 600.0) -> None:
    """Wait until the operator has written nothing for `quiet_s`."""
    deadline = time.monotonic() + timeout
    last = -1.0
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        writes = sum(n for (verb, _), n in operator.requests().items() if verb in WRITE_VERBS)
        if writes != last:
            last, quiet_since = writes, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return
        time.sleep(0.5)
    raise BenchError("the operator kept writing")


def converge(setup: Setup, observer: Observer, namespace: str, result: Round, timeout: float,
             writer_cpu: Callable[[], float], check: Callable[[], None] = lambda: None) -> None:
    """`kubectl create` of `result.pools` pools in `namespace`, then wait until every child exists
    (`check` raises meanwhile when the writer failed); the times and the CPU seconds each process
    used meanwhile, in `result`."""
    objects = pools(result.pools, namespace)
    expected = {obj["metadata"]["name"]: children_of(obj) for obj in objects}
    cpu_before = {**control_plane_cpu(setup), result.writer: writer_cpu()}
    started = time.monotonic()
    setup.kubectl("create", "-f", "-", stdin=yaml.safe_dump_all(objects), timeout=timeout)
    created = time.monotonic()
    result.create_s = created - started

    def complete() -> bool:
        check()
        return all(observer.first_seen(kind, namespace, name) is not None
                   for children in expected.values() for kind, name in children)
    done = observer.wait_for(complete, timeout, f"the children of {result.pools} pools")
    cpu_after = {**control_plane_cpu(setup), result.writer: writer_cpu()}
    result.converge_cpu = {name: cpu_after[name] - cpu_before.get(name, 0.0) for name in cpu_after}
    for pool, children in expected.items():
        appeared = observer.first_seen(models.KIND, namespace, pool)
        assert appeared is not None
        last = max(observer.first_seen(kind, namespace, name) or done for kind, name in children)
        result.children_s.append(max(0.0, last - appeared))
    result.last_after_create_s = max(0.0, max(observer.first_seen(k, namespace, n) or done
                                              for children in expected.values() for k, n in children) - created)


def run_round(setup: Setup, operator: OperatorProcess, count: int, idle_seconds: float,
              converge_timeout: float) -> Round:
    namespace = f"bench-{count}"
    setup.kubectl("create", "namespace", namespace)
    observer = Observer(setup.admin, namespace)
    result = Round(pools=count)
    try:
        dispatched, requests = apiserver_dispatched(setup), operator.requests()
        converge(setup, observer, namespace, result, converge_timeout, operator.cpu_seconds)
        quiesce(operator, timeout=converge_timeout)
        # Both counts of the same requests, the API server's and the operator's: they must agree.
        result.converge_dispatched = apiserver_dispatched(setup) - dispatched
        result.converge_by_kind = delta(operator.requests(), requests)
        result.converge_requests = sum(result.converge_by_kind.values())
        requests, dispatched, cpu = operator.requests(), apiserver_dispatched(setup), operator.cpu_seconds()
        idle_started = time.monotonic()
        time.sleep(idle_seconds)
        result.idle_s = time.monotonic() - idle_started
        result.idle_requests = delta(operator.requests(), requests)
        result.idle_cpu_s = operator.cpu_seconds() - cpu
        result.idle_dispatched = apiserver_dispatched(setup) - dispatched
        result.rss_mb = operator.rss_mb()

        result.drift_delete_s, result.drift_scale_s = drift(setup, observer, namespace)
        result.cleanup_s = cleanup(setup, observer, namespace, converge_timeout)
    finally:
        observer.stop()
        with contextlib.suppress(BenchError, subprocess.TimeoutExpired):
            setup.kubectl("delete", "namespace", namespace, "--wait=false")
    return result


def run_floor_round(setup: Setup, count: int, workers: int, converge_timeout: float) -> Round:
    """The same round with a FloorWriter in place of the operator (on a cluster no operator runs on):
    the convergence and the clean-up (the garbage collector's), nothing the operator alone does."""
    namespace = f"floor-{count}"
    setup.kubectl("create", "namespace", namespace)
    writer = FloorWriter(Kube.from_kubeconfig(setup.operator_kubeconfig), workers)
    observer = Observer(setup.admin, namespace, on_pool=writer.pool_added)
    result = Round(pools=count, writer="floor")
    try:
        converge(setup, observer, namespace, result, converge_timeout, lambda: cpu_seconds(os.getpid()),
                 writer.check)
        result.cleanup_s = cleanup(setup, observer, namespace, converge_timeout)
    finally:
        observer.stop()
        writer.stop()
        with contextlib.suppress(BenchError, subprocess.TimeoutExpired):
            setup.kubectl("delete", "namespace", namespace, "--wait=false")
    return result


def drift(setup: Setup, observer: Observer, namespace: str) -> tuple[float, float]:
    """Seconds from a child's deletion (and from a child's scale) to the operator's repair, both
    measured from the benchmark's watch event of the change."""
    deployments = observer.cache.reflectors[("apps/v1", "Deployment")][0]

    def event_after(start: float, what: str, name: str, check: Any = lambda obj: True) -> float | None:
        with observer.lock:
            for when, kind, obj_kind, _, obj_name, obj in observer.events:
                if when >= start and kind == what and obj_kind == "Deployment" and obj_name == name and check(obj):
                    return when
        return None

    mark = time.monotonic()
    setup.kubectl("delete", "deployment", "pool-0000-decode", "-n", namespace, "--wait=false")
    gone = observer.wait_for(lambda: event_after(mark, "DELETED", "pool-0000-decode"), 30, "the deletion")
    back = observer.wait_for(lambda: deployments.get(namespace, "pool-0000-decode") is not None, 30,
                             "the deleted Deployment to come back")
    deleted_at = event_after(mark, "DELETED", "pool-0000-decode") or gone

    mark = time.monotonic()
    setup.kubectl("scale", "deployment", "pool-0001-prefill", "-n", namespace, "--replicas=9")
    scaled = observer.wait_for(lambda: event_after(mark, "MODIFIED", "pool-0001-prefill",
                                                   lambda o: o and o["spec"]["replicas"] == 9), 30, "the scale")
    restored = observer.wait_for(lambda: event_after(mark, "MODIFIED", "pool-0001-prefill",
                                                     lambda o: o and o["spec"]["replicas"] == 1), 30,
                                 "the replicas to be restored")
    scaled_at = event_after(mark, "MODIFIED", "pool-0001-prefill", lambda o: o and o["spec"]["replicas"] == 9)
    return back - deleted_at, restored - (scaled_at or scaled)


def cleanup(setup: Setup, observer: Observer, namespace: str, timeout: float) -> float:
    """Seconds from deleting every pool until their children are gone (garbage collection)."""
    started = time.monotonic()
    setup.kubectl("delete", "disaggregatedservings", "--all", "-n", namespace, "--wait=false", timeout=timeout)

    def empty() -> bool:
        return all(not reflector.keys() for (_, kind), group in observer.cache.reflectors.items()
                   for reflector in group)
    return observer.wait_for(empty, timeout, "the children to be garbage-collected") - started


# ---- the table ---------------------------------------------------------------------------------------


def header(workers: int, floor: bool) -> Iterator[str]:
    yield (f"operator: xpyd operator -A --workers {workers}, out of cluster; {os.cpu_count()} cores shared with "
           "the control plane")
    if floor:
        yield (f"floor: the same children rendered and applied as the operator does, {workers} pools at once, by a "
               "writer that does nothing else, on a cluster of its own with no operator")
    yield (f"{'writer':>8} {'pools':>6} {'create s':>9} {'children p50 s':>15} {'p99 s':>6} {'max s':>6} "
           f"{'last after create s':>20} {'idle req/s':>11} {'non-watch req/s':>16} {'idle writes':>12} "
           f"{'CPU %':>6} {'RSS MB':>7} {'drift del s':>12} {'drift scale s':>14} {'cleanup s':>10} "
           f"{'converge req (apiserver/own)':>29}")


def row(r: Round) -> str:
    children = sorted(r.children_s)
    line = (f"{r.writer:>8} {r.pools:>6} {r.create_s:>9.1f} {percentile(children, 0.5):>15.2f} "
            f"{percentile(children, 0.99):>6.2f} {max(children):>6.2f} {r.last_after_create_s:>20.2f} ")
    if r.writer == "floor":  # what only an operator does is not measured
        return line + (f"{'-':>11} {'-':>16} {'-':>12} {'-':>6} {'-':>7} {'-':>12} {'-':>14} {r.cleanup_s:>10.1f} "
                       f"{'-':>29}")
    return line + (f"{r.idle_dispatched / r.idle_s:>11.3f} {r.idle_non_watch / r.idle_s:>16.3f} "
                   f"{r.idle_writes:>12.0f} {100 * r.idle_cpu_s / r.idle_s:>6.2f} {r.rss_mb:>7.0f} "
                   f"{r.drift_delete_s:>12.2f} {r.drift_scale_s:>14.2f} {r.cleanup_s:>10.1f} "
                   f"{f'{r.converge_dispatched:.0f}/{r.converge_requests:.0f}':>29}")


def details(r: Round) -> Iterator[str]:
    if r.converge_by_kind:
        detail = ", ".join(f"{verb} {resource}: {n:.0f}" for (verb, resource), n in sorted(r.converge_by_kind.items()))
        yield f"  {r.pools} pools, requests until converged by verb and resource: {detail}"
    cpu = ", ".join(f"{name} {seconds:.1f}" for name, seconds in r.converge_cpu.items())
    total = sum(r.converge_cpu.values())
    yield (f"  {r.writer} {r.pools} pools, CPU seconds from the create to the last child: {cpu}; together "
           f"{total:.1f}, {total / (os.cpu_count() or 1):.1f} s of wall time on {os.cpu_count()} cores")
    if r.idle_requests:
        detail = ", ".join(f"{verb} {resource}: {n:.0f}" for (verb, resource), n in sorted(r.idle_requests.items()))
        yield f"  {r.pools} pools, idle requests by verb and resource: {detail}"


def against_floor(rounds: list[Round]) -> Iterator[str]:
    """The operator's convergence beside the floor's, per pool count."""
    floors = {r.pools: r for r in rounds if r.writer == "floor"}
    for r in rounds:
        floor = floors.get(r.pools)
        if r.writer != "operator" or floor is None:
            continue
        p50, floor_p50 = percentile(sorted(r.children_s), 0.5), percentile(sorted(floor.children_s), 0.5)
        yield (f"  {r.pools} pools, operator / floor: last child after the create {r.last_after_create_s:.2f} / "
               f"{floor.last_after_create_s:.2f} s ({ratio(r.last_after_create_s, floor.last_after_create_s)}), "
               f"children p50 {p50:.2f} / {floor_p50:.2f} s ({ratio(p50, floor_p50)}), "
               f"create {r.create_s:.1f} / {floor.create_s:.1f} s")


def ratio(value: float, floor: float) -> str:
    return f"{value / floor:.2f}x" if floor > 0 else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pools", type=int, nargs="+", default=[100, 200, 1000])
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help="skip the floor rounds (a cluster of their own, before the operator's)")
    parser.add_argument("--converge-timeout", type=float, default=900.0,
                        help="seconds a step may take before the run fails")
    parser.add_argument("--json", type=Path, help="also write the rounds as JSON here")
    args = parser.parse_args()
    rounds: list[Round] = []
    out = sys.stdout
    for line in header(args.workers, args.floor):
        out.write(line + "\n")
    with tempfile.TemporaryDirectory(prefix="xpyd-operator-scale-") as tmp:
        try:
            if args.floor:
                rounds.extend(floor_rounds(Path(tmp) / "floor", args, out))
            rounds.extend(operator_rounds(Path(tmp) / "operator", args, out))
        except BenchError as error:
            sys.stderr.write(f"operator_scale: {error}\n")
            with contextlib.suppress(OSError):
                sys.stderr.write((Path(tmp) / "operator" / "operator.log").read_text()[-4000:])
            return 1
    for r in rounds:
        for line in details(r):
            out.write(line + "\n")
    for line in against_floor(rounds):
        out.write(line + "\n")
    if args.json:
        args.json.write_text(json.dumps([{**r.__dict__, **{
            name: {f"{verb} {resource}": n for (verb, resource), n in getattr(r, name).items()}
            for name in ("idle_requests", "converge_by_kind")}} for r in rounds], indent=2))
    bad = [r.pools for r in rounds if r.idle_writes]
    if bad:
        sys.stderr.write(f"operator_scale: the idle operator wrote ({bad} pools)\n")
        return 1
    return 0


@contextlib.contextmanager
def cluster(workdir: Path) -> Iterator[Setup]:
    """A cluster of its own in `workdir`, stopped afterwards."""
    workdir.mkdir()
    setup = start_cluster(workdir)
    try:
        yield setup
    finally:
        setup.plane.down(progress=lambda message: None)


def printed(result: Round, out: Any) -> Round:
    out.write(row(result) + "\n")
    out.flush()
    return result


def floor_rounds(workdir: Path, args: argparse.Namespace, out: Any) -> Iterator[Round]:
    with cluster(workdir) as setup:
        for count in args.pools:
            yield printed(run_floor_round(setup, count, args.workers, args.converge_timeout), out)


def operator_rounds(workdir: Path, args: argparse.Namespace, out: Any) -> Iterator[Round]:
    with cluster(workdir) as setup:
        operator = OperatorProcess(setup, args.workers)
        try:
            for count in args.pools:
                yield printed(run_round(setup, operator, count, args.idle_seconds, args.converge_timeout), out)
        finally:
            operator.stop()


if __name__ == "__main__":
    sys.exit(main())
