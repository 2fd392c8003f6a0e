"""`react()`: scale-up between two decisions, on the gauges vLLM exposes at once.

    decision = react(observation, config, state)   # None: nothing to add; else apply it, keep its state

`decide()` runs every interval on a window of metrics (60 s by default): its rates lag the present by
half a window and it acts at most once an interval. Between its runs the operator reads only what
the engines' gauges show now, every `AutoscalerConfig.react_s` seconds (Dynamo's load-based planner
reads them every 5 s): each role's running and waiting requests, KV usage, the replica counts. It
reads nothing of the window (`react` uses no rate, quantile or histogram of the observation), and it
only ever adds replicas: scale-down stays with `decide()`'s windows.

Its judgement is `decide()`'s backlog rule (rule 6) at the basis the last sizing decision left
(`AutoscalerState.basis`: the prompt length, the load sized for, a prefill replica's corrected
capacity), with the present read from the gauges:

- Prefill, once it has a backlog as `decide()`'s attribution judges one (queued work that takes
  the ready replicas sharing it more than `queue_drain_share` of the TTFT target to drain, or half
  that while the queue grows, `queue_drain_s`; none while one engine holds a queue the others do
  not share, `pinned_queue`, judged at the basis' capacity as `decide()` judges it at its own): the
  queued prompt tokens (waiting requests x ISL) and what keeps queueing until
  replicas ordered now serve. The arrival rate is the basis' offered load or, while the queue has
  grown since the last decision (over at least `MIN_GROWTH_SPAN_S`), what was served (at most the
  ready replicas' capacity) plus that growth: a growing queue shows load past capacity now, which a
  window's rate shows only half a window later. The replicas that serve it and drain the backlog
  within the sizing horizon (`drain_budget_s`), at most those the load needs plus the ready ones
  (`pinned_limit`), are counted against those in force (ready and starting), so work foreseen while
  replicas start orders nothing more.
- Decode, once its admission is blocked (KV nearly full, at `max_num_seqs`, or more waiting than the
  KV hand-offs in flight explain): the requests waiting beyond those hand-offs, admitted within the
  same budget on top of the load sized for (`size_decode`), within the same limit (the load's
  replicas as the last sizing decision planned them).

A role grows at once to what it needs, by at most `scale_up.max_step`, within its bounds and the GPU
budget, unless it has Pending pods (they are not capacity: `decide()` reports InsufficientGPUs).
It acts only between two sizing decisions (a basis at most 1.5 intervals old): while `decide()`
holds on missing metrics, or before its first sizing, there is nothing to judge with.
"""

from __future__ import annotations

import math
from dataclasses import replace

from xpyd.api.naming import DECODE, PREFILL
from xpyd.autoscaler.config import AutoscalerConfig
from xpyd.autoscaler.decide import (
    DECODE_ADMISSION,
    PREFILL_QUEUEING,
    WITHIN_TARGETS,
    AutoscalerState,
    Decision,
    RoleDecision,
    RoleState,
    ScaleUpBasis,
    drain_budget_s,
    pd_ratio,
    pinned_limit,
    pinned_queue,
    queue_drain_s,
    until_serving,
)
from xpyd.autoscaler.observation import Observation, RoleObservation

#: The least time over which the prefill queue's growth is read as an arrival rate past capacity:
#: shorter, a batch of arrivals that lands at once would read as a rate.
MIN_GROWTH_SPAN_S = 10.0


