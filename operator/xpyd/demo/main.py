"""`xpyd demo`: the main job on an embedded default, on a local cluster, narrated step by step.

1. builds the control plane's binaries if they are missing (cached in ~/.cache/xpyd);
2. starts the local control plane (real API server on loopback, fake GPU nodes, Prometheus, the pod
   process runtime) in a state directory of its own;
3. installs the operator with the Helm chart and waits for it;
4. applies a DisaggregatedServing with autoscaling Auto and waits until it is Ready;
5. replays a minute of a prefill-heavy slice of the Azure code trace through a ready proxy pod
   (`xpyd bench`, loopback only) with a live view of the pool, the latency and the autoscaler;
6. prints a summary and writes a PNG plot and a JSON summary;
7. tears everything down (`--keep` leaves the cluster up and says how to use it).

Every step prints one line with the seconds since the start; a failure names the step and the logs
to read and exits 1 (130 when interrupted). The cluster is torn down on failure and Ctrl-C too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from xpyd.api import models
from xpyd.bench import BenchConfig, BenchError, BenchResult, RequestRecord, SloMs, run_bench
from xpyd.bench.runner import plan_arrivals
from xpyd.cluster.binaries import (
    Binaries,
    BinariesMissing,
    build_script,
    cache_dir,
    env_file,
    locate_binaries,
    prometheus_env_file,
    read_env_file,
)
from xpyd.cluster.controlplane import ClusterError, ClusterState, ControlPlane
from xpyd.common.jsontypes import JSON
from xpyd.common.netguard import LOOPBACK_ONLY_ENV, NonLoopbackAddress, require_loopback, require_loopback_url
from xpyd.demo import view
from xpyd.demo.manifest import DemoPool, serving_manifest
from xpyd.demo.plot import write_plot
from xpyd.demo.timeline import PoolSample, demo_report, latency_so_far, sample_from_status
from xpyd.kube import Kube, KubeError
from xpyd.kube.pods import condition, pod_ready

ROOT = Path(__file__).resolve().parents[3]
"""The source checkout: the chart and the trace fixtures come from it."""
CHART = ROOT / "charts" / "xpyd-operator"
DEFAULT_TRACE = ROOT / "tests" / "fixtures" / "traces" / "azure_conv_2023_600s_240s.csv"
DEFAULT_PLOT = Path("build") / "demo" / "demo.png"
OPERATOR_NAMESPACE = "xpyd-system"
RELEASE = "xpyd-operator"
TOTAL_STEPS = 7
READY_TIMEOUT_S = 120.0
BENCH_TIMEOUT_S = 60.0
MAX_CONCURRENCY = 512
"""Requests in flight beyond it are dropped (counted as failed): the client's own bound."""
"""Per request: a request not answered within it is counted as failed."""


def default_state_dir() -> Path:
    """The demo's own cluster state directory (apart from `xpyd cluster`'s default)."""
    return cache_dir() / "demo"


@dataclass(frozen=True)
class DemoOptions:
    """What to run and where to write it."""

    state_dir: Path
    plot: Path
    trace: Path
    speedup: float
    duration_s: float | None
    sample_s: float
    keep: bool
    pool: DemoPool = field(default_factory=DemoPool)

    @property
    def summary_json(self) -> Path:
        """The JSON summary, next to the plot."""
        return self.plot.with_suffix(".json")


class DemoFailed(RuntimeError):
    """A step cannot go on; the message says why."""


@dataclass
class DemoStep:
    """The step in progress: its number, what it does, and where its logs are (files, and pod-log
    name prefixes `<namespace>_<pod>` resolved when it fails)."""

    number: int
    title: str
    logs: tuple[Path, ...] = ()
    pods: tuple[str, ...] = ()


