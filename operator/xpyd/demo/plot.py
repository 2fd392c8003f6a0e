"""The demo's PNG: load, P and D replicas, and TTFT / TPOT p90 over the load's time."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from xpyd.plotting import ROLE_COLORS, LatencyPanel, Series, TimelinePlot, write_timeline_plot

LATENCY_COLOR = "#3182bd"


def write_plot(report: Mapping[str, Any], path: Path) -> None:
    """Write the plot of a `demo_report` to `path`."""
    load, replicas = report["load_timeline"], report["replica_timeline"]
    edges = [*load["t_s"], load["t_s"][-1] + load["bin_s"]]
    end_s = max(edges[-1], *replicas["t_s"]) if replicas["t_s"] else edges[-1]
    slo, settings = report["slo"], report["demo"]
    role_lines = [line for role, color in ROLE_COLORS.items() for line in (
        Series(f"{role} desired", replicas[f"{role}_desired"], color, width=1.2, dashed=True),
        Series(f"{role} ready", replicas[f"{role}_ready"], color, width=2.2))]
    write_timeline_plot(TimelinePlot(
        title=f"xpyd demo: {settings['trace_name']} x{settings['speedup']:g} through {settings['name']} "
              f"(autoscaling Auto)   attainment {report['attainment']:.1%}",
        edges=edges,
        sent=Series("sent (missed an SLO)", load["requests_rps"], "#fcbba1"),
        good=Series("met both SLOs", load["good_rps"], "#74c476"),
        replica_times=[*replicas["t_s"], end_s] if replicas["t_s"] else [],
        replicas=role_lines,
        latency=(LatencyPanel("TTFT p90", slo["ttft_ms"], [Series("TTFT p90", load["ttft_p90_ms"], LATENCY_COLOR)]),
                 LatencyPanel("TPOT p90", slo["tpot_ms"], [Series("TPOT p90", load["tpot_p90_ms"], LATENCY_COLOR)])),
        xlabel=f"seconds since the load started; latencies of the requests sent in each {load['bin_s']} s bin",
        x_end=end_s,
    ), path)
