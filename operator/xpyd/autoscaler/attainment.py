"""The target attainment: the share of requests meeting both SLOs, measured from the latency
histograms `decide()` already reads, and the load headroom that reaches the share asked for,
learnt online.

`autoscaling.slo.attainment` (e.g. 0.95) states the goal as users choose along it: how many requests
within their SLOs. The sizing model (`sizing.PoolModel`) predicts latencies of a steady load; what it
cannot see (the forecast's error over the start-up delay, bursts, a profile that is off) shows as
requests missing their SLOs. So each decision measures the window's attainment and moves a headroom
`h` (the load is sized as `(1 + h)` times the forecast) to close the gap:

- measured: the share of the window's requests under the TTFT target and the share under the TPOT
  target, each read from the histogram's cumulative buckets at the target (linear within a bucket,
  as `histogram_quantile()` reads them), multiplied (the histograms are separate, so the share
  meeting both is taken as if the two were independent; misses of both at once make it a lower
  bound of the true share);
- learnt: on the miss ratio, `e = min(miss / M - 1, MAX_ERROR)` with `M = 1 - target`: by
  `GAIN * e` a decision, within [`MIN_HEADROOM`, `MAX_HEADROOM`]: down by at most `GAIN` (a window
  missing nothing), up by at most `GAIN * MAX_ERROR`. The step is linear in the misses with one gain
  both ways, so the headroom comes to rest where the windows miss `M` on average, as the hour's
  attainment counts them. Misses come in clumps (a few windows missing many, many missing none): a
  step on the log of the miss ratio that rose 4x faster than it fell came to rest well above the
  target (asked 80%, 83.7-93.4% warm in the evaluation) and wound up to +70% over conv's cold
  start; this one attains 81.5-96.9% there (the most on mooncake, whose 17 minutes end before the
  headroom has fallen), and conv's cold start holds at most +36%. The cap bounds what one window of
  a start-up or a burst can teach. Windows with fewer than `config.min_requests` new requests,
  windows holding the release of a start from zero (their misses are the start-up's, which no
  headroom shortens), windows while every role is at its maximum (more headroom orders nothing)
  teach nothing. While one prefill engine holds a queue the other engines do not share
  (`decide.pinned_queue`: queued work stays on its engine, so its late requests miss however many
  replicas serve beside it), the requests it serves from that queue (at most the window's misses)
  are `excused`: taught as met (and reported as they were).
- anti-windup: until the pool first settles on the autoscaler's sizes (`AttainmentState.settled_s`),
  an upward step is scaled by the share of the ordered pool that served (`served`). A pool created or
  woken far smaller than its load misses while the replicas the autoscaler ordered start, whatever
  the headroom: taught at full gain (by the earlier log step), such a cold start wound the headroom
  up to its maximum within minutes in the evaluation, and the slow way down still held +44% 20
  minutes later. Once settled, a miss while the pool grows again teaches at full gain: the
  autoscaler sized that pool a start-up earlier, too small, which is what the headroom is for.
- reported: the attainment over the last hour (`HOUR_S`), kept as requests and requests met in
  `BUCKET_S` buckets, and the headroom held now (`status.autoscaler.attainment`, the operator's
  `xpyd_autoscaler_attainment` and `xpyd_autoscaler_headroom`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

#: Bounds of the headroom: at most twice the forecast load; at least 15% under it (a model that sizes
#: with more slack than the target needs gives some back). Lower, the learner steps past cliffs where
#: a replica less during a rise queues its requests: in the evaluation, long asked 95% attained 93.4%
#: on 8.20 GPU-hours with the floor at -0.25, against 98.5% on 8.18 at -0.15.
MIN_HEADROOM = -0.15
MAX_HEADROOM = 1.0
#: Headroom moved per decision per unit of the miss ratio's error (`miss / M - 1`), up and down, and
#: the largest error one window teaches (misses of 5x what the target allows).
GAIN = 0.01
MAX_ERROR = 4.0
#: The span the reported attainment covers, and the buckets it is kept in.
HOUR_S = 3600.0
BUCKET_S = 300.0

#: One histogram as Prometheus exposes it: (upper bound `le`, cumulative count or rate), ascending,
#: the last bound +Inf.
Buckets = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class AttainmentState:
    """The headroom held and the requests seen (and met) per `BUCKET_S` bucket over the last hour."""

    headroom: float = 0.0
    updates: int = 0
    # When a decision first found the pool settled on the autoscaler's sizes since it began or woke
    # (NaN: not yet): from then on an upward step is taught at full gain.
    settled_s: float = math.nan
    history: tuple[tuple[float, float, float], ...] = ()   # (bucket start, requests, requests met)

    def last_hour(self, now: float) -> float:
        """The share of the last hour's requests that met both SLOs (NaN when none was measured)."""
        seen = [(n, met) for start, n, met in self.history if start > now - HOUR_S - BUCKET_S]
        total = sum(n for n, _ in seen)
        return sum(met for _, met in seen) / total if total > 0 else math.nan


