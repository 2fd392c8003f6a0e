"""A work queue of object keys (client-go's workqueue, in small).

- A key added while it waits is queued once; a key added while a worker holds it is queued again
  when that worker is done, so one key is never worked on by two workers at once and no change is
  missed.
- `retry(key)` queues it again after a per-key exponential backoff (`base` doubling up to `cap`);
  `forget(key)` resets the backoff after a success.
- Two priorities: an `urgent` key (a new or changed object, a deleted or edited child) is taken
  before every normal one (a status to refresh); a waiting normal key added as urgent moves up.
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
        self._urgent: deque[K] = deque()
        self._waiting: set[K] = set()      # queued, not yet taken
        self._urgent_keys: set[K] = set()  # queued urgent (also in _waiting)
        self._processing: set[K] = set()   # taken by a worker
        self._again: set[K] = set()        # added while processing
        self._later: list[tuple[float, int, K, bool]] = []
        self._failures: dict[K, int] = {}
        self._sequence = 0
        self._shutdown = False
        self._cond = threading.Condition()

    def __len__(self) -> int:
        with self._cond:
            return len(self._waiting)

    def add(self, key: K, urgent: bool = False) -> None:
        with self._cond:
            self._add(key, urgent)

    def _add(self, key: K, urgent: bool = False) -> None:
        if self._shutdown:
            return
        if key in self._processing:
            self._again.add(key)
            if urgent:
                self._urgent_keys.add(key)
            return
        if key in self._waiting:
            if urgent and key not in self._urgent_keys:
                self._urgent_keys.add(key)
                self._urgent.append(key)  # its normal entry is skipped when reached
                self._cond.notify()
            return
        self._waiting.add(key)
        if urgent:
            self._urgent_keys.add(key)
            self._urgent.append(key)
        else:
            self._ready.append(key)
        self._cond.notify()

    def add_after(self, key: K, delay: float, urgent: bool = False) -> None:
        if delay <= 0:
            self.add(key, urgent)
            return
        with self._cond:
            self._sequence += 1
            heapq.heappush(self._later, (self.clock() + delay, self._sequence, key, urgent))
            self._cond.notify()

    def retry(self, key: K) -> float:
        """Queue `key` again after its backoff; the delay chosen."""
        with self._cond:
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
        delay = min(self.cap, self.base * 2.0 ** failures)
        self.add_after(key, delay, urgent=True)
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
                key = self._take()
                if key is not None:
                    return key
                waits = [t - self.clock() for t in (self._later[0][0] if self._later else None, deadline)
                         if t is not None]
                if deadline is not None and self.clock() >= deadline:
                    return None
                self._cond.wait(max(0.0, min(waits)) if waits else None)

    def _take(self) -> K | None:
        while self._urgent or self._ready:
            key = self._urgent.popleft() if self._urgent else self._ready.popleft()
            if key not in self._waiting:
                continue  # taken already through its other entry
            self._waiting.discard(key)
            self._urgent_keys.discard(key)
            self._processing.add(key)
            return key
        return None

    def _promote(self) -> None:
        now = self.clock()
        while self._later and self._later[0][0] <= now:
            _, _, key, urgent = heapq.heappop(self._later)
            self._add(key, urgent)

    def done(self, key: K) -> None:
        """The worker is done with `key` (queued again if it was added meanwhile)."""
        with self._cond:
            self._processing.discard(key)
            if key in self._again:
                self._again.discard(key)
                urgent = key in self._urgent_keys
                self._urgent_keys.discard(key)
                self._add(key, urgent)

    def shutdown(self) -> None:
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()
