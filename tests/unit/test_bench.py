"""`xpyd bench`'s pure core: arrival schedules, prompts, per-request TPOT, SLO checks, the summary,
the exit code, the configuration's checks and the SSE event helpers."""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

import pytest

from xpyd.bench.client import _error_message, _event_text
from xpyd.bench.load import (
    BLOCK_TOKENS,
    PROMPT_WORDS,
    Arrival,
    build_prompt,
    completion_body,
    poisson_arrivals,
    trace_arrivals,
)
from xpyd.bench.report import (
    EXIT_ATTAINMENT,
    RequestRecord,
    SloMs,
    build_report,
    exit_code,
    format_summary,
    is_good,
    summarize,
)
from xpyd.bench.runner import BenchConfig, BenchError, plan_arrivals
from xpyd.traces import TraceRequest

pytestmark = pytest.mark.unit


def record(index: int = 0, *, ok: bool = True, ttft_ms: float | None = 100.0, e2e_ms: float | None = 1100.0,
           tokens: int = 101, kind: str | None = None, scheduled_s: float = 0.0, sent_s: float = 0.0,
           itl_ms: tuple[float, ...] = ()) -> RequestRecord:
    """A record in milliseconds (the defaults: TTFT 100 ms, TPOT 10 ms, a success)."""
    return RequestRecord(index, scheduled_s, sent_s, isl=100, osl=tokens, ok=ok,
                         ttft_s=None if ttft_ms is None else ttft_ms / 1000.0,
                         e2e_s=None if e2e_ms is None else e2e_ms / 1000.0, output_tokens=tokens,
                         itl_s=tuple(t / 1000.0 for t in itl_ms), error_kind=kind,
                         error=None if ok else "detail")


# --- arrivals ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("duration_s", "max_requests", "expected_count"), [
    (None, 1, 1),
    (None, 25, 25),
    (1e-9, None, 1),           # the first request goes at 0 even in a tiny window
    (1e-9, 10, 1),
    (1e9, 40, 40),             # the smaller bound wins
])
def test_poisson_arrivals_respect_both_bounds(duration_s: float | None, max_requests: int | None,
                                              expected_count: int) -> None:
    arrivals = poisson_arrivals(5.0, 64, 8, duration_s=duration_s, max_requests=max_requests, seed=3)
    assert len(arrivals) == expected_count
    assert [a.index for a in arrivals] == list(range(expected_count))
    assert arrivals[0].at_s == 0.0
    assert all(a.isl == 64 and a.osl == 8 for a in arrivals)
    assert all(b.at_s >= a.at_s for a, b in itertools.pairwise(arrivals))


def test_poisson_arrivals_are_seeded_and_have_the_rate() -> None:
    first = poisson_arrivals(20.0, 10, 10, duration_s=100.0, seed=7)
    assert first == poisson_arrivals(20.0, 10, 10, duration_s=100.0, seed=7)
    assert first != poisson_arrivals(20.0, 10, 10, duration_s=100.0, seed=8)
    assert all(a.at_s < 100.0 for a in first)
    assert len(first) / 100.0 == pytest.approx(20.0, rel=0.1)   # 2,000 arrivals: within 3 sigma


