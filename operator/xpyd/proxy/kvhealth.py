"""KV-transfer health: hand-off failures counted per prefill/decode pair.

A hand-off failure is a decode leg that failed after its prefill succeeded while the decode engine
itself answered: an HTTP 5xx (vLLM's `kv_load_failure_policy: fail` answers 500 when the KV
cannot be loaded) or no first byte in time (a pull that hangs). A refused or reset connection is
the decode engine's own health (`xpyd.proxy.health`), not the pair's.

`threshold` failures in a row make a pair failing: new requests avoid it for `cooldown` seconds,
doubling while it keeps failing (up to `max_cooldown`); one success resets it. Avoiding is a
preference: when every pair left is failing, they are used (`xpyd.proxy.server` falls back), since
refusing a request a pair might still serve would lose it for certain.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
