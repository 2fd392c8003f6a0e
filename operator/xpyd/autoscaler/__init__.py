"""The SLO-driven prefill/decode autoscaler: a pure `decide()` over what Prometheus shows.

- `decide`: one decision (sizes, CamelCase reason, message, recommended P:D ratio, new state).
- `config`: what `decide` is configured with, and `config_for`, the one translation of a spec into it.
- `sizing`: the steady-state model (M/G/c prefill with queueing headroom, the decode ITL/KV frontier).
- `forecast`: short-term load forecasts over the replica start-up delay (Holt's linear trend).
- `policies`: `decide()` and the baselines it is judged against, as simulator policies
  (`xpyd sim --policy xpyd|static-peak|static-mean|queue-threshold|dynamo-sla|oracle`).
"""

from __future__ import annotations

from xpyd.autoscaler.decide import AutoscalerConfig, AutoscalerState, Decision, RoleDecision, decide

__all__ = ["AutoscalerConfig", "AutoscalerState", "Decision", "RoleDecision", "decide"]
