"""Health of the upstream instances: `GET /health` probes, what a failed leg does to an instance
(its circuit breaker, its learnt identities, a probe at once), and the NIXL engines' own count of
failed KV transfers, read from their /metrics (`kvhealth.EngineTransferFailures`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

from xpyd.api.naming import Role
from xpyd.proxy.config import ProxyConfig
from xpyd.proxy.kvhealth import EngineTransferFailures, failed_transfers
from xpyd.proxy.metrics import ProxyMetrics
from xpyd.proxy.pool import Instance, Pool

log = logging.getLogger(__name__)


class HealthProber:
    """Probes the pools' instances and reacts to failed legs."""

    def __init__(self, config: ProxyConfig, pools: dict[Role, Pool], metrics: ProxyMetrics,
                 session: Callable[[], aiohttp.ClientSession], timeouts: dict[str, aiohttp.ClientTimeout],
                 spawn: Callable[[Awaitable[None]], None],
                 engine_failures: EngineTransferFailures | None = None) -> None:
        self.config = config
        self.engine_failures = engine_failures if engine_failures is not None else EngineTransferFailures()
        self.pools = pools
        self.metrics = metrics
        self.session = session
        self.timeouts = timeouts
        self.spawn = spawn

    async def run(self) -> None:
        """Probe every listed instance each `health_interval` (one probe at a time per instance)."""
        while True:
            await asyncio.sleep(self.config.health_interval)
            for pool in self.pools.values():
                for instance in list(pool.instances.values()):
                    if instance.listed and not instance.probing:
                        self.spawn(self.probe(instance))

    async def probe(self, instance: Instance) -> None:
        """GET /health: 200 is healthy; 503 (loading, dead), anything else or no answer is not. A
        probe overtaken by new readiness evidence (`Pool.update`) decides nothing: the probe sent
        with that evidence does."""
        evidence = instance.evidence
        instance.probing = True
        try:
            async with self.session().get(instance.url + "/health", timeout=self.timeouts["probe"]) as response:
                await response.read()
                healthy = response.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            healthy = False
        finally:
            if instance.evidence == evidence:
                instance.probing = False
        if instance.evidence != evidence:
            return
        if instance.set_healthy(healthy):  # turning healthy also forgets the engine ids (a restart changes them)
            log.info("%s %s is %s", instance.role, instance.url, "healthy" if healthy else "unhealthy")
        instance.breaker.probe(healthy, time.monotonic())

    async def run_kv_metrics(self) -> None:
        """Read every listed instance's failed KV transfers each `kv_metrics_interval` (NIXL
        connectors only: the others export no such count)."""
        if not self.config.kv_metrics_interval or not self.config.connector.is_nixl:
            return
        while True:
            await asyncio.sleep(self.config.kv_metrics_interval)
            instances = [i for pool in self.pools.values() for i in pool.instances.values() if i.listed]
            try:
                await asyncio.gather(*(self.read_kv_failures(i) for i in instances))
            except Exception:  # never the end of the loop: the next round reads again
                log.exception("could not read the engines' failed KV transfers")

    async def read_kv_failures(self, instance: Instance) -> None:
        """One read of an engine's failed KV transfers (nothing when it does not answer: its health
        probe says so)."""
        try:
            async with self.session().get(instance.url + "/metrics", timeout=self.timeouts["probe"]) as response:
                if response.status != 200:
                    return
                text = await response.text()
            value = failed_transfers(text)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, UnicodeDecodeError):
            return
        if value is not None and (rise := self.engine_failures.observe(instance.url, value, time.monotonic())):
            log.warning("%s %s counts %g more failed KV transfer(s) (%s)", instance.role, instance.name or instance.url,
                        rise, "vllm:nixl_num_failed_transfers_total")

    def failed(self, instance: Instance, reason: str) -> None:
        """A leg to `instance` failed: count it on its breaker and probe it now."""
        log.warning("%s leg to %s failed: %s", instance.role, instance.url, reason)
        instance.forget_identity()  # a restarted engine has new ids: ask its bootstrap server again
        if instance.breaker.failure(time.monotonic()):
            self.metrics.breaker_trips.inc(instance.role)
            log.warning("circuit breaker of %s %s opened", instance.role, instance.url)
        if not instance.probing:
            self.spawn(self.probe(instance))
