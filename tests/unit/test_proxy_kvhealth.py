"""KV-transfer health of prefill/decode pairs: when a pair becomes failing, how long it is avoided,
what heals it, and the condition a proxy writes on its pod (and the operator reads)."""

from __future__ import annotations

import pytest

from xpyd.api.conditions import KV_TRANSFER_FAILING, KV_TRANSFER_POD_CONDITION
from xpyd.controller.status import kv_transfer_problem
from xpyd.controller.watches import pod_signal
from xpyd.proxy.kvhealth import EngineTransferFailures, PairHealth, failed_transfers
from xpyd.proxy.podreport import MAX_PAIRS_NAMED, kv_condition

pytestmark = pytest.mark.unit


def test_a_pair_is_avoided_after_the_threshold_and_for_its_cooldown() -> None:
    health = PairHealth(threshold=3, cooldown=10.0, max_cooldown=25.0)
    assert [health.failed("p", "d", 0.0) for _ in range(3)] == [False, False, True]
    assert health.avoided("p", "d", 9.9) and not health.avoided("p", "d", 10.0)
    assert not health.avoided("p", "other", 5.0) and not health.avoided("other", "d", 5.0)
    (pair,) = health.failing(4.0)
    assert (pair.prefill, pair.decode, pair.failures, pair.total, pair.avoided_for) == ("p", "d", 3, 3, 6.0)
    # Tried again after the cool-down: one more failure avoids it again, twice as long, up to the cap.
    assert health.failed("p", "d", 10.0) and health.pairs[("p", "d")].cooldown == 20.0
    assert health.avoided("p", "d", 29.9)
    assert health.failed("p", "d", 30.0) and health.pairs[("p", "d")].cooldown == 25.0
    # A failure while avoided (a request already on its way) does not extend it.
    assert not health.failed("p", "d", 31.0) and not health.avoided("p", "d", 55.0)
    # One success heals it.
    health.succeeded("p", "d")
    assert not health.failing(60.0) and not health.avoided("p", "d", 60.0)


def test_failures_below_the_threshold_are_forgotten_by_a_success() -> None:
    health = PairHealth(threshold=3)
    health.failed("p", "d", 0.0)
    health.failed("p", "d", 0.0)
    health.succeeded("p", "d")
    assert not health.failed("p", "d", 0.0) and not health.failing(0.0)


def test_gone_instances_take_their_pairs_along() -> None:
    health = PairHealth(threshold=1)
    health.failed("p1", "d1", 0.0)
    health.failed("p2", "d1", 0.0)
    health.failed("p2", "d2", 0.0)
    health.forget({"d1"})
    assert [(f.prefill, f.decode) for f in health.failing(0.0)] == [("p2", "d2")]


def _pair(n: int) -> dict[str, object]:
    return {"prefill": f"llama-prefill-{n}", "decode": f"llama-decode-{n}", "failures": 3, "total": 4,
            "avoidedForSeconds": 12.0}


def test_the_pod_condition_names_the_failing_pairs() -> None:
    healthy = kv_condition([])
    assert (healthy["type"], healthy["status"]) == (KV_TRANSFER_POD_CONDITION, "True")
    failing = kv_condition([_pair(0), _pair(1)])
    assert (failing["status"], failing["reason"]) == ("False", KV_TRANSFER_FAILING)
    assert failing["message"] == ("KV hand-offs keep failing for 2 pair(s): llama-prefill-0 -> llama-decode-0: 3 "
                                  "failed in a row; llama-prefill-1 -> llama-decode-1: 3 failed in a row")
    many = kv_condition([_pair(n) for n in range(MAX_PAIRS_NAMED + 2)])
    assert many["message"].endswith("; and 2 more") and "llama-prefill-5" not in many["message"]


def _proxy_pod(name: str, condition: dict[str, str] | None, role: str = "proxy", deleting: bool = False) -> dict:
    meta: dict[str, object] = {"name": name, "labels": {"xpyd.io/role": role}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"metadata": meta, "status": {"conditions": [{"type": "Ready", "status": "True"},
                                                        *([condition] if condition else [])]}}


def test_the_pool_is_degraded_while_a_serving_proxy_reports_failing_pairs() -> None:
    failing = kv_condition([_pair(0)])
    assert kv_transfer_problem([_proxy_pod("a", kv_condition([])), _proxy_pod("b", None)]) is None
    assert kv_transfer_problem([_proxy_pod("gone", failing, deleting=True)]) is None
    assert kv_transfer_problem([_proxy_pod("engine", failing, role="decode")]) is None
    problem = kv_transfer_problem([_proxy_pod("b", failing), _proxy_pod("a", failing)])
    assert problem is not None and problem.status is True and problem.reason == KV_TRANSFER_FAILING
    assert problem.message.startswith("proxy a: KV hand-offs keep failing for 1 pair(s): llama-prefill-0")
    assert "; proxy b: " in problem.message


