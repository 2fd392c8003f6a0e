"""The autoscaler's inputs: an `Observation` from Prometheus (the pool's own series) and the
Kubernetes API (its pods).

Pure core, thin I/O:
- `queries(scope)` is every PromQL query one decision needs (table-tested), `gauge_queries(scope)`
  the engines' gauges alone, which `react()` reads between decisions;
- `observation(results, pods, now, scope)` turns their answers and the pool's pods into the
  `Observation` that `decide()` reads, or says why the metrics cannot be trusted (`MetricsError`);
  `gauges(results, pods, now, scope)` the gauges-only one `react()` reads;
- `Prometheus` runs the queries through prometheus-api-client's `PrometheusConnect` (instant
  queries, `/api/v1/query`), with the pool's bearer token and CA bundle (`Access`), synchronously:
  the operator calls it in a worker thread, off the event loop.

Series are selected by the labels every scrape of the pool carries: `namespace`, `xpyd_io_serving`
and `xpyd_io_role` (the chart's PodMonitor relabels the pod labels `xpyd.io/serving` and
`xpyd.io/role` into them; the local cluster's file_sd targets carry the same). Role-level
aggregates are one query `by (xpyd_io_role)` for both engine pools. Client-side TTFT and the
arrival rate come from the proxy's own series; without a scraped proxy, arrivals fall back to the
prefill engines' request count and TTFT is unknown (decide() then steers by the engines' queues).
How prompt work bunches on arrival comes from the proxies too (`autoscaler.arrivals`; `arrival_prompt_tokens`
rescales their estimated tokens to the engines' and scales a proxy's share up to the pool's); without
it, none is sized for.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Final

import requests
from prometheus_api_client.exceptions import PrometheusApiClientException
from prometheus_api_client.prometheus_connect import PrometheusConnect
from urllib3.util.retry import Retry

from xpyd.api.naming import (
    DECODE,
    LWS_GROUP_KEY_LABEL,
    LWS_SIZE_ANNOTATION,
    LWS_WORKER_INDEX_LABEL,
    PREFILL,
    ROLE_LABEL,
    ROLES,
    SERVING_LABEL,
)
from xpyd.api.waiting import Held, held_by_pod
from xpyd.autoscaler.observation import Observation, Quantiles, RoleObservation, hit_rate
from xpyd.common.bunching import WINDOWS_S as ARRIVAL_WINDOWS_S
from xpyd.common.bunching import window_label
from xpyd.common.jsontypes import JSON
from xpyd.common.netguard import NonLoopbackAddress, guard_url
from xpyd.common.timefmt import parse_rfc3339
from xpyd.kube.pods import condition

#: Seconds without a fresh scrape of a role's engines after which their gauges are stale; also how
#: long a pod may be ready before Prometheus must have found it (discovery plus a scrape interval).
STALE_AFTER_S: Final = 90.0

#: Quantile levels every histogram is read at (`Quantiles.p50/p90/p99`).
LEVELS: Final = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))

#: Engine histograms read per role: Observation field -> vLLM series (without `vllm:` and `_bucket`).
ROLE_HISTOGRAMS: Final = {
    "time_to_first_token_seconds": "time_to_first_token_seconds",
    "inter_token_latency_seconds": "inter_token_latency_seconds",
    "request_queue_time_seconds": "request_queue_time_seconds",
}

#: Whole-pool histograms: Observation field -> (role, series).
POOL_HISTOGRAMS: Final = {
    "isl": ("prefill", "vllm:request_prompt_tokens"),
    "osl": ("decode", "vllm:request_generation_tokens"),
    "tpot": ("decode", "vllm:request_time_per_output_token_seconds"),
}

PROXY_TTFT: Final = "xpyd_proxy_time_to_first_token_seconds"  # streamed requests only
PROXY_REQUESTS: Final = "xpyd_proxy_requests_total"
#: How prompt work bunches on arrival (`autoscaler.arrivals`), per `window`, and the prompt tokens it counted.
PROXY_ARRIVALS: Final = "xpyd_proxy_arrival_prompt_tokens"
PROXY_PROMPT_TOKENS: Final = "xpyd_proxy_prompt_tokens_total"
#: The suffix of the queries answered by bucket (`sum by (le)`): their samples are keyed by `le`.
BUCKETS: Final = ".buckets"
#: The prefix of the arrival queries, answered per slot length: their samples are keyed by `window`.
ARRIVALS: Final = "arrival"


class MetricsError(Exception):
    """Prometheus cannot be read, or what it returns cannot be trusted; the message says which."""


@dataclass(frozen=True)
class Scope:
    """The series of one DisaggregatedServing, over a rate window."""

    namespace: str
    serving: str
    window_s: int = 60

    def selector(self, roles: str = "prefill|decode") -> str:
        """A label matcher of the pool's series of `roles` (a regex)."""
        return (f'namespace="{_quote(self.namespace)}",xpyd_io_serving="{_quote(self.serving)}",'
                f'xpyd_io_role=~"{roles}"')

    @property
    def range(self) -> str:
        return f"[{self.window_s}s]"


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _histogram_queries(key: str, series: str, selector: str, window: str, by: str) -> dict[str, str]:
    group = f"sum by ({by}) " if by else "sum "
    group_le = f"sum by ({by + ', ' if by else ''}le) "
    result = {f"{key}.{name}": f"histogram_quantile({level}, {group_le}(rate({series}_bucket{{{selector}}}{window})))"
              for name, level in LEVELS}
    result[f"{key}.mean"] = (f"{group}(rate({series}_sum{{{selector}}}{window})) / "
                             f"{group}(rate({series}_count{{{selector}}}{window}))")
    return result


