"""The one figure the simulator's reports and the demo both draw: load (and the part of it that met
the SLOs), P and D replicas, and TTFT and TPOT against their SLO lines, over one time axis
(matplotlib, Agg backend, written as a PNG)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROLE_COLORS = {"prefill": "#d95f02", "decode": "#1b9e77"}
SLO_COLOR = "#e41a1c"


@dataclass(frozen=True)
class Series:
    """One step line (values per bin; None is a gap)."""

    label: str
    values: Sequence[float | None]
    color: str
    width: float = 1.8
    dashed: bool = False


@dataclass(frozen=True)
class LatencyPanel:
    """TTFT or TPOT: its series (quantiles) and the SLO target, in milliseconds."""

    label: str
    target_ms: float
    series: Sequence[Series]


@dataclass(frozen=True)
class TimelinePlot:
    """What the four panels show. `edges` bound the load and latency bins; the replica series step
    at `replica_times` (one more entry than each series: where the last step ends)."""

    title: str
    edges: Sequence[float]
    sent: Series
    good: Series
    replica_times: Sequence[float]
    replicas: Sequence[Series]
    latency: tuple[LatencyPanel, LatencyPanel]
    xlabel: str
    x_end: float
    log_latency: bool = False
    height_ratios: tuple[float, float, float, float] = (1, 1, 1, 1)
    size: tuple[float, float] = (11, 9)
    dpi: int = 100


def _finite(values: Sequence[float | None]) -> list[float]:
    return [v if v is not None else math.nan for v in values]


def write_timeline_plot(plot: TimelinePlot, path: str | Path) -> None:
    """Draw `plot` and write it to `path` as a PNG (parent folders are created)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot, ticker

    figure, axes = pyplot.subplots(4, 1, figsize=plot.size, sharex=True,
                                   gridspec_kw={"height_ratios": list(plot.height_ratios)})
    load_axis, replica_axis, *latency_axes = axes
    for series in (plot.sent, plot.good):
        load_axis.stairs(_finite(series.values), plot.edges, fill=True, color=series.color, label=series.label)
    load_axis.set_ylabel("load (req/s)")
    load_axis.set_ylim(bottom=0)

    peak = 1.0
    for series in plot.replicas if plot.replica_times else ():
        values = _finite(series.values)
        peak = max(peak, *(v for v in values if math.isfinite(v)))
        replica_axis.stairs(values, plot.replica_times, color=series.color, linewidth=series.width,
                            linestyle="--" if series.dashed else "-", baseline=None, label=series.label)
    replica_axis.set_ylabel("replicas")
    replica_axis.set_ylim(0, peak + 1)
    replica_axis.yaxis.set_major_locator(ticker.MaxNLocator(integer=True))

    for axis, panel in zip(latency_axes, plot.latency, strict=True):
        seen = [panel.target_ms]
        for series in panel.series:
            values = _finite(series.values)
            seen += [v for v in values if math.isfinite(v) and v > 0]
            axis.stairs(values, plot.edges, color=series.color, linewidth=series.width, baseline=None,
                        label=series.label)
        axis.axhline(panel.target_ms, color=SLO_COLOR, linestyle="--", linewidth=1.5,
                     label=f"SLO {panel.target_ms:g} ms")
        if plot.log_latency:
            axis.set_yscale("log")
            axis.set_ylim(min(seen) / 1.5, max(seen) * 1.5)
            axis.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            axis.yaxis.set_major_formatter(ticker.FuncFormatter(
                lambda value, _: f"{value:,.0f}" if value >= 1 else f"{value:g}"))
            axis.yaxis.set_minor_formatter(ticker.NullFormatter())
            axis.set_ylabel(f"{panel.label} (ms, log)")
        else:
            axis.set_ylim(0, max(seen) * 1.15)
            axis.set_ylabel(f"{panel.label} (ms)")
    for axis in axes:
        axis.grid(True, which="major", alpha=0.3)
        axis.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    axes[-1].set_xlabel(plot.xlabel)
    axes[-1].set_xlim(0, plot.x_end)
    figure.suptitle(plot.title, fontsize=11)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=plot.dpi)
    pyplot.close(figure)
