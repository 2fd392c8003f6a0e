"""Prometheus text exposition (format 0.0.4) of one emulated engine's `vllm:*` metrics.

The output is what vLLM 0.33 serves on `/metrics` (through `prometheus_client` 0.26, the version its
lock pins): the same metric names, types, HELP texts, label names (`model_name`, `engine`;
`finished_reason`, `source`, `reason`, `stage`, `sleep_state` where vLLM has them), bucket bounds and
number formatting (`floatToGoString`: `1.0`, `+Inf`, `1e+06`), so a Prometheus scrape or a parser
written against vLLM reads the emulator unchanged. As `prometheus_client` does in this format, a
counter's `# TYPE` line carries its `_total` name, the labels of a sample are sorted by name, and
every counter and histogram family is followed by its `_created` gauge family (the Unix time its
series were created: vLLM creates them all at start-up, the emulator when its engine is built).
tests/conformance/test_emulator_vs_real.py pins all of this against recordings of real vLLM.

As in vLLM, the `vllm:nixl_*` families exist only on an engine with a KV connector (`kv_role` set),
and `vllm:num_requests_kv_fetch_by_stage` only on a KV consumer (`kv_consumer`, `kv_both`).

The prefix cache's families are the engine model's (`sim.core`, its `kvcache.BlockPool` keyed by
vLLM's hashes of the emulator's token ids): `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits`
count prompt tokens looked up and found at admission (0 with `--no-enable-prefix-caching`, as in
vLLM), the `device` series of `vllm:prompt_tokens_cached_by_source` the same hits, and
`vllm:prompt_tokens_by_source{source="local_cache_hit"}` and `vllm:prompt_tokens_cached` (local +
external) the requests' hits once their prompt is done; `vllm:external_prefix_cache_queries` counts
what the local cache left to the connector.

Families vLLM 0.33 has and the emulator leaves out, because it does not model what they count (any
value would be invented): `vllm:nixl_post_time_seconds` and `vllm:nixl_num_descriptors` (NIXL's
posting and descriptor lists), `vllm:mm_cache_*` (text only), `vllm:estimated_*_per_gpu` (no FLOP or byte model),
`vllm:admission_rejections` (no `--max-num-queued-*` limits), `vllm:cache_config_info` (CacheConfig's
fields: most are not modelled), the KV-block residency histograms, LoRA, spec-decode and sleep-mode
transitions; and the non-vLLM families of vLLM's process: `python_*`, `process_*` (prometheus_client's
default collectors) and `http_*` (prometheus-fastapi-instrumentator).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from xpyd.sim.core import BucketHistogram, EngineCore

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
"""vLLM 0.33's `FINISH_REASON_STRINGS`: one `vllm:request_success_total` series each."""

KV_FETCH_STAGES = ("waiting_to_start", "in_progress", "completed_waiting")
"""vLLM 0.33's `KV_FETCH_STAGES`: one `vllm:num_requests_kv_fetch_by_stage` series each."""

SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
"""The `sleep_state` series of `vllm:engine_sleep_state`."""

CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
"""vLLM 0.33's `CacheHitSource`: one `vllm:prompt_tokens_cached_by_source_total` series each."""

NIXL_XFER_TIME_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
"""`vllm:nixl_xfer_time_seconds` buckets (vLLM's NixlPromMetrics)."""

NIXL_BYTES_BUCKETS: tuple[float, ...] = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
"""`vllm:nixl_bytes_transferred` buckets: 2 KiB to 8 GiB (vLLM's NixlPromMetrics)."""


WAITING_BY_REASON_HELP = ("Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
                          "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, "
                          "blocked status). Sum of all reasons equals vllm:num_requests_waiting.")

KV_FETCH_BY_STAGE_HELP = ("Number of waiting requests by async KV load stage. Stage labels: 'waiting_to_start' = "
                          "needs an async KV load that has not started; 'in_progress' = load started and not yet "
                          "reported finished; 'completed_waiting' = load finished, request not running yet.")

SLEEP_STATE_HELP = ("Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
                    "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.")

CACHED_BY_SOURCE_HELP = ("Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host "
                         "(offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
                         "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
                         "vllm:external_prefix_cache_hits.")

NIXL_HELP = {
    "nixl_num_failed_transfers": "Number of failed NIXL KV Cache transfers, including handshake and notification "
                                 "failures. NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
    "nixl_num_failed_notifications": "Number of failed NIXL KV Cache notifications. Retained for compatibility; "
                                     "these failures are also included in vllm:nixl_num_failed_transfers.",
    "nixl_num_kv_expired_reqs": "Number of requests that had their KV expire. NOTE: This metric is tracked on the "
                                "P instance.",
    "nixl_num_notifications_after_expiry": "Number of completion notifications for requests that were no longer "
                                           "tracked, usually because their KV lease expired. The KV blocks may have "
                                           "been reused before the transfer finished. Counted per notification (one "
                                           "per remote rank), not per request.",
}
"""HELP texts of vLLM 0.33's NIXL counters (`nixl/stats.py`)."""


