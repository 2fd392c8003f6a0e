"""The proxy's KV-transfer health on its own Pod: the condition `xpyd.io/KVTransferHealthy`
(`api.conditions.KV_TRANSFER_POD_CONDITION`), which the operator reads to set the pool's
`Degraded` condition with reason `KVTransferFailing` (and its Event).

It is a custom Pod condition, the kind readiness gates use: written through `pods/status` with a
strategic merge patch, so the kubelet's own conditions stay (the kubelet keeps conditions it does
not own). The proxy writes it when its report (`Proxy.kv_transfer_report`: the failing pairs, and
the engines whose own count of failed KV transfers rose) changes, at most every `interval` seconds;
`pod_name` comes from the downward API (`POD_NAME`).

`WaitingReporter` keeps a second condition, `xpyd.io/RequestsWaiting` (`api.waiting`): what the
proxy's waiting room holds while no prefill and decode pair is ready. It is the demand signal of a
pool at zero, so it is written as soon as the room changes (the first held request at once), then
at most every `WAITING_INTERVAL_SECONDS` while the counts keep changing; the operator's pod watch
sees each write within milliseconds and decides (`controller.runtime.OperatorRuntime.wake`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from xpyd.api.conditions import KV_TRANSFER_FAILING, KV_TRANSFER_HEALTHY, KV_TRANSFER_POD_CONDITION
from xpyd.api.waiting import held_condition
from xpyd.common.jsontypes import JSON
from xpyd.common.timefmt import rfc3339
from xpyd.kube import Kube, KubeError
from xpyd.proxy.waiting import WaitingRoom

log = logging.getLogger(__name__)

REPORT_INTERVAL_SECONDS = 2.0
#: Least time between two writes of the waiting room's condition (the first change is written at once).
WAITING_INTERVAL_SECONDS = 0.5
#: A condition message stays short: the first pairs, then how many more.
MAX_PAIRS_NAMED = 5


def _named(items: Sequence[JSON], describe: Callable[[JSON], str]) -> str:
    more = f"; and {len(items) - MAX_PAIRS_NAMED} more" if len(items) > MAX_PAIRS_NAMED else ""
    return "; ".join(describe(item) for item in items[:MAX_PAIRS_NAMED]) + more


def kv_condition(failing: Sequence[JSON], engines: Sequence[JSON] = ()) -> JSON:
    """The condition for the pairs `Proxy.failing_pairs()` and the engines `Proxy.failing_engines()`
    list (without its transition time)."""
    if not failing and not engines:
        return {"type": KV_TRANSFER_POD_CONDITION, "status": "True", "reason": KV_TRANSFER_HEALTHY,
                "message": "no prefill/decode pair keeps failing its KV hand-offs"}
    parts = []
    if failing:
        parts.append(f"KV hand-offs keep failing for {len(failing)} pair(s): " + _named(
            failing, lambda p: f"{p['prefill']} -> {p['decode']}: {p['failures']} failed in a row"))
    if engines:
        parts.append(f"{len(engines)} engine(s) count failed KV transfers: " + _named(
            engines, lambda e: f"{e['engine']}: {e['failedTransfers']:g} in {e['windowSeconds']:g} s"))
    return {"type": KV_TRANSFER_POD_CONDITION, "status": "False", "reason": KV_TRANSFER_FAILING,
            "message": "; ".join(parts)}


class _PodConditionWriter:
    """Writes one condition on the proxy's own Pod, only when its status or message changed: stamped
    with `lastProbeTime`, and `lastTransitionTime` when the status moves (as metav1.Condition does)."""

    def __init__(self, kube: Kube, namespace: str, pod_name: str, interval: float) -> None:
        self.kube, self.namespace, self.pod_name = kube, namespace, pod_name
        self.interval = interval
        self.written: tuple[str, str] | None = None  # (status, message) last written
        self.writes = 0

    def write(self, condition: JSON) -> bool:
        """Write `condition` if it changed; True when written. Blocking."""
        key = (condition["status"], condition["message"])
        if key == self.written:
            return False
        stamped = {**condition, "lastProbeTime": rfc3339()}
        if self.written is None or self.written[0] != key[0]:
            stamped["lastTransitionTime"] = stamped["lastProbeTime"]
        try:
            self.kube.patch("v1", "Pod", self.namespace, self.pod_name, {"status": {"conditions": [stamped]}},
                            subresource="status", strategic=True)
        except KubeError as error:  # the next round tries again
            log.warning("could not write %s on pod %s: %s", condition["type"], self.pod_name, error)
            return False
        self.written = key
        self.writes += 1
        return True


class PodConditionReporter(_PodConditionWriter):
    """Keeps the condition on the proxy's Pod current (see the module docstring)."""

    def __init__(self, kube: Kube, namespace: str, pod_name: str, report: Callable[[], JSON],
                 interval: float = REPORT_INTERVAL_SECONDS) -> None:
        super().__init__(kube, namespace, pod_name, interval)
        self.report = report

    async def run(self) -> None:
        """Forever: read the report (on the event loop, which owns it), write off it."""
        while True:
            try:
                report = self.report()
                condition = kv_condition(report["failingPairs"], report["failingEngines"])
                if await asyncio.to_thread(self.write, condition) and (
                        condition["status"] == "False" or self.writes > 1):  # not the healthy start
                    log.info("pod condition %s=%s: %s", KV_TRANSFER_POD_CONDITION, condition["status"],
                             condition["message"])
            except Exception:  # the API server unreachable, say: serving goes on, the next round retries
                log.exception("could not report %s", KV_TRANSFER_POD_CONDITION)
            await asyncio.sleep(self.interval)


class WaitingReporter(_PodConditionWriter):
    """Keeps `xpyd.io/RequestsWaiting` on the proxy's Pod in step with its waiting room (see the module
    docstring): written at start, then whenever what is held changes, at most every `interval`."""

    def __init__(self, kube: Kube, namespace: str, pod_name: str, room: WaitingRoom,
                 interval: float = WAITING_INTERVAL_SECONDS) -> None:
        super().__init__(kube, namespace, pod_name, interval)
        self.room = room

    async def run(self) -> None:
        """Forever: wait for a change of the room, write it (off the event loop), pause `interval`."""
        changed = self.room.changed
        changed.set()  # the state at start: a restarted proxy clears what its predecessor reported
        while True:
            await changed.wait()
            changed.clear()
            condition = held_condition(self.room.held)
            try:
                await asyncio.to_thread(self.write, condition)
            except Exception:  # the API server unreachable, say: serving goes on
                log.exception("could not report the waiting room")
            if self.written != (condition["status"], condition["message"]):
                changed.set()  # not written: try again after the pause
            await asyncio.sleep(self.interval)
