"""How well does the autoscaler see the load a start-up ahead? The forecast's error per workload.

    python benchmarks/forecast_error.py [--workloads conv ...] [--startup 120] [--duration S]
                                        [--out benchmarks/results]

`decide()` sizes for the load when replicas ordered now serve: Holt's linear trend
(`xpyd.autoscaler.forecast.HoltForecaster`, the default) on the request rate and on OSL, read at the
sizing horizon (`AutoscalerConfig.horizon_s`: start-up, one interval, half a window), taking the
larger of it, the window's value and the smoothed level; ISL as seen, the larger of the window's mean
and its smoothed level, not carried along its trend. This replays each workload of `autoscaler_eval.py` as
the autoscaler's windows would see it (60 s windows every 30 s, by arrival: vLLM's histograms count
a request when it finishes, a little later) and compares what each way of reading a series predicts
with the window that ends a horizon later.

Per workload and series it prints the bias (mean of predicted / actual - 1), the mean absolute error,
the share of decisions predicting more than 10% too little (what the headroom must cover) and more
than 25% too much (GPUs paid for nothing until the scale-down window lets them go). The rows:

- `rate`: the rate as sized (the larger of now and its Holt forecast);
- `ISL, as seen`, `OSL, as seen`: the larger of the window's mean and the smoothed level (ISL as
  sized), and `ISL, trend`, `OSL, trend`: the larger of those and the Holt forecast (OSL as sized;
  ISL as `decide()` sized it before);
- `prompt tok/s`: prefill's demand, the rate as sized times ISL as seen, and `prompt tok/s, ISL
  trend` times ISL along its trend: two extrapolations multiplied compound at the top of every rise.

The table also goes to `<out>/forecast_error.md`, with the command that made it.
"""

from __future__ import annotations

import argparse
import bisect
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from pathlib import Path

import autoscaler_eval as ev  # beside this script: its workloads

from xpyd.autoscaler.config import AutoscalerConfig, sizing_horizon_s
from xpyd.autoscaler.forecast import HoltForecaster, SeriesState, ahead, seen
from xpyd.traces import TraceRequest

HERE = Path(__file__).resolve().parent
#: The autoscaler's default metrics window and decision interval.
_DEFAULTS = {f.name: f.default for f in fields(AutoscalerConfig)}
WINDOW_S = float(_DEFAULTS["window_s"])  # type: ignore[arg-type]
INTERVAL_S = float(_DEFAULTS["interval_s"])  # type: ignore[arg-type]
#: Decisions before any is judged: Holt's trend needs a few samples to mean anything.
WARMUP = 4


def horizon_s(startup_s: float) -> float:
    """The autoscaler's sizing horizon at `startup_s` and the default window and interval."""
    return sizing_horizon_s(startup_s, INTERVAL_S, WINDOW_S)


#: A window's (rate, mean ISL, mean OSL).
Window = tuple[float, float, float]


def windows(requests: Sequence[TraceRequest]) -> dict[float, Window]:
    """The windows a decision every `INTERVAL_S` reads, by the time each ends (those with no request left out)."""
    arrivals = [r.arrival_s for r in requests]
    out: dict[float, Window] = {}
    end = WINDOW_S
    while requests and end <= arrivals[-1]:
        seen = requests[bisect.bisect_left(arrivals, end - WINDOW_S):bisect.bisect_left(arrivals, end)]
        if seen:
            out[end] = (len(seen) / WINDOW_S, statistics.fmean(r.isl for r in seen),
                        statistics.fmean(r.osl for r in seen))
        end += INTERVAL_S
    return out


