"""The autoscaler's shell in the operator: collect, `decide()`, record, and (in Auto mode) actuate.

Once per `autoscaling.intervalSeconds` (at once after the spec changed) for every
DisaggregatedServing whose mode is not Off, under the object's reconcile lock:

1. build the decision's config from the spec and the engines' profile (`autoscaler.profile`), with
   `autoscaler.config.config_for`, the one translation of a spec into what `decide()` reads;
2. read the pool's pods (Kubernetes) and its series (Prometheus, with the bearer token and CA
   bundle the spec names from the object's namespace) into an `Observation`; when Prometheus cannot
   be read (its Secret or ConfigMap missing too) or its series are missing or stale, hold every role
   at its current size and say why (`ScalingActive=False`, reason `MetricsUnavailable`): never
   scale on missing data;
3. `decide()` (the same pure function the simulator runs) with the state it returned last time;
4. record: `status.autoscaler` (the decision, its reason and message, the observed load), the
   `ScalingActive` condition, an Event when the decision changes replicas (or, in Recommend mode,
   when the recommendation changes) and the operator metrics;
5. Auto mode only: `status.{prefill,decode}.desiredReplicas`, which the reconcile (run right after,
   the single writer of the Deployments) applies to the children's replicas.

Between two decisions, every `autoscaling.reactSeconds` (default 5; 0: never), for every object this
process has decided in Auto mode, under the same lock (`look`): read the pool's pods and
only the engines' gauges (one batch of instant queries: `collect.gauge_queries`), and run `react()`
with the decision state in memory. When it grows a role (a prefill backlog building, decode
admission blocked) the decision is recorded and actuated exactly as step 4 and 5 record and actuate
a decision. It never scales down, and when Prometheus cannot be read it does nothing: the next
decision holds and says why. Replicas the autoscaler asked for in the last `ASKED_POD_LAG_S` whose
pods the watch cache does not show yet count as starting, for a look and a decision alike
(`collect.with_asked`), so neither orders a scale-up back nor sizes from too few. In Recommend mode
there are no looks: the user's pods never follow a recommendation, and a look sized from them would
raise what the next decision lowers again, an Event each way.

The decision state (forecasts, capacity corrections, stabilisation windows, bursts) is kept in
memory and, with every status write of a decision, in `status.autoscaler.state`
(`autoscaler.state`). After an operator restart or a hand-over to another replica the new process
starts from that state rather than empty, so a scale-down does not wait a whole window again and a
recent prompt burst is still remembered. It makes its first decision of an object only once
`intervalSeconds` have passed since the last decision recorded in its status
(`status.autoscaler.lastDecision.time`), so the hand-over never decides twice in one interval.
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import prometheus_client
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from xpyd.api.conditions import METRICS_AVAILABLE, PROFILE_UNAVAILABLE, RECOMMEND_ONLY, VALID_METRICS, ConditionType
from xpyd.api.load import SpecError, parse_serving
from xpyd.api.models import (
    DEFAULT_REACT_SECONDS,
    AutoscalingMode,
    CABundleRef,
    DisaggregatedServing,
    PrometheusSpec,
    SecretKeyRef,
)
from xpyd.api.naming import DECODE, PREFILL
from xpyd.api.waiting import Held
from xpyd.autoscaler import collect
from xpyd.autoscaler.config import config_for as config_for
from xpyd.autoscaler.config import react_cadence, state_max_age_s
from xpyd.autoscaler.decide import (
    METRICS_UNAVAILABLE,
    WITHIN_TARGETS,
    AutoscalerConfig,
    AutoscalerState,
    Decision,
    RoleDecision,
    RoleState,
    decide,
    headroom,
    hold,
    pd_ratio,
    quantile_at,
    waking,
)
from xpyd.autoscaler.observation import Observation
from xpyd.autoscaler.profile import ProfileError, perf_model
from xpyd.autoscaler.react import react
from xpyd.autoscaler.state import decode as decode_state
from xpyd.autoscaler.state import encode as encode_state
from xpyd.common import exposition
from xpyd.common.bunching import window_label
from xpyd.common.jsontypes import JSON
from xpyd.common.timefmt import parse_rfc3339, rfc3339
from xpyd.controller.status import ConditionValue, merge_conditions, status_changed
from xpyd.kube import Kube, KubeError
from xpyd.perf.model import PerfModel

log = logging.getLogger(__name__)



def observed_load(observation: Observation, percentile: float) -> JSON:
    """`status.autoscaler.observed`: the load and latencies the decision saw (None when unknown), the
    quantiles at the decision's sizing percentile (`AutoscalerConfig.percentile`: the target
    attainment's share when there is one), read as `decide` reads them."""
    def number(value: float, digits: int = 3) -> float | None:
        return round(value, digits) if math.isfinite(value) else None

    return {
        "requestRate": number(observation.request_rate),
        "isl": number(observation.isl_mean, 1),
        "osl": number(observation.osl_mean, 1),
        "ttftMs": number(quantile_at(observation.ttft_seconds, percentile) * 1e3, 1),
        "tpotMs": number(quantile_at(observation.tpot_seconds, percentile) * 1e3, 2),
        "prefillQueue": number(observation.prefill.num_requests_waiting, 1),
        "decodeQueue": number(observation.decode.num_requests_waiting, 1),
        "kvCacheUsage": number(observation.decode.kv_cache_usage_perc),
        # Every slot length, unknown ones as None, which a merge patch removes (no stale value stays).
        "arrivalPromptTokens": {window_label(window): number(quantile_at(q, percentile), 0)
                                for window, q in observation.arrival_prompt_tokens} or None,
    }


