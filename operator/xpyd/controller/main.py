"""`xpyd operator`: run the operator's runtime (xpyd.controller.runtime) in a kopf-hosted process,
with this project's settings."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import kopf
from aiohttp import web

from xpyd.common import exposition
from xpyd.controller.autoscale import Autoscaler
from xpyd.controller.leader import LeaderElector, Timing
from xpyd.controller.metrics import OperatorMetrics
from xpyd.controller.runtime import OperatorRuntime
from xpyd.kube import Kube
from xpyd.render import DEFAULT_OPERATOR_IMAGE

log = logging.getLogger(__name__)

#: The Lease the replicas of one operator elect their leader with.
LEASE_NAME: Final = "xpyd-operator"
#: Where a pod finds its own namespace (the service account's projected volume).
NAMESPACE_FILE: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
DEFAULT_LEASE_NAMESPACE: Final = "xpyd-system"


def default_lease_namespace(namespace_file: Path = NAMESPACE_FILE) -> str:
    """The pod's own namespace, else xpyd-system (outside a cluster)."""
    try:
        return namespace_file.read_text().strip() or DEFAULT_LEASE_NAMESPACE
    except OSError:
        return DEFAULT_LEASE_NAMESPACE


def candidate_identity() -> str:
    """The pod's name (`POD_NAME`, from the downward API) or the host name, with a random suffix:
    a restarted process is a new candidate, never mistaken for the one that held the Lease."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{secrets.token_hex(4)}"


def configure_settings(settings: kopf.OperatorSettings) -> None:
    """kopf runs no resource handlers here: quiet event posting, no CRD scanning."""
    settings.posting.level = logging.WARNING  # Events are written by the reconciler itself.
    settings.networking.request_timeout = 60
    # The resources are fixed: no need to list CustomResourceDefinitions (and no RBAC for it).
    settings.scanning.disabled = True


def register(registry: kopf.OperatorRegistry) -> None:
    """Register the operator's start-up and clean-up on `registry` (its own: no global registry): kopf
    only hosts the process (start-up and clean-up, signals, the liveness endpoint); the work is the
    runtime's (xpyd.controller.runtime)."""

    @kopf.on.startup(registry=registry)
    async def _startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        configure_settings(settings)
        runtime: OperatorRuntime = memo.state
        await asyncio.to_thread(runtime.start)
        runtime.tasks.append(asyncio.create_task(_every(runtime.resync_seconds, runtime.resync, delay_first=True)))
        if runtime.autoscaler is not None:
            runtime.tasks.append(asyncio.create_task(_every(runtime.autoscale_tick_seconds, runtime.autoscale_due)))

    @kopf.on.cleanup(registry=registry)
    async def _cleanup(memo: kopf.Memo, **_: Any) -> None:
        runtime: OperatorRuntime = memo.state
        for task in runtime.tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        runtime.tasks.clear()
        await asyncio.to_thread(runtime.stop)


def build(operator_image: str | None, resync_seconds: float, namespaces: list[str],
          kube: Kube | None = None, retry_seconds: float = 1.0,
          login: Callable[..., Any] | None = None, workers: int = 8, lease_namespace: str | None = None,
          lease_timing: Timing | None = None, identity: str | None = None,
          ) -> tuple[kopf.OperatorRegistry, kopf.Memo]:
    """The registry and memo of one operator instance (tests run several in one process). With
    `lease_namespace`, the instance elects its leader on the Lease `xpyd-operator` there.

    kopf's own credentials come from `login`, by default the kubernetes client's: in-cluster
    service account, else the current kubeconfig (the same as `Kube.from_environment`).
    """
    registry = kopf.OperatorRegistry()
    register(registry)
    kopf.on.login(registry=registry)(login or kopf.login_via_client)
    kube = kube or Kube.from_environment()
    runtime = OperatorRuntime(kube=kube, operator_image=operator_image or DEFAULT_OPERATOR_IMAGE,
                              resync_seconds=resync_seconds, namespaces=namespaces, retry_seconds=retry_seconds,
                              autoscaler=Autoscaler(kube), workers=workers)
    if lease_namespace is not None:
        runtime.elector = LeaderElector(kube, lease_namespace, LEASE_NAME, identity or candidate_identity(),
                                        lease_timing or Timing(), on_started=runtime.lead, on_stopped=runtime.follow)
        kube.fence = runtime.elector.holding
    return registry, kopf.Memo(state=runtime)


async def start_metrics(runtime: OperatorRuntime, url: str) -> web.AppRunner:
    """Serve the operator's metrics (the autoscaler's decisions, API requests, caches) on `url`, e.g.
    http://0.0.0.0:8081/metrics."""
    parsed = urlsplit(url)

    own = exposition.registry([*([runtime.autoscaler.metrics] if runtime.autoscaler is not None else []),
                               OperatorMetrics(runtime)])

    async def metrics(_: web.Request) -> web.Response:
        return exposition.response(own)

    app = web.Application()
    app.router.add_get(parsed.path or "/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, parsed.hostname or "0.0.0.0", parsed.port or 8081).start()
    return runner


async def serve(registry: kopf.OperatorRegistry, memo: kopf.Memo, namespaces: list[str], liveness: str | None,
                stop_flag: threading.Event | None = None, ready_flag: threading.Event | None = None,
                metrics: str | None = None) -> None:
    runner = await start_metrics(memo.state, metrics) if metrics else None
    try:
        await kopf.operator(
            registry=registry,
            memo=memo,
            clusterwide=not namespaces,
            namespaces=namespaces,
            standalone=True,  # no kopf peering: replicas elect their leader on a Lease (controller.leader)
            liveness_endpoint=liveness or None,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
    finally:
        if runner is not None:
            await runner.cleanup()


def run(namespaces: list[str], all_namespaces: bool, liveness: str | None, operator_image: str | None,
        resync_seconds: float, verbose: bool, metrics: str | None = None, workers: int = 8,
        leader_elect: bool = False, lease_namespace: str | None = None) -> int:
    kopf.configure(verbose=verbose, log_format=kopf.LogFormat.JSON)
    logging.getLogger("xpyd").setLevel(logging.DEBUG if verbose else logging.INFO)
    scope = [] if all_namespaces else namespaces
    registry, memo = build(operator_image, resync_seconds, scope, workers=workers,
                           lease_namespace=(lease_namespace or default_lease_namespace()) if leader_elect else None)
    asyncio.run(serve(registry, memo, scope, liveness, metrics=metrics))
    return 0


async def _every(seconds: float, work: Callable[[], None], delay_first: bool = False) -> None:
    """Run `work` in a thread every `seconds`; a bug in it is logged and the loop goes on."""
    if delay_first:
        await asyncio.sleep(seconds)
    while True:
        try:
            await asyncio.to_thread(work)
        except Exception:
            log.exception("%s failed; the next round retries", getattr(work, "__name__", work))
        await asyncio.sleep(seconds)