#: The `finished_reason` values of vLLM 0.33's `vllm:request_success_total` that are successes (its
#: `FINISH_REASON_STRINGS` also has "abort" and "error").
SUCCESS_REASONS = "stop|length|repetition"


def gauge_queries(scope: Scope) -> dict[str, str]:
    """The queries of the engines' gauges alone, per role (`by (xpyd_io_role)`): which engines are
    scraped and how fresh their samples are, running and waiting requests (and the fullest engine's
    waiting), KV usage. What `react()`
    reads between decisions (`gauges`); a part of `queries`, which reads the same names."""
    engines, by = scope.selector(), "xpyd_io_role"
    return {
        "up": f"count by ({by}) (up{{{engines}}} == 1)",
        "age": f"max by ({by}) (time() - timestamp(vllm:num_requests_running{{{engines}}}))",
        "running": f"sum by ({by}) (vllm:num_requests_running{{{engines}}})",
        "waiting": f"sum by ({by}) (vllm:num_requests_waiting{{{engines}}})",
        # The fullest engine: per scrape target (a data-parallel pod's ranks summed), as the proxy routes.
        "waiting_max": f"max by ({by}) (sum by ({by}, instance) (vllm:num_requests_waiting{{{engines}}}))",
        "kv_mean": f"avg by ({by}) (vllm:kv_cache_usage_perc{{{engines}}})",
        "kv_max": f"max by ({by}) (vllm:kv_cache_usage_perc{{{engines}}})",
    }


