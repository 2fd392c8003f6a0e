"""`xpyd proxy`: the command line, and running the proxy until SIGTERM/SIGINT.

The operator starts it with (see `xpyd.render.proxy.proxy_args`)::

    xpyd proxy --port=8000 --connector=NixlConnector --namespace=NS
        --prefill-selector=xpyd.io/serving=NAME,xpyd.io/role=prefill
        --decode-selector=xpyd.io/serving=NAME,xpyd.io/role=decode
        --engine-port=8000 --routing-policy=LeastLoaded --served-model-name=NAME

and, outside Kubernetes, `xpyd proxy --prefill URL --decode URL [--decode URL ...]`.
The optional API key comes from the environment variable XPYD_PROXY_API_KEY. With discovery and
POD_NAME set (the downward API), the proxy keeps its KV-transfer health as a condition on its own
Pod (`xpyd.proxy.podreport`), and, with the waiting room on (`--wait-timeout`), what it holds for a
ready prefill and decode pair: the demand signal the operator scales a pool up from zero on.

Stopping. On SIGTERM (what Kubernetes sends a terminating pod) the proxy at once fails its
readiness (`GET /ready` answers 503; `GET /health`, the liveness probe, stays 200), then keeps
serving for `--drain-seconds`, new requests included, while the pod leaves the Service's
endpoints. Then it closes its listener, gives the requests in flight (streams included) up to
`--finish-timeout` seconds to finish, cancels what is left and exits 0. SIGINT skips the drain
period, and so does a second signal. The pod's terminationGracePeriodSeconds covers both periods
(see `xpyd.render`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
from collections.abc import Callable
from typing import Any

from xpyd.api.models import (
    DEFAULT_MAX_WAITING_BYTES,
    DEFAULT_MAX_WAITING_REQUESTS,
    MAX_DATA_PARALLEL,
    MAX_PROXY_DRAIN_SECONDS,
    MAX_PROXY_FINISH_SECONDS,
    MAX_PROXY_WAIT_SECONDS,
    MAX_TENSOR_PARALLEL,
    Connector,
    RoutingPolicy,
)
from xpyd.proxy import kvaware, protocol
from xpyd.proxy.config import ProxyConfig
from xpyd.proxy.server import API_KEY_ENV, Proxy

log = logging.getLogger(__name__)

#: Seconds the proxy keeps serving after SIGTERM while it fails readiness (endpoint removal is not instant).
DRAIN_SECONDS = 5.0
#: Seconds the requests in flight get to finish once the listener is closed.
FINISH_SECONDS = 45.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The proxy's flags."""
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--connector", default=Connector.NIXL.value, choices=[c.value for c in Connector],
                        help="KV connector of the pool: decides what each leg carries (default NixlConnector)")
    parser.add_argument("--routing-policy", default=RoutingPolicy.LEAST_LOADED.value,
                        choices=[p.value for p in RoutingPolicy],
                        help="LeastLoaded: fewest outstanding prompt tokens (prefill) or requests (decode), ties "
                        "random; PowerOfTwo: the less loaded of two random instances; RoundRobin; KVAware: where the "
                        "prompt's prefix is cached, weighed against load (see the --kv-* flags)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients must use (others get 404); unset: any name passes through")
    where = parser.add_argument_group("engines (Kubernetes pods, or fixed URLs)")
    where.add_argument("--namespace", default=None, help="namespace of the engine pods (default: the proxy's own)")
    where.add_argument("--prefill-selector", default=None, help="label selector of the prefill pods")
    where.add_argument("--decode-selector", default=None, help="label selector of the decode pods")
    where.add_argument("--engine-port", type=int, default=8000, help="HTTP port of the engines in their pods")
    where.add_argument("--prefill", action="append", default=[], metavar="URL",
                       help="a prefill engine's base URL, e.g. http://10.0.0.5:8000 (repeatable)")
    where.add_argument("--decode", action="append", default=[], metavar="URL",
                       help="a decode engine's base URL (repeatable)")
    failures = parser.add_argument_group("failures and limits")
    failures.add_argument("--prefill-retries", type=int, default=2,
                          help="other prefill instances tried after a failed prefill leg (default 2)")
    failures.add_argument("--decode-retries", type=int, default=1,
                          help="other decode instances tried when decode fails before its first byte (default 1)")
    failures.add_argument("--prefill-timeout", type=float, default=300.0, help="seconds for a prefill leg")
    failures.add_argument("--decode-timeout", type=float, default=3600.0,
                          help="seconds for an unstreamed decode leg")
    failures.add_argument("--stream-idle-timeout", type=float, default=300.0,
                          help="longest silence of a streamed decode leg, in seconds")
    failures.add_argument("--connect-timeout", type=float, default=2.0, help="seconds to connect to an engine")
    failures.add_argument("--health-interval", type=float, default=2.0, help="seconds between health probes")
    failures.add_argument("--health-timeout", type=float, default=2.0,
                          help="seconds a health probe may take (also a Mooncake bootstrap /query; "
                          "GET /v1/models gets five times as long)")
    failures.add_argument("--kv-metrics-interval", type=float, default=10.0,
                          help="seconds between reads of the NIXL engines' failed KV transfers on their /metrics "
                          "(vllm:nixl_num_failed_transfers_total), reported with the pairs' hand-off health; 0: never")
    failures.add_argument("--breaker-threshold", type=int, default=3,
                          help="consecutive failed legs that open an instance's circuit breaker")
    failures.add_argument("--breaker-cooldown", type=float, default=2.0,
                          help="seconds before an open breaker's first recovery probe (doubles while it fails)")
    failures.add_argument("--upstream-idle-timeout", type=float, default=4.0,
                          help="seconds an idle upstream connection is kept; must stay below the engines' "
                          "keep-alive (uvicorn: 5 s)")
    failures.add_argument("--max-concurrency", type=int, default=2048,
                          help="client requests in flight before new ones get 429")
    failures.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024,
                          help="largest request body accepted (larger: 413)")
    failures.add_argument("--drain-seconds", type=float, default=DRAIN_SECONDS,
                          help="after SIGTERM: seconds of serving on with readiness failed, so the pod leaves the "
                          f"Service first (default {DRAIN_SECONDS:g}, at most {MAX_PROXY_DRAIN_SECONDS:g})")
    failures.add_argument("--finish-timeout", type=float, default=FINISH_SECONDS,
                          help="after the drain: seconds requests in flight get to finish before they are cut "
                          f"(default {FINISH_SECONDS:g}, at most {MAX_PROXY_FINISH_SECONDS:g})")
    failures.add_argument("--wait-timeout", type=float, default=0.0,
                          help="seconds a request is held while no prefill and decode pair is ready (a pool "
                          "scaled to zero, starting), then 503 with Retry-After; 0 (default): off, such "
                          "requests get 503 at once. With it, /ready stays 200 at zero")
    failures.add_argument("--wait-max-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                          help="requests held at once; more get 429 at once (default "
                          f"{DEFAULT_MAX_WAITING_REQUESTS})")
    failures.add_argument("--wait-max-bytes", type=int, default=DEFAULT_MAX_WAITING_BYTES,
                          help=f"request body bytes held at once; more get 429 at once (default "
                          f"{DEFAULT_MAX_WAITING_BYTES})")
    failures.add_argument("--decode-only-fallback", action="store_true",
                          help="when no prefill instance can serve, let decode compute the prompt (counted in "
                          "xpyd_proxy_decode_only_fallbacks_total and logged) instead of answering 503")
    connectors = parser.add_argument_group("connector settings")
    connectors.add_argument("--mooncake-bootstrap-port", type=int, default=protocol.MOONCAKE_BOOTSTRAP_PORT,
                            help="MooncakeConnector: prefill engines' VLLM_MOONCAKE_BOOTSTRAP_PORT")
    connectors.add_argument("--p2p-nccl-kv-port", type=int, default=protocol.P2P_NCCL_KV_PORT,
                            help="P2pNcclConnector: engines' kv_port, for instances that have not registered")
    connectors.add_argument("--p2p-nccl-registration-port", type=int, default=0,
                            help="P2pNcclConnector: ZMQ port engines register on (their proxy_port, e.g. 30001; "
                            "0: off; needs pyzmq and msgpack)")
    connectors.add_argument("--prefill-data-parallel-size", type=int, default=1, metavar="N",
                            help="data-parallel ranks per prefill server (its --data-parallel-size): "
                            "NixlPushConnector pins prefill legs to ranks and learns each rank's identity")
    connectors.add_argument("--lmcache-init-port", type=int, default=protocol.LMCACHE_INIT_PORT,
                            help="LMCacheConnectorV1: the decode engines' LMCache pd_peer_init_port (rank i: +i)")
    connectors.add_argument("--lmcache-alloc-port", type=int, default=protocol.LMCACHE_ALLOC_PORT,
                            help="LMCacheConnectorV1: the decode engines' LMCache pd_peer_alloc_port (rank i: +i)")
    connectors.add_argument("--decode-tensor-parallel-size", type=int, default=1, metavar="N",
                            help="LMCacheConnectorV1: the decode engines' --tensor-parallel-size (one init and "
                            "one alloc port per rank)")
    kvaware.add_arguments(parser)
    parser.add_argument("--event-loop", default="auto", choices=("auto", "uvloop", "asyncio"),
                        help="auto (default): uvloop where it is installed (a dependency except on Windows), "
                        "else asyncio's")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def add_parser(subparsers: Any) -> None:
    """Register `proxy` on the `xpyd` command's sub-parsers."""
    parser = subparsers.add_parser("proxy", help="run the xPyD routing proxy (prefill, then decode with the KV "
                                   "hand-off)", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """The proxy's configuration from parsed flags and the environment."""
    return ProxyConfig(
        connector=Connector(args.connector),
        routing_policy=RoutingPolicy(args.routing_policy),
        served_model_name=args.served_model_name,
        api_key=os.environ.get(API_KEY_ENV) or None,
        prefill_retries=args.prefill_retries,
        decode_retries=args.decode_retries,
        prefill_timeout=args.prefill_timeout,
        decode_timeout=args.decode_timeout,
        stream_idle_timeout=args.stream_idle_timeout,
        connect_timeout=args.connect_timeout,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        kv_metrics_interval=args.kv_metrics_interval,
        breaker_threshold=args.breaker_threshold,
        breaker_cooldown=args.breaker_cooldown,
        upstream_idle_timeout=args.upstream_idle_timeout,
        max_concurrency=args.max_concurrency,
        max_body_bytes=args.max_body_bytes,
        decode_only_fallback=args.decode_only_fallback,
        wait_timeout=args.wait_timeout,
        wait_max_requests=args.wait_max_requests,
        wait_max_bytes=args.wait_max_bytes,
        mooncake_bootstrap_port=args.mooncake_bootstrap_port,
        p2p_nccl_kv_port=args.p2p_nccl_kv_port,
        prefill_data_parallel_size=args.prefill_data_parallel_size,
        lmcache_init_port=args.lmcache_init_port,
        lmcache_alloc_port=args.lmcache_alloc_port,
        decode_tensor_parallel_size=args.decode_tensor_parallel_size,
        kv=kvaware.settings_from_args(args),
    )


def _check(args: argparse.Namespace) -> str | None:
    """A message when the flags contradict each other."""
    kube = args.prefill_selector is not None or args.decode_selector is not None
    static = bool(args.prefill or args.decode)
    if kube == static:
        return "give either --prefill-selector and --decode-selector (Kubernetes) or --prefill and --decode URLs"
    if (kv_problem := kvaware.problem(args)) is not None:
        return kv_problem
    if kube and not (args.prefill_selector and args.decode_selector):
        return "--prefill-selector and --decode-selector go together"
    if static and not args.decode:
        return "at least one --decode URL is needed"
    if static and not args.prefill and not args.decode_only_fallback:
        return "at least one --prefill URL is needed (or --decode-only-fallback)"
    if not 1 <= args.prefill_data_parallel_size <= MAX_DATA_PARALLEL:
        return f"--prefill-data-parallel-size must be within 1..{MAX_DATA_PARALLEL}"
    if not 1 <= args.decode_tensor_parallel_size <= MAX_TENSOR_PARALLEL:
        return f"--decode-tensor-parallel-size must be within 1..{MAX_TENSOR_PARALLEL}"
    for flag, port in (("--lmcache-init-port", args.lmcache_init_port),
                       ("--lmcache-alloc-port", args.lmcache_alloc_port)):
        if not 1 <= port <= 65536 - args.decode_tensor_parallel_size:
            return f"{flag} must leave a port per decode tensor-parallel rank within 1..65535"
    if not (args.kv_metrics_interval == 0 or 1 <= args.kv_metrics_interval <= 3600):
        return "--kv-metrics-interval must be 0 (never) or within 1..3600 seconds"
    if args.upstream_idle_timeout >= 5.0:
        return "--upstream-idle-timeout must stay below the engines' 5 s keep-alive"
    if not 0 <= args.drain_seconds <= MAX_PROXY_DRAIN_SECONDS:
        return f"--drain-seconds must be within 0..{MAX_PROXY_DRAIN_SECONDS:g}"
    if not 0 <= args.wait_timeout <= MAX_PROXY_WAIT_SECONDS:
        return f"--wait-timeout must be within 0 (off)..{MAX_PROXY_WAIT_SECONDS:g} seconds"
    if args.wait_max_requests < 1 or args.wait_max_bytes < 1:
        return "--wait-max-requests and --wait-max-bytes must be at least 1"
    if not 0 < args.finish_timeout <= MAX_PROXY_FINISH_SECONDS:
        return f"--finish-timeout must be above 0 and at most {MAX_PROXY_FINISH_SECONDS:g}"
    return None


def run(args: argparse.Namespace) -> int:
    """Run the proxy until SIGTERM or SIGINT; 2 on contradictory flags."""
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = _check(args)
    if problem:
        log.error("xpyd proxy: %s", problem)
        return 2
    loop = event_loop(args.event_loop)
    if loop is None:
        log.error("xpyd proxy: --event-loop uvloop, but uvloop is not installed")
        return 2
    name, factory = loop
    log.info("event loop: %s", name)
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(args))
    return 0


def event_loop(choice: str) -> tuple[str, Callable[[], asyncio.AbstractEventLoop]] | None:
    """The event loop `--event-loop` asks for (its name and factory); None when that is uvloop and
    uvloop is missing. uvloop was ahead in most latency rows of benchmarks/proxy_bench.py, which
    compares both (figures in docs/proxy.md)."""
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            return None if choice == "uvloop" else ("asyncio", asyncio.new_event_loop)
        return "uvloop", uvloop.new_event_loop
    return "asyncio", asyncio.new_event_loop


def _own_namespace() -> str:
    path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    with contextlib.suppress(OSError), open(path) as file:  # noqa: PTH123 (one read of a well-known file)
        return file.read().strip()
    return os.environ.get("POD_NAMESPACE", "default")


async def serve(args: argparse.Namespace) -> None:
    """Start discovery and the HTTP server; stop on a signal, letting requests in flight finish."""
    from aiohttp import web

    from xpyd.proxy.discovery import PodWatcher, static_endpoints

    config = config_from_args(args)
    proxy = Proxy(config)
    runner = web.AppRunner(proxy.app(), access_log=None, handler_cancellation=True,
                           shutdown_timeout=args.finish_timeout)
    await runner.setup()
    loop = asyncio.get_running_loop()
    watchers: list[PodWatcher] = []
    registration = None
    reporting: asyncio.Future[None] | None = None
    signalling: asyncio.Future[None] | None = None
    if args.prefill_selector:
        from xpyd.kube import Kube

        kube = Kube.from_environment()
        namespace = args.namespace or _own_namespace()
        for role, selector in (("prefill", args.prefill_selector), ("decode", args.decode_selector)):
            def publish(endpoints: list[Any], role: Any = role) -> None:
                loop.call_soon_threadsafe(proxy.set_endpoints, role, endpoints)

            watcher = PodWatcher(kube, namespace, selector, args.engine_port, publish)
            watcher.start()
            watchers.append(watcher)
        if pod_name := os.environ.get("POD_NAME"):
            from xpyd.proxy.podreport import PodConditionReporter

            reporter = PodConditionReporter(kube, namespace, pod_name, proxy.kv_transfer_report)
            reporting = asyncio.ensure_future(reporter.run())
            if proxy.waiting.enabled:  # the demand signal of a pool at zero (xpyd.io/RequestsWaiting)
                from xpyd.proxy.podreport import WaitingReporter

                signalling = asyncio.ensure_future(WaitingReporter(kube, namespace, pod_name, proxy.waiting).run())
    else:
        proxy.set_endpoints("prefill", static_endpoints(args.prefill))
        proxy.set_endpoints("decode", static_endpoints(args.decode))
    if config.connector == Connector.P2P_NCCL and args.p2p_nccl_registration_port:
        from xpyd.proxy.p2pnccl import Registrations

        def register(role: Any, endpoints: list[Any]) -> None:
            loop.call_soon_threadsafe(proxy.set_endpoints, role, endpoints, "registration")

        registration = Registrations(args.host, args.p2p_nccl_registration_port, register)
        try:
            registration.start()
        except RuntimeError as error:  # serving goes on: each engine is addressed at <pod IP>:kv_port
            log.error("%s; install them (pip install 'xpyd-operator[p2p-nccl]') to take registrations. Engines "
                      "are addressed at their discovered IP and --p2p-nccl-kv-port until then", error)
            registration = None
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    # What start-up leaves (modules, the app, the parsers: some 50,000 objects) lives as long as the
    # process: moved out of the collector's reach, a full collection no longer walks it (36 ms a time
    # here, the KV-event lag's p99; 1.6 ms after: benchmarks/kv_events_bench.py).
    gc.collect()
    gc.freeze()
    log.info("xpyd proxy (%s, %s) listening on %s:%d", config.connector.value, config.routing_policy.value,
             args.host, args.port)
    stopping = Stopping(proxy)
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.signalled, signum)
    await stopping.drain(args.drain_seconds)
    log.info("closing the listener; %d request(s) in flight get up to %g s", proxy.in_flight, args.finish_timeout)
    for watcher in watchers:
        watcher.stop()
    for task in (reporting, signalling):
        if task is not None:
            task.cancel()
    if registration is not None:
        registration.stop()
    await runner.cleanup()
    log.info("stopped")


class Stopping:
    """The signals that stop the proxy: the first SIGTERM starts the drain (readiness fails, serving
    goes on for the drain period); SIGINT, or any second signal, ends the drain period at once."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.requested = asyncio.Event()
        self.hurry = asyncio.Event()

    def signalled(self, signum: int) -> None:
        """A signal handler (runs in the event loop)."""
        if self.requested.is_set() or signum == signal.SIGINT:
            self.hurry.set()
        self.proxy.start_draining()
        self.requested.set()

    async def drain(self, seconds: float) -> None:
        """Wait for a stop signal, then serve on (failing readiness) for `seconds`, or until hurried."""
        await self.requested.wait()
        if seconds > 0 and not self.hurry.is_set():
            log.info("draining for %g s: readiness fails, requests are still served", seconds)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.hurry.wait(), seconds)


def main() -> int:
    """`python -m xpyd.proxy`: the same flags as `xpyd proxy`."""
    parser = argparse.ArgumentParser(prog="python -m xpyd.proxy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args())
