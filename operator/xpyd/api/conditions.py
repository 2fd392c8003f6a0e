"""The vocabulary of a DisaggregatedServing's `status.conditions`: the condition types, who owns each
(the only code that sets it) and every reason it can carry. Events use the same reasons.

- `Ready`, owned by the reconcile (`controller.status.compute_status`): `AllReplicasReady`,
  `PartiallyReady`, `PrefillUnavailable`, `DecodeUnavailable`, `ProxyUnavailable`, `ScaledToZero`,
  `IdleAtZero` (True: prefill and decode scaled to zero by the autoscaler, the proxies ready to hold
  requests while both start), `StartingFromZero` (True: both started from zero and not both ready
  yet, the proxies holding requests meanwhile), `InvalidSpec`.
- `Progressing`, owned by the reconcile: `RollingOut`, `KVRevisionRollingOut`, `Converged`,
  `InvalidSpec`.
- `Degraded`, owned by the reconcile: `AsExpected`, `InsufficientGPUs`, `Unschedulable`,
  `EngineCrashLoop`, `LeaderWorkerSetMissing`, `LeaderWorkerSetForbidden`, `KVTransferFailing`.
- `ScalingActive`, owned by the autoscaler loop (`controller.autoscale`; the reconcile sets only
  `AutoscalingOff` and `AutoscalerNotRunning`): `ValidMetrics`, `RecommendOnly`,
  `ProfileUnavailable`, `AutoscalingOff`, `AutoscalerNotRunning`, and `decide()`'s
  `MetricsUnavailable`.

The reasons of the autoscaler's decisions (`status.autoscaler.lastDecision.reason`: `PrefillQueueing`,
`TpotOverTarget`, `DemandFell`, ...) are `xpyd.autoscaler.decide`'s.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final


class ConditionType(StrEnum):
    """The condition types the operator writes."""

    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    SCALING_ACTIVE = "ScalingActive"


# Ready
ALL_REPLICAS_READY: Final = "AllReplicasReady"
PARTIALLY_READY: Final = "PartiallyReady"
SCALED_TO_ZERO: Final = "ScaledToZero"
#: Ready=True with prefill and decode at zero replicas after an idle window (autoscaling's
#: scale-to-zero): the proxies are ready and hold requests while both roles start.
IDLE_AT_ZERO: Final = "IdleAtZero"
#: Ready=True while a pool the autoscaler started from zero (its last decision ScaleFromZero) has a
#: role without a ready pod: the proxies hold requests until both serve.
STARTING_FROM_ZERO: Final = "StartingFromZero"
INVALID_SPEC: Final = "InvalidSpec"            # Ready and Progressing, and the Event


def role_unavailable(role: str) -> str:
    """`PrefillUnavailable`, `DecodeUnavailable`, `ProxyUnavailable`: no ready pod of `role`."""
    return f"{role.capitalize()}Unavailable"


# Progressing
ROLLING_OUT: Final = "RollingOut"
#: Both engine roles roll a new template at once (the image, the vLLM version, the model...: a new
#: KV compatibility hash), so new prefill pairs only with new decode.
KV_REVISION_ROLLING_OUT: Final = "KVRevisionRollingOut"
CONVERGED: Final = "Converged"

# Degraded
AS_EXPECTED: Final = "AsExpected"
INSUFFICIENT_GPUS: Final = "InsufficientGPUs"
UNSCHEDULABLE: Final = "Unschedulable"
ENGINE_CRASH_LOOP: Final = "EngineCrashLoop"
#: A role spans nodes (nodesPerReplica > 1) but the cluster does not serve leaderworkerset.x-k8s.io/v1.
LEADER_WORKER_SET_MISSING: Final = "LeaderWorkerSetMissing"
#: ... or the operator's RBAC does not let it use LeaderWorkerSets.
LEADER_WORKER_SET_FORBIDDEN: Final = "LeaderWorkerSetForbidden"
#: A proxy reports prefill/decode pairs whose KV hand-offs keep failing (its pod's condition below).
KV_TRANSFER_FAILING: Final = "KVTransferFailing"

#: The condition each proxy keeps on its own Pod (pods/status): False with reason KVTransferFailing
#: and the failing pairs in its message while some pair's hand-offs keep failing, else True.
KV_TRANSFER_POD_CONDITION: Final = "xpyd.io/KVTransferHealthy"
KV_TRANSFER_HEALTHY: Final = "HandoffsSucceeding"

#: The condition each proxy keeps on its own Pod while its waiting room is in use: True with reason
#: RequestsWaiting and the held requests' counts in its message (`xpyd.api.waiting`) while requests
#: wait for a ready prefill and decode pair, else False with reason NoneWaiting. The operator reads
#: it (watch-fed) as the demand signal of a pool at zero.
REQUESTS_WAITING_POD_CONDITION: Final = "xpyd.io/RequestsWaiting"
REQUESTS_WAITING: Final = "RequestsWaiting"
NONE_WAITING: Final = "NoneWaiting"

# ScalingActive (besides decide()'s MetricsUnavailable)
VALID_METRICS: Final = "ValidMetrics"
RECOMMEND_ONLY: Final = "RecommendOnly"
PROFILE_UNAVAILABLE: Final = "ProfileUnavailable"
AUTOSCALING_OFF: Final = "AutoscalingOff"
AUTOSCALER_NOT_RUNNING: Final = "AutoscalerNotRunning"
#: The Event when metrics are readable again after MetricsUnavailable.
METRICS_AVAILABLE: Final = "MetricsAvailable"