def queries(scope: Scope) -> dict[str, str]:
    """Every query of one observation, by name: the gauges (`gauge_queries`) and the window's rates
    and histograms. Names with a role dimension answer one sample per role (`by (xpyd_io_role)`);
    the others answer a single sample (or none)."""
    engines, proxy, window = scope.selector(), scope.selector("proxy"), scope.range
    by = "xpyd_io_role"
    result = {
        **gauge_queries(scope),
        "prompt_tps": f"sum by ({by}) (rate(vllm:prompt_tokens_total{{{engines}}}{window}))",
        "generation_tps": f"sum by ({by}) (rate(vllm:generation_tokens_total{{{engines}}}{window}))",
        # vLLM's own prefix caches (the same families from 0.13 to 0.33): prompt tokens looked up, found.
        "cache_queries": f"sum by ({by}) (rate(vllm:prefix_cache_queries_total{{{engines}}}{window}))",
        "cache_hits": f"sum by ({by}) (rate(vllm:prefix_cache_hits_total{{{engines}}}{window}))",
        # Successes only: vLLM counts aborted and errored requests in the same family.
        "success_rps": (f"sum by ({by}) (rate(vllm:request_success_total{{{engines},"
                        f"finished_reason=~\"{SUCCESS_REASONS}\"}}{window}))"),
        "proxy_up": f"count(up{{{proxy}}} == 1)",
        # Every request offered, refused at the concurrency limit too (demand), except unauthorised ones.
        "proxy_rps": f"sum(rate({PROXY_REQUESTS}{{{proxy},outcome!=\"unauthorized\"}}{window}))",
        "prefill_rps": (f"sum(rate(vllm:request_prompt_tokens_count{{{scope.selector('prefill')}}}"
                        f"{window}))"),
    }
    for key, series in ROLE_HISTOGRAMS.items():
        result.update(_histogram_queries(key, f"vllm:{series}", engines, window, by))
    for key, (role, series) in POOL_HISTOGRAMS.items():
        result.update(_histogram_queries(key, series, scope.selector(role), window, ""))
    result.update(_histogram_queries("ttft", PROXY_TTFT, proxy, window, ""))
    # The client histograms' buckets (by `le`): the share of requests within each SLO (attainment).
    result[f"ttft{BUCKETS}"] = f"sum by (le) (rate({PROXY_TTFT}_bucket{{{proxy}}}{window}))"
    tpot = POOL_HISTOGRAMS["tpot"]
    result[f"tpot{BUCKETS}"] = f"sum by (le) (rate({tpot[1]}_bucket{{{scope.selector(tpot[0])}}}{window}))"
    # Per slot length (`by (window)`), in the proxies' estimated tokens; with their estimated mean prompt.
    result.update(_histogram_queries(ARRIVALS, PROXY_ARRIVALS, proxy, window, "window"))
    first_slot = f'{proxy},window="{window_label(ARRIVAL_WINDOWS_S[0])}"'
    result["arrival_prompt"] = (f"sum(rate({PROXY_PROMPT_TOKENS}{{{proxy}}}{window})) / "
                                f"sum(rate({PROXY_ARRIVALS}_count{{{first_slot}}}{window}))")
    # The proxies the requests spread over: those that counted arrivals in the window (not every
    # proxy scraped: one starting in a rollout, or an older one without the histogram, takes none).
    result["arrival_proxies"] = f"count(rate({PROXY_ARRIVALS}_count{{{first_slot}}}{window}) > 0)"
    return result


# --- answers -> observation ----------------------------------------------------------------------

#: One query's answer: value by role ("" for the single-sample queries).
Samples = dict[str, float]


def parse_vector(answer: JSON) -> Samples:
    """The samples of a `/api/v1/query` answer, by their `xpyd_io_role` label ("" without one).
    NaN values (e.g. a quantile of a histogram without increments) are kept: they mean "no data"."""
    if answer.get("status") != "success":
        raise MetricsError(f"Prometheus answered {answer.get('errorType', 'an error')}: "
                           f"{answer.get('error', 'no detail')}")
    return parse_result((answer.get("data") or {}).get("result") or [])


def parse_result(result: Sequence[Any], label: str = "xpyd_io_role") -> Samples:
    """The samples of an answer's `data.result` (what `PrometheusConnect.custom_query` returns), as
    `parse_vector`: an instant vector's samples by their `label` ("" without one), or a scalar's
    `[time, value]` pair as one sample."""
    if len(result) == 2 and not isinstance(result[0], dict):
        return {"": float(result[1])}
    samples: Samples = {}
    for sample in result:
        role = (sample.get("metric") or {}).get(label, "")
        samples[role] = float(sample["value"][1])
    return samples


def buckets(results: Mapping[str, Samples], key: str) -> tuple[tuple[float, float], ...]:
    """A `sum by (le)` answer as ascending (le, cumulative rate) pairs ending at +Inf; empty when it has
    no +Inf bucket or any value is not a number."""
    pairs: list[tuple[float, float]] = []
    for le, value in results.get(f"{key}{BUCKETS}", {}).items():
        try:
            bound = float(le)
        except ValueError:
            return ()
        if not math.isfinite(value):
            return ()
        pairs.append((bound, value))
    pairs.sort()
    return tuple(pairs) if pairs and math.isinf(pairs[-1][0]) else ()


def _value(results: Mapping[str, Samples], name: str, role: str = "", default: float = math.nan) -> float:
    return results.get(name, {}).get(role, default)


def _quantiles(results: Mapping[str, Samples], key: str, role: str = "") -> Quantiles:
    def get(part: str) -> float:
        value = _value(results, f"{key}.{part}", role)
        return value if math.isfinite(value) else math.nan
    return Quantiles(get("p50"), get("p90"), get("p99"), get("mean"))