def errors(series: dict[float, Window], horizon_s: float) -> dict[str, list[float]]:
    """Per row, predicted / actual - 1 at every decision whose horizon ends on a window."""
    forecaster = HoltForecaster()
    rate, isl, osl = SeriesState(), SeriesState(), SeriesState()
    rows: dict[str, list[float]] = {name: [] for name in ROWS}
    for end, (rate_now, isl_now, osl_now) in sorted(series.items()):
        rate = forecaster.update(rate, end, rate_now)
        isl = forecaster.update(isl, end, isl_now)
        osl = forecaster.update(osl, end, osl_now)
        actual = series.get(end + horizon_s)
        if actual is None or rate.samples < WARMUP:
            continue
        sized_rate = max(rate_now, forecaster.predict(rate, horizon_s))
        isl_seen, isl_ahead = seen(isl, isl_now), ahead(forecaster, isl, isl_now, horizon_s)
        actual_rate, actual_isl, actual_osl = actual
        for name, predicted, truth in (
                ("rate", sized_rate, actual_rate),
                ("ISL, as seen", isl_seen, actual_isl),
                ("ISL, trend", isl_ahead, actual_isl),
                ("OSL, as seen", seen(osl, osl_now), actual_osl),
                ("OSL, trend", ahead(forecaster, osl, osl_now, horizon_s), actual_osl),
                ("prompt tok/s", sized_rate * isl_seen, actual_rate * actual_isl),
                ("prompt tok/s, ISL trend", sized_rate * isl_ahead, actual_rate * actual_isl)):
            rows[name].append(predicted / truth - 1.0)
    return rows


ROWS = ("rate", "ISL, as seen", "ISL, trend", "OSL, as seen", "OSL, trend", "prompt tok/s", "prompt tok/s, ISL trend")
COLUMNS: tuple[tuple[str, Callable[[list[float]], float]], ...] = (
    ("bias", statistics.fmean),
    ("mean abs error", lambda e: statistics.fmean(abs(x) for x in e)),
    ("under by >10%", lambda e: sum(x < -0.10 for x in e) / len(e)),
    ("over by >25%", lambda e: sum(x > 0.25 for x in e) / len(e)),
)


def table(workloads: Sequence[ev.Workload], horizon_s: float) -> list[str]:
    lines = ["| workload | series | decisions | " + " | ".join(name for name, _ in COLUMNS) + " |",
             "|---|---|---:|" + "---:|" * len(COLUMNS)]
    for workload in workloads:
        rows = errors(windows(workload.load()), horizon_s)
        for name in ROWS:
            found = rows[name]
            cells = [f"{value(found):+.1%}" if i == 0 else f"{value(found):.1%}"
                     for i, (_, value) in enumerate(COLUMNS)] if found else ["-"] * len(COLUMNS)
            lines.append(f"| {workload.name} | {name} | {len(found)} | " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=[w.name for w in ev.WORKLOADS],
                        choices=[w.name for w in ev.WORKLOADS])
    parser.add_argument("--startup", type=float, default=120.0, metavar="S", help="replicas' start-up delay")
    parser.add_argument("--duration", type=float, default=None, metavar="S", help="each workload's first S seconds")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    if not (args.startup >= 0 and (args.duration is None or args.duration > 0)):
        parser.error("need --startup >= 0 and --duration > 0")
    horizon = horizon_s(args.startup)
    if not math.isclose(horizon % INTERVAL_S, 0.0) and not math.isclose(horizon % INTERVAL_S, INTERVAL_S):
        parser.error(f"--startup {args.startup:g}: the horizon ({horizon:g} s) must end on a decision "
                     f"(a multiple of {INTERVAL_S:g} s)")
    chosen = [replace(w, duration_s=args.duration) for w in ev.WORKLOADS if w.name in args.workloads]
    text = f"Horizon {horizon:g} s ({args.startup:g} s start-up):\n\n" + "\n".join(table(chosen, horizon)) + "\n"
    sys.stdout.write(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python3 benchmarks/forecast_error.py", *sys.argv[1:]])
    (out / "forecast_error.md").write_text(f"# The forecast's error a start-up ahead\n\n`{command}` (what each column "
                                           f"means: the script's docstring).\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
