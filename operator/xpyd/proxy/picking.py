"""Which instance of a role gets the next leg. Pure: the caller passes the candidates, their
loads and the random source.

The load of an instance is what the proxy itself has outstanding there: prompt tokens for prefill
(a prefill engine's queue drains at a rate in tokens per second, so one long prompt weighs as much
as many short ones) and requests for decode (each running sequence costs a decode engine about the
same per step). Every proxy replica counts only its own traffic; with several replicas, random tie
breaking keeps them from herding onto the same idle instance.

- LeastLoaded: the candidate with the least load; ties broken uniformly at random.
- PowerOfTwo: two distinct candidates drawn at random, the less loaded of the two (ties random);
  nearly as balanced as LeastLoaded and less prone to herding when many proxies share a pool.
- RoundRobin: candidates in a stable order (by name), one after another, ignoring load.
- KVAware: scored per request by `xpyd.proxy.kvaware` (where the prompt's prefix is cached, weighed
  against load); a pick without a request (`/v1/models`, the decode-only fallback) is LeastLoaded's.

LeastLoaded and PowerOfTwo are `xpyd.kvcache.scoring.least_loaded`, the simulator's pick too.

Pairing: a prefill and a decode instance may serve one request only when their KV compatibility
hashes (the pods' `xpyd.io/kv-compat` label, `xpyd.render.compat`) are equal; an instance without
one (a fixed URL, a pod rendered before the label existed) pairs only with others without one. The
prefill is picked among those that have a compatible decode candidate (`pairable`), then the decode
among that prefill's partners (`partners`): during a rollout new prefill pairs with new decode and
old with old, and a prefill whose kind of decode is gone gets no requests. `xpyd.proxy.pairing`
applies these rules to the pools.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from xpyd.api.models import RoutingPolicy
from xpyd.kvcache.scoring import least_loaded

T = TypeVar("T")


def pick(policy: RoutingPolicy, candidates: Sequence[T], load: Callable[[T], float], name: Callable[[T], str],
         rng: random.Random, turn: int) -> T:
    """The candidate `policy` chooses. `turn` counts earlier picks of this role (RoundRobin);
    `candidates` must not be empty."""
    if not candidates:
        raise ValueError("no candidates to pick from")
    if len(candidates) == 1:
        return candidates[0]
    if policy == RoutingPolicy.ROUND_ROBIN:
        ordered = sorted(candidates, key=name)
        return ordered[turn % len(ordered)]
    loads = [load(candidate) for candidate in candidates]
    return candidates[least_loaded(loads, rng, power_of_two=policy == RoutingPolicy.POWER_OF_TWO)]


def pairable(prefills: Iterable[T], decodes: Iterable[T], compat: Callable[[T], str | None]) -> list[T]:
    """The prefill candidates that have at least one decode candidate of an equal compatibility
    hash (None, no hash, equals only None)."""
    kinds = {compat(decode) for decode in decodes}
    return [prefill for prefill in prefills if compat(prefill) in kinds]


def partners(decodes: Iterable[T], kind: str | None, compat: Callable[[T], str | None]) -> list[T]:
    """The decode candidates a prefill of compatibility hash `kind` may pair with."""
    return [decode for decode in decodes if compat(decode) == kind]
