"""The chaos suite: faults, scaling and rollouts of one pool under steady open-loop load, counting
every client request.

One pool (NIXL, 1 prefill, 2 decode, 2 proxies, autoscaler in Recommend mode on the cluster's
Prometheus) takes `xpyd bench`'s Poisson load (8 requests/s, 512 prompt tokens, 32 output
tokens) through its proxy Service, as kube-proxy would route it (`e2e.service`). Each scenario
starts the load, waits 4 s, makes its event, waits until the pool has recovered (the replaced pods
gone, not just their successors ready), keeps the load 3 s more and stops it. It then asserts how
many requests failed: 0 wherever a healthy instance could serve, else the bound it states, and in
that case that no failure was a refusal (a 5xx) a healthy instance could have served. Scenarios
run in order on the same pool and each leaves it as it found it (1/2/2, every pod ready).

The cold-start scenario runs a pool of its own instead, scaled to zero, and sends it a burst of 50
requests (issue 31).

Every scenario adds a row (requests, failed, p99 TTFT of the requests sent during the event) to a
table printed at the end; with XPYD_UPDATE_DOCS=1 the table replaces the one in
docs/operations.md#chaos."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import (
    OPERATOR_NAMESPACE,
    ROOT,
    Cluster,
    condition,
    delete_namespace,
    eventually,
    pods_of,
    provide_prerequisites,
    serving_of,
    wait_ready,
)
from e2e.service import Arrived, SteadyLoad, forwarded
from xpyd.api.conditions import KV_TRANSFER_POD_CONDITION
from xpyd.api.load import load_servings
from xpyd.cluster.controlplane import ControlPlane
from xpyd.cluster.pidfiles import PID_FILE
from xpyd.common.netguard import require_loopback_url
from xpyd.common.stats import percentile
from xpyd.kube import Kube
from xpyd.kube.pods import pod_ready as ready

pytestmark = pytest.mark.e2e

NAMESPACE = "e2e-chaos"
NAME = "chaos"
MODEL = "llama-8b"
LEAD_SECONDS = 4.0
TAIL_SECONDS = 3.0
DOCS = ROOT / "docs" / "operations.md"
TABLE_START = "<!-- chaos table: written by e2e/test_chaos.py with XPYD_UPDATE_DOCS=1 -->"
TABLE_END = "<!-- end of chaos table -->"
#: What a client sees when a stream it is reading is cut (kill -9 of the engine serving it): never
#: a refusal, which would mean the proxy had no instance to send the request to.
CUT_STREAM_KINDS = frozenset({"stream_error", "incomplete", "connection"})


def pool_manifest(prometheus_url: str) -> str:
    obj = yaml.safe_load((ROOT / "manifests" / "samples" / "nixl.yaml").read_text())
    obj["metadata"]["name"] = NAME
    spec = obj["spec"]
    for role in ("prefill", "decode"):
        spec[role]["drainTimeoutSeconds"] = 20
    # reactSeconds must be under intervalSeconds; looks between 5 s decisions add nothing to chaos.
    spec["autoscaling"] = {"mode": "Recommend", "intervalSeconds": 5, "reactSeconds": 0,
                           "prometheus": {"url": prometheus_url, "windowSeconds": 30}}
    return yaml.safe_dump(obj)


@dataclass
class Row:
    scenario: str
    requests: int
    failed: int
    bound: str
    ttft_p99_ms: float | None
    event_seconds: float

    def markdown(self) -> str:
        ttft = "-" if self.ttft_p99_ms is None else f"{self.ttft_p99_ms:,.0f}"
        return (f"| {self.scenario} | {self.requests} | {self.failed} | {self.bound} | {ttft} | "
                f"{self.event_seconds:.0f} |")


ROWS: list[Row] = []


def table() -> str:
    return "\n".join(["| Scenario | Requests | Failed | Allowed | p99 TTFT during the event (ms) | Event (s) |",
                      "|---|---:|---:|---|---:|---:|", *(row.markdown() for row in ROWS)])


@pytest.fixture(scope="module")
def pool(operator: Cluster) -> Iterator[Cluster]:
    assert operator.state.prometheus_url is not None
    manifest = pool_manifest(operator.state.prometheus_url)
    operator.kubectl("create", "namespace", NAMESPACE)
    try:
        (spec_obj,) = load_servings(manifest)
        provide_prerequisites(operator, NAMESPACE, spec_obj)
        operator.apply(manifest, NAMESPACE)
        wait_ready(operator, NAMESPACE, NAME, timeout=120)
        eventually(lambda: len(proxies(operator)) == 2, what="both proxies ready")
        # Each proxy keeps its KV-transfer health on its own pod (pods/status, merged beside the
        # kubelet's conditions): healthy here.
        eventually(lambda: all(kv_healthy(p) == "True" for p in proxies(operator)), timeout=30,
                   what="the proxies' KV-transfer condition")
        yield operator
    finally:
        print("\n" + table())
        if ROWS and os.environ.get("XPYD_UPDATE_DOCS") == "1":
            text = DOCS.read_text()
            head, rest = text.split(TABLE_START, 1)
            _, tail = rest.split(TABLE_END, 1)
            DOCS.write_text(f"{head}{TABLE_START}\n{table()}\n{TABLE_END}{tail}")
        delete_namespace(operator, NAMESPACE)


def kv_healthy(pod: Any) -> str | None:
    return next((c["status"] for c in pod["status"].get("conditions", []) if c["type"] == KV_TRANSFER_POD_CONDITION),
                None)


def proxies(cluster: Cluster) -> list[Any]:
    return [p for p in pods_of(cluster, NAMESPACE, NAME, "proxy") if ready(p)]


def every_pod(cluster: Cluster, role: str) -> list[Any]:
    """The role's pods, terminating ones included."""
    return list(cluster.get("pods", "-n", NAMESPACE, "-l", f"xpyd.io/serving={NAME},xpyd.io/role={role}")["items"])


