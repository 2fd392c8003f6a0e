"""KV-transfer health: hand-off failures counted per prefill/decode pair.

A hand-off failure is a decode leg that failed after its prefill succeeded while the decode engine
itself answered: an HTTP 5xx (vLLM's `kv_load_failure_policy: fail` answers 500 when the KV
cannot be loaded) or no first byte in time (a pull that hangs). A refused or reset connection is
the decode engine's own health (`xpyd.proxy.health`), not the pair's.

`threshold` failures in a row make a pair failing: new requests avoid it for `cooldown` seconds,
doubling while it keeps failing (up to `max_cooldown`); one success resets it. Avoiding is a
preference: when every pair left is failing, they are used (`xpyd.proxy.pairing` falls back), since
refusing a request a pair might still serve would lose it for certain.

The engines' own count of failed KV transfers (`FAILED_TRANSFERS_METRIC` on their /metrics, which
HealthProber reads every `kv_metrics_interval`) is the other sign, and under
`kv_load_failure_policy: recompute` the only one: decode then recomputes the prompt and the request
succeeds, slower. An engine whose count rose within `window` seconds is reported beside the pairs
(`EngineTransferFailures`); it is not avoided, since its requests still succeed and the count does
not say which peer failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from prometheus_client.parser import text_string_to_metric_families

#: vLLM's count of failed NIXL KV transfers on an engine (from 0.23 handshake and notification
#: failures included: `nixl/stats.py`); summed over its series (one per data-parallel engine).
FAILED_TRANSFERS_METRIC: Final = "vllm:nixl_num_failed_transfers"
#: Its samples, as prometheus_client writes a counter (the family named so too, in text format 0.0.4).
FAILED_TRANSFERS_SAMPLE: Final = FAILED_TRANSFERS_METRIC + "_total"


@dataclass
class PairState:
    failures: int = 0  # in a row
    total: int = 0
    avoided_until: float = 0.0
    cooldown: float = 0.0


@dataclass(frozen=True)
class FailingPair:
    prefill: str
    decode: str
    failures: int  # in a row
    total: int
    avoided_for: float  # seconds of cool-down left (0: tried again)


@dataclass
class PairHealth:
    threshold: int = 3
    cooldown: float = 30.0
    max_cooldown: float = 300.0
    pairs: dict[tuple[str, str], PairState] = field(default_factory=dict)

    def failed(self, prefill: str, decode: str, now: float) -> bool:
        """A hand-off from `prefill` to `decode` failed; True when the pair is now newly avoided."""
        state = self.pairs.setdefault((prefill, decode), PairState())
        state.failures += 1
        state.total += 1
        if state.failures < self.threshold or now < state.avoided_until:
            return False
        state.cooldown = min(self.max_cooldown, state.cooldown * 2 if state.cooldown else self.cooldown)
        state.avoided_until = now + state.cooldown
        return True

    def succeeded(self, prefill: str, decode: str) -> None:
        """A hand-off worked: the pair is healthy again."""
        self.pairs.pop((prefill, decode), None)

    def avoided(self, prefill: str, decode: str, now: float) -> bool:
        state = self.pairs.get((prefill, decode))
        return state is not None and now < state.avoided_until

    def failing(self, now: float) -> list[FailingPair]:
        """The pairs at or above the threshold (avoided now, or tried again after their cool-down
        and not yet proven healthy), by URL."""
        return [FailingPair(p, d, s.failures, s.total, round(max(0.0, s.avoided_until - now), 3))
                for (p, d), s in sorted(self.pairs.items()) if s.failures >= self.threshold]

    def forget(self, urls: set[str]) -> None:
        """Drop the pairs of instances that are gone."""
        for key in [k for k in self.pairs if k[0] in urls or k[1] in urls]:
            del self.pairs[key]


def failed_transfers(exposition: str) -> float | None:
    """An engine's failed KV transfers from its /metrics text; None when it exports no such counter
    (another connector). ValueError when the text is not Prometheus' format."""
    samples = [sample.value for family in text_string_to_metric_families(exposition) for sample in family.samples
               if sample.name == FAILED_TRANSFERS_SAMPLE]
    return sum(samples) if samples else None


@dataclass
class EngineTransferFailures:
    """The engines whose own count of failed KV transfers rose recently (see the module docstring)."""

    window: float = 60.0
    #: url -> the counter at the last reading
    last: dict[str, float] = field(default_factory=dict)
    #: url -> (when, rise) of the readings that rose, within the window
    rises: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def observe(self, url: str, value: float, now: float) -> float:
        """A reading of the engine's counter; the rise since the last one. The first reading is only
        a baseline, and so is a lower one (the engine restarted: its counter began again at 0)."""
        previous = self.last.get(url)
        self.last[url] = value
        if previous is None or value <= previous:
            return 0.0
        self.rises.setdefault(url, []).append((now, value - previous))
        return value - previous

    def failing(self, now: float) -> list[tuple[str, float]]:
        """(url, failed transfers within the window) of each engine that had some, by URL."""
        for url in list(self.rises):
            self.rises[url] = [(t, n) for t, n in self.rises[url] if now - t <= self.window]
            if not self.rises[url]:
                del self.rises[url]
        return [(url, sum(n for _, n in rises)) for url, rises in sorted(self.rises.items())]

    def forget(self, urls: set[str]) -> None:
        """Drop the engines that are gone."""
        for url in urls:
            self.last.pop(url, None)
            self.rises.pop(url, None)
