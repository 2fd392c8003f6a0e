"""The instances of one role (prefill or decode), what the proxy knows about each, and which of
them may get new legs.

An instance gets new legs only while all of these hold: discovery lists it and says it is ready
(in Kubernetes: the pod has an IP, `Ready=True` and no deletionTimestamp), its last health probe
answered 200 (vLLM answers 503 while loading or dead, and nothing at all before it serves HTTP),
and its circuit breaker is closed. An instance that stops being listed or ready keeps the legs it
has until they finish, and leaves the pool then.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from xpyd.api.models import RoutingPolicy
from xpyd.api.naming import Role
from xpyd.proxy.breaker import Breaker
from xpyd.proxy.picking import pick


@dataclass(frozen=True)
class Endpoint:
    """One instance as discovery reports it."""

    url: str
    ready: bool = True
    #: P2pNccl: the instance's ZMQ address (host:port), when known from registration.
    zmq_address: str | None = None


@dataclass(eq=False)
class Instance:
    """One engine of a role and the proxy's state about it."""

    url: str
    role: Role
    breaker: Breaker
    listed: bool = True
    ready: bool = True
    healthy: bool | None = None
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    zmq_address: str | None = None
    #: NixlPushConnector: the prefill engine's identity per data-parallel rank, learnt from its answers.
    push_identities: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: MooncakeConnector: the engine id of each data-parallel rank of the prefill engine, from its
    #: bootstrap server (`GET /query`); None until asked, and again after a failure or a restart.
    mooncake_engines: dict[int, str] | None = None
    #: Legs outstanding per data-parallel rank, where the proxy pins legs to ranks (Mooncake, NIXL push).
    rank_outstanding: dict[int, int] = field(default_factory=dict)
    rank_turn: int = 0
    probing: bool = False

    @property
    def host(self) -> str:
        """The host of the URL (without IPv6 brackets)."""
        return urlsplit(self.url).hostname or ""

    def eligible(self) -> bool:
        """Whether new legs may go here (see the module docstring)."""
        return self.listed and self.ready and self.healthy is True and self.breaker.allows()

    def load(self) -> float:
        """Outstanding prompt tokens for prefill, outstanding requests for decode."""
        return float(self.outstanding_tokens if self.role == "prefill" else self.outstanding_requests)

    def acquire(self, tokens: int = 0) -> None:
        """Count a leg (and its prompt tokens) against this instance."""
        self.outstanding_requests += 1
        self.outstanding_tokens += tokens

    def release(self, tokens: int = 0) -> None:
        """A leg counted by `acquire` finished."""
        self.outstanding_requests -= 1
        self.outstanding_tokens -= tokens

    def forget_identity(self) -> None:
        """Drop what was learnt about the engine's identity (a restarted engine has new ids)."""
        self.mooncake_engines = None
        self.push_identities.clear()

    def pick_rank(self, ranks: Iterable[int]) -> int:
        """The data-parallel rank with the fewest outstanding legs; ties go round, starting after the
        rank picked last, so an idle instance spreads its legs over every rank."""
        ordered = sorted(ranks)
        if not ordered:
            raise ValueError("no data-parallel rank to pick from")
        self.rank_turn += 1
        start = self.rank_turn % len(ordered)
        rotated = ordered[start:] + ordered[:start]
        return min(rotated, key=lambda rank: self.rank_outstanding.get(rank, 0))

    def acquire_rank(self, rank: int) -> None:
        """Count a leg pinned to data-parallel `rank`."""
        self.rank_outstanding[rank] = self.rank_outstanding.get(rank, 0) + 1

    def release_rank(self, rank: int) -> None:
        """A leg counted by `acquire_rank` finished."""
        left = self.rank_outstanding.get(rank, 0) - 1
        if left > 0:
            self.rank_outstanding[rank] = left
        else:
            self.rank_outstanding.pop(rank, None)


@dataclass
class Pool:
    """The instances of one role, keyed by URL."""

    role: Role
    policy: RoutingPolicy
    rng: random.Random
    breaker_threshold: int = 3
    breaker_cooldown: float = 2.0
    instances: dict[str, Instance] = field(default_factory=dict)
    turn: int = 0

    def update(self, endpoints: Iterable[Endpoint]) -> list[Instance]:
        """Make the pool what discovery lists now; returns the instances that are new (to probe)."""
        listed: Mapping[str, Endpoint] = {endpoint.url: endpoint for endpoint in endpoints}
        added: list[Instance] = []
        for url, endpoint in listed.items():
            instance = self.instances.get(url)
            if instance is None:
                instance = self.instances[url] = Instance(
                    url=url, role=self.role,
                    breaker=Breaker(threshold=self.breaker_threshold, base_cooldown=self.breaker_cooldown))
                added.append(instance)
            instance.listed = True
            instance.ready = endpoint.ready
            if endpoint.zmq_address is not None:
                instance.zmq_address = endpoint.zmq_address
        for url, instance in list(self.instances.items()):
            if url not in listed:
                instance.listed = False
                self.forget_if_done(instance)
        return added

    def forget_if_done(self, instance: Instance) -> None:
        """Drop an instance discovery no longer lists once its last leg finished."""
        if not instance.listed and instance.outstanding_requests <= 0 and \
                self.instances.get(instance.url) is instance:
            del self.instances[instance.url]

    def pick(self, exclude: Iterable[str] = ()) -> Instance | None:
        """The eligible instance the routing policy picks (skipping URLs in `exclude`), or None."""
        excluded = set(exclude)
        candidates = [i for i in self.instances.values() if i.url not in excluded and i.eligible()]
        if not candidates:
            return None
        self.turn += 1
        return pick(self.policy, candidates, load=Instance.load, name=lambda i: i.url, rng=self.rng, turn=self.turn)

    def counts(self) -> dict[str, int]:
        """Instances by state, for /health and metrics."""
        result = {"eligible": 0, "unhealthy": 0, "open": 0, "not_ready": 0}
        for instance in self.instances.values():
            if not (instance.listed and instance.ready):
                result["not_ready"] += 1
            elif not instance.breaker.allows():
                result["open"] += 1
            elif instance.healthy is not True:
                result["unhealthy"] += 1
            else:
                result["eligible"] += 1
        return result
