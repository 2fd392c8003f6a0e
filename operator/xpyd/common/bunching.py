"""How prompt work bunches on arrival, measured: per request, the prompt tokens arriving in the same
aligned slot of each length in `WINDOWS_S` (its own included), handed over when the slot closes.

The proxy exports it as `xpyd_proxy_arrival_prompt_tokens{window}` and the simulator's proxy records
the same, with the same slots and buckets; the autoscaler sizes prefill by it
(`xpyd.autoscaler.arrivals`, which says why).
"""

from __future__ import annotations

import math
from collections.abc import Callable

#: The slot lengths measured (seconds), and their label values on the proxy's histogram.
WINDOWS_S: tuple[float, ...] = (0.25, 1.0, 4.0)
#: Bucket bounds of the slot work (prompt tokens): 128 to 16.8M tokens in steps of sqrt(2).
BUCKETS: tuple[float, ...] = tuple(float(round(128 * 2 ** (i / 2))) for i in range(35))


def window_label(window_s: float) -> str:
    """The `window` label value of a slot length: "0.25", "1", "4"."""
    return f"{window_s:g}"


class ArrivalSlots:
    """Prompt tokens per aligned slot of each of `windows_s`, handed to `emit(window_s, tokens,
    requests)` when a slot closes: at the first arrival past its end, or at `flush(now)`.

    Arrivals must come in time order (a later one with an earlier time is counted in the open slot).
    """

    __slots__ = ("_emit", "_open", "windows_s")

    def __init__(self, emit: Callable[[float, float, int], None], windows_s: tuple[float, ...] = WINDOWS_S) -> None:
        if not windows_s or any(not (w > 0 and math.isfinite(w)) for w in windows_s):
            raise ValueError(f"slot lengths must be positive seconds, not {windows_s}")
        self.windows_s = windows_s
        self._emit = emit
        self._open: list[tuple[int, float, int]] = [(-1, 0.0, 0) for _ in windows_s]   # (slot, tokens, requests)

    def add(self, now: float, tokens: float) -> None:
        """One request of `tokens` prompt tokens arriving at `now` (seconds)."""
        for i, window in enumerate(self.windows_s):
            slot = math.floor(now / window)
            current, total, requests = self._open[i]
            if slot > current:
                if requests:
                    self._emit(window, total, requests)
                self._open[i] = (slot, float(tokens), 1)
            else:
                self._open[i] = (current, total + tokens, requests + 1)

    def flush(self, now: float) -> None:
        """Close the slots that ended by `now` (e.g. before a scrape, when no arrival closed them)."""
        for i, window in enumerate(self.windows_s):
            current, total, requests = self._open[i]
            if requests and (current + 1) * window <= now:
                self._emit(window, total, requests)
                self._open[i] = (current, 0.0, 0)
