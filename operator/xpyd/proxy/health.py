"""Health of the upstream instances: `GET /health` probes, and what a failed leg does to an instance
(its circuit breaker, its learnt identities, a probe at once)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

from xpyd.api.naming import Role
from xpyd.proxy.config import ProxyConfig
from xpyd.proxy.metrics import ProxyMetrics
from xpyd.proxy.pool import Instance, Pool

log = logging.getLogger(__name__)


class HealthProber:
    """Probes the pools' instances and reacts to failed legs."""

    def __init__(self, config: ProxyConfig, pools: dict[Role, Pool], metrics: ProxyMetrics,
                 session: Callable[[], aiohttp.ClientSession], timeouts: dict[str, aiohttp.ClientTimeout],
                 spawn: Callable[[Awaitable[None]], None]) -> None:
        self.config = config
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

    def failed(self, instance: Instance, reason: str) -> None:
        """A leg to `instance` failed: count it on its breaker and probe it now."""
        log.warning("%s leg to %s failed: %s", instance.role, instance.url, reason)
        instance.forget_identity()  # a restarted engine has new ids: ask its bootstrap server again
        if instance.breaker.failure(time.monotonic()):
            self.metrics.breaker_trips.inc(instance.role)
            log.warning("circuit breaker of %s %s opened", instance.role, instance.url)
        if not instance.probing:
            self.spawn(self.probe(instance))
