"""The seam between the cluster simulator and an autoscaling policy.

Every `interval` seconds of simulated time the simulator builds an `Observation`
(`xpyd.autoscaler.observation`) from what an autoscaler would read from Prometheus and from the
replica counts, calls `policy.desired_sizes(observation)` and scales each role to the returned
`Desired` sizes. `desired_sizes` should be pure in the observation (keeping its own smoothing state is
fine), so it can be table-tested and run unchanged in the operator. The policies themselves are registered in
`xpyd.sim.policies`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from xpyd.api.models import DEFAULT_REACT_SECONDS
from xpyd.autoscaler.observation import Desired, Observation, Slo
from xpyd.sim.core import EngineConfig, EnginePerf
from xpyd.traces import TraceRequest


@dataclass(frozen=True)
class PolicyContext:
    """What a policy is built from: the starting sizes, the targets, the engines' performance model.

    `trace` (the requests to be replayed) and `engine` (the engines' arguments) are given by the
    simulator for the policies that are baselines by hindsight (`static-peak`, `static-mean`,
    `oracle`); an autoscaler proper must not read them.
    """

    initial: Desired
    slo: Slo
    perf: EnginePerf
    interval_s: float
    startup_delay_s: float
    trace: Sequence[TraceRequest] = ()
    engine: EngineConfig | None = None
    #: The `xpyd` policy scales the pool to zero after this many idle seconds (minReplicas 0 on both
    #: roles; the simulator's `SimConfig.min_replicas` 0 and its waiting room go with it). None: never.
    idle_s: float | None = None
    #: The share of requests the `xpyd` policy aims to have meet both SLOs (its target attainment,
    #: `autoscaling.slo.attainment`): strictly between 0 and 1.
    attainment: float = 0.95
    #: The `xpyd` policy reacts to the gauges between its decisions this often (`autoscaler.react`), by
    #: default as the operator does (`autoscaling.reactSeconds`' default). None: never.
    react_s: float | None = float(DEFAULT_REACT_SECONDS)

    def __post_init__(self) -> None:
        if not 0.0 < self.attainment < 1.0:
            raise ValueError(f"the target attainment must be between 0 and 1 (exclusive), not {self.attainment:g}")


class Policy(Protocol):
    """An autoscaling policy: desired pool sizes from an observation."""

    def desired_sizes(self, observation: Observation) -> Desired:
        """The replica counts wanted now."""
        ...


@runtime_checkable
class ReactingPolicy(Policy, Protocol):
    """A policy that also reacts between its decisions: every `react_s` seconds (None: never) the
    simulator shows it the gauges only (`Simulator.gauges`: replica counts, running and waiting
    requests, KV usage; nothing of a window) and scales to what it returns, if anything."""

    react_s: float | None

    def react(self, observation: Observation) -> Desired | None:
        """The replica counts wanted now, or None to change nothing."""
        ...


@dataclass(frozen=True)
class StaticPolicy:
    """Keeps the given sizes whatever happens: the baseline."""

    desired: Desired

    def desired_sizes(self, observation: Observation) -> Desired:
        """The fixed sizes."""
        return self.desired


PolicyFactory = Callable[[PolicyContext], Policy]
