"""Which prefill and decode instances an attempt may pair: the rules of `xpyd.proxy.picking`
(equal KV compatibility hashes: `pairable`, `partners`) over the pools' candidates, with the
rollout of both roles taken into account (`candidates`) and the pairs whose KV hand-offs keep
failing avoided while others are left (`xpyd.proxy.kvhealth`)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from xpyd.api.naming import KV_COMPAT_LABEL, Role
from xpyd.proxy.kvhealth import PairHealth
from xpyd.proxy.picking import pairable, partners
from xpyd.proxy.pool import Instance, Pool
from xpyd.proxy.validation import RequestError


def _compat(instance: Instance) -> str | None:
    return instance.compat


class NoCompatiblePair(RequestError):
    """Both roles have instances that could take a request, but no prefill has a decode of its KV
    compatibility hash (a rollout between revisions that cannot share KV, or a misconfiguration)."""

    def __init__(self) -> None:
        super().__init__(503, "No prefill and decode instances of the same KV compatibility (the pods' "
                              f"{KV_COMPAT_LABEL} label) are available: a prefill's KV cache cannot be "
                              "read by any decode instance now.")


class Pairing:
    """The pairs the pools' instances form, and which of them the next attempt may use."""

    def __init__(self, pools: Mapping[Role, Pool], health: PairHealth) -> None:
        self.pools = pools
        self.health = health

    def candidates(self, now: float, tried_prefill: Iterable[str] = (),
                   tried_decode: Iterable[str] = ()) -> tuple[list[Instance], list[Instance]]:
        """The prefill and the decode instances an attempt may use: per role the pool's candidates
        (the ones not terminating, else the terminating ones within their fallback time), unless
        those hold no compatible pair and the terminating ones complete one. That is a rollout of
        both roles: the new revision has one role ready, the old revision's other role is only
        left draining, and the old pair serves until the new one can."""
        (prefill_live, prefill_fallback), (decode_live, decode_fallback) = \
            self.pools["prefill"].tiers(now, tried_prefill), self.pools["decode"].tiers(now, tried_decode)
        prefills, decodes = prefill_live or prefill_fallback, decode_live or decode_fallback
        if not pairable(prefills, decodes, _compat):
            every_prefill, every_decode = prefill_live + prefill_fallback, decode_live + decode_fallback
            if pairable(every_prefill, every_decode, _compat):
                return every_prefill, every_decode
        return prefills, decodes

    def prefills(self, prefills: list[Instance], decodes: list[Instance], now: float) -> list[Instance]:
        """The `prefills` that have a partner among `decodes`, and of those the ones with a partner
        whose pair is not failing (all of them when none has: avoiding is a preference)."""
        paired = pairable(prefills, decodes, _compat)
        healthy = [p for p in paired if self._unavoided(p, partners(decodes, p.compat, _compat), now)]
        return healthy or paired

    def partners(self, prefill: Instance | None, decodes: list[Instance], now: float) -> list[Instance]:
        """The `decodes` that may read the KV of `prefill` (None: of no prefill), and of those the
        ones whose pair with it is not failing (all of them when all are)."""
        compatible = partners(decodes, prefill.compat if prefill is not None else None, _compat)
        if prefill is None:
            return compatible
        return self._unavoided(prefill, compatible, now) or compatible

    def _unavoided(self, prefill: Instance, decodes: list[Instance], now: float) -> list[Instance]:
        """The `decodes` whose pair with `prefill` is not avoided now (possibly none)."""
        return [d for d in decodes if not self.health.avoided(prefill.url, d.url, now)]

    def compatible_pair(self) -> bool:
        """Whether some prefill and decode instances that could take a request now share a KV
        compatibility hash."""
        return bool(pairable(*self.candidates(time.monotonic()), _compat))
