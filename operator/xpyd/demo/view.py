"""What the demo prints, as pure functions of its data: step lines, the live view, the failure
message and the summary. Nothing here writes; `xpyd.demo.main` does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from xpyd.demo.timeline import LatencySoFar, PoolSample

INDENT = " " * 10
"""Detail lines sit under the step text (after the `[ 12.3s] ` prefix)."""


def step_line(elapsed_s: float, number: int, total: int, text: str) -> str:
    """`[  12.3s] 2/7 text`: one line per step, with the seconds since the demo started."""
    return f"[{elapsed_s:6.1f}s] {number}/{total} {text}"


def detail_line(text: str) -> str:
    """A line of detail under the current step."""
    return f"{INDENT}{text}"


def failure_message(number: int, total: int, title: str, error: str, logs: Sequence[Path]) -> str:
    """Which step failed, why, and which log files to read."""
    lines = [f"xpyd demo: step {number}/{total} ({title}) failed: {error}"]
    lines += [f"  read {log}" for log in logs]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f} ms" if value >= 100 else f"{value:.1f} ms"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:max(width - 3, 0)] + "..."


def _decision(sample: PoolSample) -> str:
    decision = sample.decision
    if decision is None:
        return "no decision yet"
    return f"{decision.reason}: {decision.message}" if decision.message else decision.reason


def live_line(sample: PoolSample, latency: LatencySoFar, planned: int, width: int = 160) -> str:
    """One line per sample (when stdout is not a terminal): time, P and D ready/desired, requests
    finished, TTFT and TPOT p90 so far, the prefill queue and the last decision."""
    queue = "-" if sample.prefill_queue is None else f"{sample.prefill_queue:.1f}"
    text = (f"t={sample.t_s:5.1f}s  P {sample.prefill_ready}/{sample.prefill_desired}  "
            f"D {sample.decode_ready}/{sample.decode_desired}  done {latency.finished}/{planned}  "
            f"TTFT p90 {_ms(latency.ttft_p90_ms)}  TPOT p90 {_ms(latency.tpot_p90_ms)}  queue {queue}  "
            f"| {_decision(sample)}")
    return _clip(INDENT + text, width)


def live_block(sample: PoolSample, latency: LatencySoFar, planned: int, load_s: float,
               slo: Mapping[str, float], width: int = 100) -> list[str]:
    """The live view on a terminal: a few lines redrawn in place every sample."""
    queue = "-" if sample.prefill_queue is None else f"{sample.prefill_queue:.1f} requests"
    failed = f", {latency.failed:,} failed" if latency.failed else ""
    lines = [
        f"load      t={sample.t_s:5.1f}s (arrivals over {load_s:.0f} s)   {latency.finished:,}/{planned:,} requests "
        f"done{failed}",
        f"replicas  prefill {sample.prefill_ready}/{sample.prefill_desired}   "
        f"decode {sample.decode_ready}/{sample.decode_desired}   (ready/desired)",
        f"latency   TTFT p90 {_ms(latency.ttft_p90_ms)} (SLO {slo['ttft_ms']:g})   "
        f"TPOT p90 {_ms(latency.tpot_p90_ms)} (SLO {slo['tpot_ms']:g})   prefill queue {queue}",
        f"decision  {_decision(sample)}",
    ]
    return [_clip(INDENT + line, width) for line in lines]


def redraw(lines: Sequence[str], previous: int) -> str:
    """Terminal text that replaces the `previous` lines just written with `lines` (ANSI: cursor up,
    erase line)."""
    return f"\x1b[{previous}F" * (previous > 0) + "".join(f"\x1b[2K{line}\n" for line in lines)


def summary_lines(report: Mapping[str, Any], plot: Path, summary_json: Path, width: int = 150) -> list[str]:
    """The closing summary: load, attainment, latency percentiles, replicas, decisions, Events (their
    messages clipped to `width`: the JSON has them whole) and where the plot and the JSON are."""
    slo = report["slo"]

    def percentiles(stats: Mapping[str, float | None]) -> str:
        return "  ".join(f"{q} {_ms(stats.get(q))}" for q in ("p50", "p90", "p99"))

    settings = report["demo"]
    lines = [
        f"{report['requests']:,} requests of {settings['trace_name']} (x{settings['speedup']:g}) in "
        f"{report['duration_s']:,.1f} s: {report['succeeded']:,} succeeded, {report['failed']:,} failed",
        f"attainment {report['attainment']:.1%}  (TTFT <= {slo['ttft_ms']:g} ms: {report['attainment_ttft']:.1%}, "
        f"TPOT <= {slo['tpot_ms']:g} ms: {report['attainment_tpot']:.1%})",
        f"TTFT  {percentiles(report['ttft_ms'])}",
        f"TPOT  {percentiles(report['tpot_ms'])}",
    ]
    for role, counts in report["replicas"].items():
        lines.append(f"{role:<8} replicas {counts['before']} before, {counts['peak']} peak, {counts['after']} after")
    hours, per_hour = report["gpu_hours"], report["goodput_per_gpu_hour"]
    lines.append(f"{report['scaling_actions']} scaling actions, {hours * 60:.1f} GPU-minutes"
                 + (f", {per_hour:,.0f} good requests per GPU-hour" if per_hour is not None else ""))
    lines.append("decisions (load time: sizes, reason, first message):")
    lines += [_clip(f"  t={run['t_s']:5.1f}s  P {run['prefill']} D {run['decode']}  {run['reason']}"
                    + (f" (x{run['count']})" if run["count"] > 1 else "")
                    + (f": {run['message']}" if run["message"] else ""), width)
              for run in report["decisions"]] or ["  none"]
    lines.append("Events of the DisaggregatedServing:")
    lines += [_clip(f"  {event['type']:<7} {event['reason']}"
                    + (f" (x{event['count']})" if event.get("count", 1) > 1 else "") + f": {event['message']}", width)
              for event in report["events"]] or ["  none"]
    lines.append(f"plot {plot}   summary {summary_json}")
    return lines


def keep_lines(kubeconfig: Path, bin_dir: Path, state_dir: Path, name: str) -> list[str]:
    """How to use the cluster `--keep` left running, and how to stop it."""
    return [
        "the cluster is still running:",
        f"  export KUBECONFIG={kubeconfig} PATH={bin_dir}:$PATH",
        "  kubectl get xpyd -A",
        f"  kubectl describe xpyd {name}",
        f"  xpyd cluster down --state-dir {state_dir}",
    ]