def settled(cluster: Cluster, role: str, count: int) -> bool:
    """Exactly `count` pods of the role exist (none terminating) and all are ready."""
    pods = every_pod(cluster, role)
    return len(pods) == count and all(ready(p) and not p["metadata"].get("deletionTimestamp") for p in pods)


def baseline(cluster: Cluster) -> bool:
    return settled(cluster, "prefill", 1) and settled(cluster, "decode", 2) and settled(cluster, "proxy", 2)


def scale(cluster: Cluster, role: str, replicas: int) -> None:
    cluster.kubectl("patch", "disaggregatedserving", NAME, "-n", NAMESPACE, "--type=merge",
                    "-p", f'{{"spec": {{"{role}": {{"replicas": {replicas}}}}}}}')


def p99_ttft_ms(results: list[Arrived], start: float, end: float) -> float | None:
    ttfts = [a.record.ttft_s for a in results if start <= a.at <= end and a.record.ok and a.record.ttft_s is not None]
    return None if not ttfts else 1000.0 * percentile(sorted(ttfts), 0.99)


def run(cluster: Cluster, scenario: str, event: Callable[[], object], recovered: Callable[[], Any],
        cuts_streams: bool = False, timeout: float = 120.0) -> list[Arrived]:
    """The scenario under load; returns the records after asserting the failures: none, or with
    `cuts_streams` (an engine dies without a drain) only streams cut at the event: requests sent
    before it and still running then, and each a cut stream rather than a refusal."""
    assert eventually(lambda: baseline(cluster), timeout=90, what="the pool at 1/2/2, every pod ready")
    kube = Kube.from_kubeconfig(Path(cluster.state.kubeconfig))
    with SteadyLoad(kube, NAMESPACE, f"{NAME}-proxy", MODEL) as load:
        time.sleep(LEAD_SECONDS)
        start = time.monotonic()
        event()
        eventually(recovered, timeout=timeout, interval=0.5, what=f"{scenario}: recovered")
        end = time.monotonic()
        time.sleep(TAIL_SECONDS)
        results = load.stop()
    failed = [a for a in results if not a.record.ok]
    running = [a for a in results if a.at <= start <= a.finished]
    allowed = f"≤ {len(running)}: the streams then running" if cuts_streams else "0"
    ROWS.append(Row(scenario, len(results), len(failed), allowed, p99_ttft_ms(results, start, end), end - start))
    print(f"{scenario}: {len(results)} requests, {len(failed)} failed, {ROWS[-1].markdown()}")
    assert len(results) >= 8 * (LEAD_SECONDS + TAIL_SECONDS) * 0.5, "the load did not run"
    details = [(a.record.index, a.at - start, a.record.error_kind, a.record.error) for a in failed]
    if not cuts_streams:
        assert not failed, details
    else:  # sent before the event (a 50 ms margin for the send-time estimate), cut, never refused
        assert all(a.at <= start + 0.05 and a.finished >= start for a in failed), details
        assert {a.record.error_kind for a in failed} <= CUT_STREAM_KINDS, details
    return results