def react(observation: Observation, config: AutoscalerConfig, state: AutoscalerState) -> Decision | None:
    """The replicas to add now on the gauges (module docstring), or None when none are needed."""
    basis = state.basis
    now = observation.time_s
    if basis is None or now - basis.time_s > 1.5 * config.interval_s or now < basis.time_s:
        return None
    needs = {PREFILL: _prefill_need(observation, config, state, basis),
             DECODE: _decode_need(observation, config, basis)}
    gpus = {PREFILL: config.prefill_gpus, DECODE: config.decode_gpus}
    pools = {PREFILL: observation.prefill, DECODE: observation.decode}
    used = sum((role.replicas + role.pending) * gpus[name] for name, role in pools.items())
    roles: dict[str, RoleDecision] = {}
    role_states: dict[str, RoleState] = {}
    for name, role in pools.items():
        current = role.replicas + role.pending
        need, why = needs[name]
        wanted = min(need, current + config.scale_up.max_step, config.bounds(name).max_replicas)
        if config.gpu_budget is not None:
            wanted = min(wanted, current + max(0, config.gpu_budget - used) // gpus[name])
        role_state = state.role(name)
        if wanted > current and role.pending == 0 and role.ready > 0:
            used += (wanted - current) * gpus[name]
            reason = PREFILL_QUEUEING if name == PREFILL else DECODE_ADMISSION
            roles[name] = RoleDecision(current, wanted, need, reason,
                                       f"{name[0].upper()} {current}->{wanted} between decisions: {why}")
            starting_since = role_state.starting_since_s if math.isfinite(role_state.starting_since_s) else now
            role_states[name] = replace(role_state, last_scale_up_s=now, starting_since_s=starting_since)
        else:
            roles[name] = RoleDecision(current, current, current, WITHIN_TARGETS,
                                       f"{name[0].upper()} stays {current}")
            role_states[name] = role_state
    grown = [roles[name] for name in pools if roles[name].replicas > roles[name].current]
    if not grown:
        return None
    message = "; ".join(r.message for r in grown)
    return Decision(roles[PREFILL], roles[DECODE], grown[0].reason, message,
                    pd_ratio(roles[PREFILL].replicas, roles[DECODE].replicas),
                    replace(state, prefill=role_states[PREFILL], decode=role_states[DECODE]))


def _prefill_need(observation: Observation, config: AutoscalerConfig, state: AutoscalerState,
                  basis: ScaleUpBasis) -> tuple[int, str]:
    prefill: RoleObservation = observation.prefill
    per_replica = basis.prefill_tokens_per_s
    if not (per_replica > 0 and basis.isl > 0 and prefill.ready > 0):
        return 0, ""
    if pinned_queue(prefill, basis.isl, per_replica, config):
        return 0, ""   # one engine's queue: it drains it, more replicas would take none (decide's attribution)
    now = observation.time_s
    tolerated = config.queue_drain_share * config.model.ttft_target_s
    queued = prefill.num_requests_waiting * basis.isl
    offered = basis.offered_tokens_per_s
    span = now - state.time_s
    growth = 0.0
    if span >= MIN_GROWTH_SPAN_S and math.isfinite(state.prefill.waiting):
        growth = max(0.0, prefill.num_requests_waiting - state.prefill.waiting) / span * basis.isl
    # A backlog as `decide()`'s attribution judges one: queued work that takes more than a share of
    # the TTFT target to drain, or half that while it grows.
    drain_s = queue_drain_s(prefill, basis.isl, per_replica)
    if not (drain_s > tolerated or (growth > 0 and drain_s > tolerated / 2)):
        return 0, ""
    # A growing queue: arrivals are what was served (at most the ready replicas' capacity) plus the growth.
    offered = max(offered, min(offered, prefill.ready * per_replica) + growth)
    until_s = until_serving(prefill, state.prefill, now, config)
    building = max(0.0, offered - prefill.ready * per_replica) * until_s
    budget_s = drain_budget_s(config)
    load = max(basis.prefill_replicas, math.ceil(offered / per_replica - 1e-9))
    need, note = pinned_limit(max(1, math.ceil((offered + (queued + building) / budget_s) / per_replica - 1e-9)),
                              load, prefill.ready)
    grew = f", queue grew {growth / basis.isl:.2f} req/s over {span:.0f}s" if growth > 0 else ""
    return need, (f"prefill waiting {prefill.num_requests_waiting:.0f} ({queued / 1e3:.1f}k prompt tokens{grew}) + "
                  f"{building / 1e3:.1f}k building over {until_s:.0f}s of start-up, drained within {budget_s:.0f}s on "
                  f"top of {offered / 1e3:.1f}k tok/s: P {need} x {per_replica / 1e3:.1f}k tok/s{note}")


def _decode_need(observation: Observation, config: AutoscalerConfig, basis: ScaleUpBasis) -> tuple[int, str]:
    decode = observation.decode
    model = config.model
    if not (basis.isl > 0 and basis.osl > 0 and decode.ready > 0):
        return 0, ""
    in_flight = basis.rate_now * model.perf.kv_transfer_seconds(round(basis.isl))
    waiting = max(0.0, decode.num_requests_waiting - in_flight)
    kv_full = decode.kv_cache_usage_perc_max >= 0.95
    seqs_full = decode.num_requests_running >= 0.95 * model.max_num_seqs * decode.ready
    # Admission blocked, as `decide()`'s attribution judges it (its queue-time tail aside: a gauge only).
    if not (waiting > 0 and (kv_full or seqs_full or decode.num_requests_waiting > 4 * in_flight + 2 * decode.ready)):
        return 0, ""
    drain_s = drain_budget_s(config)
    sizing = model.size_decode(basis.rate + waiting / drain_s, basis.isl, basis.osl, basis.k_decode)
    replicas, note = pinned_limit(sizing.replicas, basis.decode_replicas, decode.ready)
    state = f"KV max {decode.kv_cache_usage_perc_max:.2f}, running {decode.num_requests_running:.0f}"
    return replicas, (f"{waiting:.0f} requests waiting for decode admission beyond the KV hand-offs in flight "
                      f"({state}), admitted within {drain_s:.0f}s on top of the load: D {replicas}{note}")
