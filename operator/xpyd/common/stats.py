"""Latency statistics shared by the reports of `xpyd sim` and `xpyd bench` (and the demo)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile (0-1) of ascending values, linear between order statistics (NaN if empty)."""
    if not sorted_values:
        return math.nan
    position = q * (len(sorted_values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def finite(value: float, digits: int) -> float | None:
    """`value` rounded, or None (JSON null) when it is NaN or infinite."""
    return round(value, digits) if math.isfinite(value) else None


def summary_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99/mean/max in milliseconds of durations in seconds (NaNs ignored; None when empty)."""
    values = sorted(v * 1000.0 for v in values_s if not math.isnan(v))
    stats = {"p50": percentile(values, 0.5), "p90": percentile(values, 0.9), "p99": percentile(values, 0.99),
             "mean": sum(values) / len(values) if values else math.nan, "max": values[-1] if values else math.nan}
    return {key: finite(value, 3) for key, value in stats.items()}
