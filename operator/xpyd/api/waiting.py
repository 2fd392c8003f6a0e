"""What a proxy's waiting room holds, as the Pod condition `xpyd.io/RequestsWaiting` carries it: the
one format the proxy writes (`xpyd.proxy.podreport.WaitingReporter`) and the operator reads
(`xpyd.autoscaler.collect.held_requests`), so the two cannot drift apart.

The condition's message is machine-readable and still reads as a sentence in `kubectl describe pod`:

    requests=12 bytes=20480 promptTokens=9350: held for a ready prefill and decode pair

A message that does not parse counts as nothing held (an older or foreign writer); the status alone
never does, so a True condition without counts is not demand either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

from xpyd.api.conditions import NONE_WAITING, REQUESTS_WAITING, REQUESTS_WAITING_POD_CONDITION
from xpyd.common.jsontypes import JSON

_MESSAGE: Final = re.compile(r"^requests=(\d+) bytes=(\d+) promptTokens=(\d+)(?::|$)")


@dataclass(frozen=True)
class Held:
    """Requests held in a waiting room (or several, summed): how many, their bodies' bytes and their
    estimated prompt tokens (the proxy's estimate: exact for token ids, 4 characters a token for text)."""

    requests: int = 0
    bytes: int = 0
    prompt_tokens: int = 0

    def __add__(self, other: Held) -> Held:
        return Held(self.requests + other.requests, self.bytes + other.bytes, self.prompt_tokens + other.prompt_tokens)


def held_condition(held: Held) -> JSON:
    """The Pod condition for `held` (without its timestamps)."""
    counts = f"requests={held.requests} bytes={held.bytes} promptTokens={held.prompt_tokens}"
    if held.requests > 0:
        return {"type": REQUESTS_WAITING_POD_CONDITION, "status": "True", "reason": REQUESTS_WAITING,
                "message": f"{counts}: held for a ready prefill and decode pair"}
    return {"type": REQUESTS_WAITING_POD_CONDITION, "status": "False", "reason": NONE_WAITING,
            "message": f"{counts}: nothing held"}


def held_of(condition: Any) -> Held:
    """What a condition written by `held_condition` says is held (nothing for another condition, a
    False one, or a message that does not parse)."""
    if not isinstance(condition, dict) or condition.get("type") != REQUESTS_WAITING_POD_CONDITION:
        return Held()
    if condition.get("status") != "True":
        return Held()
    match = _MESSAGE.match(str(condition.get("message", "")))
    if match is None:
        return Held()
    requests, size, tokens = (int(group) for group in match.groups())
    return Held(requests, size, tokens)


def held_by_pod(pod: Any) -> Held:
    """What one proxy Pod's condition says its waiting room holds."""
    status = pod.get("status") if isinstance(pod, dict) else None
    conditions = (status or {}).get("conditions") or []
    return sum((held_of(c) for c in conditions if isinstance(c, dict)), Held())
