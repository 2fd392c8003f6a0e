"""`xpyd operator`: run the kopf operator with this project's settings."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import kopf
from aiohttp import web

from xpyd.common import exposition
from xpyd.controller.autoscale import Autoscaler
from xpyd.controller.handlers import OperatorState, register
from xpyd.controller.metrics import OperatorMetrics
from xpyd.kube import Kube
from xpyd.render import DEFAULT_OPERATOR_IMAGE


def build(operator_image: str | None, resync_seconds: float, namespaces: list[str],
          kube: Kube | None = None, retry_seconds: float = 1.0,
          login: Callable[..., Any] | None = None, workers: int = 8) -> tuple[kopf.OperatorRegistry, kopf.Memo]:
    """The registry and memo of one operator instance (tests run several in one process).

    kopf's own credentials come from `login`, by default the kubernetes client's: in-cluster
    service account, else the current kubeconfig (the same as `Kube.from_environment`).
    """
    registry = kopf.OperatorRegistry()
    register(registry)
    kopf.on.login(registry=registry)(login or kopf.login_via_client)
    kube = kube or Kube.from_environment()
    state = OperatorState(kube=kube, operator_image=operator_image or DEFAULT_OPERATOR_IMAGE,
                          resync_seconds=resync_seconds, namespaces=namespaces, retry_seconds=retry_seconds,
                          autoscaler=Autoscaler(kube), workers=workers)
    return registry, kopf.Memo(state=state)


async def start_metrics(state: OperatorState, url: str) -> web.AppRunner:
    """Serve the operator's metrics (the autoscaler's decisions, API requests, caches) on `url`, e.g.
    http://0.0.0.0:8081/metrics."""
    parsed = urlsplit(url)

    own = exposition.registry([*([state.autoscaler.metrics] if state.autoscaler is not None else []),
                               OperatorMetrics(state)])

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
            standalone=True,  # one replica (Recreate strategy): no peering objects needed
            liveness_endpoint=liveness or None,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
    finally:
        if runner is not None:
            await runner.cleanup()


def run(namespaces: list[str], all_namespaces: bool, liveness: str | None, operator_image: str | None,
        resync_seconds: float, verbose: bool, metrics: str | None = None, workers: int = 8) -> int:
    kopf.configure(verbose=verbose, log_format=kopf.LogFormat.JSON)
    logging.getLogger("xpyd").setLevel(logging.DEBUG if verbose else logging.INFO)
    scope = [] if all_namespaces else namespaces
    registry, memo = build(operator_image, resync_seconds, scope, workers=workers)
    asyncio.run(serve(registry, memo, scope, liveness, metrics=metrics))
    return 0
