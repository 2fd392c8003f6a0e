"""How prompt work bunches on arrival: the signal the proxy measures and prefill is sized by.

The steady model (`sizing.PoolModel.size_prefill`) takes arrivals as Poisson. Real traces bunch far
more at sub-second scale: in the Azure conversation trace the prompt tokens sharing a request's
250 ms slot reach 4.4 times their mean at the 99th percentile of requests, where a Poisson stream of
the same rate and prompts reaches 1.9 (`benchmarks/arrival_bunching.py`); on the same minutes the
model predicts every request within the TTFT target on 2 prefill replicas while replaying them shows
8% missing it (3 are needed). The engines' queue-time histogram cannot show it while the pool is
large enough (its first bucket is 0.3 s), so the autoscaler shrank into the misses and grew back,
window after window.

The proxy sees every arrival, so it measures the bunching directly: per request, the prompt tokens
arriving (at that proxy) in the same aligned slot of `w` seconds, the request's own included, for
each `w` of `WINDOWS_S`, as the histogram `xpyd_proxy_arrival_prompt_tokens{window="w"}` (observed
when the slot closes, once per request in it, so its quantiles are over requests), beside the
counter of the prompt tokens counted, `xpyd_proxy_prompt_tokens_total` (the proxy's estimates:
`collect` rescales them to the engines' mean prompt). The slots and buckets are
`xpyd.common.bunching`, which the proxy and the simulator share; this module is the sizing.

Sizing (`replicas_for`): a slot's work `W` spread over `c` replicas of saturated rate `mu` drains
in `W / (c mu)`; its last request arrived at most `w` after its first, so it meets the queue budget
`b` when `W <= c mu (b + w)`. Prefill gets at least the fewest `c` that holds for the slot work at
the SLO's quantile, for every window length: short windows bind for short TTFT targets, long ones
for long targets and sustained bursts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ArrivalNeed:
    """The prefill replicas the bunched arrivals need, and the window length and slot work that bind
    (window 0 when nothing is known)."""

    replicas: int = 1
    window_s: float = 0.0
    tokens: float = 0.0


def replicas_for(work: Mapping[float, float], tokens_per_s: float, budget_s: float,
                 max_replicas: int = 1024) -> ArrivalNeed:
    """The fewest prefill replicas (at least 1, at most `max_replicas`) of saturated rate
    `tokens_per_s` that drain each window's slot work (`work`: window seconds -> prompt tokens at the
    SLO's quantile) within the queue budget plus the window."""
    need = ArrivalNeed()
    if not tokens_per_s > 0:
        return need
    for window_s, tokens in sorted(work.items()):
        if not (math.isfinite(tokens) and tokens > 0):
            continue
        drained = tokens_per_s * (max(budget_s, 0.0) + window_s)
        replicas = max(1, min(math.ceil(tokens / drained - 1e-9), max(max_replicas, 1)))
        if need.window_s == 0.0 or replicas > need.replicas:   # the shortest window of the most replicas
            need = ArrivalNeed(replicas, window_s, tokens)
    return need
