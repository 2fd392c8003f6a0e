"""A work queue of object keys (client-go's workqueue, in small).

- A key added while it waits is queued once; a key added while a worker holds it is queued again
  when that worker is done, so one key is never worked on by two workers at once and no change is
  missed.
- `retry(key)` queues it again after a per-key exponential backoff (`base` doubling up to `cap`);
  `forget(key)` resets the backoff after a success.
- `shutdown()` wakes every waiting worker; `get()` then returns None.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    def __init__(self, base: float = 0.5, cap: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.base, self.cap, self.clock = base, cap, clock
        self._ready: deque[K] = deque()
        self._waiting: set[K] = set()      # queued, not yet taken
        self._processing: set[K] = set()   # taken by a worker
        self._again: set[K] = set()        # added while processing
        self._later: list[tuple[float, int, K]] = []
        self._failures: dict[K, int] = {}
        self._sequence = 0
        self._shutdown = False
        self._cond = threading.Condition()

    def __len__(self) -> int:
        with self._cond:
            return len(self._ready)

    def add(self, key: K) -> None:
        with self._cond:
            self._add(key)

    def _add(self, key: K) -> None:
        if self._shutdown or key in self._waiting:
            return
        if key in self._processing:
            self._again.add(key)
            return
        self._waiting.add(key)
        self._ready.append(key)
        self._cond.notify()

    def add_after(self, key: K, delay: float) -> None:
        if delay <= 0:
            self.add(key)
            return
        with self._cond:
            self._sequence += 1
            heapq.heappush(self._later, (self.clock() + delay, self._sequence, key))
            self._cond.notify()

    def retry(self, key: K) -> float:
        """Queue `key` again after its backoff; the delay chosen."""
        with self._cond:
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
        delay = min(self.cap, self.base * 2.0 ** failures)
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        with self._cond:
            self._failures.pop(key, None)

    def get(self, timeout: float | None = None) -> K | None:
        """The next key to work on (None on shutdown, or when `timeout` passes with nothing)."""
        deadline = None if timeout is None else self.clock() + timeout
        with self._cond:
            while True:
                self._promote()
                if self._shutdown:
                    return None
                if self._ready:
                    key = self._ready.popleft()
                    self._waiting.discard(key)
                    self._processing.add(key)
                    return key
                waits = [t - self.clock() for t in (self._later[0][0] if self._later else None, deadline)
                         if t is not None]
                if deadline is not None and self.clock() >= deadline:
                    return None
                self._cond.wait(max(0.0, min(waits)) if waits else None)

    def _promote(self) -> None:
        now = self.clock()
        while self._later and self._later[0][0] <= now:
            _, _, key = heapq.heappop(self._later)
            self._add(key)

    def done(self, key: K) -> None:
        """The worker is done with `key` (queued again if it was added meanwhile)."""
        with self._cond:
            self._processing.discard(key)
            if key in self._again:
                self._again.discard(key)
                self._add(key)

    def shutdown(self) -> None:
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()
