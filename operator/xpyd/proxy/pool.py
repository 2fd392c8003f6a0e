"""The instances of one role (prefill or decode), what the proxy knows about each, and which of
them may get new legs.

An instance serves while all of these hold: discovery lists it and says it is ready (in Kubernetes:
the pod has an IP and `Ready=True`), its last health probe answered 200 (vLLM answers 503 while
loading or dead, and nothing at all before it serves HTTP), and its circuit breaker is closed. New
legs go to the serving instances that are not terminating (their pod has a deletionTimestamp); only
when a role has none of those do they go to a serving terminating instance, and only within
`fallback_seconds` of the later of its termination and the end of its last answer to the proxy, and
before its drain's timeout: the engine's preStop drain keeps it taking new requests that long
(`xpyd.render.drain`), vLLM aborts every new one once it gets SIGTERM after the drain. An instance
that stops being listed or ready keeps the legs it has until they finish, and leaves the pool then.

A pod's readiness is evidence of health (the kubelet's readiness probe is the engine's own
`/health`): a pod that turns or appears Ready counts as healthy at once, until the probe the proxy
sends it at once says otherwise. Fixed URLs vouch for nothing: they wait for their first probe.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

from xpyd.api.models import ENGINE_DRAIN_QUIET_SECONDS, RoutingPolicy
from xpyd.api.naming import Role
from xpyd.proxy.breaker import Breaker
from xpyd.proxy.picking import pick

#: How much earlier than the drain could end the proxy stops sending a terminating instance new
#: requests: time for a request to reach the engine, and for clocks to differ.
FALLBACK_MARGIN_SECONDS: Final = 1.0


@dataclass(frozen=True)
class Endpoint:
    """One instance as discovery (or P2pNccl registration) lists it: an endpoint in Kubernetes'
    sense, the address of a pod behind a Service with its readiness and termination. (The URL
    clients use is the DisaggregatedServing's `status.endpoint`; which OpenAI API a request calls,
    `validation.ClientApi`.)"""

    url: str
    ready: bool = True
    #: `ready` comes from a check of the engine's own health: a Pod's Ready condition (the kubelet's
    #: readiness probe). Fixed URLs and registrations vouch for nothing.
    checked: bool = False
    #: The Pod is being deleted (deletionTimestamp set); its engine may still serve for a while.
    terminating: bool = False
    #: A terminating Pod: the wall-clock time (time.time()) before which its drain does not reach its
    #: timeout (`ENGINE_SHUTDOWN_MARGIN_SECONDS` before the deletionTimestamp); None: unknown.
    drain_timeout_at: float | None = None
    #: P2pNccl: the instance's ZMQ address (host:port), when known from registration.
    zmq_address: str | None = None
    #: The pod's KV compatibility hash (`naming.KV_COMPAT_LABEL`); None: a fixed URL or an unlabelled pod.
    compat: str | None = None
    #: The pod's name; None: a fixed URL.
    name: str | None = None


@dataclass(eq=False)
class Instance:
    """One engine of a role and the proxy's state about it."""

    url: str
    role: Role
    breaker: Breaker
    listed: bool = True
    ready: bool = True
    #: Whether `ready` was a Pod's Ready condition (see `Endpoint.checked`).
    checked: bool = False
    #: The KV compatibility hash (see `Endpoint.compat`): pairs only with an equal one.
    compat: str | None = None
    #: The pod's name (see `Endpoint.name`).
    name: str | None = None
    healthy: bool | None = None
    #: time.monotonic() when discovery first reported the instance terminating; None while it is not.
    terminating_since: float | None = None
    #: time.monotonic() after which a terminating instance gets no new legs whatever its activity:
    #: its drain's timeout less the margin.
    fallback_deadline: float = math.inf
    #: time.monotonic() when the engine's answer to this proxy's last leg there ended.
    last_answer_end: float = -math.inf
    #: Counts the pod's readiness evidence; a probe begun before the latest one decides nothing.
    evidence: int = 0
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    #: Prefill: the prompt tokens of its legs it is expected to compute (those KVAware routing expected
    #: cached there left out; every token under the other policies).
    outstanding_computed: int = 0
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

    def serving(self) -> bool:
        """Listed, ready, healthy and with a closed breaker (see the module docstring)."""
        return self.listed and self.ready and self.healthy is True and self.breaker.allows()

    def fallback_open(self, now: float, seconds: float) -> bool:
        """A terminating instance: whether its engine still takes new requests, as far as this
        proxy knows (within `seconds` of its termination or of the end of its last answer to this proxy)."""
        return self.terminating_since is not None and \
            now < min(max(self.terminating_since, self.last_answer_end) + seconds, self.fallback_deadline)

    def set_healthy(self, healthy: bool) -> bool:
        """Record the instance's health; True when that changed. An instance turning healthy may
        be a restarted engine: what was learnt about its identity is dropped."""
        changed = healthy != self.healthy
        if changed and healthy:
            self.forget_identity()
        self.healthy = healthy
        return changed

    def load(self) -> float:
        """Outstanding prompt tokens for prefill, outstanding requests for decode."""
        return float(self.outstanding_tokens if self.role == "prefill" else self.outstanding_requests)

    def acquire(self, tokens: int = 0, computed: int | None = None) -> None:
        """Count a leg (and its prompt tokens, of which `computed` are expected to be computed: all of
        them when None) against this instance."""
        self.outstanding_requests += 1
        self.outstanding_tokens += tokens
        self.outstanding_computed += tokens if computed is None else computed

    def release(self, tokens: int = 0, computed: int | None = None) -> None:
        """A leg counted by `acquire` finished."""
        self.outstanding_requests -= 1
        self.outstanding_tokens -= tokens
        self.outstanding_computed -= tokens if computed is None else computed

    def answered(self, now: float) -> None:
        """The engine's answer to a leg ended at `now` (time.monotonic()): it was busy until then."""
        self.last_answer_end = now

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
    #: How long after its termination, or after the end of its last answer, a terminating instance may
    #: still get new legs: the engines' quiet period less a second for the request to reach the engine.
    fallback_seconds: float = ENGINE_DRAIN_QUIET_SECONDS - FALLBACK_MARGIN_SECONDS
    instances: dict[str, Instance] = field(default_factory=dict)
    turn: int = 0
    #: Called when an instance discovery no longer lists is dropped after its last leg (not during
    #: `update`, whose caller tidies up after it): what the proxy keeps per instance goes with it.
    on_forget: Callable[[], None] | None = None

    def update(self, endpoints: Iterable[Endpoint], now: float, wall_now: float) -> list[Instance]:
        """Make the pool what discovery lists now (at time.monotonic() `now`, time.time() `wall_now`);
        returns the instances to probe at once: the new ones, and those whose pod just turned (or
        appeared) Ready, which count as healthy meanwhile."""
        listed: Mapping[str, Endpoint] = {endpoint.url: endpoint for endpoint in endpoints}
        to_probe: list[Instance] = []
        for url, endpoint in listed.items():
            instance = self.instances.get(url)
            new = instance is None
            if instance is None:
                instance = self.instances[url] = Instance(
                    url=url, role=self.role,
                    breaker=Breaker(threshold=self.breaker_threshold, base_cooldown=self.breaker_cooldown))
            was_ready_pod = instance.listed and instance.ready and instance.checked
            vouched = endpoint.ready and endpoint.checked and not was_ready_pod
            if vouched:
                instance.set_healthy(True)
                instance.evidence += 1
            if new or vouched:
                to_probe.append(instance)
            instance.listed = True
            instance.ready = endpoint.ready
            instance.checked = endpoint.checked
            instance.compat = endpoint.compat
            instance.name = endpoint.name
            if not endpoint.terminating:
                instance.terminating_since = None
            elif instance.terminating_since is None:
                instance.terminating_since = now
            instance.fallback_deadline = math.inf if endpoint.drain_timeout_at is None else \
                now + endpoint.drain_timeout_at - wall_now - FALLBACK_MARGIN_SECONDS
            if endpoint.zmq_address is not None:
                instance.zmq_address = endpoint.zmq_address
        for url, instance in list(self.instances.items()):
            if url not in listed:
                instance.listed = False
                self._drop_if_done(instance)
        return to_probe

    def forget_if_done(self, instance: Instance) -> None:
        """Drop an instance discovery no longer lists once its last leg finished (then `on_forget`)."""
        if self._drop_if_done(instance) and self.on_forget is not None:
            self.on_forget()

    def _drop_if_done(self, instance: Instance) -> bool:
        if not instance.listed and instance.outstanding_requests <= 0 and \
                self.instances.get(instance.url) is instance:
            del self.instances[instance.url]
            return True
        return False

    def candidates(self, now: float, exclude: Iterable[str] = ()) -> list[Instance]:
        """The instances new legs may go to (skipping URLs in `exclude`): the serving ones that are not
        terminating, else the serving terminating ones still within their fallback time."""
        live, fallback = self.tiers(now, exclude)
        return live or fallback

    def tiers(self, now: float, exclude: Iterable[str] = ()) -> tuple[list[Instance], list[Instance]]:
        """The serving instances (skipping URLs in `exclude`) that are not terminating, and the
        serving terminating ones still within their fallback time."""
        excluded = set(exclude)
        serving = [i for i in self.instances.values() if i.url not in excluded and i.serving()]
        return ([i for i in serving if i.terminating_since is None],
                [i for i in serving if i.terminating_since is not None and i.fallback_open(now, self.fallback_seconds)])

    def pick(self, now: float, exclude: Iterable[str] = ()) -> Instance | None:
        """The candidate the routing policy picks, or None."""
        return self.choose(self.candidates(now, exclude))

    def choose(self, candidates: Sequence[Instance],
               chooser: Callable[[Sequence[Instance]], Instance] | None = None) -> Instance | None:
        """The one of `candidates` (some of this pool's `candidates()`) the routing policy picks, or None.
        `chooser`: the request's own pick (KVAware routing scores each candidate for its prompt)."""
        if not candidates:
            return None
        self.turn += 1
        if chooser is not None:
            return chooser(candidates)
        return pick(self.policy, candidates, load=Instance.load, name=lambda i: i.url, rng=self.rng, turn=self.turn)

    def counts(self) -> dict[str, int]:
        """Instances by state, for /health and metrics."""
        result = {"eligible": 0, "unhealthy": 0, "open": 0, "not_ready": 0, "terminating": 0}
        for instance in self.instances.values():
            if not (instance.listed and instance.ready):
                result["not_ready"] += 1
            elif instance.terminating_since is not None:
                result["terminating"] += 1
            elif not instance.breaker.allows():
                result["open"] += 1
            elif instance.healthy is not True:
                result["unhealthy"] += 1
            else:
                result["eligible"] += 1
        return result