def attainment_status(config: AutoscalerConfig, state: AutoscalerState, now: float) -> JSON:
    """`status.autoscaler.attainment`: the target, the share of the last hour's requests that met both
    SLOs (None before any was measured) and the headroom held now."""
    hour = state.attainment.last_hour(now)
    return {"target": config.attainment, "lastHour": round(hour, 4) if math.isfinite(hour) else None,
            "headroom": round(headroom(config, state), 4)}


#: Reads an object of the serving's namespace by kind and name (None when it does not exist).
Reader = Callable[[str, str], JSON | None]


def _key_of(read: Reader, kind: str, ref: SecretKeyRef | CABundleRef, field: str) -> str:
    """The text of key `ref.key` of the Secret or ConfigMap `ref.name`; MetricsError when either is missing."""
    obj = read(kind, ref.name)
    if obj is None:
        raise collect.MetricsError(f"{kind} {ref.name} ({field}) not found")
    data = obj.get("data") or {}
    if kind == "ConfigMap" and ref.key in data:
        return str(data[ref.key])
    # Secret data, and ConfigMap binaryData, are base64.
    encoded = data.get(ref.key) if kind == "Secret" else (obj.get("binaryData") or {}).get(ref.key)
    if encoded is None:
        raise collect.MetricsError(f"{kind} {ref.name} ({field}) has no key {ref.key}")
    try:
        return base64.b64decode(encoded, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise collect.MetricsError(f"{kind} {ref.name} ({field}): key {ref.key} is not UTF-8 text") from None


def prometheus_access(spec: PrometheusSpec, read: Reader) -> collect.Access:
    """The bearer token and CA bundle `spec` names, read with `read`; MetricsError naming the field
    when a Secret, a ConfigMap or a key is missing."""
    field = "autoscaling.prometheus"
    token = None
    if (token_ref := spec.bearer_token_secret_ref) is not None:
        token = _key_of(read, "Secret", token_ref, f"{field}.bearerTokenSecretRef").strip()
        if not token:
            raise collect.MetricsError(f"Secret {token_ref.name} ({field}.bearerTokenSecretRef): key "
                                       f"{token_ref.key} is empty")
    tls = spec.tls
    ca = None
    if tls is not None:  # at most one CA source (the API's rule)
        for kind, ref, name in (("Secret", tls.ca_secret_ref, "caSecretRef"),
                                ("ConfigMap", tls.ca_config_map_ref, "caConfigMapRef")):
            if ref is not None:
                ca = _key_of(read, kind, ref, f"{field}.tls.{name}")
                if "-----BEGIN CERTIFICATE-----" not in ca:
                    raise collect.MetricsError(f"{kind} {ref.name} ({field}.tls.{name}): key {ref.key} holds no "
                                               "PEM certificate")
    return collect.Access(bearer_token=token, ca_pem=ca,
                          insecure_skip_verify=tls is not None and tls.insecure_skip_verify)


def scaling_condition(mode: AutoscalingMode, decision: Decision | None, problem: str | None) -> ConditionValue:
    """ScalingActive: True while Auto mode acts on valid metrics; False with the reason otherwise."""
    if problem is not None:
        return ConditionValue(ConditionType.SCALING_ACTIVE, False, PROFILE_UNAVAILABLE, problem)
    assert decision is not None
    if not decision.scaling_active:
        return ConditionValue(ConditionType.SCALING_ACTIVE, False, METRICS_UNAVAILABLE, decision.message)
    if mode == AutoscalingMode.RECOMMEND:
        return ConditionValue(ConditionType.SCALING_ACTIVE, False, RECOMMEND_ONLY,
                              f"recommends prefill {decision.prefill.replicas}, decode {decision.decode.replicas} "
                              "(mode Recommend never scales)")
    return ConditionValue(ConditionType.SCALING_ACTIVE, True, VALID_METRICS,
                          f"scaling on the pool's metrics; last decision {decision.reason}")


def with_condition(old_status: JSON, condition: ConditionValue, generation: int | None, now: str) -> list[JSON]:
    """The status conditions with `condition` set (the others untouched)."""
    conditions = [c for c in old_status.get("conditions", []) if c.get("type") != condition.type.value]
    merged = merge_conditions(old_status.get("conditions", []), [condition], generation, now)
    return [*conditions, *merged]


@dataclass(frozen=True)
class _PoolPods:
    """A pool's pods as a decision reads them."""

    pods: list[JSON]
    #: What its proxies hold for a ready pair.
    held: Held
    #: The observation of the pods alone (no metrics), with what is held.
    bare: Observation

    @property
    def cold(self) -> bool:
        """Requests held and a role without a ready pod: decided from the pods alone."""
        return waking(self.bare)


@dataclass(frozen=True)
class _Decided:
    """A decision and what it was made from, as step 4 records it."""

    profile: str
    config: AutoscalerConfig
    observation: Observation
    held: Held
    decision: Decision
    #: `status.autoscaler.lastDecision` before this decision ({} when none).
    previous: JSON


def decision_status(body: JSON, mode: AutoscalingMode, decided: _Decided, now: float) -> JSON:
    """The status patch of a decision: `status.autoscaler`, the ScalingActive condition, and in Auto
    mode the desired replicas of prefill and decode."""
    old_status: JSON = body.get("status") or {}
    decision, previous, observation = decided.decision, decided.previous, decided.observation
    stamp = rfc3339(now)
    recorded = {"time": stamp, "prefill": decision.prefill.replicas, "decode": decision.decode.replicas,
                "reason": decision.reason, "message": decision.message[:4096]}
    observed_before = dict((old_status.get("autoscaler") or {}).get("observed") or {})
    if waking(observation):
        observed = observed_before  # no metrics read
    elif observation.window_s == 0:  # the gauges alone (`look`): the window's figures stay the decision's
        gauges = observed_load(observation, decided.config.percentile)
        observed = {**observed_before, **{k: gauges[k] for k in ("prefillQueue", "decodeQueue", "kvCacheUsage")}}
    else:
        observed = observed_load(observation, decided.config.percentile)
    observed["heldRequests"] = decided.held.requests
    autoscaler_status = {"lastDecision": recorded, "observed": observed,
                         "recommendedRatio": decision.recommended_ratio, "profile": decided.profile,
                         "attainment": attainment_status(decided.config, decision.state, now)}
    if previous and all(previous.get(k) == recorded[k] for k in ("prefill", "decode", "reason", "message")):
        autoscaler_status["lastDecision"] = previous  # nothing new was decided: keep its time
    patch: JSON = {"autoscaler": autoscaler_status,
                   "conditions": with_condition(old_status, scaling_condition(mode, decision, None),
                                                body["metadata"].get("generation"), stamp)}
    if mode == AutoscalingMode.AUTO:
        patch["prefill"] = {"desiredReplicas": decision.prefill.replicas}
        patch["decode"] = {"desiredReplicas": decision.decode.replicas}
    return patch


@dataclass
class _Memory:
    """What the autoscaler keeps per object between decisions."""

    uid: str
    state: AutoscalerState = field(default_factory=AutoscalerState)
    last_run_s: float = -math.inf
    last_look_s: float = -math.inf    # the last look at the gauges between decisions (`Autoscaler.look`)
    generation: int | None = None
    profile_key: tuple[Any, ...] = ()
    perf: PerfModel | None = None
    desired: dict[str, int] = field(default_factory=dict)
    attainment: float = math.nan      # the last hour's, as the last decision measured it
    headroom: float = 0.0             # held by the last decision


class AutoscalerMetrics(Collector):
    """`xpyd_autoscaler_*` series of the operator's /metrics: prometheus_client counters (in no
    registry but the operator's own) and the desired replicas, read at scrape time from the
    decisions' memory (a DisaggregatedServing the autoscaler forgot has none)."""

    def __init__(self, desired: Callable[[], Iterable[exposition.GaugeSample]],
                 attainment: Callable[[], Iterable[exposition.GaugeSample]] = list,
                 headroom: Callable[[], Iterable[exposition.GaugeSample]] = list) -> None:
        self.decisions = prometheus_client.Counter(
            "xpyd_autoscaler_decisions_total", "Autoscaler decisions by DisaggregatedServing and reason.",
            ("namespace", "name", "reason"), registry=None)
        self.errors = prometheus_client.Counter(
            "xpyd_autoscaler_metrics_unavailable_total", "Decisions held because metrics were missing or stale.",
            ("namespace", "name"), registry=None)
        self.desired = exposition.ScrapeGauge(
            "xpyd_autoscaler_desired_replicas", "Replicas the autoscaler's last decision wants, by "
            "DisaggregatedServing and role.", ("namespace", "name", "role"), desired)
        self.attainment = exposition.ScrapeGauge(
            "xpyd_autoscaler_attainment", "Share of the last hour's requests that met both SLOs (TTFT and TPOT), "
            "as the autoscaler's last decision measured it, by DisaggregatedServing.", ("namespace", "name"),
            attainment)
        self.headroom = exposition.ScrapeGauge(
            "xpyd_autoscaler_headroom", "Load headroom the autoscaler holds for the target attainment (demand sized "
            "for 1 + headroom times the forecast), by DisaggregatedServing.", ("namespace", "name"), headroom)

    def collect(self) -> Iterable[Metric]:
        """The desired replicas, then the counters without their `_created` series."""
        yield from self.desired.collect()
        yield from self.attainment.collect()
        yield from self.headroom.collect()
        yield from exposition.without_created(self.decisions.collect())
        yield from exposition.without_created(self.errors.collect())


class Autoscaler:
    """Runs decisions for every autoscaled object the operator serves (one instance per operator)."""

    def __init__(self, kube: Kube,
                 prometheus: Callable[[str, collect.Access], collect.Prometheus] = collect.Prometheus,
                 clock: Callable[[], float] = time.time) -> None:
        self.kube = kube
        self.prometheus = prometheus
        self.clock = clock
        self.metrics = AutoscalerMetrics(self._desired_samples, self._attainment_samples, self._headroom_samples)
        #: What the operator's /metrics serves (a registry of this operator's own).
        self.registry = exposition.registry([self.metrics])
        self._memory: dict[tuple[str, str], _Memory] = {}
        self._guard = threading.Lock()

    # --- metrics ---------------------------------------------------------------------------------

    def _desired_samples(self) -> list[exposition.GaugeSample]:
        with self._guard:
            return [((ns, name, role), float(n)) for (ns, name), memory in self._memory.items()
                    for role, n in memory.desired.items()]

    def _attainment_samples(self) -> list[exposition.GaugeSample]:
        with self._guard:
            return [((ns, name), memory.attainment) for (ns, name), memory in self._memory.items()
                    if memory.desired and math.isfinite(memory.attainment)]

    def _headroom_samples(self) -> list[exposition.GaugeSample]:
        with self._guard:
            return [((ns, name), memory.headroom) for (ns, name), memory in self._memory.items() if memory.desired]

    # --- scheduling -------------------------------------------------------------------------------

    def due(self, body: JSON, now: float) -> bool:
        """Whether `body` needs a decision now: autoscaled, and its interval passed or its spec changed."""
        spec = body.get("spec", {}).get("autoscaling", {})
        if spec.get("mode", "Off") == "Off":
            self.forget(body["metadata"]["namespace"], body["metadata"]["name"])
            return False
        meta = body["metadata"]
        interval = float(spec.get("intervalSeconds", 30)) - 0.5
        with self._guard:
            memory = self._memory.get((meta["namespace"], meta["name"]))
        if memory is None or memory.uid != meta.get("uid"):
            # Not decided by this process yet (a new object, a restart, a replica that just took over
            # the Lease): wait out the interval since the last change of replicas the status records,
            # so a hand-over never decides twice within one interval.
            last = parse_rfc3339(((body.get("status") or {}).get("autoscaler") or {}).get("lastDecision", {})
                                 .get("time"))
            return last is None or now - last >= interval
        if memory.generation != meta.get("generation"):
            return True
        return now - memory.last_run_s >= interval

    def look_due(self, body: JSON, now: float) -> bool:
        """Whether `body` needs a look at its gauges now (`look`): mode Auto with
        `reactSeconds` > 0 and under `intervalSeconds` (at or above it the next decision comes first),
        decided by this process at its present spec (there is a state to react from; a spec change
        makes a decision due instead), and `reactSeconds` passed since its last decision or look."""
        spec = body.get("spec", {}).get("autoscaling", {})
        react_s = react_cadence(float(spec.get("reactSeconds", DEFAULT_REACT_SECONDS)),
                                float(spec.get("intervalSeconds", 30)))
        if spec.get("mode", "Off") != "Auto" or react_s is None:
            return False
        meta = body["metadata"]
        with self._guard:
            memory = self._memory.get((meta["namespace"], meta["name"]))
        if memory is None or memory.uid != meta.get("uid") or memory.generation != meta.get("generation"):
            return False
        return now - max(memory.last_run_s, memory.last_look_s) >= react_s - 0.5

    def forget(self, namespace: str, name: str) -> None:
        with self._guard:
            self._memory.pop((namespace, name), None)

    def forget_absent(self, present: set[tuple[str, str]], scopes: list[str | None]) -> None:
        """Drop the memory of objects that no longer exist in the listed scopes."""
        with self._guard:
            for key in list(self._memory):
                if key not in present and (None in scopes or key[0] in scopes):
                    del self._memory[key]

    # --- one decision -----------------------------------------------------------------------------

    def step(self, body: JSON, wake: bool = False) -> bool:
        """One decision for `body` (read fresh by the caller, under its lock), in the five steps of
        the module docstring. Returns whether the children's replicas must be reconciled (Auto mode
        and the desired replicas changed).

        A pool whose proxies hold requests while a role has no ready replica (a pool at zero, or
        starting from it) is decided from its pods alone, without Prometheus: its demand is in the
        proxies' pod conditions, and a pool at zero has no engine metrics. With `wake` (a proxy's
        condition changed: `controller.runtime`), only such a pool is decided, at once."""
        meta = body["metadata"]
        try:
            serving = parse_serving(body)
        except SpecError:
            return False  # reported by the reconcile
        if serving.spec.autoscaling.mode == AutoscalingMode.OFF:
            self.forget(meta["namespace"], meta["name"])
            return False
        now = self.clock()
        memory = self._recall(body, serving, now)
        pool = self._read_pods(body, serving, now)
        if wake and not pool.cold:
            return False  # it can serve, or nothing is held: the regular decisions see to it
        if not wake:  # a wake-up leaves the regular decisions' schedule (interval, spec changes) alone
            memory.last_run_s, memory.generation = now, meta.get("generation")
        configured = self._configure(body, serving, memory, now)  # 1.
        if configured is None:
            return False
        perf, config = configured
        observation, problem = self._observe(body, serving, pool, now)  # 2.
        decision = decide(observation, config, memory.state) if problem is None else \
            hold(observation, config, memory.state, problem)  # 3.
        memory.state = decision.state
        previous = ((body.get("status") or {}).get("autoscaler") or {}).get("lastDecision") or {}
        if wake and not decision.changed and previous.get("reason") == decision.reason:
            return False  # more held, nothing more to start: no write (the proxies report twice a second)
        self._record(body, serving.spec.autoscaling.mode, memory,
                     _Decided(perf.description, config, observation, pool.held, decision, previous), now)  # 4.
        return self._actuates(body, serving, memory)  # 5.

    def look(self, body: JSON) -> bool:
        """Between decisions: the pool's pods and gauges, and `react()` on them with the decision state
        in memory (module docstring). A role it grows past what the last decision asks for
        (`_beyond_asked`) is recorded and actuated as `step`'s decisions are (steps 4 and 5); nothing
        more to ask, or gauges that cannot be read, change nothing. Returns whether the
        children's replicas must be reconciled."""
        meta = body["metadata"]
        try:
            serving = parse_serving(body)
        except SpecError:
            return False
        mode = serving.spec.autoscaling.mode
        with self._guard:
            memory = self._memory.get((meta["namespace"], meta["name"]))
        if (mode != AutoscalingMode.AUTO or memory is None or memory.uid != meta.get("uid")
                or memory.generation != meta.get("generation") or memory.perf is None):
            return False  # not decided by this process at this spec: the next decision comes first
        now = self.clock()
        memory.last_look_s = now
        config = config_for(serving, memory.perf)
        if config.react_s is None:
            return False
        pool = self._read_pods(body, serving, now)
        if pool.cold:
            return False  # a pool at zero, or starting from it: the wake-ups decide it
        try:
            scope, results = self._query(body, serving, now, only_gauges=True)
            observation = collect.with_asked(collect.with_held(collect.gauges(results, pool.pods, now, scope),
                                                               pool.held), _asked(body, mode, now))
        except collect.MetricsError as error:
            log.debug("autoscaler %s/%s: no look at the gauges: %s", meta["namespace"], meta["name"], error)
            return False  # the next decision holds and says why
        reacted = react(observation, config, memory.state)
        decision = None if reacted is None else _beyond_asked(body, reacted, memory.state)
        if decision is None:
            return False
        memory.state = decision.state
        previous = ((body.get("status") or {}).get("autoscaler") or {}).get("lastDecision") or {}
        self._record(body, mode, memory,
                     _Decided(memory.perf.description, config, observation, pool.held, decision, previous), now)
        return self._actuates(body, serving, memory)

    def _recall(self, body: JSON, serving: DisaggregatedServing, now: float) -> _Memory:
        """What this process keeps of the object, restored from its status on the first decision
        (of a restart, or a hand-over)."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        autoscaling = serving.spec.autoscaling
        with self._guard:
            memory = self._memory.get((namespace, name))
            if memory is None or memory.uid != meta.get("uid"):
                max_age = state_max_age_s(autoscaling)
                memory = self._memory[(namespace, name)] = _Memory(
                    uid=meta.get("uid", ""), state=restored(namespace, name, body.get("status") or {}, now - max_age))
        return memory

    def _read_pods(self, body: JSON, serving: DisaggregatedServing, now: float) -> _PoolPods:
        """The pool's pods, what its proxies hold, and the observation they alone make."""
        meta = body["metadata"]
        window_s = float(serving.spec.autoscaling.prometheus.window_seconds)
        pods = self.kube.list_objects("v1", "Pod", meta["namespace"], collect.pool_selector(meta["name"]))
        held = collect.held_requests(pods)
        return _PoolPods(pods, held, collect.with_held(collect.pods_only(pods, now, window_s), held))

    def _configure(self, body: JSON, serving: DisaggregatedServing, memory: _Memory,
                   now: float) -> tuple[PerfModel, AutoscalerConfig] | None:
        """Step 1: the engines' profile and the decision's config; None when the profile cannot be
        used (said in the ScalingActive condition, the metrics, and an Event when it starts)."""
        meta, old_status = body["metadata"], body.get("status") or {}
        try:
            perf = self._perf(serving, meta["namespace"], memory)
        except ProfileError as error:
            condition = scaling_condition(serving.spec.autoscaling.mode, None, str(error))
            self._write(body, {"conditions": with_condition(old_status, condition, meta.get("generation"),
                                                            rfc3339(now))})
            self.metrics.decisions.labels(meta["namespace"], meta["name"], PROFILE_UNAVAILABLE).inc()
            if old_status_reason(old_status) != PROFILE_UNAVAILABLE:
                self.kube.event(body, "Warning", PROFILE_UNAVAILABLE, str(error))
            return None
        return perf, config_for(serving, perf)

    def _observe(self, body: JSON, serving: DisaggregatedServing, pool: _PoolPods,
                 now: float) -> tuple[Observation, str | None]:
        """Step 2: the observation to decide on, and why the metrics cannot be used (then the
        observation is the pods' alone, as it is for a cold pool, decided without Prometheus)."""
        asked = _asked(body, serving.spec.autoscaling.mode, now)
        if pool.cold:
            return collect.with_asked(pool.bare, asked), None
        try:
            scope, results = self._query(body, serving, now)
            observation = collect.with_held(collect.observation(results, pool.pods, now, scope), pool.held)
            return collect.with_asked(observation, asked), None
        except collect.MetricsError as error:
            return collect.with_asked(pool.bare, asked), str(error)

    def _query(self, body: JSON, serving: DisaggregatedServing, now: float,
               only_gauges: bool = False) -> tuple[collect.Scope, dict[str, collect.Samples]]:
        """The pool's series at `now` (`only_gauges`: the gauges alone), read with the bearer token
        and CA bundle the spec names; MetricsError when they cannot be read."""
        prometheus = serving.spec.autoscaling.prometheus
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        scope = collect.Scope(namespace, name, prometheus.window_seconds)
        access = prometheus_access(prometheus, lambda kind, ref: self._read(kind, namespace, ref))
        return scope, self.prometheus(prometheus.url, access).collect(scope, now, only_gauges=only_gauges)

    def _record(self, body: JSON, mode: AutoscalingMode, memory: _Memory, decided: _Decided, now: float) -> None:
        """Step 4: the metrics, the status (with the desired replicas in Auto mode: step 5's
        actuation), the Events and the log line of a decision."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        decision, config = decided.decision, decided.config
        self.metrics.decisions.labels(namespace, name, decision.reason).inc()
        if not decision.scaling_active:
            self.metrics.errors.labels(namespace, name).inc()
        with self._guard:
            memory.desired = {"prefill": decision.prefill.replicas, "decode": decision.decode.replicas}
            memory.attainment = decision.state.attainment.last_hour(now)
            memory.headroom = headroom(config, decision.state)
        self._write(body, decision_status(body, mode, decided, now), decision.state)
        self._announce(body, decision, decided.previous, mode == AutoscalingMode.AUTO)
        if decision.changed or decision.reason != decided.previous.get("reason"):
            log.info("autoscaler %s/%s: %s: %s", namespace, name, decision.reason, decision.message)

    @staticmethod
    def _actuates(body: JSON, serving: DisaggregatedServing, memory: _Memory) -> bool:
        """Step 5: whether the reconcile must apply new desired replicas (Auto mode, and they differ
        from those the status held before this decision)."""
        old_status: JSON = body.get("status") or {}
        live = {role: (old_status.get(role) or {}).get("desiredReplicas") for role in ("prefill", "decode")}
        return serving.spec.autoscaling.mode == AutoscalingMode.AUTO and live != memory.desired

    def _perf(self, serving: DisaggregatedServing, namespace: str, memory: _Memory) -> PerfModel:
        """The profile's model, rebuilt only when the profile (or its ConfigMap) changed."""
        profile = serving.spec.autoscaling.profile
        config_map = None
        if profile.config_map:
            config_map = self.kube.get("v1", "ConfigMap", namespace, profile.config_map)
        key = (profile.model_dump_json(), serving.spec.model.name, serving.spec.decode.gpu.product,
               serving.spec.decode.tensor_parallel_size,
               (config_map or {}).get("metadata", {}).get("resourceVersion"))
        if memory.perf is None or memory.profile_key != key:
            memory.perf, memory.profile_key = perf_model(serving.spec, config_map), key
        return memory.perf

    def _read(self, kind: str, namespace: str, name: str) -> JSON | None:
        """A Secret or ConfigMap of the object's namespace; an API error (e.g. 403 without the
        operator's `get` on secrets) is a metrics problem, reported like one."""
        try:
            return self.kube.get("v1", kind, namespace, name)
        except KubeError as error:
            raise collect.MetricsError(f"{kind} {name} cannot be read: {error}") from None

    def _write(self, body: JSON, patch: JSON, state: AutoscalerState | None = None) -> None:
        """Patch the status when `patch` changes it, with the decision `state` beside the decision
        (only then: the state alone, whose clock moves every decision, is no reason to write)."""
        old: JSON = body.get("status") or {}
        merged = {key: ({**(old.get(key) or {}), **value} if key in ("prefill", "decode") else value)
                  for key, value in patch.items()}
        if "autoscaler" in merged:
            merged["autoscaler"] = {**merged["autoscaler"], "state": (old.get("autoscaler") or {}).get("state")}
        if status_changed(old, merged):
            if state is not None and "autoscaler" in patch:
                patch = {**patch, "autoscaler": {**patch["autoscaler"], "state": encode_state(state)}}
            self.kube.patch_status(body["metadata"]["namespace"], body["metadata"]["name"], patch)

    def _announce(self, body: JSON, decision: Decision, previous: JSON, auto: bool) -> None:
        """An Event when replicas change (Auto), when the recommendation changes (Recommend), and when
        the autoscaler starts or stops holding for lack of metrics."""
        held_before = previous.get("reason") == METRICS_UNAVAILABLE
        if not decision.scaling_active:
            if not held_before:
                self.kube.event(body, "Warning", METRICS_UNAVAILABLE, decision.message)
            return
        sizes = (decision.prefill.replicas, decision.decode.replicas)
        before = (previous.get("prefill"), previous.get("decode"))
        if auto and decision.changed:
            what = ", ".join(f"{role} {d.current}->{d.replicas}" for role, d in
                             (("prefill", decision.prefill), ("decode", decision.decode)) if d.replicas != d.current)
            self.kube.event(body, "Normal", decision.reason, f"{what}: {decision.message}")
        elif not auto and sizes != before:
            self.kube.event(body, "Normal", decision.reason,
                            f"recommends prefill {sizes[0]}, decode {sizes[1]}: {decision.message}")
        elif held_before:
            self.kube.event(body, "Normal", METRICS_AVAILABLE, f"metrics are back: {decision.message}")


#: How long after the autoscaler last changed the desired replicas the pods it asked for, not yet in
#: the watch cache, count as starting (`collect.with_asked`): the Deployment controller creates them
#: within seconds; a pod that cannot be placed shows as Pending, not as missing.
ASKED_POD_LAG_S = 30.0


def _asked(body: JSON, mode: AutoscalingMode, now: float) -> dict[str, int]:
    """In Auto mode, the desired replicas per role the autoscaler wrote within `ASKED_POD_LAG_S`
    (its last decision's time), else nothing."""
    status: JSON = body.get("status") or {}
    written = parse_rfc3339(((status.get("autoscaler") or {}).get("lastDecision") or {}).get("time"))
    if mode != AutoscalingMode.AUTO or written is None or now - written > ASKED_POD_LAG_S:
        return {}
    desired = {role: (status.get(role) or {}).get("desiredReplicas") for role in (PREFILL, DECODE)}
    return {role: value for role, value in desired.items() if isinstance(value, int)}


def _beyond_asked(body: JSON, decision: Decision, state: AutoscalerState) -> Decision | None:
    """A look's `decision` on top of what the last decision asks for (the desired replicas): a role
    it grows past that gets its size; any other
    role keeps the size asked, so a look never undoes a scale-up or scale-down whose pods the cache
    does not show yet, and keeps its state from before the look. None when it asks for nothing more
    (then a backlog that lasts writes nothing at every look)."""
    status: JSON = body.get("status") or {}

    def asked(role: str) -> int | None:
        value = (status.get(role) or {}).get("desiredReplicas")
        return value if isinstance(value, int) else None

    roles: dict[str, RoleDecision] = {}
    states: dict[str, RoleState] = {}
    grown: list[RoleDecision] = []
    for name, role in ((PREFILL, decision.prefill), (DECODE, decision.decode)):
        before = asked(name)
        if role.replicas > role.current and (before is None or role.replicas > before):
            roles[name], states[name] = role, decision.state.role(name)
            grown.append(role)
        else:
            size = role.current if before is None else before
            roles[name] = RoleDecision(size, size, size, WITHIN_TARGETS, f"{name[0].upper()} stays {size}")
            states[name] = state.role(name)
    if not grown:
        return None
    return replace(decision, prefill=roles[PREFILL], decode=roles[DECODE], reason=grown[0].reason,
                   message="; ".join(role.message for role in grown),
                   recommended_ratio=pd_ratio(roles[PREFILL].replicas, roles[DECODE].replicas),
                   state=replace(decision.state, prefill=states[PREFILL], decode=states[DECODE]))


def restored(namespace: str, name: str, status: JSON, not_before: float) -> AutoscalerState:
    """The decision state recorded in `status` (a process that has none of its own: it restarted or
    took over), or an empty one when there is none, it cannot be used (logged), or it was made
    before `not_before` (autoscaling was off, or no operator ran, for long)."""
    recorded = (status.get("autoscaler") or {}).get("state")
    if recorded is None:
        return AutoscalerState()
    try:
        state = decode_state(recorded)
    except ValueError as error:
        log.warning("autoscaler %s/%s: starting from an empty state: the recorded one cannot be used: %s",
                    namespace, name, error)
        return AutoscalerState()
    if state.time_s < not_before:
        log.info("autoscaler %s/%s: starting from an empty state: the recorded one is too old", namespace, name)
        return AutoscalerState()
    log.info("autoscaler %s/%s: resuming from the decision state in its status", namespace, name)
    return state


def old_status_reason(status: JSON) -> str | None:
    """The reason of the ScalingActive condition in `status`."""
    for condition in status.get("conditions", []):
        if condition.get("type") == ConditionType.SCALING_ACTIVE.value:
            return str(condition.get("reason"))
    return None