@dataclass(frozen=True)
class PodCounts:
    """One role's pods by state, as `RoleObservation` counts them, and how long the longest-ready
    pod has been ready (seconds; 0 when none is, or when the pods do not say)."""

    ready: int = 0
    starting: int = 0
    pending: int = 0
    draining: int = 0
    ready_for_s: float = 0.0

    @property
    def replicas(self) -> int:
        return self.ready + self.starting


def _age_s(timestamp: str | None, now: float) -> float:
    then = parse_rfc3339(timestamp)
    return 0.0 if then is None else max(0.0, now - then)


def count_pods(pods: Sequence[JSON], role: str, now: float = 0.0) -> PodCounts:
    """Ready (serving), starting (placed, loading), Pending (not placed: no GPU) and draining
    (terminating) replicas of one role. A replica is a pod, or the group of pods of a multi-node
    replica (LeaderWorkerSet): the group serves when its leader is ready, is draining when its leader
    terminates, and is Pending while any of its pods is (or has not been created yet): a group short
    of a node is no capacity. A pod that is both unschedulable and deleted counts nowhere."""
    ready = starting = pending = draining = 0
    ready_for = 0.0
    for members in _replicas(pods, role):
        leader = members[0]
        meta = leader.get("metadata", {})
        states = [_pod_state(pod) for pod in members]
        if any(state is None for state in states):
            continue  # a finished pod: not a replica
        leader_ready, _ = states[0]  # type: ignore[misc]
        size = _group_size(leader)
        if meta.get("deletionTimestamp"):
            draining += int(leader_ready)
        elif any(not scheduled for _, scheduled in states) or len(members) < size:  # type: ignore[misc]
            pending += 1
        elif leader_ready:
            ready += 1
            ready_for = max(ready_for, _age_s(condition(leader, "Ready").get("lastTransitionTime"), now))
        else:
            starting += 1
    return PodCounts(ready, starting, pending, draining, ready_for)


def _replicas(pods: Sequence[JSON], role: str) -> list[list[JSON]]:
    """The role's pods by replica, the leader (or the only pod) first."""
    groups: dict[str | int, list[JSON]] = {}
    for index, pod in enumerate(pods):
        labels = pod.get("metadata", {}).get("labels", {})
        if labels.get(ROLE_LABEL) == role:
            groups.setdefault(labels.get(LWS_GROUP_KEY_LABEL) or index, []).append(pod)
    result = []
    for members in groups.values():
        members.sort(key=lambda p: int(p.get("metadata", {}).get("labels", {}).get(LWS_WORKER_INDEX_LABEL, 0) or 0))
        leader_index = members[0].get("metadata", {}).get("labels", {}).get(LWS_WORKER_INDEX_LABEL)
        if leader_index not in (None, "0"):
            continue  # workers whose leader is gone: the group is being recreated
        result.append(members)
    return result


def _group_size(pod: JSON) -> int:
    try:
        return max(1, int(pod.get("metadata", {}).get("annotations", {}).get(LWS_SIZE_ANNOTATION, 1)))
    except ValueError:
        return 1


def _pod_state(pod: JSON) -> tuple[bool, bool] | None:
    """(ready, scheduled) of a pod, None when it has finished."""
    status = pod.get("status", {})
    if status.get("phase") in ("Succeeded", "Failed"):
        return None
    scheduled = condition(pod, "PodScheduled").get("status") == "True" or bool(pod.get("spec", {}).get("nodeName"))
    return condition(pod, "Ready").get("status") == "True", scheduled


