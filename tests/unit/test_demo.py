"""`xpyd demo`'s pure parts: sampling the status, latency so far, the summary maths, the plot data,
the live view and the lines it prints."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from xpyd.bench import RequestRecord, SloMs
from xpyd.cli import build_parser
from xpyd.demo import view
from xpyd.demo.main import DemoFailed, proxy_url, serving_events
from xpyd.demo.manifest import DemoPool, serving_manifest
from xpyd.demo.plot import write_plot
from xpyd.demo.timeline import (
    DecisionSample,
    PoolSample,
    decision_runs,
    demo_report,
    gpu_hours,
    latency_so_far,
    load_timeline,
    replica_summary,
    sample_from_status,
    scaling_actions,
)

pytestmark = pytest.mark.unit

SLO = SloMs(ttft_ms=500, tpot_ms=15)


def record(index: int, sent_s: float, ttft_s: float | None = 0.1, e2e_s: float = 0.5, tokens: int = 11,
           ok: bool = True) -> RequestRecord:
    """A finished request: TPOT = (e2e - ttft) / (tokens - 1)."""
    if not ok:
        return RequestRecord(index, sent_s, sent_s, 100, tokens, ok=False, error_kind="dropped")
    return RequestRecord(index, sent_s, sent_s, 100, tokens, ok=True, ttft_s=ttft_s, e2e_s=e2e_s,
                         output_tokens=tokens)


def sample(t_s: float, p: tuple[int, int] = (1, 1), d: tuple[int, int] = (1, 1),
           decision: DecisionSample | None = None) -> PoolSample:
    """A sample with (ready, desired) per role."""
    return PoolSample(t_s, p[0], p[1], d[0], d[1], decision=decision)


def decision(time: str, p: int, d: int, reason: str, message: str = "") -> DecisionSample:
    return DecisionSample(time, p, d, reason, message)


# -- sampling the status ----------------------------------------------------------------------


def test_a_sample_reads_ready_desired_queue_and_the_last_decision() -> None:
    obj = {"status": {
        "prefill": {"replicas": 2, "readyReplicas": 1, "desiredReplicas": 3},
        "decode": {"replicas": 1, "readyReplicas": 1, "desiredReplicas": 1},
        "autoscaler": {"observed": {"prefillQueue": 12.0},
                       "lastDecision": {"time": "2025-01-01T00:00:05Z", "prefill": 3, "decode": 1,
                                        "reason": "PrefillQueueing", "message": "P 1->3"}},
    }}
    assert sample_from_status(obj, 4.5) == PoolSample(
        4.5, 1, 3, 1, 1, 12.0, DecisionSample("2025-01-01T00:00:05Z", 3, 1, "PrefillQueueing", "P 1->3"))


@pytest.mark.parametrize("obj", [{}, {"status": {}}, {"status": {"prefill": None, "autoscaler": {}}}])
def test_a_sample_of_an_object_without_status_is_empty(obj: dict[str, Any]) -> None:
    assert sample_from_status(obj, 0.0) == PoolSample(0.0, 0, 0, 0, 0, None, None)


def test_desired_falls_back_to_the_replicas_the_pool_has() -> None:
    obj = {"status": {"prefill": {"replicas": 2, "readyReplicas": 2}, "decode": {"replicas": 1}}}
    assert (sample_from_status(obj, 0.0).prefill_desired, sample_from_status(obj, 0.0).decode_desired) == (2, 1)


# -- latency so far ---------------------------------------------------------------------------


def test_latency_so_far_is_none_before_any_request_finishes() -> None:
    assert latency_so_far([]) == latency_so_far([record(0, 0.0, ok=False)]).__class__(0, 0, None, None)
    assert latency_so_far([record(0, 0.0, ok=False)]).failed == 1


def test_latency_so_far_is_the_p90_of_the_succeeded_requests() -> None:
    # TTFT 0.1 ... 1.0 s; TPOT (1.1 - ttft) / 10.
    records = [record(i, i, ttft_s=(i + 1) / 10, e2e_s=1.1) for i in range(10)] + [record(10, 10.0, ok=False)]
    latency = latency_so_far(records)
    assert (latency.finished, latency.failed) == (11, 1)
    assert latency.ttft_p90_ms == pytest.approx(910.0)
    assert latency.tpot_p90_ms == pytest.approx(91.0)


def test_one_token_answers_have_no_tpot() -> None:
    assert latency_so_far([record(0, 0.0, tokens=1)]).tpot_p90_ms is None


# -- summary maths ----------------------------------------------------------------------------


def test_replicas_before_peak_after_are_the_desired_sizes() -> None:
    samples = [sample(0, (1, 1), (1, 1)), sample(3, (1, 3), (1, 1)), sample(6, (3, 3), (1, 2)), sample(9, (2, 2))]
    assert replica_summary(samples) == {"prefill": {"before": 1, "peak": 3, "after": 2},
                                        "decode": {"before": 1, "peak": 2, "after": 1}}
    assert replica_summary([]) == {"prefill": {"before": 0, "peak": 0, "after": 0},
                                   "decode": {"before": 0, "peak": 0, "after": 0}}


def test_scaling_actions_count_each_role_that_changed() -> None:
    samples = [sample(0), sample(3, (1, 3), (1, 2)), sample(6, (3, 3), (2, 2)), sample(9, (3, 2), (2, 2))]
    assert scaling_actions(samples) == 3
    assert scaling_actions(samples[:1]) == 0


def test_gpu_hours_hold_each_samples_ready_count_until_the_next() -> None:
    samples = [sample(0, (1, 1), (1, 1)), sample(1800, (3, 3), (1, 1)), sample(3600, (3, 3), (1, 1))]
    assert gpu_hours(samples) == pytest.approx(2 * 0.5 + 4 * 0.5)
    assert gpu_hours(samples[:1]) == 0.0


def test_decisions_are_deduplicated_by_time_and_folded_when_they_repeat() -> None:
    first = decision("t1", 1, 1, "NoTraffic")
    grow = decision("t2", 2, 1, "PrefillQueueing", "P 1->2")
    bound_1 = decision("t3", 4, 1, "ReplicaBounds", "P 2->4")
    bound_2 = decision("t4", 4, 1, "ReplicaBounds", "P 4->4")
    samples = [sample(0), sample(3, decision=first), sample(6, decision=first), sample(9, decision=grow),
               sample(12, decision=bound_1), sample(15, decision=bound_2), sample(18, decision=bound_2)]
    runs = [(r.t_s, r.prefill, r.decode, r.reason, r.message, r.count) for r in decision_runs(samples)]
    assert runs == [(3, 1, 1, "NoTraffic", "", 1), (9, 2, 1, "PrefillQueueing", "P 1->2", 1),
                    (12, 4, 1, "ReplicaBounds", "P 2->4", 2)]


# -- plot data --------------------------------------------------------------------------------


def test_the_load_timeline_bins_requests_by_send_time() -> None:
    records = [record(0, 0.5), record(1, 1.0, ttft_s=0.9), record(2, 6.0), record(3, 7.0, ok=False),
               record(4, 19.9)]
    line = load_timeline(records, duration_s=20.0, slo=SloMs(ttft_ms=500, tpot_ms=50), bins=4)
    assert line["bin_s"] == 5 and line["t_s"] == [0, 5, 10, 15]
    assert line["requests_rps"] == [0.4, 0.4, 0.0, 0.2]
    assert line["good_rps"] == [0.2, 0.2, 0.0, 0.2]     # TTFT 900 ms and a dropped request miss
    assert line["ttft_p90_ms"][0] == pytest.approx(820.0) and line["ttft_p90_ms"][2] is None
    assert line["tpot_p90_ms"][1] == pytest.approx(40.0)


def test_a_request_sent_after_the_planned_end_lands_in_the_last_bin() -> None:
    line = load_timeline([record(0, 25.0)], duration_s=20.0, slo=SLO, bins=4)
    assert line["t_s"] == [0, 5, 10, 15, 20] and line["requests_rps"][-1] == 0.2


def test_the_report_fills_in_the_cluster_side_keys() -> None:
    samples = [sample(0), sample(1800, (1, 2), (1, 1)), sample(3600, (2, 2), (1, 1))]
    bench = {"requests": 4, "attainment": 0.5, "good_requests": 2, "slo": {"ttft_ms": 500, "tpot_ms": 15}}
    report = demo_report(bench, samples, [record(0, 0.0)], [{"type": "Normal", "reason": "Created"}],
                         {"load_s": 10.0}, SLO)
    assert report["gpu_hours"] == pytest.approx(2.0) and report["goodput_per_gpu_hour"] == pytest.approx(1.0)
    assert report["scaling_actions"] == 1 and report["attainment"] == 0.5
    assert report["replicas"]["prefill"] == {"before": 1, "peak": 2, "after": 2}
    assert report["replica_timeline"]["prefill_ready"] == [1, 1, 2]
    assert report["events"] == [{"type": "Normal", "reason": "Created"}]


# -- what is printed --------------------------------------------------------------------------


def test_step_detail_and_failure_lines() -> None:
    assert view.step_line(3.14159, 2, 7, "starting") == "[   3.1s] 2/7 starting"
    assert view.detail_line("x") == " " * 10 + "x"
    message = view.failure_message(3, 7, "installing", "helm exited with 1", [Path("/s/helm.log"), Path("/s/op")])
    assert message.splitlines() == ["xpyd demo: step 3/7 (installing) failed: helm exited with 1",
                                    "  read /s/helm.log", "  read /s/op"]


def test_the_live_line_has_every_figure() -> None:
    current = PoolSample(12.34, 1, 2, 1, 1, 3.0, decision("t", 2, 1, "PrefillQueueing", "P 1->2"))
    line = view.live_line(current, latency_so_far([record(0, 0.0, ttft_s=0.25, e2e_s=0.3)]), 100)
    assert line == (" " * 10 + "t= 12.3s  P 1/2  D 1/1  done 1/100  TTFT p90 250 ms  TPOT p90 5.0 ms  queue 3.0  "
                    "| PrefillQueueing: P 1->2")


def test_the_live_line_before_anything_is_known_and_clipped() -> None:
    empty = PoolSample(0.0, 1, 1, 1, 1)
    line = view.live_line(empty, latency_so_far([]), 10)
    assert "TTFT p90 -" in line and "queue -" in line and line.endswith("no decision yet")
    long = PoolSample(0.0, 1, 1, 1, 1, decision=decision("t", 1, 1, "Why", "x" * 500))
    clipped = view.live_line(long, latency_so_far([]), 10, width=80)
    assert len(clipped) == 80 and clipped.endswith("...")


def test_the_live_block_fits_the_terminal() -> None:
    current = PoolSample(30.0, 3, 4, 1, 1, 0.0, decision("t", 4, 1, "ReplicaBounds", "P 3->4 " + "y" * 200))
    block = view.live_block(current, latency_so_far([record(0, 0.0), record(1, 0.0, ok=False)]), 50, 60.0,
                            {"ttft_ms": 500, "tpot_ms": 15}, width=120)
    assert len(block) == 4 and all(len(line) <= 120 for line in block) and block[3].endswith("...")
    assert "prefill 3/4" in block[1] and "decode 1/1" in block[1]
    assert "SLO 500" in block[2] and "prefill queue 0.0 requests" in block[2]
    assert "2/50 requests done, 1 failed" in block[0]


def test_redraw_moves_up_over_the_previous_block() -> None:
    assert view.redraw(["a", "b"], 0) == "\x1b[2Ka\n\x1b[2Kb\n"
    assert view.redraw(["a"], 2) == "\x1b[2F\x1b[2Ka\n"


def _report() -> dict[str, Any]:
    samples = [sample(0.0), sample(5.0, (1, 2)), sample(10.0, (2, 2), decision=decision("t", 2, 1, "PrefillQueueing",
                                                                                        "P 1->2"))]
    records = [record(i, i * 0.5, ttft_s=0.2 + i / 10) for i in range(20)]
    bench = {"requests": 20, "attainment": 0.4, "good_requests": 8, "succeeded": 20, "failed": 0,
             "duration_s": 10.4, "attainment_ttft": 0.4, "attainment_tpot": 1.0,
             "ttft_ms": {"p50": 1150.0, "p90": 1910.0, "p99": 2081.0},
             "tpot_ms": {"p50": 30.0, "p90": 40.0, "p99": 43.0},
             "slo": {"ttft_ms": 500.0, "tpot_ms": 15.0}}
    events = [{"type": "Normal", "reason": "PrefillQueueing", "message": "prefill 1->2", "count": 1}]
    return demo_report(bench, samples, records, events, {"name": "llama-8b", "trace_name": "t.csv", "speedup": 12.0,
                                                          "load_s": 9.5}, SLO)


def test_the_summary_lines() -> None:
    lines = view.summary_lines(_report(), Path("d.png"), Path("d.json"))
    assert lines[0] == "20 requests of t.csv (x12) in 10.4 s: 20 succeeded, 0 failed"
    assert lines[1].startswith("attainment 40.0%  (TTFT <= 500 ms: 40.0%")
    assert "TTFT  p50 1,150 ms  p90 1,910 ms  p99 2,081 ms" in lines
    assert "prefill  replicas 1 before, 2 peak, 2 after" in lines
    assert "  t= 10.0s  P 2 D 1  PrefillQueueing: P 1->2" in lines
    assert "  Normal  PrefillQueueing: prefill 1->2" in lines
    assert lines[-1] == "plot d.png   summary d.json"


def test_keep_lines_say_how_to_use_and_stop_the_cluster() -> None:
    lines = view.keep_lines(Path("/s/kubeconfig"), Path("/b"), Path("/s"), "llama-8b")
    assert "  export KUBECONFIG=/s/kubeconfig PATH=/b:$PATH" in lines
    assert "  kubectl get xpyd -A" in lines and "  xpyd cluster down --state-dir /s" in lines


def test_the_plot_is_a_png(tmp_path: Path) -> None:
    path = tmp_path / "out" / "demo.png"
    write_plot(_report(), path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1100, 900) and len(data) > 20_000


# -- the sample pool and the cluster reads ----------------------------------------------------


def test_the_sample_pool_is_a_valid_autoscaled_serving() -> None:
    from xpyd.api.load import load_servings

    manifest = serving_manifest(DemoPool(), "http://127.0.0.1:9090")
    assert manifest["spec"]["autoscaling"]["mode"] == "Auto"
    assert manifest["spec"]["autoscaling"]["prometheus"]["url"] == "http://127.0.0.1:9090"
    import yaml

    (serving,) = load_servings(yaml.safe_dump(manifest), source="demo")
    autoscaling = serving.spec.autoscaling
    assert autoscaling is not None
    assert (autoscaling.prefill.max_replicas, autoscaling.decode.max_replicas) == (8, 4)


def _pod(ip: str, ready: bool) -> dict[str, Any]:
    return {"spec": {"containers": [{"ports": [{"containerPort": 8000}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_the_proxy_url_is_a_ready_pods_loopback_address() -> None:
    assert proxy_url([_pod("127.0.0.9", False), _pod("127.0.0.10", True)]) == "http://127.0.0.10:8000"
    with pytest.raises(DemoFailed):
        proxy_url([_pod("127.0.0.9", False)])
    from xpyd.common.netguard import NonLoopbackAddress

    with pytest.raises(NonLoopbackAddress):
        proxy_url([_pod("10.0.0.3", True)])


def test_events_are_the_servings_oldest_first() -> None:
    events = [
        {"involvedObject": {"kind": "DisaggregatedServing"}, "type": "Normal", "reason": "B", "message": "b",
         "lastTimestamp": "2025-01-01T00:00:02Z", "count": 2},
        {"involvedObject": {"kind": "Pod"}, "type": "Normal", "reason": "Scheduled", "message": "p"},
        {"involvedObject": {"kind": "DisaggregatedServing"}, "type": "Warning", "reason": "A", "message": "a",
         "metadata": {"creationTimestamp": "2025-01-01T00:00:01Z"}},
    ]
    assert [(e["reason"], e["count"]) for e in serving_events(events)] == [("A", 1), ("B", 2)]


def test_the_command_is_registered_with_its_defaults() -> None:
    args = build_parser().parse_args(["demo"])
    assert (args.keep, args.speedup, args.duration, args.plot) == (False, 4.0, None, Path("build/demo/demo.png"))
    assert args.trace.name == "azure_conv_2023_600s_240s.csv" and args.trace.exists()
