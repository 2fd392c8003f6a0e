"""Short-term forecasts of the load (arrival rate, ISL, OSL) over the replica start-up delay.

A forecaster is pure: `update(state, time_s, value)` returns the new state, `predict(state, horizon_s)`
the value expected `horizon_s` after the last update. The state is an immutable value the caller
keeps (the autoscaler's state holds one per series), so forecasters are swappable and table-testable.

- `HoltForecaster` (the default): Holt's linear trend (double exponential smoothing) for irregularly
  spaced samples, with a damped trend and a bounded extrapolation so one burst cannot plan a
  runaway.
- `LastValueForecaster`: the latest value (no forecast).

What a series is sized at, from its window's value and its state: `seen` (the larger of the window's
and the smoothed level) and `ahead` (those or the forecast at the horizon, whichever is largest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SeriesState:
    """A smoothed series: level, trend per second, time of the last sample, samples seen."""

    level: float = math.nan
    trend_per_s: float = 0.0
    time_s: float = math.nan
    samples: int = 0


class Forecaster(Protocol):
    """Pure one-series forecaster."""

    def update(self, state: SeriesState, time_s: float, value: float) -> SeriesState:
        """The state after observing `value` at `time_s` (non-finite values are ignored)."""
        ...

    def predict(self, state: SeriesState, horizon_s: float) -> float:
        """The value expected `horizon_s` seconds after the last sample (NaN before any sample)."""
        ...


@dataclass(frozen=True)
class HoltForecaster:
    """Holt's linear trend for irregular sampling.

    With `dt` since the last sample: `prior = level + trend·dt`; `level' = alpha·x + (1-alpha)·prior`;
    `trend' = beta·(level' - level)/dt + (1-beta)·trend`. The prediction `level + trend·Σφ^i` damps the
    trend per `damping_s` seconds (φ = 1/e per `damping_s`) and stays within
    [`level / max_ratio`, `level · max_ratio`].
    """

    alpha: float = 0.6
    beta: float = 0.2
    damping_s: float = 300.0
    max_ratio: float = 1.5

    def update(self, state: SeriesState, time_s: float, value: float) -> SeriesState:
        if not math.isfinite(value):
            return state
        if state.samples == 0 or not math.isfinite(state.level):
            return SeriesState(value, 0.0, time_s, 1)
        dt = time_s - state.time_s
        if dt <= 0:
            return state
        prior = state.level + state.trend_per_s * dt
        level = self.alpha * value + (1.0 - self.alpha) * prior
        trend = self.beta * (level - state.level) / dt + (1.0 - self.beta) * state.trend_per_s
        return SeriesState(level, trend, time_s, state.samples + 1)

    def predict(self, state: SeriesState, horizon_s: float) -> float:
        if state.samples == 0:
            return math.nan
        if state.samples < 2 or horizon_s <= 0:
            return state.level
        # Integral of a trend decaying as exp(-t/damping): damping·(1 - exp(-h/damping)).
        reach = self.damping_s * (1.0 - math.exp(-horizon_s / self.damping_s)) if self.damping_s > 0 else horizon_s
        forecast = state.level + state.trend_per_s * reach
        if state.level > 0:
            forecast = min(max(forecast, state.level / self.max_ratio), state.level * self.max_ratio)
        return max(0.0, forecast)


def seen(state: SeriesState, current: float) -> float:
    """The larger of the window's value and the smoothed level, finite and positive ones only (NaN if none)."""
    return _largest(current, state.level)


def ahead(forecaster: Forecaster, state: SeriesState, current: float, horizon_s: float) -> float:
    """The largest of the window's value, the smoothed level and the forecast `horizon_s` ahead, finite and
    positive ones only (NaN if none)."""
    return _largest(current, state.level, forecaster.predict(state, horizon_s))


def _largest(*values: float) -> float:
    kept = [v for v in values if math.isfinite(v) and v > 0]
    return max(kept) if kept else math.nan


@dataclass(frozen=True)
class LastValueForecaster:
    """No forecast: the latest sample."""

    def update(self, state: SeriesState, time_s: float, value: float) -> SeriesState:
        if not math.isfinite(value):
            return state
        return SeriesState(value, 0.0, time_s, state.samples + 1)

    def predict(self, state: SeriesState, horizon_s: float) -> float:
        return state.level if state.samples else math.nan