@dataclass
class ConnectorMetrics:
    """What the emulator adds to the core's metrics: request outcomes the core does not see (client
    aborts, KV-load errors) and the NIXL connector's series.

    `kv_connector`: whether the engine has a KV connector (vLLM registers the `vllm:nixl_*` families
    and counts external prefix-cache queries only then). `created`: the Unix time the series were
    created, which the `_created` gauges report."""

    kv_connector: bool = True
    created: float = field(default_factory=time.time)
    aborted_total: int = 0
    errored_total: int = 0
    nixl_num_failed_transfers_total: int = 0
    nixl_num_kv_expired_reqs_total: int = 0
    nixl_num_notifications_after_expiry_total: int = 0   # a release for KV no longer held
    #: Prefix-cache lookups the core counted twice: a decode leg admitted again after its first attempt
    #: was parked or failed (the engine's `_relookups`); vLLM looks a request up once.
    repeated_prefix_cache_queries: int = 0
    repeated_prefix_cache_hits: int = 0
    nixl_xfer_time_seconds: BucketHistogram = field(default_factory=lambda: BucketHistogram(NIXL_XFER_TIME_BUCKETS))
    nixl_bytes_transferred: BucketHistogram = field(default_factory=lambda: BucketHistogram(NIXL_BYTES_BUCKETS))


def format_value(value: float) -> str:
    """A sample value or `le` bound as `prometheus_client` writes it (its `floatToGoString`)."""
    value = float(value)
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:   # Go switches to exponents sooner than Python
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(labels: Mapping[str, str]) -> str:
    """A sample's label set, sorted by name as `prometheus_client` writes it."""
    return "{" + ",".join(f'{key}="{_escape(labels[key])}"' for key in sorted(labels)) + "}"


Series = Iterable[tuple[Mapping[str, str], float]]
"""A family's series: (labels beyond the engine's, value)."""


