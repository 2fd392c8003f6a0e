"""Prometheus text exposition (format 0.0.4) of one emulated engine's `vllm:*` metrics.

The output is what vLLM 0.33 serves on `/metrics` through `prometheus_client`: the same metric
names, types, label names (`model_name`, `engine`; `finished_reason`, `source` where vLLM has them),
bucket bounds and number formatting (`floatToGoString`: `1.0`, `+Inf`, `1e+06`), so a Prometheus
scrape or a parser written against vLLM reads the emulator unchanged. As `prometheus_client` does
in this format, a counter's `# TYPE` line carries its `_total` name.

Families vLLM 0.33 has and the emulator leaves out: `vllm:nixl_post_time_seconds` and
`vllm:nixl_num_descriptors` (NIXL's posting and descriptor lists are not modelled: any value would be
invented), prefix-cache families (`vllm:prefix_cache_*`, `vllm:external_prefix_cache_*`,
`vllm:prompt_tokens_cached_by_source`; there is no prefix cache), `vllm:num_requests_kv_fetch_by_stage`,
`vllm:engine_sleep_state`, `vllm:admission_rejections`, the KV-block residency histograms, LoRA,
multi-modal, spec-decode and cache-config info families.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from xpyd.sim.core import BucketHistogram, EngineCore

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
"""vLLM 0.33's `FINISH_REASON_STRINGS`: one `vllm:request_success_total` series each."""

NIXL_XFER_TIME_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
"""`vllm:nixl_xfer_time_seconds` buckets (vLLM's NixlPromMetrics)."""

NIXL_BYTES_BUCKETS: tuple[float, ...] = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
"""`vllm:nixl_bytes_transferred` buckets: 2 KiB to 8 GiB (vLLM's NixlPromMetrics)."""


WAITING_BY_REASON_HELP = ("Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
                          "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, "
                          "blocked status). Sum of all reasons equals vllm:num_requests_waiting.")

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
    aborts, KV-load errors) and the NIXL connector's series."""

    aborted_total: int = 0
    errored_total: int = 0
    nixl_num_failed_transfers_total: int = 0
    nixl_num_kv_expired_reqs_total: int = 0
    nixl_num_notifications_after_expiry_total: int = 0   # a release for KV no longer held
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
    return "{" + ",".join(f'{key}="{_escape(value)}"' for key, value in labels.items()) + "}"