class LoadRun:
    """`run_bench` in a background thread, collecting each record as its request finishes."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.result: BenchResult | None = None
        self.error: BaseException | None = None
        self._records: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="xpyd-demo-load", daemon=True)

    def _record(self, record: RequestRecord) -> None:
        with self._lock:
            self._records.append(record)

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as error:  # handed to the main thread by `join`'s caller
            self.error = error

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.result = await run_bench(self.config, self._record, self._stop)

    def start(self) -> None:
        """Start sending."""
        self._thread.start()

    def join(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s`; True once the run has ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Send nothing more (requests in flight still finish, each within its timeout)."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)

    def records(self) -> list[RequestRecord]:
        """The records of the requests finished so far."""
        with self._lock:
            return list(self._records)


class Demo:
    """One run of the demo, writing its narrative to `out` (and failures to `err`)."""

    def __init__(self, options: DemoOptions, out: TextIO, err: TextIO) -> None:
        self.options = options
        self.out, self.err = out, err
        self.plane = ControlPlane(options.state_dir)
        self.started = time.monotonic()
        self.step: DemoStep | None = None
        self.binaries: Binaries | None = None
        self.state: ClusterState | None = None
        self.load: LoadRun | None = None

    # -- narration ------------------------------------------------------------------------------

    def _write(self, text: str, stream: TextIO | None = None) -> None:
        target = stream or self.out
        target.write(text + "\n")
        target.flush()

    def begin(self, title: str, logs: Sequence[Path] = (), pods: Sequence[str] = (), number: int = 0) -> None:
        """Start the next step (or step `number`) and say so."""
        number = number or (self.step.number + 1 if self.step else 1)
        self.step = DemoStep(number, title, tuple(logs), tuple(pods))
        self._write(view.step_line(time.monotonic() - self.started, number, TOTAL_STEPS, title))

    def detail(self, text: str) -> None:
        """A line of detail under the current step."""
        self._write(view.detail_line(text))

    # -- the run --------------------------------------------------------------------------------

    def run(self) -> int:
        """Run every step; 0 on success, 1 on failure, 130 when interrupted. The cluster is torn down
        at the end (unless `keep`), whatever happened."""
        previous = signal.signal(signal.SIGTERM, _interrupt)
        code, failure = 0, ""
        try:
            self._steps()
        except KeyboardInterrupt:
            code = 130
            failure = self._failure("interrupted")
        except (DemoFailed, ClusterError, BinariesMissing, KubeError, BenchError, NonLoopbackAddress, OSError,
                subprocess.SubprocessError) as error:
            code = 1
            failure = self._failure(str(error))
        finally:
            self._finish(failed=code != 0)
            signal.signal(signal.SIGTERM, previous)
        if failure:
            self._write(failure, self.err)
        else:
            self._write(f"demo finished in {time.monotonic() - self.started:.0f} s")
        return code

    def _steps(self) -> None:
        self.binaries = self._build()
        self.state = self._cluster(self.binaries)
        kube = Kube.from_kubeconfig(self.state.kubeconfig)
        self._operator(self.binaries, self.state, kube)
        proxy = self._serving(self.state, kube)
        samples, result = self._replay(proxy, kube)
        self._summary(samples, result, kube)

    def _build(self) -> Binaries:
        log = cache_dir() / "logs" / "demo-build.log"
        self.begin("building what is missing (etcd, Kubernetes, kwok, helm, Prometheus; cached in "
                   f"{cache_dir()})", logs=[log])
        try:
            binaries: Binaries | None = locate_binaries(build=False)
        except BinariesMissing:
            binaries = None
        scripts = ([] if binaries is not None else ["build.sh"]) + \
            (["prometheus.sh"] if binaries is None or binaries.prometheus is None else [])
        for name in scripts:
            script = build_script(name)
            if script is None:
                raise DemoFailed(f"e2e/build/{name} is not at hand: run the demo from a checkout of xpyd-operator")
            self.detail(f"running e2e/build/{name}" + (" (the first build takes about 16 minutes on 2 cores)"
                                                       if name == "build.sh" else ""))
            _stream(["bash", str(script)], log, self.detail)
        binaries = locate_binaries(build=False)
        if binaries.prometheus is None:
            raise DemoFailed("no Prometheus binary after e2e/build/prometheus.sh: the autoscaler needs it")
        versions = {**read_env_file(env_file()), **read_env_file(prometheus_env_file())}
        self.detail(f"{'built' if scripts else 'cached'}: etcd {versions.get('ETCD_VERSION', '?')}, Kubernetes "
                    f"{versions.get('KUBERNETES_VERSION', '?')}, kwok {versions.get('KWOK_VERSION', '?')}, helm "
                    f"{versions.get('HELM_VERSION', '?')}, Prometheus {versions.get('PROMETHEUS_VERSION', '?')}")
        return binaries

    def _cluster(self, binaries: Binaries) -> ClusterState:
        self.plane = ControlPlane(self.options.state_dir, binaries)
        self.begin(f"starting the local control plane in {self.plane.state_dir}", logs=[self.plane.logs])
        if ClusterState.load(self.plane.state_dir) is not None:
            self.detail("stopping the cluster an earlier demo left there")
            self.plane.down(progress=lambda _: None)
        state = self.plane.up(progress=self.detail)
        if state.prometheus_url is None:
            raise DemoFailed("Prometheus did not start")
        return state

    def _operator(self, binaries: Binaries, state: ClusterState, kube: Kube) -> None:
        log = self.plane.logs / "helm.log"
        self.begin(f"installing the operator with Helm ({CHART.relative_to(ROOT)})", logs=[log],
                   pods=[f"{OPERATOR_NAMESPACE}_{RELEASE}"])
        env = {**os.environ, "KUBECONFIG": str(state.kubeconfig)}
        _stream([str(binaries.helm), "install", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE,
                 "--create-namespace", "--wait", "--timeout", "120s"], log, lambda _: None, env=env)

        def ready() -> JSON | None:
            deployment = kube.get("apps/v1", "Deployment", OPERATOR_NAMESPACE, RELEASE) or {}
            return deployment if deployment.get("status", {}).get("readyReplicas", 0) >= 1 else None

        _poll(ready, 90.0, f"the {RELEASE} Deployment did not become ready")
        pods = kube.list_objects("v1", "Pod", OPERATOR_NAMESPACE, "app.kubernetes.io/name=xpyd-operator")
        where = ", ".join(f"{p['metadata']['name']} at {p.get('status', {}).get('podIP', '?')}" for p in pods)
        self.detail(f"helm release {RELEASE} deployed in {OPERATOR_NAMESPACE}; operator pod {where}")

    def _serving(self, state: ClusterState, kube: Kube) -> str:
        pool = self.options.pool
        assert state.prometheus_url is not None
        prometheus = require_loopback_url(state.prometheus_url)
        self.begin(f"applying DisaggregatedServing {pool.namespace}/{pool.name} (autoscaling Auto) and waiting "
                   "for Ready", pods=[f"{OPERATOR_NAMESPACE}_{RELEASE}", f"{pool.namespace}_{pool.name}"])
        kube.create(serving_manifest(pool, prometheus))
        self.detail(f"profile {pool.profile}, SLO TTFT p90 <= {pool.ttft_ms} ms and TPOT p90 <= {pool.tpot_ms} ms")
        self.detail(f"prefill 1-{pool.prefill_max_replicas} and decode 1-{pool.decode_max_replicas} replicas, a "
                    f"decision every {pool.interval_s} s over {pool.window_s} s of Prometheus data ({prometheus})")

        def ready() -> JSON | None:
            obj = kube.get(models.API_VERSION, models.KIND, pool.namespace, pool.name) or {}
            return obj if condition(obj, "Ready").get("status") == "True" else None

        obj = _poll(ready, READY_TIMEOUT_S, f"{pool.name} was not Ready after {READY_TIMEOUT_S:.0f} s "
                    f"(kubectl describe xpyd {pool.name})")
        sample = sample_from_status(obj, 0.0)
        proxy = proxy_url(kube.list_objects("v1", "Pod", pool.namespace,
                                            f"xpyd.io/serving={pool.name},xpyd.io/role=proxy"))
        self.detail(f"Ready: prefill {sample.prefill_ready}/{sample.prefill_desired}, decode "
                    f"{sample.decode_ready}/{sample.decode_desired}; proxy pod at {proxy}")
        return proxy

    def _replay(self, proxy: str, kube: Kube) -> tuple[list[PoolSample], BenchResult]:
        options, pool = self.options, self.options.pool
        os.environ[LOOPBACK_ONLY_ENV] = "1"  # this process dials only loopback from here on
        config = BenchConfig(url=proxy, model=pool.served_model, trace=options.trace, speedup=options.speedup,
                             duration_s=options.duration_s, max_concurrency=MAX_CONCURRENCY, timeout_s=BENCH_TIMEOUT_S,
                             slo=SloMs(ttft_ms=pool.ttft_ms, tpot_ms=pool.tpot_ms), loopback_only=True)
        arrivals = plan_arrivals(config)
        load_s = arrivals[-1].at_s if arrivals else 0.0
        self.begin(f"replaying {len(arrivals):,} requests of {options.trace.name} at x{options.speedup:g} "
                   f"(~{load_s:.0f} s) through the proxy, loopback only",
                   pods=[f"{pool.namespace}_{pool.name}-proxy", f"{OPERATOR_NAMESPACE}_{RELEASE}"])
        terminal = self.out.isatty()
        width = shutil.get_terminal_size((160, 24)).columns if terminal else 200
        slo = {"ttft_ms": float(pool.ttft_ms), "tpot_ms": float(pool.tpot_ms)}
        samples: list[PoolSample] = []
        shown = 0
        origin = time.monotonic()

        def sample() -> None:
            nonlocal shown
            try:
                obj = kube.get(models.API_VERSION, models.KIND, pool.namespace, pool.name) or {}
            except KubeError:
                return  # a missed sample; the next one comes in a few seconds
            current = sample_from_status(obj, time.monotonic() - origin)
            samples.append(current)
            latency = latency_so_far(load.records())
            if terminal:
                lines = view.live_block(current, latency, len(arrivals), load_s, slo, width)
                self.out.write(view.redraw(lines, shown))
                self.out.flush()
                shown = len(lines)
            else:
                self._write(view.live_line(current, latency, len(arrivals), width))

        load = self.load = LoadRun(config)
        sample()  # before the load
        load.start()
        while not load.join(options.sample_s):
            sample()
        sample()  # after it
        if load.error is not None:
            raise load.error
        assert load.result is not None
        return samples, load.result

    def _summary(self, samples: list[PoolSample], result: BenchResult, kube: Kube) -> None:
        options, pool = self.options, self.options.pool
        self.begin("summary")
        events = serving_events(kube.list_objects("v1", "Event", pool.namespace,
                                                  field_selector=f"involvedObject.name={pool.name}"))
        settings = {"name": pool.name, "namespace": pool.namespace, "trace": str(options.trace),
                    "trace_name": options.trace.name, "speedup": options.speedup, "duration_s": options.duration_s,
                    "load_s": max((r.scheduled_s for r in result.records), default=0.0), "profile": pool.profile,
                    "slo": {"ttft_ms": pool.ttft_ms, "tpot_ms": pool.tpot_ms}}
        report = demo_report(result.summary, samples, result.records, events, settings, result.config.slo)
        options.summary_json.parent.mkdir(parents=True, exist_ok=True)
        options.summary_json.write_text(json.dumps(report, indent=2) + "\n")
        write_plot(report, options.plot)
        for line in view.summary_lines(report, options.plot, options.summary_json):
            self.detail(line)

    # -- the end --------------------------------------------------------------------------------

    def _failure(self, error: str) -> str:
        """The failure message of the current step (pod logs copied out of the cluster first)."""
        step = self.step or DemoStep(0, "starting")
        pods = _collect_pod_logs(self.plane.state_dir, self.plane.logs / "pods")
        logs = [*step.logs, *(p for p in pods if any(p.name.startswith(prefix) for prefix in step.pods))]
        return view.failure_message(step.number, TOTAL_STEPS, step.title, error, logs or [self.plane.logs])

    def _finish(self, failed: bool) -> None:
        """Stop the load, then tear the cluster down, or say how to use it with `--keep`."""
        if self.load is not None:
            self.load.stop()
        if ClusterState.load(self.plane.state_dir) is None:
            return
        if self.options.keep and self.state is not None and self.binaries is not None:
            self.begin("leaving the cluster up (--keep)", number=TOTAL_STEPS)
            for line in view.keep_lines(self.state.kubeconfig, self.binaries.bin_dir, self.plane.state_dir,
                                        self.options.pool.name):
                self.detail(line)
            return
        self.begin("tearing everything down" + (" (logs kept)" if failed else ""), number=TOTAL_STEPS)
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not strand processes
        try:
            self.plane.down(progress=lambda _: None, keep_logs=failed)
        finally:
            signal.signal(signal.SIGINT, interrupt)
        if self.load is not None:
            self.load.join(BENCH_TIMEOUT_S)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM ends the demo like Ctrl-C: through the teardown."""
    raise KeyboardInterrupt


