"""The demo's PNG: load, P and D replicas, and TTFT / TPOT p90 over the load's time."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROLE_COLORS = {"prefill": "#d95f02", "decode": "#1b9e77"}


def write_plot(report: Mapping[str, Any], path: Path) -> None:
    """Write the plot of a `demo_report` to `path` (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot, ticker

    load, replicas = report["load_timeline"], report["replica_timeline"]
    edges = [*load["t_s"], load["t_s"][-1] + load["bin_s"]]
    end_s = max(edges[-1], *replicas["t_s"]) if replicas["t_s"] else edges[-1]
    slo = report["slo"]

    figure, axes = pyplot.subplots(4, 1, figsize=(11, 9), sharex=True,
                                   gridspec_kw={"height_ratios": [1, 1, 1, 1]})
    load_axis, replica_axis, ttft_axis, tpot_axis = axes
    load_axis.stairs(load["requests_rps"], edges, fill=True, color="#fcbba1", label="sent (missed an SLO)")
    load_axis.stairs(load["good_rps"], edges, fill=True, color="#74c476", label="met both SLOs")
    load_axis.set_ylabel("load (req/s)")
    load_axis.set_ylim(bottom=0)

    times = [*replicas["t_s"], end_s] if replicas["t_s"] else []
    peak = 1
    for role, color in ROLE_COLORS.items():
        if not times:
            break
        ready, desired = replicas[f"{role}_ready"], replicas[f"{role}_desired"]
        peak = max(peak, *ready, *desired)
        replica_axis.stairs(desired, times, color=color, linewidth=1.2, linestyle="--", baseline=None,
                            label=f"{role} desired")
        replica_axis.stairs(ready, times, color=color, linewidth=2.2, baseline=None, label=f"{role} ready")
    replica_axis.set_ylabel("replicas")
    replica_axis.set_ylim(0, peak + 1)
    replica_axis.yaxis.set_major_locator(ticker.MaxNLocator(integer=True))

    for axis, key, label, target in ((ttft_axis, "ttft_p90_ms", "TTFT p90", slo["ttft_ms"]),
                                     (tpot_axis, "tpot_p90_ms", "TPOT p90", slo["tpot_ms"])):
        values = [v if v is not None else math.nan for v in load[key]]
        axis.stairs(values, edges, color="#3182bd", linewidth=1.8, baseline=None, label=label)
        axis.axhline(target, color="#e41a1c", linestyle="--", linewidth=1.4, label=f"SLO {target:g} ms")
        finite = [v for v in values if math.isfinite(v)] + [target]
        axis.set_ylim(0, max(finite) * 1.15)
        axis.set_ylabel(f"{label} (ms)")
    for axis in axes:
        axis.grid(True, alpha=0.3)
        axis.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    tpot_axis.set_xlabel(f"seconds since the load started; latencies of the requests sent in each "
                         f"{load['bin_s']} s bin")
    tpot_axis.set_xlim(0, end_s)
    settings = report["demo"]
    figure.suptitle(f"xpyd demo: {settings['trace_name']} x{settings['speedup']:g} through {settings['name']} "
                    f"(autoscaling Auto)   attainment {report['attainment']:.1%}", fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