def observation(results: Mapping[str, Samples], pods: Sequence[JSON], now: float, scope: Scope) -> Observation:
    """The Observation of one decision from the query answers and the pool's pods.

    Raises MetricsError when the metrics are missing or stale: engines of a role ready for longer
    than STALE_AFTER_S that Prometheus does not scrape, or whose last scrape is older than that.
    (Pods that just became ready are not in Prometheus yet: discovery and the first scrape take a
    scrape interval or two.)
    """
    counts = _scraped_counts(results, pods, now, scope)

    def role_observation(role: str) -> RoleObservation:
        return replace(
            _role_gauges(counts[role], results, role),
            time_to_first_token_seconds=_quantiles(results, "time_to_first_token_seconds", role),
            inter_token_latency_seconds=_quantiles(results, "inter_token_latency_seconds", role),
            request_queue_time_seconds=_quantiles(results, "request_queue_time_seconds", role),
            prompt_tokens_per_s=_value(results, "prompt_tps", role, 0.0),
            generation_tokens_per_s=_value(results, "generation_tps", role, 0.0),
            requests_per_s=_value(results, "success_rps", role, 0.0),
            prefix_cache_hit_rate=hit_rate(_value(results, "cache_hits", role, 0.0),
                                           _value(results, "cache_queries", role, 0.0)),
        )

    proxied = _value(results, "proxy_up", "", 0.0) > 0
    rate = _value(results, "proxy_rps" if proxied else "prefill_rps", "", 0.0)
    isl, osl = _quantiles(results, "isl"), _quantiles(results, "osl")
    return Observation(
        time_s=now, window_s=float(scope.window_s), request_rate=rate if math.isfinite(rate) else 0.0,
        isl_mean=isl.mean, osl_mean=osl.mean, isl_quantiles=isl,
        ttft_seconds=_quantiles(results, "ttft") if proxied else Quantiles(),
        tpot_seconds=_quantiles(results, "tpot"),
        prefill=role_observation("prefill"), decode=role_observation("decode"),
        ttft_buckets=buckets(results, "ttft") if proxied else (), tpot_buckets=buckets(results, "tpot"),
        arrival_prompt_tokens=arrival_prompt_tokens(results, isl.mean))


def arrival_prompt_tokens(results: Mapping[str, Samples], isl_mean: float) -> tuple[tuple[float, Quantiles], ...]:
    """The arrival histogram's quantiles per slot length, turned into the engines' tokens across the
    pool: each proxy counts its own arrivals in its estimated tokens, so each value is rescaled by the
    engines' mean prompt over the proxies' estimated one and multiplied by the proxies that counted
    arrivals in the window (the requests taken as spread evenly over them: spread unevenly, the
    busier proxies' requests weigh most in the pooled quantile, which then over-sizes). Empty when
    either mean is unknown or no proxy counted any."""
    proxies = _value(results, "arrival_proxies", "", 0.0)
    estimated = _value(results, "arrival_prompt")
    if not (proxies > 0 and math.isfinite(estimated) and estimated > 0 and math.isfinite(isl_mean) and isl_mean > 0):
        return ()
    scale = proxies * isl_mean / estimated
    out: list[tuple[float, Quantiles]] = []
    for window in ARRIVAL_WINDOWS_S:
        label = window_label(window)
        quantiles = _quantiles(results, ARRIVALS, label)
        out.append((window, Quantiles(scale * quantiles.p50, scale * quantiles.p90, scale * quantiles.p99,
                                      scale * quantiles.mean)))
    return tuple(out)


def gauges(results: Mapping[str, Samples], pods: Sequence[JSON], now: float, scope: Scope) -> Observation:
    """The gauges-only Observation `react()` reads between decisions, from the answers of
    `gauge_queries` and the pool's pods: each role's replica counts (as `observation` counts them),
    running and waiting requests and KV usage, nothing of a window (`window_s` 0: no rate, quantile
    or histogram). Raises MetricsError as `observation` does."""
    counts = _scraped_counts(results, pods, now, scope)
    return Observation(time_s=now, window_s=0.0, prefill=_role_gauges(counts[PREFILL], results, PREFILL),
                       decode=_role_gauges(counts[DECODE], results, DECODE))


def _scraped_counts(results: Mapping[str, Samples], pods: Sequence[JSON], now: float,
                    scope: Scope) -> dict[str, PodCounts]:
    """Each role's pods by state; MetricsError when the answers of a role's ready engines are missing
    or stale (`observation`)."""
    counts: dict[str, PodCounts] = {role: count_pods(pods, role, now) for role in ROLES}
    for role in ROLES:
        if counts[role].ready == 0:
            continue
        scraped = _value(results, "up", role, 0.0)
        if scraped <= 0 and counts[role].ready_for_s <= STALE_AFTER_S:
            continue  # not discovered yet: the role's series read as zero for now
        if scraped <= 0:
            raise MetricsError(f"{counts[role].ready} {role} pod(s) ready but Prometheus scrapes none of them "
                               f"(no up == 1 series with namespace={scope.namespace}, "
                               f"xpyd_io_serving={scope.serving}, xpyd_io_role={role})")
        age = _value(results, "age", role)
        if not math.isfinite(age):
            raise MetricsError(f"no vllm:num_requests_running series from the {role} engines")
        if age > STALE_AFTER_S:
            raise MetricsError(f"the {role} engines' metrics are stale (last sample {age:.0f}s old)")
    return counts