@pytest.mark.parametrize(("rate", "isl", "osl", "duration_s", "max_requests", "message"), [
    (0.0, 10, 10, 1.0, None, "rate"),
    (-1.0, 10, 10, 1.0, None, "rate"),
    (math.inf, 10, 10, 1.0, None, "rate"),
    (math.nan, 10, 10, 1.0, None, "rate"),
    (1.0, 0, 10, 1.0, None, "at least 1 token"),
    (1.0, 10, 0, 1.0, None, "at least 1 token"),
    (1.0, 10, 10, None, None, "needs a bound"),
])
def test_poisson_arrivals_reject_bad_arguments(rate: float, isl: int, osl: int, duration_s: float | None,
                                               max_requests: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        poisson_arrivals(rate, isl, osl, duration_s=duration_s, max_requests=max_requests)


def test_trace_arrivals_sort_number_and_cut() -> None:
    requests = [TraceRequest(2.0, 30, 3), TraceRequest(0.5, 10, 1, (7, 8)), TraceRequest(1.0, 20, 2)]
    assert trace_arrivals(requests) == [Arrival(0, 0.5, 10, 1, (7, 8)), Arrival(1, 1.0, 20, 2),
                                        Arrival(2, 2.0, 30, 3)]
    assert trace_arrivals(requests, max_requests=2) == [Arrival(0, 0.5, 10, 1, (7, 8)), Arrival(1, 1.0, 20, 2)]


# --- prompts ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("isl", [1, 2, 511, 512, 513, 1500, 4096])
def test_prompts_have_isl_four_character_words(isl: int) -> None:
    prompt = build_prompt(Arrival(3, 0.0, isl, 10))
    # Four characters a word: exactly `isl` tokens for the engine emulator's and the proxy's count.
    assert len(prompt) == 4 * isl
    words = [prompt[i:i + 4] for i in range(0, len(prompt), 4)]
    assert set(words) <= set(PROMPT_WORDS)


def test_prompt_words_are_four_characters_and_distinct() -> None:
    assert all(len(word) == 4 and word.startswith(" ") and word[1:].isalpha() for word in PROMPT_WORDS)
    assert len(set(PROMPT_WORDS)) == len(PROMPT_WORDS)


def test_prompts_differ_between_requests_and_seeds_but_not_between_runs() -> None:
    one, two = Arrival(0, 0.0, 600, 10), Arrival(1, 0.0, 600, 10)
    assert build_prompt(one) == build_prompt(one)
    assert build_prompt(one)[:40] != build_prompt(two)[:40]          # no shared prefix by accident
    assert build_prompt(one, seed=1)[:40] != build_prompt(one, seed=2)[:40]


def test_prefix_blocks_share_text_exactly_as_far_as_they_are_shared() -> None:
    block = BLOCK_TOKENS * 4   # characters per block
    a = build_prompt(Arrival(0, 0.0, 3 * BLOCK_TOKENS, 10, (1, 2, 3)))
    b = build_prompt(Arrival(1, 0.0, 2 * BLOCK_TOKENS + 100, 10, (1, 2, 9)))
    c = build_prompt(Arrival(2, 0.0, 2 * BLOCK_TOKENS, 10, (5, 2)))
    assert a[:2 * block] == b[:2 * block]
    assert a[2 * block:2 * block + 40] != b[2 * block:2 * block + 40]
    assert c[:40] != a[:40]
    assert len(b) == 4 * (2 * BLOCK_TOKENS + 100)


def test_completion_body_asks_for_exactly_osl_streamed_tokens_with_usage() -> None:
    arrival = Arrival(0, 0.0, 12, 34)
    body = completion_body(arrival, "llama")
    assert body == {"model": "llama", "prompt": build_prompt(arrival), "max_tokens": 34, "min_tokens": 34,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    assert "model" not in completion_body(arrival, None)


# --- records, SLOs, summary, exit code ------------------------------------------------------------------

@pytest.mark.parametrize(("rec", "tpot_ms"), [
    (record(ttft_ms=100.0, e2e_ms=1100.0, tokens=101), 10.0),
    (record(ttft_ms=50.0, e2e_ms=60.0, tokens=2), 10.0),
    (record(ttft_ms=50.0, e2e_ms=50.0, tokens=1), None),        # one token: no TPOT
    (record(ttft_ms=50.0, e2e_ms=50.0, tokens=0), None),
    (record(ok=False, ttft_ms=None, e2e_ms=None, kind="connect"), None),
    (record(ok=False, ttft_ms=40.0, e2e_ms=None, kind="timeout"), None),
])
def test_tpot_is_the_mean_interval_after_the_first_token(rec: RequestRecord, tpot_ms: float | None) -> None:
    if tpot_ms is None:
        assert rec.tpot_s is None
    else:
        assert rec.tpot_s == pytest.approx(tpot_ms / 1000.0)


SLO = SloMs(ttft_ms=200.0, tpot_ms=20.0)


@pytest.mark.parametrize(("rec", "good"), [
    (record(ttft_ms=100.0, e2e_ms=1100.0, tokens=101), True),     # TPOT 10
    (record(ttft_ms=200.0, e2e_ms=2200.0, tokens=101), True),     # both exactly on target
    (record(ttft_ms=200.1, e2e_ms=1200.0, tokens=101), False),    # TTFT over
    (record(ttft_ms=100.0, e2e_ms=2200.0, tokens=101), False),    # TPOT 21
    (record(ttft_ms=100.0, e2e_ms=100.0, tokens=1), True),        # one token: TPOT vacuous
    (record(ttft_ms=300.0, e2e_ms=300.0, tokens=1), False),
    (record(ok=False, ttft_ms=10.0, e2e_ms=None, kind="timeout"), False),
    (record(ok=False, ttft_ms=None, e2e_ms=None, kind="dropped"), False),
])
def test_a_request_is_good_when_it_succeeded_within_both_targets(rec: RequestRecord, good: bool) -> None:
    assert is_good(rec, SLO) is good


@pytest.mark.parametrize(("ttft_ms", "tpot_ms"), [(0.0, 1.0), (1.0, 0.0), (-5.0, 1.0), (math.nan, 1.0),
                                                  (1.0, math.inf)])
def test_slo_targets_must_be_positive(ttft_ms: float, tpot_ms: float) -> None:
    with pytest.raises(ValueError, match="target"):
        SloMs(ttft_ms, tpot_ms)


def test_summary_counts_attainment_goodput_and_errors() -> None:
    records = [
        record(0, ttft_ms=100.0, e2e_ms=1100.0, tokens=101, itl_ms=(5.0, 15.0)),   # good
        record(1, ttft_ms=300.0, e2e_ms=1300.0, tokens=101),                      # TTFT over
        record(2, ttft_ms=100.0, e2e_ms=3100.0, tokens=101),                      # TPOT 30: over
        record(3, ttft_ms=50.0, e2e_ms=50.0, tokens=1, scheduled_s=1.0, sent_s=1.25),   # good, 250 ms late
        record(4, ok=False, ttft_ms=None, e2e_ms=None, tokens=0, kind="http_503"),
        record(5, ok=False, ttft_ms=None, e2e_ms=None, tokens=0, kind="dropped", scheduled_s=2.0, sent_s=9.0),
    ]
    summary = summarize(records, SLO, wall_s=4.0)
    assert summary["requests"] == 6 and summary["good_requests"] == 2
    assert summary["attainment"] == pytest.approx(2 / 6, abs=1e-6)
    assert summary["goodput_rps"] == pytest.approx(0.5)
    assert (summary["succeeded"], summary["failed"], summary["dropped"]) == (4, 2, 1)
    assert summary["errors"] == {"dropped": 1, "http_503": 1}
    assert summary["attainment_ttft"] == pytest.approx(3 / 6, abs=1e-6)
    assert summary["attainment_tpot"] == pytest.approx(3 / 6, abs=1e-6)     # 0, 1, 3 (vacuous)
    assert summary["ttft_ms"]["p50"] == pytest.approx(100.0) and summary["ttft_ms"]["max"] == pytest.approx(300.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(50.0 / 3, abs=1e-3)   # 10, 10, 30 (3 has none)
    assert summary["itl_ms"]["p50"] == pytest.approx(10.0)
    assert summary["output_tokens"] == 304 and summary["output_tokens_per_s"] == pytest.approx(76.0)
    assert summary["max_send_lag_ms"] == pytest.approx(250.0)               # dropped requests are not sent
    for key in ("requests", "attainment", "goodput_rps", "gpu_hours", "goodput_per_gpu_hour", "ttft_ms",
                "tpot_ms", "scaling_actions"):
        assert key in summary
    assert set(summary["ttft_ms"]) >= {"p50", "p90", "p99"}
    json.dumps(summary, allow_nan=False)


def test_summary_of_all_failed_requests_has_no_latencies() -> None:
    summary = summarize([record(i, ok=False, ttft_ms=None, e2e_ms=None, kind="connect") for i in range(3)],
                        SLO, wall_s=0.5)
    assert summary["attainment"] == 0.0 and summary["goodput_rps"] == 0.0
    assert summary["ttft_ms"]["p50"] is None and summary["tpot_ms"]["p99"] is None
    assert summary["errors"] == {"connect": 3}
    text = format_summary(summary, "test")
    assert "3 failed" in text and "p50 -" in text and "errors: connect 3" in text
    json.dumps(summary, allow_nan=False)


def test_format_summary_warns_when_the_client_fell_behind() -> None:
    on_time = summarize([record(0, sent_s=0.01)], SLO, wall_s=1.0)
    late = summarize([record(0, scheduled_s=1.0, sent_s=1.5)], SLO, wall_s=2.0)
    assert "warning" not in format_summary(on_time, "t")
    assert "500 ms after their arrival time" in format_summary(late, "t")
    assert format_summary(on_time, "t").splitlines()[2].startswith("  attainment 100.0%")


def test_report_carries_summary_config_and_records() -> None:
    records = [record(0, itl_ms=(1.0,)), record(1, ok=False, ttft_ms=None, e2e_ms=None, kind="timeout")]
    report = build_report(summarize(records, SLO, 1.0), records, {"url": "u"})
    assert report["requests"] == 2 and report["config"] == {"url": "u"}
    assert report["records"][0]["tpot_s"] == pytest.approx(0.01) and report["records"][0]["itl_s"] == [0.001]
    assert report["records"][1]["error_kind"] == "timeout" and report["records"][1]["tpot_s"] is None
    json.dumps(report, allow_nan=False)


@pytest.mark.parametrize(("attainment", "minimum", "code"), [
    (0.5, None, 0), (0.0, None, 0), (0.9, 0.9, 0), (1.0, 0.9, 0), (0.899, 0.9, EXIT_ATTAINMENT),
    (0.0, 0.01, EXIT_ATTAINMENT), (0.0, 0.0, 0), (0.99, 1.0, EXIT_ATTAINMENT),
])
def test_exit_code(attainment: float, minimum: float | None, code: int) -> None:
    assert exit_code(attainment, minimum) == code


# --- configuration --------------------------------------------------------------------------------------

URL = "http://127.0.0.1:8000"


@pytest.mark.parametrize(("overrides", "message"), [
    ({}, "exactly one load"),
    ({"trace": "t.csv", "rate_rps": 1.0}, "not trace and rate"),
    ({"rate_rps": 1.0, "speedup": 2.0}, "trace only"),
    ({"rate_rps": 1.0, "start_s": 5.0}, "trace only"),
    ({"rate_rps": 1.0, "max_requests": 0}, "max-requests"),
    ({"rate_rps": 1.0, "max_concurrency": 0}, "max-concurrency"),
    ({"rate_rps": 1.0, "timeout_s": 0.0}, "timeout"),
    ({"rate_rps": 1.0, "timeout_s": math.inf}, "timeout"),
    ({"rate_rps": 1.0, "duration_s": -1.0}, "duration"),
    ({"rate_rps": 1.0, "url": "127.0.0.1:8000"}, "http"),
    ({"rate_rps": 1.0, "url": "ftp://127.0.0.1/"}, "http"),
])
def test_bench_config_rejects_contradictions(overrides: dict[str, Any], message: str) -> None:
    settings: dict[str, Any] = {"url": URL, **overrides}
    with pytest.raises(BenchError, match=message):
        BenchConfig(**settings)


@pytest.mark.parametrize(("url", "completions", "models"), [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1/completions", "http://127.0.0.1:8000/v1/models"),
    ("http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1/completions", "http://127.0.0.1:8000/v1/models"),
    ("http://h:1/v1/completions", "http://h:1/v1/completions", "http://h:1/v1/models"),
    ("https://h/api/v1/completions/", "https://h/api/v1/completions", "https://h/api/v1/models"),
    ("http://h:1/route", "http://h:1/route/v1/completions", "http://h:1/route/v1/models"),
])
def test_urls(url: str, completions: str, models: str) -> None:
    config = BenchConfig(url=url, rate_rps=1.0, max_requests=1)
    assert (config.completions_url, config.models_url) == (completions, models)


def test_plan_arrivals_of_explicit_requests_and_synthetic_load() -> None:
    requests = [TraceRequest(0.0, 10, 2), TraceRequest(0.2, 20, 3), TraceRequest(5.0, 30, 4)]
    assert plan_arrivals(BenchConfig(url=URL, requests=requests, duration_s=1.0)) == [
        Arrival(0, 0.0, 10, 2), Arrival(1, 0.2, 20, 3)]
    assert len(plan_arrivals(BenchConfig(url=URL, requests=requests, max_requests=1))) == 1
    with pytest.raises(BenchError, match="no requests"):
        plan_arrivals(BenchConfig(url=URL, requests=[], duration_s=1.0))
    synthetic = plan_arrivals(BenchConfig(url=URL, rate_rps=10.0, isl=7, osl=3, max_requests=4))
    assert [(a.index, a.isl, a.osl) for a in synthetic] == [(i, 7, 3) for i in range(4)]
    with pytest.raises(BenchError, match="needs a bound"):
        plan_arrivals(BenchConfig(url=URL, rate_rps=10.0))


# --- SSE helpers -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("event", "text"), [
    ({"choices": [{"index": 0, "text": " tok", "finish_reason": None}]}, " tok"),
    ({"choices": [{"index": 0, "text": ""}]}, ""),
    ({"choices": [], "usage": {"completion_tokens": 3}}, ""),
    ({"choices": [{"delta": {"content": " hi"}}]}, " hi"),
    ({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, ""),
    ({"choices": None}, ""),
    ({"choices": ["x"]}, ""),
    ({}, ""),
])
def test_event_text(event: dict[str, Any], text: str) -> None:
    assert _event_text(event) == text


@pytest.mark.parametrize(("body", "message"), [
    (b'{"error": {"message": "The model `x` does not exist.", "type": "NotFoundError"}}',
     "The model `x` does not exist."),
    (b'{"error": "plain"}', "plain"),
    (b'{"detail": "other"}', '{"detail": "other"}'),
    (b"Bad Gateway", "Bad Gateway"),
    (b"\xff\xfe", "\ufffd\ufffd"),
    (b"x" * 1000, "x" * 300),
])
def test_error_message(body: bytes, message: str) -> None:
    assert _error_message(body) == message
