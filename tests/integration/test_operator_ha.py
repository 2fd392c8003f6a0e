"""Two operator replicas electing their leader on a Lease, against the mock API: only the leader
writes, a graceful stop hands over within the retry period, a leader that stops renewing is
replaced within the takeover bound and, while it still runs, writes nothing more; every write is
attributed to its replica by its User-Agent."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from tests.eventually import eventually
from tests.integration.fakekube import FakeKube, Write
from tests.integration.operatorrig import (
    LEASE_NAMESPACE,
    LEASE_TIMING,
    NS,
    Operator,
    children_exist,
    create_serving,
    request,
)
from xpyd.controller.main import LEASE_NAME, serve
from xpyd.controller.metrics import OperatorMetrics

pytestmark = pytest.mark.integration

LEASE = "coordination.k8s.io/v1/leases"


class Replica(Operator):
    """An operator in a thread with its own event loop, as in a pod of its own: kopf, when it stops,
    cancels every task of its loop, which would include the other replica's."""

    async def start(self) -> None:
        registry, memo = self.build()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, daemon=True, name=f"replica-{self.identity}",
                                       args=(serve(registry, memo, [], liveness=None, stop_flag=self.stopping),))
        self.thread.start()

    async def stop(self) -> None:
        self.stopping.set()
        await asyncio.to_thread(self.thread.join, 20)
        assert not self.thread.is_alive()


def holder(fake: FakeKube) -> str | None:
    lease = fake.get_object(LEASE, LEASE_NAMESPACE, LEASE_NAME) or {}
    return (lease.get("spec") or {}).get("holderIdentity")


def writes_of(fake: FakeKube, identity: str) -> list[Write]:
    """What one replica wrote, the Lease apart."""
    return [w for w in fake.writes if w.agent.startswith(f"xpyd-test/{identity}") and "/leases" not in w.path]


def lease_writes(fake: FakeKube, identity: str) -> list[Write]:
    return [w for w in fake.writes if w.agent.startswith(f"xpyd-test/{identity}") and "/leases" in w.path]


async def start_pair(fake: FakeKube) -> tuple[Operator, Operator]:
    """Replica a, leading, and replica b, standing by; then a pool a has created."""
    url = str(fake.url).rstrip("/")
    a, b = Replica(url, identity="a"), Replica(url, identity="b")
    await a.start()
    await eventually(lambda: holder(fake) == "a" and a.memo.state.acting(), what="a leads")
    await b.start()
    await eventually(lambda: b.memo.state.elector.candidate.observed_version, what="b read the Lease")
    await create_serving(fake)
    await eventually(lambda: children_exist(fake), what="children")
    await asyncio.sleep(1.0)  # several of b's rounds
    assert not b.memo.state.acting() and holder(fake) == "a"
    assert writes_of(fake, "a") and writes_of(fake, "b") == []
    return a, b


async def delete_decode(fake: FakeKube) -> None:
    await request(fake, "DELETE", f"/apis/apps/v1/namespaces/{NS}/deployments/llama-decode")
    await eventually(lambda: fake.get_object("apps/v1/deployments", NS, "llama-decode"), what="decode repaired")


def assert_one_writer_at_a_time(first: list[Write], second: list[Write]) -> None:
    assert first and second
    assert max(w.at for w in first) < min(w.at for w in second), "both replicas wrote in the same interval"


def metric_leader(op: Operator) -> float:
    families: dict[str, Any] = {f.name: f for f in OperatorMetrics(op.memo.state).collect()}
    return float(families["xpyd_operator_leader"].samples[0].value)


async def test_graceful_stop_hands_over_within_the_retry_period(fake: FakeKube) -> None:
    a, b = await start_pair(fake)
    try:
        assert (metric_leader(a), metric_leader(b)) == (1.0, 0.0)
        await a.stop()
        await eventually(lambda: b.memo.state.acting(), what="b leads")
        # From a's release (its last Lease write) to b's acquisition (b's first).
        released = max(w.at for w in lease_writes(fake, "a"))
        took = min(w.at for w in lease_writes(fake, "b")) - released
        assert 0 < took <= LEASE_TIMING.retry_period + 0.5, took
        assert holder(fake) == "b" and metric_leader(b) == 1.0
        lease = fake.get_object(LEASE, LEASE_NAMESPACE, LEASE_NAME)
        assert lease is not None and lease["spec"]["leaseTransitions"] == 1
        await delete_decode(fake)
        assert_one_writer_at_a_time(writes_of(fake, "a"), writes_of(fake, "b"))
    finally:
        await a.stop()
        await b.stop()


async def test_a_leader_that_stops_renewing_is_replaced_and_fenced(fake: FakeKube) -> None:
    a, b = await start_pair(fake)
    try:
        # a's renewals stop (a partition from the Lease, or a hung elector) while its workers and
        # watches go on: it must stop writing at its renew deadline, before b takes over.
        await asyncio.to_thread(a.memo.state.elector.stop)
        stopped = asyncio.get_running_loop().time()
        await eventually(lambda: b.memo.state.acting(), timeout=10, what="b leads")
        took = asyncio.get_running_loop().time() - stopped
        # Never before a's lease ran out (what the fence relies on). The bound itself is held exactly
        # by tests/unit/test_leader.py on a fake clock; here, on the wall clock of a loaded machine,
        # a second of scheduling slack.
        assert LEASE_TIMING.lease_duration - LEASE_TIMING.retry_period <= took <= LEASE_TIMING.takeover_bound + 1, \
            took
        assert not a.memo.state.acting() and metric_leader(a) == 0.0
        # a's workers see the deletion too (its caches are live) and reconcile; the fence stops them.
        await delete_decode(fake)
        await asyncio.sleep(1.0)
        assert_one_writer_at_a_time(writes_of(fake, "a"), writes_of(fake, "b"))
        assert any("/deployments" in w.path for w in writes_of(fake, "b"))
    finally:
        await a.stop()
        await b.stop()