def _role_gauges(counts: PodCounts, results: Mapping[str, Samples] | None = None, role: str = "") -> RoleObservation:
    """A role's replica counts and (with `results`, the answers of `gauge_queries`) its engines' gauges."""
    answers = results or {}
    return RoleObservation(
        replicas=counts.replicas, ready=counts.ready, starting=counts.starting, pending=counts.pending,
        draining=counts.draining,
        num_requests_running=_value(answers, "running", role, 0.0),
        num_requests_waiting=_value(answers, "waiting", role, 0.0),
        num_requests_waiting_max=_value(answers, "waiting_max", role, 0.0),
        kv_cache_usage_perc=_value(answers, "kv_mean", role, 0.0),
        kv_cache_usage_perc_max=_value(answers, "kv_max", role, 0.0))


def held_requests(pods: Sequence[JSON]) -> Held:
    """What the pool's proxies hold for a ready prefill and decode pair, summed over their pods'
    `xpyd.io/RequestsWaiting` conditions (`api.waiting`): a pool at zero's demand, read from the
    Kubernetes API (the operator's pod cache) rather than Prometheus, so it is seen at once."""
    return sum((held_by_pod(pod) for pod in pods
                if (pod.get("metadata", {}).get("labels") or {}).get(ROLE_LABEL) == "proxy"), Held())


def with_held(observation: Observation, held: Held) -> Observation:
    """`observation` with what the proxies hold."""
    return replace(observation, held_requests=float(held.requests), held_prompt_tokens=float(held.prompt_tokens))


def with_asked(observation: Observation, asked: Mapping[str, int]) -> Observation:
    """`observation` with the replicas each role was just asked for (its desired replicas) but has no
    pod for yet counted as starting. A decision or a look right after a scale-up, before the watch
    cache shows the new pods, must not take the pods it sees for the pool in force: it would order
    the scale-up back, or size (and count GPUs) from too few."""
    roles: dict[str, RoleObservation] = {}
    for name, role in ((PREFILL, observation.prefill), (DECODE, observation.decode)):
        missing = asked.get(name, 0) - (role.replicas + role.pending)
        roles[name] = replace(role, replicas=role.replicas + missing, starting=role.starting + missing) \
            if missing > 0 else role
    return replace(observation, prefill=roles[PREFILL], decode=roles[DECODE])


def pods_only(pods: Sequence[JSON], now: float, window_s: float) -> Observation:
    """An Observation with the pool's pod counts and no metrics (for holding replicas)."""
    return Observation(time_s=now, window_s=window_s, prefill=_role_gauges(count_pods(pods, PREFILL, now)),
                       decode=_role_gauges(count_pods(pods, DECODE, now)))


# --- I/O -------------------------------------------------------------------------------------------


#: Queries of one observation in flight at once (a decision makes about 40).
PARALLEL_QUERIES = 8

#: No retries: a query fails at once and the decision holds; the next interval tries again.
#: (PrometheusConnect's default retries 5xx and connection errors three times with backoff.)
NO_RETRIES: Final = Retry(total=0, read=False)


@dataclass(frozen=True)
class Access:
    """What reaching one Prometheus takes besides its URL: the bearer token (None: no
    Authorization header) and how its certificate is verified: against `ca_pem` (PEM CA
    certificates), else against the public CAs (certifi), or not at all (`insecure_skip_verify`)."""

    bearer_token: str | None = field(default=None, repr=False)
    ca_pem: str | None = None
    insecure_skip_verify: bool = False