def _pod_gone(cluster: Cluster, pod: Any) -> bool:
    now = cluster.get("pod", "-n", NAMESPACE, pod["metadata"]["name"])
    return now is None or now["metadata"]["uid"] != pod["metadata"]["uid"]


def test_delete_the_only_prefill_pod(pool: Cluster) -> None:
    (victim,) = pods_of(pool, NAMESPACE, NAME, "prefill")
    run(pool, "delete the only prefill pod",
        lambda: pool.kubectl("delete", "pod", "-n", NAMESPACE, victim["metadata"]["name"], "--wait=false"),
        lambda: _pod_gone(pool, victim) and settled(pool, "prefill", 1))


def test_delete_one_of_two_decode_pods(pool: Cluster) -> None:
    victim = pods_of(pool, NAMESPACE, NAME, "decode")[0]
    run(pool, "delete one of two decode pods",
        lambda: pool.kubectl("delete", "pod", "-n", NAMESPACE, victim["metadata"]["name"], "--wait=false"),
        lambda: _pod_gone(pool, victim) and settled(pool, "decode", 2))


def test_kill_an_engine_process(pool: Cluster) -> None:
    """kill -9 of one decode engine: no drain. Only the streams it was sending at that instant can
    fail (a stream cannot move to another engine mid-answer); the proxy sends every later request
    to the other decode until the runtime has restarted this one."""
    victim = pods_of(pool, NAMESPACE, NAME, "decode")[0]
    name = victim["metadata"]["name"]
    restarts = victim["status"]["containerStatuses"][0]["restartCount"]
    pid_file = Path(pool.state.state_dir) / "pods" / f"{NAMESPACE}_{name}" / PID_FILE

    def restarted() -> bool:
        now = pool.get("pod", "-n", NAMESPACE, name) or {}
        statuses = now.get("status", {}).get("containerStatuses") or [{}]
        return statuses[0].get("restartCount", 0) > restarts and ready(now)

    run(pool, "kill -9 a decode engine", lambda: os.kill(int(pid_file.read_text()), signal.SIGKILL), restarted,
        cuts_streams=True)