class Exposition:
    """Builds one exposition text, family by family."""

    def __init__(self, labels: Mapping[str, str]) -> None:
        self.labels = dict(labels)
        self.lines: list[str] = []

    def _header(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def gauge(self, name: str, help_text: str, value: float) -> None:
        """One gauge series with the engine's labels."""
        self._header(name, "gauge", help_text)
        self.lines.append(f"{name}{_labels(self.labels)} {format_value(value)}")

    def gauges(self, name: str, help_text: str, series: Iterable[tuple[Mapping[str, str], float]]) -> None:
        """A gauge family: one series per (extra labels, value)."""
        self._header(name, "gauge", help_text)
        for extra, value in series:
            self.lines.append(f"{name}{_labels({**self.labels, **extra})} {format_value(value)}")

    def counter(self, name: str, help_text: str, series: Iterable[tuple[Mapping[str, str], float]]) -> None:
        """A counter family (`name` ends in `_total`): one series per (extra labels, value)."""
        self._header(name, "counter", help_text)
        for extra, value in series:
            self.lines.append(f"{name}{_labels({**self.labels, **extra})} {format_value(value)}")

    def histogram(self, name: str, help_text: str, histogram: BucketHistogram) -> None:
        """A histogram family: cumulative `_bucket` series up to `+Inf`, then `_count` and `_sum`."""
        self._header(name, "histogram", help_text)
        labels = _labels(self.labels)
        prefix = labels[:-1] + ","
        for bound, count in zip((*histogram.buckets, math.inf), histogram.cumulative(), strict=True):
            self.lines.append(f'{name}_bucket{prefix}le="{format_value(bound)}"}} {format_value(count)}')
        self.lines.append(f"{name}_count{labels} {format_value(histogram.count)}")
        self.lines.append(f"{name}_sum{labels} {format_value(histogram.sum)}")

    def text(self) -> str:
        """The exposition, newline-terminated."""
        return "\n".join(self.lines) + "\n"


_HISTOGRAMS: tuple[tuple[str, str], ...] = (
    ("time_to_first_token_seconds", "Histogram of time to first token in seconds."),
    ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
    ("request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request."),
    ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
    ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
    ("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request."),
    ("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
    ("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
    ("request_prompt_tokens", "Number of prefill tokens processed."),
    ("request_generation_tokens", "Number of generation tokens processed."),
    ("iteration_tokens_total", "Histogram of number of tokens per engine_step."),
    ("request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens."),
    ("request_params_n", "Histogram of the n request parameter."),
    ("request_params_max_tokens", "Histogram of the max_tokens request parameter."),
    ("request_num_preemptions", "Histogram of the number of times a request was preempted."),
    ("request_prefill_kv_computed_tokens",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens)."),
)


def render_metrics(core: EngineCore, connector: ConnectorMetrics, model_name: str, engine: str = "0") -> str:
    """The `/metrics` text of one engine: the core's gauges, counters and histograms, plus the
    emulator's request outcomes and NIXL series, labelled `model_name` and `engine` as vLLM does."""
    metrics = core.metrics
    out = Exposition({"model_name": model_name, "engine": engine})
    out.gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              core.num_requests_running)
    out.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", core.num_requests_waiting)
    deferred = core.num_requests_waiting_deferred
    out.gauges("vllm:num_requests_waiting_by_reason", WAITING_BY_REASON_HELP, [
        ({"reason": "capacity"}, core.num_requests_waiting - deferred), ({"reason": "deferred"}, deferred)])
    out.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", core.kv_cache_usage_perc)
    out.counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
                [({}, metrics.num_preemptions_total)])
    out.counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", [({}, metrics.prompt_tokens_total)])
    out.counter("vllm:prompt_tokens_by_source_total", "Number of prompt tokens by source.", [
        ({"source": "local_compute"}, metrics.prompt_tokens_local_compute),
        ({"source": "local_cache_hit"}, 0),
        ({"source": "external_kv_transfer"}, metrics.prompt_tokens_external_kv_transfer),
    ])
    out.counter("vllm:prompt_tokens_cached_total", "Number of cached prompt tokens (local + external).",
                [({}, metrics.prompt_tokens_external_kv_transfer)])
    out.counter("vllm:generation_tokens_total", "Number of generation tokens processed.",
                [({}, metrics.generation_tokens_total)])
    # Every emulated request generates exactly max_tokens tokens, so it finishes by length.
    outcomes = {"stop": 0, "length": metrics.request_success_total, "abort": connector.aborted_total,
                "error": connector.errored_total, "repetition": 0}
    out.counter("vllm:request_success_total", "Count of successfully processed requests.",
                [({"finished_reason": reason}, outcomes[reason]) for reason in FINISHED_REASONS])
    histograms = metrics.histograms()
    for name, help_text in _HISTOGRAMS:
        out.histogram(f"vllm:{name}", help_text, histograms[name])
    out.histogram("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.",
                  connector.nixl_xfer_time_seconds)
    out.histogram("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.",
                  connector.nixl_bytes_transferred)
    out.counter("vllm:nixl_num_failed_transfers_total", NIXL_HELP["nixl_num_failed_transfers"],
                [({}, connector.nixl_num_failed_transfers_total + metrics.kv_transfer_failures_total)])
    out.counter("vllm:nixl_num_failed_notifications_total", NIXL_HELP["nixl_num_failed_notifications"],
                [({}, 0)])
    out.counter("vllm:nixl_num_kv_expired_reqs_total", NIXL_HELP["nixl_num_kv_expired_reqs"],
                [({}, connector.nixl_num_kv_expired_reqs_total)])
    out.counter("vllm:nixl_num_notifications_after_expiry_total", NIXL_HELP["nixl_num_notifications_after_expiry"],
                [({}, connector.nixl_num_notifications_after_expiry_total)])
    return out.text()