def share_within(buckets: Sequence[tuple[float, float]], target: float) -> float:
    """The share of a histogram's observations at or under `target`, NaN without observations.
    Linear within the bucket that holds `target` (from 0 for the first), as `histogram_quantile()`;
    past the last finite bound, the observations under it."""
    if not buckets:
        return math.nan
    total = buckets[-1][1]
    if not total > 0:
        return math.nan
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if target < le:
            if math.isinf(le):
                return lower_count / total
            within = lower_count + (count - lower_count) * (target - lower_le) / (le - lower_le)
            return min(max(within / total, 0.0), 1.0)
        lower_le, lower_count = le, count
    return 1.0


def window_attainment(ttft: Buckets, tpot: Buckets, ttft_target_s: float, tpot_target_s: float) -> float:
    """The share of the window's requests meeting both targets (independence of the two), NaN when
    neither histogram has observations; a histogram without any counts as met (e.g. no proxy scraped)."""
    shares = [share_within(buckets, target) for buckets, target in ((ttft, ttft_target_s), (tpot, tpot_target_s))]
    known = [s for s in shares if math.isfinite(s)]
    return math.prod(known) if known else math.nan


def learn(state: AttainmentState, now: float, attainment: float, requests: float, target: float | None,
          min_requests: float, teach: bool = True, served: float = 1.0, excused: float = 0.0) -> AttainmentState:
    """The state after a window whose `requests` new requests met both SLOs at `attainment`: the hour's
    history gains them; with a `target` (and `teach`), the headroom moves on the miss ratio, an
    upward step times `served` (within 0-1: the share of the ordered pool that served the window), the
    misses of an `excused` share of the requests (those no headroom could have prevented) taught as met."""
    history = tuple(b for b in state.history if b[0] > now - HOUR_S - BUCKET_S)
    if not (math.isfinite(attainment) and requests > 0):
        return replace(state, history=history)
    start = math.floor(now / BUCKET_S) * BUCKET_S
    if history and history[-1][0] == start:
        _, n, met = history[-1]
        history = (*history[:-1], (start, n + requests, met + requests * attainment))
    else:
        history = (*history, (start, requests, requests * attainment))
    state = replace(state, history=history)
    if target is None or not teach or requests < min_requests:
        return state
    allowed = 1.0 - target
    missed = max(1.0 - attainment - (max(excused, 0.0) if math.isfinite(excused) else 0.0), 0.0)
    error = min(missed / allowed - 1.0, MAX_ERROR)
    share = min(max(served, 0.0), 1.0) if math.isfinite(served) else 1.0
    step = GAIN * error * (share if error > 0 else 1.0)
    headroom = min(max(state.headroom + step, MIN_HEADROOM), MAX_HEADROOM)
    return replace(state, headroom=headroom, updates=state.updates + 1)