def test_kv_handoffs_fail_between_the_prefill_and_one_decode(pool: Cluster) -> None:
    """A broken KV link (engine-sim's fault injection: one decode cannot read the prefill's KV). Under
    `kv_load_failure_policy: fail` that decode answers 500 after each good prefill leg: the proxies
    retry those requests on the other decode (no client sees it), avoid the pair after 3 failures in
    a row, and report it, so the pool turns Degraded `KVTransferFailing` naming the two pods, with a
    Warning Event. Once the link is back, the pair's next trial after its cool-down heals it, and
    Degraded clears."""
    (prefill,) = pods_of(pool, NAMESPACE, NAME, "prefill")
    decode = pods_of(pool, NAMESPACE, NAME, "decode")[0]
    (port,) = [p["containerPort"] for p in decode["spec"]["containers"][0]["ports"] if p["name"] == "http"]
    faults = require_loopback_url(f"http://{decode['status']['podIP']}:{port}/xpyd/faults")
    reports: list[str] = []

    def set_faults(unreadable_from: list[str]) -> None:
        request = urllib.request.Request(faults, method="PUT", data=json.dumps(
            {"unreadable_from": unreadable_from}).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as response:
            assert json.load(response)["unreadable_from"] == unreadable_from

    def degraded() -> dict[str, Any]:
        return condition(serving_of(pool, NAMESPACE, NAME), "Degraded")

    def names_the_pair() -> dict[str, Any] | None:
        # The decode's own count of failed transfers (scraped every 10 s) may be reported before the
        # proxies have seen the pair fail 3 times in a row: wait for the report that names the pair.
        found = degraded()
        message = found.get("message", "")
        return found if (found.get("reason") == "KVTransferFailing" and prefill["metadata"]["name"] in message
                         and decode["metadata"]["name"] in message) else None

    def event() -> None:
        set_faults([prefill["status"]["podIP"]])
        try:
            found = eventually(names_the_pair, timeout=60, interval=0.5,
                               what="Degraded KVTransferFailing naming the prefill and decode pods")
            reports.append(found["message"])
        finally:  # the link is repaired whatever happened, for the scenarios after this one
            set_faults([])

    run(pool, "KV hand-offs fail between the prefill and one decode", event,
        lambda: degraded().get("status") == "False", timeout=150)
    assert "KV hand-offs keep failing for 1 pair(s)" in reports[0], reports
    warnings = pool.get("events", "-n", NAMESPACE, "--field-selector", "reason=KVTransferFailing")["items"]
    assert any(e["type"] == "Warning" for e in warnings), warnings


@pytest.mark.parametrize(("role", "replicas", "other"), [("prefill", 1, 2), ("decode", 2, 1)])
def test_scale_each_role_and_back(pool: Cluster, role: str, replicas: int, other: int) -> None:
    def event() -> None:
        scale(pool, role, other)
        eventually(lambda: settled(pool, role, other), timeout=60, what=f"{other} {role} settled")
        scale(pool, role, replicas)

    run(pool, f"scale {role} {replicas} → {other} → {replicas}", event, lambda: settled(pool, role, replicas))


#: How much longer than prefill the new decode pods take to start in the rollout: more than the
#: pool's drain timeout (20 s), so the old prefill's drain alone could not bridge the wait.
SLOW_DECODE_START_SECONDS = 35


def test_roll_the_engine_image_with_a_slower_decode_start(pool: Cluster) -> None:
    """A new engine image changes the pods' KV compatibility hash: both roles roll at once. The new
    decode pods take 35 s to load, the new prefill none: the operator holds the prefill
    Deployment's old pod (and decode's) until a new decode is Ready, so the old pair serves until
    the new one has both roles (`controller.rollout`)."""
    image = "vllm/vllm-openai:v0.33.1"
    reasons: set[str | None] = set()
    held: list[str] = []

    def rolled() -> bool:
        progressing = condition(serving_of(pool, NAMESPACE, NAME), "Progressing")
        reasons.add(progressing.get("reason"))
        if "keep their old pods" in progressing.get("message", ""):
            held.append(progressing["message"])
        pods = every_pod(pool, "prefill") + every_pod(pool, "decode")
        return all(p["spec"]["containers"][0]["image"] == image for p in pods) and \
            settled(pool, "prefill", 1) and settled(pool, "decode", 2)

    patch = {"spec": {"engine": {"image": image},
                      "decode": {"extraArgs": [f"--startup-delay-s={SLOW_DECODE_START_SECONDS}"]}}}
    run(pool, "roll the engine image (decode starts 35 s slower)", lambda: pool.kubectl(
        "patch", "disaggregatedserving", NAME, "-n", NAMESPACE, "--type=merge", "-p", json.dumps(patch)),
        rolled, timeout=240)
    assert "KVRevisionRollingOut" in reasons, reasons
    assert held, "the Progressing message never said the rollout was held"
    deployments = [pool.get("deployment", "-n", NAMESPACE, f"{NAME}-{role}") for role in ("prefill", "decode")]
    assert [d["spec"].get("minReadySeconds", 0) for d in deployments] == [0, 0]  # released once both had rolled


def test_roll_the_proxy(pool: Cluster) -> None:
    before = {p["metadata"]["uid"] for p in every_pod(pool, "proxy")}

    def rolled() -> bool:
        return not before & {p["metadata"]["uid"] for p in every_pod(pool, "proxy")} and settled(pool, "proxy", 2)

    run(pool, "roll the proxy", lambda: pool.kubectl("rollout", "restart", "deployment", "-n", NAMESPACE,
                                                     f"{NAME}-proxy"), rolled, timeout=180)


def test_restart_the_operator(pool: Cluster) -> None:
    selector = "app.kubernetes.io/name=xpyd-operator"
    (before,) = pool.get("pods", "-n", OPERATOR_NAMESPACE, "-l", selector)["items"]

    def replaced() -> bool:
        pods = pool.get("pods", "-n", OPERATOR_NAMESPACE, "-l", selector)["items"]
        return len(pods) == 1 and pods[0]["metadata"]["uid"] != before["metadata"]["uid"] and ready(pods[0])

    run(pool, "restart the operator", lambda: pool.kubectl(
        "delete", "pod", "-n", OPERATOR_NAMESPACE, before["metadata"]["name"], "--wait=false"), replaced)


def test_stop_prometheus(pool: Cluster) -> None:
    """Serving does not depend on Prometheus; the autoscaler holds and says why, then resumes."""
    plane = ControlPlane(Path(pool.state.state_dir), pool.binaries)

    def reason() -> str:
        return str(condition(serving_of(pool, NAMESPACE, NAME), "ScalingActive").get("reason", ""))

    def event() -> None:
        plane.stop_prometheus()
        eventually(lambda: reason() == "MetricsUnavailable", timeout=60, what="ScalingActive MetricsUnavailable")
        plane.start_prometheus()

    try:
        run(pool, "stop Prometheus", event, lambda: reason() not in ("", "MetricsUnavailable"))
    finally:
        plane.start_prometheus()


# ------------------------------------------------------------------------------------------------
# Cold start: a pool of its own, scaled to zero, takes a burst (issue 31).

COLD_NAMESPACE = "e2e-chaos-cold"
COLD = "cold"
#: The emulated engines' model load: what a pool at zero waits for (their pods' start comes on top).
COLD_ENGINE_START_SECONDS = 6
COLD_BURST = 50
COLD_IDLE_SECONDS = 15


def cold_manifest(prometheus_url: str) -> str:
    """A NIXL pool at zero (Auto, minReplicas 0 on both roles, back to zero after 15 idle seconds),
    one proxy, engines that take COLD_ENGINE_START_SECONDS to load."""
    start = [f"--startup-delay-s={COLD_ENGINE_START_SECONDS}"]
    return yaml.safe_dump({
        "apiVersion": "xpyd.io/v1alpha1", "kind": "DisaggregatedServing", "metadata": {"name": COLD},
        "spec": {
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "servedModelName": MODEL},
            "prefill": {"replicas": 0, "gpu": {"product": "NVIDIA-H200"}, "extraArgs": start},
            "decode": {"replicas": 0, "gpu": {"product": "NVIDIA-H200"}, "extraArgs": start},
            "proxy": {"replicas": 1},
            "autoscaling": {
                "mode": "Auto", "prometheus": {"url": prometheus_url, "windowSeconds": 15},
                "prefill": {"minReplicas": 0, "maxReplicas": 2}, "decode": {"minReplicas": 0, "maxReplicas": 2},
                "intervalSeconds": 5, "reactSeconds": 0, "startupSeconds": 15,
                "profile": {"name": "h200_llama31_8b_fp8_tp1"},
                "scaleToZero": {"idleSeconds": COLD_IDLE_SECONDS},
            },
        },
    })


