"""EngineCore: vLLM-like continuous batching rules, role behaviour, metrics, and the profile consistency checks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from tests.paths import H200_PROFILE
from xpyd.perf.model import PerfModel, read_profile
from xpyd.sim.core import (
    BucketHistogram,
    EngineConfig,
    EngineCore,
    EngineRequest,
    Event,
    EventKind,
    Phase,
    build_1_2_5_buckets,
    histogram_quantile,
)

pytestmark = pytest.mark.unit

PROFILE = H200_PROFILE


@dataclass
class LinearPerf:
    """A deterministic test double: prefill = a + b·tokens (+ q·tokens²), decode = c + d·batch + e·kv."""

    max_kv_tokens: int = 100_000
    a: float = 0.010
    b: float = 1e-5
    q: float = 0.0
    c: float = 0.005
    d: float = 1e-4
    e: float = 1e-8
    transfer_per_token: float = 1e-5

    def prefill_seconds(self, batch_tokens: int) -> float:
        return self.a + self.b * batch_tokens + self.q * batch_tokens**2 if batch_tokens > 0 else 0.0

    def decode_step_seconds(self, batch_size: int, kv_tokens: int) -> float:
        return self.c + self.d * batch_size + self.e * kv_tokens

    def kv_transfer_seconds(self, tokens: int) -> float:
        return self.transfer_per_token * tokens


def drive(core: EngineCore, max_decode_steps: int = 1, until: float = math.inf) -> list[Event]:
    """Run an engine by itself (no new arrivals) until it is idle; returns every event."""
    now = 0.0
    events: list[Event] = []
    while now < until:
        events += core.poll(now)
        step = core.next_step(now, max_decode_steps)
        if step is not None:
            now = step.end
            events += core.complete(step, now)
            continue
        timer = core.next_timer()
        if timer is None:
            break
        now = max(now, timer)
    return events


def times(events: list[Event], kind: EventKind) -> dict[str, float]:
    return {e.request.request_id: e.time for e in events if e.kind is kind}


def test_prefill_is_first_come_first_served_within_the_token_budget() -> None:
    perf = LinearPerf()
    core = EngineCore(perf, EngineConfig(max_num_batched_tokens=1000))
    for name in ("a", "b", "c"):
        core.add(EngineRequest(name, 600, 1), 0.0)
    step = core.next_step(0.0)
    assert step is not None
    assert [(r.request_id, c) for r, c in step.prefill] == [("a", 600), ("b", 400)]
    assert step.step_seconds == pytest.approx(perf.prefill_seconds(1000))
    assert core.num_requests_running == 2 and core.num_requests_waiting == 1
    events = core.complete(step, step.end)
    assert times(events, EventKind.FINISHED) == {"a": step.end}
    step2 = core.next_step(step.end)
    assert step2 is not None
    # The continued chunk goes first; then the queue's head; the step costs its batched time.
    assert [(r.request_id, c) for r, c in step2.prefill] == [("b", 200), ("c", 600)]
    assert step2.step_seconds == pytest.approx(perf.prefill_seconds(800))


def test_long_prompt_is_chunked_and_costs_its_batch_one_time() -> None:
    perf = LinearPerf(q=1e-9)   # superlinear: later chunks attend over more context
    core = EngineCore(perf, EngineConfig(max_num_batched_tokens=8192))
    core.add(EngineRequest("long", 20_000, 1), 0.0)
    chunks = []
    now = 0.0
    while (step := core.next_step(now)) is not None:
        chunks.append(step.prefill[0][1])
        now = step.end
        events = core.complete(step, now)
    assert chunks == [8192, 8192, 3616]
    assert now == pytest.approx(perf.prefill_seconds(20_000))
    assert times(events, EventKind.FIRST_TOKEN) == {"long": now}
    assert core.metrics.prompt_tokens_local_compute == 20_000


def test_requests_wait_while_the_kv_cache_is_full() -> None:
    core = EngineCore(LinearPerf(max_kv_tokens=1000))
    core.add(EngineRequest("a", 500, 100), 0.0)   # reserves 600
    core.add(EngineRequest("b", 350, 100), 0.0)   # needs 450: waits
    core.add(EngineRequest("c", 10, 10), 0.0)     # fits, but FCFS: behind b
    step = core.next_step(0.0)
    assert step is not None and [r.request_id for r, _ in step.prefill] == ["a"]
    assert core.kv_cache_usage_perc == pytest.approx(0.6)
    assert core.num_requests_waiting == 2
    events = core.complete(step, step.end) + drive(core)
    finished = times(events, EventKind.FINISHED)
    requests = {e.request.request_id: e.request for e in events}
    assert requests["b"].scheduled_time == pytest.approx(finished["a"])
    assert requests["c"].scheduled_time == pytest.approx(finished["a"])   # not ahead of b
    assert core.kv_reserved_tokens == 0 and core.is_idle


def test_running_requests_are_bounded_by_max_num_seqs() -> None:
    core = EngineCore(LinearPerf(), EngineConfig(max_num_seqs=2))
    for name in "abc":
        core.add(EngineRequest(name, 10, 5), 0.0)
    step = core.next_step(0.0)
    assert step is not None and len(step.prefill) == 2
    events = core.complete(step, step.end) + drive(core)
    requests = {e.request.request_id: e.request for e in events}
    assert requests["c"].scheduled_time == pytest.approx(requests["a"].finish_time)


def test_add_rejects_a_request_that_can_never_fit() -> None:
    core = EngineCore(LinearPerf(max_kv_tokens=100))
    with pytest.raises(ValueError, match="never fit"):
        core.add(EngineRequest("big", 95, 10), 0.0)
    with pytest.raises(ValueError, match="at least 1"):
        core.add(EngineRequest("empty", 0, 10), 0.0)


def test_decode_steps_time_from_batch_and_kv_and_emit_every_token() -> None:
    perf = LinearPerf()
    core = EngineCore(perf)
    core.add(EngineRequest("a", 100, 4), 0.0)
    core.add(EngineRequest("b", 300, 2), 0.0)
    prefill = core.next_step(0.0)
    assert prefill is not None
    events = core.complete(prefill, prefill.end)
    assert times(events, EventKind.FIRST_TOKEN) == {"a": prefill.end, "b": prefill.end}
    step = core.next_step(prefill.end)
    assert step is not None and step.prefill == () and len(step.decode) == 2
    assert step.step_seconds == pytest.approx(perf.decode_step_seconds(2, 100 + 1 + 300 + 1))
    events += core.complete(step, step.end) + drive(core)
    assert core.metrics.generation_tokens_total == 6
    assert core.metrics.request_success_total == 2
    assert core.metrics.inter_token_latency_seconds.count == 4   # 3 + 1 tokens after the first
    assert core.metrics.prompt_tokens_total == 400


def test_an_engine_without_all_metrics_keeps_what_an_autoscaler_reads() -> None:
    def run(all_metrics: bool) -> EngineCore:
        core = EngineCore(LinearPerf(e=1e-7), all_metrics=all_metrics)
        for i, (isl, osl) in enumerate([(100, 50), (2000, 300), (500, 120), (50, 1)]):
            core.add(EngineRequest(str(i), isl, osl, do_remote_decode=i == 3), 0.0)
        drive(core, max_decode_steps=64)
        return core
    full, lean = run(True).metrics, run(False).metrics
    read = ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_queue_time_seconds",
            "request_prompt_tokens", "request_generation_tokens",
            "request_max_num_generation_tokens", "request_params_n", "request_num_preemptions")   # made from those
    for name, histogram in full.histograms().items():
        kept = lean.histograms()[name]
        expected = (histogram.counts, histogram.sum) if name in read else ([0] * len(histogram.counts), 0.0)
        assert (kept.counts, kept.sum) == expected, name
        assert histogram.count > 0, name
    assert full.counters() == lean.counters()


def test_fused_decode_steps_match_single_steps() -> None:
    def run(max_decode_steps: int) -> tuple[dict[str, float], int]:
        core = EngineCore(LinearPerf(e=1e-7))
        for i, (isl, osl) in enumerate([(100, 50), (2000, 300), (500, 120), (50, 1)]):
            core.add(EngineRequest(str(i), isl, osl), 0.0)
        events = drive(core, max_decode_steps)
        return times(events, EventKind.FINISHED), core.metrics.generation_tokens_total

    single, tokens_single = run(1)
    fused, tokens_fused = run(1 << 20)
    assert tokens_single == tokens_fused == 50 + 300 + 120 + 1
    for name, finish in single.items():
        assert fused[name] == pytest.approx(finish, rel=1e-5)   # midpoint KV rounds to whole tokens


def test_shorten_cuts_a_fused_step_at_the_next_pass_boundary() -> None:
    perf = LinearPerf()
    core = EngineCore(perf)
    core.add(EngineRequest("a", 10, 1000), 0.0)
    step = core.next_step(0.0)
    assert step is not None
    core.complete(step, step.end)
    fused = core.next_step(step.end, max_decode_steps=1000)
    assert fused is not None and fused.num_steps == 999
    arrival = fused.start + 2.5 * fused.step_seconds
    cut = core.shorten(fused, arrival)
    # Three passes, re-timed at their own KV midpoint (shorter than the 999-pass plan's).
    assert cut.num_steps == 3 and cut.end >= arrival
    assert cut.step_seconds == pytest.approx(perf.decode_step_seconds(1, fused.kv_tokens + 1))
    assert cut.step_seconds < fused.step_seconds
    assert core.shorten(cut, cut.start + 10 * cut.step_seconds) is cut
    core.complete(cut, cut.end)
    assert core.generated_tokens(EngineRequest("x", 1, 1)) == 0
    running = next(iter(cut.decode))
    assert core.generated_tokens(running) == 4
    with pytest.raises(RuntimeError):
        core.complete(cut, cut.end)


def test_prefill_role_stops_after_the_first_token_and_holds_kv_until_released() -> None:
    core = EngineCore(LinearPerf(), EngineConfig(kv_lease_seconds=30.0))
    core.add(EngineRequest("p", 1000, 200, do_remote_decode=True), 0.0)
    events = drive(core, until=1.0)
    request = events[-1].request
    assert [e.kind for e in events] == [EventKind.FIRST_TOKEN, EventKind.FINISHED]
    assert request.phase is Phase.HELD and core.num_held == 1
    assert core.kv_reserved_tokens == 1001 and not core.is_idle
    assert core.next_timer() == pytest.approx(request.finish_time + 30.0)
    assert core.release_kv("p", 1.0) is True
    assert core.kv_reserved_tokens == 0 and core.is_idle
    assert core.release_kv("p", 1.0) is False
    assert core.next_timer() is None


def test_held_kv_is_freed_when_the_lease_expires() -> None:
    core = EngineCore(LinearPerf(), EngineConfig(kv_lease_seconds=5.0))
    core.add(EngineRequest("p", 100, 1, do_remote_decode=True), 0.0)
    events = drive(core)
    assert [e.kind for e in events] == [EventKind.FIRST_TOKEN, EventKind.FINISHED, EventKind.KV_RELEASED]
    assert events[2].time == pytest.approx(events[1].time + 5.0)
    assert core.is_idle and core.kv_reserved_tokens == 0


def test_decode_role_waits_for_the_kv_transfer_then_decodes_only() -> None:
    perf = LinearPerf(transfer_per_token=1e-4)
    core = EngineCore(perf)
    core.add(EngineRequest("d", 1000, 3, do_remote_prefill=True), 0.0)
    assert core.next_step(0.0) is None            # admitted: the transfer runs, nothing to compute
    assert core.num_requests_waiting == 1 and core.kv_reserved_tokens == 1003
    assert core.next_timer() == pytest.approx(0.1)
    loaded = core.poll(0.1)
    assert [e.kind for e in loaded] == [EventKind.KV_LOADED]
    step = core.next_step(0.1)
    assert step is not None and step.prefill == () and [r.request_id for r in step.joiners] == ["d"]
    events = core.complete(step, step.end) + drive(core)
    first = times(events, EventKind.FIRST_TOKEN)["d"]
    assert first == pytest.approx(0.1 + perf.decode_step_seconds(1, 1000))
    assert core.metrics.prompt_tokens_external_kv_transfer == 1000
    assert core.metrics.prompt_tokens_local_compute == 0
    assert core.metrics.generation_tokens_total == 3


def test_decode_role_recomputes_locally_without_kv_params_or_after_the_lease() -> None:
    core = EngineCore(LinearPerf())
    core.add(EngineRequest("plain", 500, 2), 0.0)
    core.add(EngineRequest("expired", 300, 2, do_remote_prefill=True, remote_kv_deadline=-1.0), 0.0)
    events = drive(core)
    assert core.metrics.prompt_tokens_local_compute == 800
    assert core.metrics.prompt_tokens_external_kv_transfer == 0
    assert core.metrics.kv_transfer_failures_total == 1
    assert all(e.request.local_prefill for e in events)


def test_metrics_mirror_vllm_request_histograms() -> None:
    core = EngineCore(LinearPerf())
    core.add(EngineRequest("a", 100, 10), 0.0)
    drive(core)
    metrics = core.metrics
    assert metrics.e2e_request_latency_seconds.count == 1
    assert metrics.request_queue_time_seconds.sum == 0.0
    assert metrics.request_prompt_tokens.sum == 100 and metrics.request_generation_tokens.sum == 10
    assert set(metrics.histograms()) >= {"time_to_first_token_seconds", "inter_token_latency_seconds",
                                         "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
                                         "request_queue_time_seconds", "request_prefill_time_seconds",
                                         "request_decode_time_seconds", "request_prompt_tokens",
                                         "request_generation_tokens"}
    assert metrics.counters()["request_success_total"] == 1


@pytest.mark.parametrize(("counts", "q", "expected"), [
    ([0, 0, 0, 0], 0.5, math.nan),
    ([10, 0, 0, 0], 0.5, 0.5),            # lower bound 0 for the first bucket
    ([0, 10, 0, 0], 0.5, 1.5),
    ([5, 5, 0, 0], 0.9, 1.8),
    ([0, 0, 0, 10], 0.99, 3.0),           # +Inf bucket: the highest finite bound
])
def test_histogram_quantile_follows_prometheus(counts: list[int], q: float, expected: float) -> None:
    result = histogram_quantile(q, (1.0, 2.0, 3.0), counts)
    assert (math.isnan(result) and math.isnan(expected)) or result == pytest.approx(expected)


def test_histogram_window_arithmetic() -> None:
    histogram = BucketHistogram((1.0, 2.0))
    histogram.observe(0.5)
    earlier = histogram.copy()
    histogram.observe(1.5, 3)
    window = histogram.minus(earlier)
    assert window.counts == [0, 3, 0] and window.count == 3 and window.sum == pytest.approx(4.5)
    assert histogram.cumulative() == [1, 4, 4]
    assert build_1_2_5_buckets(600) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0)


# --- consistency with the measured profile --------------------------------------------------------

@pytest.mark.parametrize("isl", [100, 1117, 4168, 8236, 12304, 16372])
def test_low_load_prefill_ttft_matches_the_profile(isl: int) -> None:
    perf = PerfModel.from_profile(PROFILE)
    measured = {p.isl_tokens: p.ttft_s for p in read_profile(PROFILE)[0]}[isl]
    core = EngineCore(perf)
    core.add(EngineRequest("r", isl, 1, do_remote_decode=True), 0.0)
    first = times(drive(core, until=1e6), EventKind.FIRST_TOKEN)["r"]
    assert first == pytest.approx(measured, rel=0.05)
    assert core.metrics.time_to_first_token_seconds.sum == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("isl", [4168, 8236, 16372])
def test_saturated_prefill_throughput_matches_the_profile(isl: int) -> None:
    perf = PerfModel.from_profile(PROFILE)
    measured = {p.isl_tokens: p.tokens_per_s for p in read_profile(PROFILE)[0]}[isl]
    core = EngineCore(perf)
    count = 200
    for i in range(count):
        core.add(EngineRequest(str(i), isl, 1), 0.0)
    events = drive(core)
    end = max(times(events, EventKind.FINISHED).values())
    assert count * isl / end == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize(("context", "usage"), [(2997, 0.30762), (5644, 0.47181), (8291, 0.64045)])
def test_saturated_decode_throughput_matches_the_profile(context: int, usage: float) -> None:
    perf = PerfModel.from_profile(PROFILE)
    point = next(p for p in read_profile(PROFILE)[1] if p.context_tokens == context and p.kv_usage == usage)
    batch = round(point.batch_size(perf.max_kv_tokens))
    osl = 64
    # The batch the profile ran: `batch` sequences at `context` tokens, refilled wave after wave.
    core = EngineCore(perf, EngineConfig(max_num_seqs=batch))
    waves = 5
    for i in range(batch * waves):
        core.add(EngineRequest(str(i), context - osl // 2, osl, do_remote_prefill=True), 0.0)
    events = drive(core, max_decode_steps=1 << 20)
    first = min(times(events, EventKind.FIRST_TOKEN).values())
    end = max(times(events, EventKind.FINISHED).values())
    tokens_per_s = core.metrics.generation_tokens_total / (end - first)
    assert tokens_per_s == pytest.approx(point.tokens_per_s, rel=0.05)


def test_abort_frees_queued_running_and_transferring_requests() -> None:
    core = EngineCore(LinearPerf(transfer_per_token=1e-3))
    queued = EngineRequest("queued", 100, 10)
    running = EngineRequest("running", 100, 50)
    remote = EngineRequest("remote", 100, 10, do_remote_prefill=True)
    core.add(running, 0.0)
    step = core.next_step(0.0)
    assert step is not None
    core.add(remote, 0.0)
    core.add(queued, 0.0)
    assert core.abort(queued, 0.001) and core.num_requests_waiting == 1
    assert core.abort(running, 0.001)                 # in the step in flight: leaves when it completes
    events = core.complete(step, step.end)
    assert [e.kind for e in events] == [EventKind.FIRST_TOKEN]
    assert running.phase is Phase.ABORTED and core.num_requests_running == 0
    assert core.next_step(step.end) is None           # admits `remote`: its transfer starts
    assert core.abort(remote, step.end) and core.poll(10.0) == []
    assert core.is_idle and core.kv_reserved_tokens == 0
    assert not core.abort(remote, 10.0)


def test_abort_of_a_decoding_request_between_steps() -> None:
    core = EngineCore(LinearPerf())
    keep, drop = EngineRequest("keep", 100, 5), EngineRequest("drop", 200, 50)
    core.add(keep, 0.0)
    core.add(drop, 0.0)
    step = core.next_step(0.0)
    assert step is not None
    core.complete(step, step.end)
    step = core.next_step(step.end)
    assert step is not None
    core.complete(step, step.end)
    assert core.abort(drop, step.end) and drop.generated_tokens == 2
    events = drive(core)
    assert [e.request.request_id for e in events if e.kind is EventKind.FINISHED] == ["keep"]
    assert core.is_idle and core.kv_reserved_tokens == 0


# The `documentation=` of vLLM 0.33's metrics (vllm/v1/metrics/loggers.py in the 0.33.0 wheel): the
# emulator's `# HELP` lines are vLLM's own.
VLLM_033_HELP = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:prompt_tokens_total": "Number of prefill tokens processed.",
    "vllm:generation_tokens_total": "Number of generation tokens processed.",
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per request.",
    "vllm:request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "vllm:request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "vllm:request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "vllm:request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "vllm:num_requests_waiting_by_reason": "Number of waiting requests by reason. Reason labels: 'capacity' = "
                                           "waiting for scheduling capacity; 'deferred' = deferred by transient "
                                           "constraints (LoRA budget, KV transfer, blocked status). Sum of all "
                                           "reasons equals vllm:num_requests_waiting.",
    "vllm:prompt_tokens_cached_total": "Number of cached prompt tokens (local + external).",
    "vllm:request_success_total": "Count of successfully processed requests.",
    "vllm:iteration_tokens_total": "Histogram of number of tokens per engine_step.",
    "vllm:request_max_num_generation_tokens": "Histogram of maximum number of requested generation tokens.",
    "vllm:request_params_n": "Histogram of the n request parameter.",
    "vllm:request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "vllm:request_num_preemptions": "Histogram of the number of times a request was preempted.",
    "vllm:request_prefill_kv_computed_tokens": "Histogram of new KV tokens computed during prefill (excluding "
                                               "cached tokens).",
    # vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py
    "vllm:nixl_xfer_time_seconds": "Histogram of transfer duration for NIXL KV Cache transfers.",
    "vllm:nixl_bytes_transferred": "Histogram of bytes transferred per NIXL KV Cache transfers.",
    "vllm:nixl_num_failed_transfers_total": "Number of failed NIXL KV Cache transfers, including handshake and "
                                            "notification failures. NOTE: KV expiry is tracked separately in "
                                            "vllm:nixl_num_kv_expired_reqs.",
    "vllm:nixl_num_failed_notifications_total": "Number of failed NIXL KV Cache notifications. Retained for "
                                                "compatibility; these failures are also included in "
                                                "vllm:nixl_num_failed_transfers.",
    "vllm:nixl_num_kv_expired_reqs_total": "Number of requests that had their KV expire. NOTE: This metric is "
                                           "tracked on the P instance.",
    "vllm:nixl_num_notifications_after_expiry_total": "Number of completion notifications for requests that were "
                                                      "no longer tracked, usually because their KV lease expired. "
                                                      "The KV blocks may have been reused before the transfer "
                                                      "finished. Counted per notification (one per remote rank), "
                                                      "not per request.",
}


def test_emulated_metrics_carry_vllms_help_texts() -> None:
    from xpyd.sim.emulator.exposition import ConnectorMetrics, render_metrics

    text = render_metrics(EngineCore(LinearPerf()), ConnectorMetrics(), "m")
    helps = dict(line[len("# HELP "):].split(" ", 1) for line in text.splitlines() if line.startswith("# HELP "))
    assert {name: helps.get(name) for name in VLLM_033_HELP} == VLLM_033_HELP
