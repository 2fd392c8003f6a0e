"""The proxy's waiting room: requests held while the pool has no ready prefill and decode pair (a
pool scaled to zero, starting again), sent on as soon as it has one.

Bounded three ways (`--wait-max-requests`, `--wait-max-bytes`, `--wait-timeout`; the operator renders
them from `spec.autoscaling.scaleToZero` for a pool that scales to zero, and `--wait-timeout 0`, the
flag's default, turns the room off):

- a request that would take it over either size bound is refused at once: 429 with `Retry-After`
  and a JSON error body (`WaitingRoomFull`); nothing waits to be refused;
- a request still held when its timeout runs out gets 503 with `Retry-After` (`WaitExpired`);
- every other held request goes on the moment a pair exists: each waiter wakes when the proxy's
  instances change (`poke()`, called by discovery) and, for what no event announces (a health probe
  that passed), every `poll_s`.

Nothing is lost silently: `xpyd_proxy_waiting_total{result}` counts every request that entered
(`held`), and how each left (`released`, `overflow`, `expired`, `cancelled`: the client went away);
`xpyd_proxy_waiting_requests` and `xpyd_proxy_waiting_bytes` are what is held now, and
`xpyd_proxy_wait_duration_seconds{result}` how long the requests waited.

`changed` is set whenever what is held changes: the proxy's Pod reporter
(`xpyd.proxy.podreport.WaitingReporter`) waits on it to write the demand signal the operator reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Final

from xpyd.api.waiting import Held
from xpyd.proxy.metrics import Counter, Gauge, Histogram
from xpyd.proxy.validation import RequestError

#: Seconds between a waiter's own checks for a pair, besides the discovery events that wake it.
POLL_SECONDS: Final = 0.1
#: Retry-After of a 429 from a full waiting room: the room drains once the pool serves.
OVERFLOW_RETRY_AFTER_SECONDS: Final = 5
#: Retry-After of a 503 after the timeout: the pool took longer than its start-up to serve.
EXPIRED_RETRY_AFTER_SECONDS: Final = 30
#: Wait durations, seconds (up to start-ups of many minutes).
WAIT_BUCKETS: Final = (0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


class WaitingError(RequestError):
    """A request the waiting room refuses or gives up on: its status, message, headers and the
    outcome it counts as in `xpyd_proxy_requests_total`."""

    outcome = "error"

    def __init__(self, status: int, message: str, retry_after: int) -> None:
        super().__init__(status, message)
        self.headers = {"Retry-After": str(retry_after)}


class WaitingRoomFull(WaitingError):
    outcome = "waiting_room_full"

    def __init__(self, what: str) -> None:
        super().__init__(429, f"No prefill and decode pair is ready (the pool is starting) and the proxy's waiting "
                              f"room is full ({what}); retry later.", OVERFLOW_RETRY_AFTER_SECONDS)


class WaitExpired(WaitingError):
    outcome = "wait_expired"

    def __init__(self, waited: float) -> None:
        super().__init__(503, f"No prefill and decode pair became ready within {waited:.0f} s (the pool is starting "
                              "from zero, or cannot start); retry later.", EXPIRED_RETRY_AFTER_SECONDS)


class WaitingRoom:
    """The bounded waiting room (see the module docstring). Runs on the proxy's event loop."""

    def __init__(self, max_requests: int, max_bytes: int, timeout_s: float, poll_s: float = POLL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_requests < 1 or max_bytes < 1 or timeout_s < 0 or poll_s <= 0:
            raise ValueError("the waiting room needs max_requests and max_bytes of at least 1, a timeout of at "
                             "least 0 (off) and a positive poll interval")
        self.max_requests, self.max_bytes, self.timeout_s, self.poll_s = max_requests, max_bytes, timeout_s, poll_s
        self.clock = clock
        self.requests = self.bytes = self.prompt_tokens = 0
        self.changed = asyncio.Event()
        self._wakeup = asyncio.Event()
        self.outcomes = Counter("xpyd_proxy_waiting_total", "Requests that entered the waiting room (held) and how "
                                "they left it: released, overflow (429), expired (503), cancelled.", ("result",))
        self.waited = Histogram("xpyd_proxy_wait_duration_seconds", "How long requests waited for a ready "
                                "prefill and decode pair, by how they left the room.", ("result",),
                                buckets=WAIT_BUCKETS)
        self.gauges = [
            Gauge("xpyd_proxy_waiting_requests", "Requests held for a ready prefill and decode pair.", (),
                  lambda: [((), float(self.requests))]),
            Gauge("xpyd_proxy_waiting_bytes", "Body bytes of the requests held.", (),
                  lambda: [((), float(self.bytes))]),
        ]

    @property
    def enabled(self) -> bool:
        """Whether requests are held at all (`--wait-timeout` above 0)."""
        return self.timeout_s > 0

    @property
    def held(self) -> Held:
        """What is held now."""
        return Held(self.requests, self.bytes, self.prompt_tokens)

    def collectors(self) -> Iterable[Counter | Histogram | Gauge]:
        """The room's metrics, for the proxy's registry."""
        return [self.outcomes, self.waited, *self.gauges]

    def poke(self) -> None:
        """The proxy's instances changed: every waiter checks for a pair now."""
        self._wakeup.set()
        self._wakeup = asyncio.Event()

    def _admit(self, size: int, tokens: int) -> None:
        if self.requests + 1 > self.max_requests:
            raise WaitingRoomFull(f"{self.requests} of {self.max_requests} requests held")
        if self.bytes + size > self.max_bytes:
            raise WaitingRoomFull(f"{self.bytes} + {size} bytes would exceed {self.max_bytes}")
        self.requests += 1
        self.bytes += size
        self.prompt_tokens += tokens
        self.changed.set()

    def _leave(self, size: int, tokens: int) -> None:
        self.requests -= 1
        self.bytes -= size
        self.prompt_tokens -= tokens
        self.changed.set()

    async def hold(self, size: int, tokens: int, can_serve: Callable[[], bool]) -> float:
        """Hold a request of `size` body bytes and `tokens` prompt tokens until `can_serve()`; the
        seconds it waited (0 when it could be served at once). Raises WaitingRoomFull at once when
        the room is full, WaitExpired after the timeout; a cancelled waiter (the client went away)
        leaves the room."""
        if can_serve():
            return 0.0
        try:
            self._admit(size, tokens)
        except WaitingRoomFull:
            self.outcomes.inc("overflow")
            raise
        self.outcomes.inc("held")
        started = self.clock()
        deadline = started + self.timeout_s
        result = "cancelled"
        try:
            while not can_serve():
                remaining = deadline - self.clock()
                if remaining <= 0:
                    result = "expired"
                    raise WaitExpired(self.timeout_s)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), min(remaining, self.poll_s))
            result = "released"
            return self.clock() - started
        finally:
            self._leave(size, tokens)
            self.outcomes.inc(result)
            self.waited.observe(self.clock() - started, result)