def _stream(argv: list[str], log: Path, echo: Callable[[str], None], env: dict[str, str] | None = None) -> None:
    """Run `argv`, appending its output to `log` and passing each line to `echo`; DemoFailed on a
    non-zero exit."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as output, subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL, text=True, env=env) as process:
        assert process.stdout is not None
        for line in process.stdout:
            output.write(line)
            output.flush()
            echo(line.rstrip())
    if process.returncode != 0:
        raise DemoFailed(f"{Path(argv[0]).name} {' '.join(Path(a).name for a in argv[1:3])} exited with "
                         f"{process.returncode}")


def _poll(check: Callable[[], JSON | None], timeout_s: float, message: str) -> JSON:
    """Call `check` every half second until it returns an object; DemoFailed with `message` after
    `timeout_s`. API errors count as not yet."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(KubeError):
            if (found := check()) is not None:
                return found
        time.sleep(0.5)
    raise DemoFailed(message)


def proxy_url(pods: Sequence[JSON]) -> str:
    """The URL of a ready proxy pod (its pod IP, loopback here: Service ClusterIPs are never dialled)."""
    for pod in pods:
        if pod_ready(pod):
            port = pod["spec"]["containers"][0]["ports"][0]["containerPort"]
            return f"http://{require_loopback(pod['status']['podIP'], 'proxy pod IP')}:{port}"
    raise DemoFailed("no ready proxy pod")


