"""The one figure the simulator's reports and the demo both draw: load (and the part of it that met
the SLOs), P and D replicas, TTFT and TPOT against their SLO lines and, when given, the prefix-cache
hit rate per role, over one time axis (matplotlib, Agg backend, written as a PNG)."""

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
    """What the panels show. `edges` bound the load, latency and hit-rate bins; the replica series step
    at `replica_times` (one more entry than each series: where the last step ends). `hit_rate` (shares
    0-1 per bin) adds a fifth panel, `height_ratios` then taking a fifth entry (0.8 when it has four)."""

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
    height_ratios: tuple[float, ...] = (1, 1, 1, 1)
    size: tuple[float, float] = (11, 9)
    dpi: int = 100
    hit_rate: Sequence[Series] = ()


def _finite(values: Sequence[float | None]) -> list[float]:
    return [v if v is not None else math.nan for v in values]


def write_timeline_plot(plot: TimelinePlot, path: str | Path) -> None:
    """Draw `plot` and write it to `path` as a PNG (parent folders are created)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot, ticker

    ratios = list(plot.height_ratios)
    if plot.hit_rate and len(ratios) == 4:
        ratios.append(0.8)
    figure, axes = pyplot.subplots(len(ratios), 1, figsize=plot.size, sharex=True,
                                   gridspec_kw={"height_ratios": ratios})
    load_axis, replica_axis, *latency_axes = axes[:4]
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
    if plot.hit_rate:
        hit_axis = axes[4]
        for series in plot.hit_rate:
            hit_axis.stairs([100.0 * v for v in _finite(series.values)], plot.edges, color=series.color,
                            linewidth=series.width, baseline=None, label=series.label)
        hit_axis.set_ylim(0, 100)
        hit_axis.set_ylabel("prefix-cache hits (%)")
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