def test_a_change_of_the_condition_is_a_pod_signal() -> None:
    assert pod_signal(_proxy_pod("a", kv_condition([]))) != pod_signal(_proxy_pod("a", kv_condition([_pair(0)])))
    assert pod_signal(_proxy_pod("a", None)) == pod_signal(_proxy_pod("a", None))


class _Kube:
    def __init__(self) -> None:
        self.patches: list[tuple[str, dict, bool]] = []

    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict,
              subresource: str | None = None, strategic: bool = False) -> dict:
        assert (api_version, kind, namespace, subresource) == ("v1", "Pod", "ns", "status")
        self.patches.append((name, patch, strategic))
        return {}


def test_the_reporter_writes_its_own_pod_only_on_change_and_merges_the_condition() -> None:
    from xpyd.proxy.podreport import PodConditionReporter

    kube = _Kube()
    reporter = PodConditionReporter(kube, "ns", "llama-proxy-abc", lambda: [])  # type: ignore[arg-type]
    assert reporter.write(kv_condition([])) and not reporter.write(kv_condition([]))
    assert reporter.write(kv_condition([_pair(0)]))
    assert [(name, strategic) for name, _, strategic in kube.patches] == [("llama-proxy-abc", True)] * 2
    (condition,) = kube.patches[1][1]["status"]["conditions"]
    assert condition["status"] == "False" and "lastTransitionTime" in condition


# As vLLM's prometheus_client writes a counter of two data-parallel engines.
EXPOSITION = """# HELP vllm:nixl_num_failed_transfers_total Number of failed NIXL KV Cache transfers.
# TYPE vllm:nixl_num_failed_transfers_total counter
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 3.0
vllm:nixl_num_failed_transfers_total{engine="1",model_name="m"} 2.0
# HELP vllm:nixl_num_failed_transfers_created Number of failed NIXL KV Cache transfers.
# TYPE vllm:nixl_num_failed_transfers_created gauge
vllm:nixl_num_failed_transfers_created{engine="0",model_name="m"} 1.7e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
"""


def test_the_engines_failed_transfers_are_read_from_their_metrics() -> None:
    assert failed_transfers(EXPOSITION) == 5.0   # both data-parallel engines; not the _created sample
    assert failed_transfers("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n") is None
    with pytest.raises(ValueError):
        failed_transfers("vllm:nixl_num_failed_transfers_total{engine=\"0\" 3\n")


def test_an_engine_whose_count_rose_is_failing_for_the_window() -> None:
    engines = EngineTransferFailures(window=60.0)
    assert engines.observe("d", 7.0, 0.0) == 0.0          # a baseline: failures from before the proxy
    assert engines.observe("d", 7.0, 10.0) == 0.0 and engines.failing(10.0) == []
    assert engines.observe("d", 9.0, 20.0) == 2.0
    assert engines.observe("d", 10.0, 30.0) == 1.0
    assert engines.failing(30.0) == [("d", 3.0)]
    assert engines.failing(85.0) == [("d", 1.0)]          # the first rise left the window
    assert engines.failing(95.0) == []
    # A restarted engine counts from 0 again: a baseline, not a rise.
    assert engines.observe("d", 1.0, 100.0) == 0.0 and engines.observe("d", 2.0, 110.0) == 1.0
    engines.forget({"d"})
    assert engines.failing(110.0) == [] and "d" not in engines.last


def test_the_pod_condition_names_engines_counting_failed_transfers() -> None:
    engine = {"engine": "llama-decode-0", "role": "decode", "failedTransfers": 4.0, "windowSeconds": 60.0}
    condition = kv_condition([], [engine])
    assert (condition["status"], condition["reason"]) == ("False", KV_TRANSFER_FAILING)
    assert condition["message"] == "1 engine(s) count failed KV transfers: llama-decode-0: 4 in 60 s"
    both = kv_condition([_pair(0)], [engine])
    assert both["message"].startswith("KV hand-offs keep failing for 1 pair(s): llama-prefill-0 -> llama-decode-0")
    assert both["message"].endswith("; 1 engine(s) count failed KV transfers: llama-decode-0: 4 in 60 s")