class Prometheus:
    """Instant queries of one Prometheus (or Thanos Querier), each with a timeout, through
    prometheus-api-client's `PrometheusConnect`."""

    def __init__(self, url: str, access: Access | None = None, timeout_s: int = 10) -> None:
        self.url = url.rstrip("/")
        self.access = access or Access()
        self.timeout_s = timeout_s

    @contextlib.contextmanager
    def _connect(self) -> Iterator[PrometheusConnect]:
        """A client for the queries of one collection; its session (and the CA file requests reads
        the bundle from) last as long as the collection."""
        try:
            guard_url(self.url)
        except NonLoopbackAddress as error:
            raise MetricsError(str(error)) from None
        with contextlib.ExitStack() as stack:
            session = stack.enter_context(requests.Session())
            session.hooks["response"].append(self._refusal)
            session.verify = not self.access.insecure_skip_verify
            if self.access.ca_pem is not None:
                ca_file = stack.enter_context(tempfile.NamedTemporaryFile("w", prefix="xpyd-prometheus-ca-",
                                                                          suffix=".pem"))
                ca_file.write(self.access.ca_pem)
                ca_file.flush()
                session.verify = ca_file.name
            token = self.access.bearer_token
            yield PrometheusConnect(self.url, headers={"Authorization": f"Bearer {token}"} if token else {},
                                    session=session, retry=NO_RETRIES, timeout=self.timeout_s)

    def _refusal(self, response: requests.Response, *_: Any, **__: Any) -> None:
        """A response hook: an answer other than 200 raises a MetricsError that says why, from
        Prometheus' JSON error (400 bad_data, 422 execution, 503 timeout) or from the HTTP status
        (e.g. 401 from an authenticating proxy). PrometheusConnect's own exception carries the body
        only as a bytes repr."""
        if response.status_code == 200 or response.is_redirect:
            return
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if isinstance(answer, dict) and answer.get("status") == "error":
            parse_vector(answer)  # raises with Prometheus' errorType and error
        hint = " (check autoscaling.prometheus.bearerTokenSecretRef)" if response.status_code in (401, 403) else ""
        raise MetricsError(f"Prometheus at {self.url} answered HTTP {response.status_code} "
                           f"{response.reason}{hint}")

    def _query(self, client: PrometheusConnect, promql: str, at: float, label: str = "xpyd_io_role") -> Samples:
        try:
            return parse_result(client.custom_query(promql, params={"time": f"{at:.3f}"}), label)
        except requests.exceptions.SSLError as error:
            raise MetricsError(f"Prometheus at {self.url}: TLS verification failed (autoscaling.prometheus.tls): "
                               f"{error}") from None
        except (requests.exceptions.InvalidJSONError, KeyError, IndexError, TypeError, ValueError,
                AttributeError) as error:
            raise MetricsError(f"Prometheus at {self.url} answered something other than an instant query "
                               f"result: {type(error).__name__}: {error}") from None
        except (requests.RequestException, PrometheusApiClientException) as error:
            raise MetricsError(f"Prometheus at {self.url} cannot be read: {error}") from None

    def query(self, promql: str, at: float) -> Samples:
        """One query evaluated at `at` (Unix seconds)."""
        with self._connect() as client:
            return self._query(client, promql, at)

    def collect(self, scope: Scope, at: float, only_gauges: bool = False) -> dict[str, Samples]:
        """Every query of `scope` (`only_gauges`: those of `gauge_queries`) evaluated at `at` (Unix
        seconds), up to `PARALLEL_QUERIES` at a time; the first failure is raised and the queries not
        yet sent are dropped."""
        named = gauge_queries(scope) if only_gauges else queries(scope)
        with self._connect() as client:
            pool = ThreadPoolExecutor(max_workers=min(PARALLEL_QUERIES, len(named)), thread_name_prefix="promql")
            try:
                def one(item: tuple[str, str]) -> Samples:
                    return self._query(client, item[1], at, answer_label(item[0]))
                return dict(zip(named, pool.map(one, named.items()), strict=True))
            finally:
                pool.shutdown(wait=False, cancel_futures=True)


def answer_label(name: str) -> str:
    """The label a query's samples are keyed by: `le` for bucket queries, `window` for the arrival
    histogram's, else `xpyd_io_role` (absent on the single-sample queries)."""
    if name.endswith(BUCKETS):
        return "le"
    return "window" if name.startswith(f"{ARRIVALS}.") else "xpyd_io_role"


def pool_selector(serving: str) -> str:
    """The label selector of a DisaggregatedServing's pods."""
    return f"{SERVING_LABEL}={serving}"