class Exposition:
    """Builds one exposition text, family by family. `created` is the Unix time every series was
    created: counters and histograms are followed by a `_created` gauge family, as `prometheus_client`
    writes them in this format."""

    def __init__(self, labels: Mapping[str, str], created: float) -> None:
        self.labels = dict(labels)
        self.created = created
        self.lines: list[str] = []

    def _header(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def _created(self, name: str, help_text: str, label_sets: Iterable[Mapping[str, str]]) -> None:
        self._header(f"{name}_created", "gauge", help_text)
        created = format_value(self.created)
        for extra in label_sets:
            self.lines.append(f"{name}_created{_labels({**self.labels, **extra})} {created}")

    def gauge(self, name: str, help_text: str, value: float) -> None:
        """One gauge series with the engine's labels."""
        self.gauges(name, help_text, [({}, value)])

    def gauges(self, name: str, help_text: str, series: Series) -> None:
        """A gauge family: one series per (extra labels, value)."""
        self._header(name, "gauge", help_text)
        for extra, value in series:
            self.lines.append(f"{name}{_labels({**self.labels, **extra})} {format_value(value)}")

    def counter(self, name: str, help_text: str, series: Series) -> None:
        """A counter family (`name` without `_total`): its `_total` series, one per (extra labels,
        value), then their `_created` gauges."""
        series = list(series)
        self._header(f"{name}_total", "counter", help_text)
        for extra, value in series:
            self.lines.append(f"{name}_total{_labels({**self.labels, **extra})} {format_value(value)}")
        self._created(name, help_text, [extra for extra, _ in series])

    def histogram(self, name: str, help_text: str, histogram: BucketHistogram) -> None:
        """A histogram family: cumulative `_bucket` series up to `+Inf`, `_count`, `_sum`, then `_created`."""
        self._header(name, "histogram", help_text)
        labels = self.labels
        for bound, count in zip((*histogram.buckets, math.inf), histogram.cumulative(), strict=True):
            self.lines.append(f"{name}_bucket{_labels({**labels, 'le': format_value(bound)})} {format_value(count)}")
        plain = _labels(labels)
        self.lines.append(f"{name}_count{plain} {format_value(histogram.count)}")
        self.lines.append(f"{name}_sum{plain} {format_value(histogram.sum)}")
        self._created(name, help_text, [{}])

    def text(self) -> str:
        """The exposition, newline-terminated."""
        return "\n".join(self.lines) + "\n"


_HISTOGRAMS: tuple[tuple[str, str], ...] = (
    ("request_prompt_tokens", "Number of prefill tokens processed."),
    ("request_generation_tokens", "Number of generation tokens processed."),
    ("iteration_tokens_total", "Histogram of number of tokens per engine_step."),
    ("request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens."),
    ("request_params_n", "Histogram of the n request parameter."),
    ("request_params_max_tokens", "Histogram of the max_tokens request parameter."),
    ("time_to_first_token_seconds", "Histogram of time to first token in seconds."),
    ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
    ("request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request."),
    ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
    ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
    ("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request."),
    ("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
    ("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
    ("request_num_preemptions", "Histogram of the number of times a request was preempted."),
    ("request_prefill_kv_computed_tokens",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens)."),
)
"""The core's histograms, in vLLM's order of registration."""


def render_metrics(core: EngineCore, connector: ConnectorMetrics, model_name: str, engine: str = "0",
                   kv_fetch: Mapping[str, int] | None = None) -> str:
    """The `/metrics` text of one engine, its families in vLLM's order: the NIXL connector's (with a
    KV connector), the core's gauges and counters, the emulator's request outcomes, the core's
    histograms; labelled `model_name` and `engine` as vLLM does. `kv_fetch` (a KV consumer's
    requests waiting for their KV, by `KV_FETCH_STAGES`) adds `vllm:num_requests_kv_fetch_by_stage`."""
    metrics = core.metrics
    out = Exposition({"model_name": model_name, "engine": engine}, connector.created)
    if connector.kv_connector:
        out.histogram("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.",
                      connector.nixl_xfer_time_seconds)
        out.histogram("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.",
                      connector.nixl_bytes_transferred)
        out.counter("vllm:nixl_num_failed_transfers", NIXL_HELP["nixl_num_failed_transfers"],
                    [({}, connector.nixl_num_failed_transfers_total + metrics.kv_transfer_failures_total)])
        out.counter("vllm:nixl_num_failed_notifications", NIXL_HELP["nixl_num_failed_notifications"], [({}, 0)])
        out.counter("vllm:nixl_num_kv_expired_reqs", NIXL_HELP["nixl_num_kv_expired_reqs"],
                    [({}, connector.nixl_num_kv_expired_reqs_total)])
        out.counter("vllm:nixl_num_notifications_after_expiry", NIXL_HELP["nixl_num_notifications_after_expiry"],
                    [({}, connector.nixl_num_notifications_after_expiry_total)])
    out.gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              core.num_requests_running)
    out.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", core.num_requests_waiting)
    deferred = core.num_requests_waiting_deferred
    out.gauges("vllm:num_requests_waiting_by_reason", WAITING_BY_REASON_HELP, [
        ({"reason": "capacity"}, core.num_requests_waiting - deferred), ({"reason": "deferred"}, deferred)])
    if kv_fetch is not None:
        out.gauges("vllm:num_requests_kv_fetch_by_stage", KV_FETCH_BY_STAGE_HELP,
                   [({"stage": stage}, kv_fetch.get(stage, 0)) for stage in KV_FETCH_STAGES])
    # The emulated engine never sleeps (no sleep mode): awake, as vLLM reports an engine without one.
    out.gauges("vllm:engine_sleep_state", SLEEP_STATE_HELP,
               [({"sleep_state": state}, 1.0 if state == "awake" else 0.0) for state in SLEEP_STATES])
    out.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", core.kv_cache_usage_perc)
    # The local prefix cache is asked at admission about every prompt (nothing counts without prefix
    # caching); the connector about what it left, and its hits are the KV pulled from a prefill engine.
    # The connector's count when the prompt is done, not at admission.
    hits = metrics.prefix_cache_hits - connector.repeated_prefix_cache_hits
    out.counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                [({}, metrics.prefix_cache_queries - connector.repeated_prefix_cache_queries)])
    out.counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", [({}, hits)])
    external = metrics.prompt_tokens_external_kv_transfer
    local = metrics.prompt_tokens_local_cache_hit
    out.counter("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector "
                "cross-instance cache sharing, in terms of number of queried tokens.",
                [({}, metrics.prompt_tokens_total - local if connector.kv_connector else 0)])
    out.counter("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance "
                "cache sharing, in terms of number of cached tokens.", [({}, external)])
    out.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                [({}, metrics.num_preemptions_total)])
    out.counter("vllm:prompt_tokens", "Number of prefill tokens processed.", [({}, metrics.prompt_tokens_total)])
    out.counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", [
        ({"source": "local_compute"}, metrics.prompt_tokens_local_compute),
        ({"source": "local_cache_hit"}, local),
        ({"source": "external_kv_transfer"}, external),
    ])
    out.counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                [({}, local + external)])
    # The prefix cache's hits are the device tier's (counted at admission, as prefix_cache_hits); NIXL's
    # come from another vLLM instance: p2p. No offloading tier.
    by_source = {"device": hits, "p2p": external}
    out.counter("vllm:prompt_tokens_cached_by_source", CACHED_BY_SOURCE_HELP,
                [({"source": source}, by_source.get(source, 0)) for source in CACHE_HIT_SOURCES])
    out.counter("vllm:generation_tokens", "Number of generation tokens processed.",
                [({}, metrics.generation_tokens_total)])
    # Every emulated request generates exactly max_tokens tokens, so it finishes by length.
    outcomes = {"stop": 0, "length": metrics.request_success_total, "abort": connector.aborted_total,
                "error": connector.errored_total, "repetition": 0}
    out.counter("vllm:request_success", "Count of successfully processed requests.",
                [({"finished_reason": reason}, outcomes[reason]) for reason in FINISHED_REASONS])
    histograms = metrics.histograms()
    for name, help_text in _HISTOGRAMS:
        out.histogram(f"vllm:{name}", help_text, histograms[name])
    return out.text()