@dataclass
class Scaling:
    """When the pool's Deployments first asked for replicas after `since` (the scale-up applied) and
    when both roles first had a Ready one, watched every 50 ms through the API (no kubectl)."""

    kube: Kube
    since: float = 0.0
    scaled_at: float | None = None
    paired_at: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            found = [self.kube.get("apps/v1", "Deployment", COLD_NAMESPACE, f"{COLD}-{role}") or {}
                     for role in ("prefill", "decode")]
            if self.scaled_at is None and all(d.get("spec", {}).get("replicas", 0) > 0 for d in found):
                self.scaled_at = now
            if self.paired_at is None and all(d.get("status", {}).get("readyReplicas", 0) > 0 for d in found):
                self.paired_at = now
            self._stop.wait(0.05)

    def __enter__(self) -> Scaling:
        self._thread = threading.Thread(target=self._run, name="cold-scaling", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=10)


@dataclass
class Answer:
    sent: float
    first_byte: float | None
    finished: float
    status: int
    complete: bool
    error: str = ""


async def _burst(url: str, count: int) -> list[Answer]:
    """`count` streamed completions at once, each read to its end."""
    import aiohttp

    async def one(session: aiohttp.ClientSession, n: int) -> Answer:
        sent = time.monotonic()
        first: float | None = None
        body = b""
        try:
            async with session.post(url + "/v1/completions", json={
                    "model": MODEL, "prompt": f"cold start request {n}: " + "word " * 200, "max_tokens": 16,
                    "stream": True}) as response:
                async for chunk in response.content.iter_any():
                    first = first or time.monotonic()
                    body += chunk
                return Answer(sent, first, time.monotonic(), response.status,
                              response.status == 200 and b"data: [DONE]" in body, body[-300:].decode(errors="replace"))
        except Exception as error:  # a request without an answer is a failure, counted
            return Answer(sent, first, time.monotonic(), 0, False, repr(error))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await asyncio.gather(*(one(session, n) for n in range(count)))


