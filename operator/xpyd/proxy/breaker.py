"""A per-instance circuit breaker. Pure: every call takes `now`.

After `threshold` consecutive failed legs an instance is opened: it gets no new legs. Once the
cooldown has passed it is half-open: the next health probe decides (a client request is never the
probe). A passing probe closes it; a failing one opens it again with the cooldown doubled (up to
`max_cooldown`). Any successful leg closes it and resets the cooldown.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BreakerState(enum.IntEnum):
    """Exported as the `xpyd_proxy_breaker_state` gauge value."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


@dataclass
class Breaker:
    """See the module docstring."""

    threshold: int = 3
    base_cooldown: float = 2.0
    max_cooldown: float = 60.0
    failures: int = 0
    opened_at: float | None = None
    cooldown: float = 0.0

    def state(self, now: float) -> BreakerState:
        """Closed, open, or half-open (cooldown over, waiting for a probe)."""
        if self.opened_at is None:
            return BreakerState.CLOSED
        return BreakerState.HALF_OPEN if now >= self.opened_at + self.cooldown else BreakerState.OPEN

    def allows(self) -> bool:
        """Whether new legs may go to the instance."""
        return self.opened_at is None

    def success(self) -> None:
        """A leg succeeded: close."""
        self.failures = 0
        self.opened_at = None
        self.cooldown = 0.0

    def failure(self, now: float) -> bool:
        """A leg failed; True when this failure opened the breaker."""
        self.failures += 1
        if self.opened_at is None and self.failures >= self.threshold:
            self.opened_at = now
            self.cooldown = self.base_cooldown
            return True
        return False

    def probe(self, healthy: bool, now: float) -> None:
        """A health probe's result: decides a half-open breaker, ignored otherwise."""
        if self.state(now) != BreakerState.HALF_OPEN:
            return
        if healthy:
            self.success()
        else:
            self.opened_at = now
            self.cooldown = min(self.cooldown * 2, self.max_cooldown)