def serving_events(events: Sequence[JSON]) -> list[dict[str, Any]]:
    """The Events of a DisaggregatedServing, oldest first, as type/reason/message/count/time."""
    ours = [e for e in events if e.get("involvedObject", {}).get("kind") == models.KIND]

    def when(event: JSON) -> str:
        return str(event.get("lastTimestamp") or event.get("eventTime") or
                   event.get("metadata", {}).get("creationTimestamp") or "")

    return [{"type": e.get("type", ""), "reason": e.get("reason", ""), "message": e.get("message", ""),
             "count": int(e.get("count") or 1), "time": when(e)} for e in sorted(ours, key=when)]


def _collect_pod_logs(state_dir: Path, destination: Path) -> list[Path]:
    """Copy every pod process's log (`<state>/pods/<namespace>_<pod>/log`) to `destination`, where a
    teardown keeps them; the copies."""
    copies = []
    for log in sorted((state_dir / "pods").glob("*/log")):
        destination.mkdir(parents=True, exist_ok=True)
        copy = destination / f"{log.parent.name}.log"
        with contextlib.suppress(OSError):
            shutil.copyfile(log, copy)
            copies.append(copy)
    return copies


def add_parser(subparsers: Any) -> None:
    """Register `xpyd demo` on the `xpyd` command's sub-parsers."""
    parser = subparsers.add_parser("demo", help="the main job on a local cluster: operator, an autoscaled pool, "
                                   "a real trace replayed, a live view, a summary and a plot",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", action="store_true", help="leave the cluster running afterwards (for kubectl)")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help=f"the demo cluster's state directory (default {default_state_dir()})")
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT,
                        help=f"PNG to write; the JSON summary goes next to it (default {DEFAULT_PLOT})")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                        help="trace to replay (Azure CSV or Mooncake JSONL; default: 4 minutes of the Azure "
                        "conversation trace, decode-heavy; tests/fixtures/traces/ also has a prefill-heavy code slice)")
    parser.add_argument("--speedup", type=float, default=4.0,
                        help="compress the trace's time K times (default 4: 4 minutes in one)")
    parser.add_argument("--duration", type=float, default=None,
                        help="replay only the first S seconds of the trace (trace time; default all)")
    parser.add_argument("--sample-seconds", type=float, default=3.0,
                        help="seconds between live-view samples (default 3)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """`xpyd demo`: see the module docstring."""
    if not args.trace.exists():
        sys.stderr.write(f"xpyd demo: no trace at {args.trace}\n")
        return 2
    options = DemoOptions(state_dir=(args.state_dir or default_state_dir()).resolve(), plot=args.plot,
                          trace=args.trace.resolve(), speedup=args.speedup, duration_s=args.duration,
                          sample_s=max(args.sample_seconds, 0.5), keep=args.keep)
    return Demo(options, sys.stdout, sys.stderr).run()