def _ready_reason(cluster: Cluster) -> tuple[str | None, str | None]:
    ready = condition(serving_of(cluster, COLD_NAMESPACE, COLD), "Ready")
    return ready.get("status"), ready.get("reason")


def _zero(cluster: Cluster) -> bool:
    deployments = [cluster.get("deployment", "-n", COLD_NAMESPACE, f"{COLD}-{role}") for role in ("prefill", "decode")]
    return all(d["spec"]["replicas"] == 0 and not d.get("status", {}).get("replicas") for d in deployments)


def test_cold_start_a_burst_at_zero_then_back_to_zero(operator: Cluster) -> None:
    """A pool at zero gets a burst of COLD_BURST requests through its Service: its proxy is Ready at
    zero (so the Service keeps it) and holds them, reports them on its Pod, the operator decides the
    scale-up from that at once (within 2 s of the first request), and every request is answered,
    the first within the pool's start-up (scale-up to both roles Ready) + 2 s. After the idle
    window the pool returns to zero and the proxy stays up (the same pod, Ready, never restarted)."""
    assert operator.state.prometheus_url is not None
    operator.kubectl("create", "namespace", COLD_NAMESPACE)
    kube = Kube.from_kubeconfig(Path(operator.state.kubeconfig))
    try:
        operator.apply(cold_manifest(operator.state.prometheus_url), COLD_NAMESPACE)
        eventually(lambda: _ready_reason(operator) == ("True", "IdleAtZero"), timeout=90,
                   what="the pool at zero, Ready (IdleAtZero): its proxy ready to hold requests")
        (proxy_before,) = pods_of(operator, COLD_NAMESPACE, COLD, "proxy")
        assert not [pod for role in ("prefill", "decode") for pod in pods_of(operator, COLD_NAMESPACE, COLD, role)]

        with forwarded(kube, COLD_NAMESPACE, f"{COLD}-proxy") as url, Scaling(kube) as scaling:
            started = time.monotonic()
            scaling.since = started
            answers = asyncio.run(_burst(url, COLD_BURST))
            ended = max(a.finished for a in answers)
        failed = [(n, a.status, a.error) for n, a in enumerate(answers) if not a.complete]
        first_request = min(a.sent for a in answers)
        first_byte = min(a.first_byte for a in answers if a.first_byte is not None) if len(failed) < COLD_BURST \
            else math.inf
        assert scaling.scaled_at is not None and scaling.paired_at is not None, "the pool never scaled up"
        decided_s = scaling.scaled_at - first_request
        startup_s = scaling.paired_at - scaling.scaled_at
        first_byte_s = first_byte - first_request
        ttfts = sorted(a.first_byte - a.sent for a in answers if a.first_byte is not None)
        print(f"cold start: {COLD_BURST} requests, {len(failed)} failed; scale-up applied {decided_s:.2f} s after the "
              f"first request; start-up (scaled to both roles Ready) {startup_s:.2f} s; first byte "
              f"{first_byte_s:.2f} s after the first request; p99 TTFT {1000 * percentile(ttfts, 0.99):,.0f} ms")
        ROWS.append(Row(f"cold start: {COLD_BURST} requests at zero", COLD_BURST, len(failed), "0",
                        1000.0 * percentile(ttfts, 0.99) if ttfts else None, ended - started))
        print(ROWS[-1].markdown())
        assert not failed, failed
        assert decided_s <= 2.0, f"the scale-up came {decided_s:.2f} s after the first request"
        assert first_byte_s <= startup_s + 2.0, (first_byte_s, startup_s)
        reasons = [e["reason"] for e in operator.get("events", "-n", COLD_NAMESPACE, "--field-selector",
                                                     f"involvedObject.name={COLD}")["items"]]
        assert "ScaleFromZero" in reasons, reasons

        # Back to zero once idle; the proxy stays.
        eventually(lambda: _zero(operator), timeout=120, interval=1.0, what="the pool back at zero")
        back = time.monotonic() - ended
        obj = eventually(lambda: (lambda o: o if condition(o, "Ready").get("reason") == "IdleAtZero" else None)(
            serving_of(operator, COLD_NAMESPACE, COLD)), timeout=30, what="Ready IdleAtZero again")
        print(f"cold start: back at zero {back:.0f} s after the last answer (idle window {COLD_IDLE_SECONDS} s)")
        assert back >= COLD_IDLE_SECONDS
        assert obj["status"]["autoscaler"]["lastDecision"]["reason"] in ("ScaleToZero", "IdleAtZero")
        found = operator.get("events", "-n", COLD_NAMESPACE, "--field-selector", f"involvedObject.name={COLD}")["items"]
        reasons = [e["reason"] for e in found]
        assert "ScaleToZero" in reasons, reasons
        # Starting from zero is no outage: Ready stayed True (StartingFromZero) while the proxy held requests.
        warnings = {e["reason"] for e in found if e["type"] == "Warning"}
        assert not {"PrefillUnavailable", "DecodeUnavailable"} & warnings, \
            [(e.get("lastTimestamp"), e["type"], e["reason"], e["message"]) for e in found]
        (proxy_after,) = pods_of(operator, COLD_NAMESPACE, COLD, "proxy")
        assert proxy_after["metadata"]["uid"] == proxy_before["metadata"]["uid"] and ready(proxy_after)
        assert proxy_after["status"]["containerStatuses"][0]["restartCount"] == 0
        columns = operator.kubectl("get", "xpyd", COLD, "-n", COLD_NAMESPACE).stdout
        assert "SCALING" in columns.splitlines()[0] and ("ScaleToZero" in columns or "IdleAtZero" in columns), columns
    finally:
        delete_namespace(operator, COLD_NAMESPACE)
