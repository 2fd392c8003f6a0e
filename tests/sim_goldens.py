"""The simulator's golden replays: the cases and the replay whose outcome `tests/golden/sim_results.json`
pins request by request. tests/unit/test_sim_golden.py checks them with the build in use,
tests/integration/test_sim_pure_python.py with the pure-Python sources."""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from tests.paths import FIXTURE_TRACES, H200_PROFILE, ROOT, TRACES
from xpyd.autoscaler.observation import Desired, Observation, Slo
from xpyd.perf.model import PerfModel
from xpyd.sim.policies import build_policy
from xpyd.sim.policy import Policy, PolicyContext
from xpyd.sim.simulator import SimConfig, Simulator
from xpyd.traces import TraceRequest, load_trace, read_trace

GOLDEN = ROOT / "tests" / "golden" / "sim_results.json"
KV_BYTES_LLAMA_8B_BF16 = 2 * 32 * 8 * 128 * 2
SLO = Slo(ttft_s=0.5, tpot_s=0.025)


@dataclass(frozen=True)
class Case:
    trace: str
    speedup: float
    policy: str
    prefill: int
    decode: int
    startup_delay_s: float = 120.0
    duration_s: float | None = None   # a window of data/traces/<trace>, prefix blocks kept, instead of a slice


CASES = {
    # decode-heavy, fixed sizes, saturating at x4 (long queues, fused decode steps cut by arrivals)
    "conv-static": Case("azure_conv_2023_600s_240s.csv", 4.0, "static", 1, 2),
    # prefill-heavy and bursty, the autoscaler scaling both ways with a short start-up
    "code-xpyd": Case("azure_code_2023_600s_720s.csv", 4.0, "xpyd", 2, 1, startup_delay_s=30.0),
    "code-queue-threshold": Case("azure_code_2023_600s_720s.csv", 4.0, "queue-threshold", 1, 1,
                                 startup_delay_s=30.0),
    # very long prompts: chunked prefill, KV transfers, lease timers
    "mooncake-static": Case("mooncake_synthetic_head50.jsonl", 1.0, "static", 1, 1),
    # the prefix caches hit, evict (at the H200's KV capacity) and shorten transfers
    "mooncake-prefix-cache": Case("mooncake_synthetic.jsonl", 1.0, "static", 2, 1, duration_s=150.0),
}


@dataclass
class Recording:
    """A policy wrapper that keeps every observation it is shown (their repr, floats exact)."""

    policy: Policy
    seen: list[str] = field(default_factory=list)

    def desired_sizes(self, observation: Observation) -> Desired:
        self.seen.append(repr(observation))
        return self.policy.desired_sizes(observation)


def digest(values: Any) -> str:
    return hashlib.sha256(repr(values).encode()).hexdigest()


def replay(case: Case) -> dict[str, Any]:
    if case.duration_s is None:
        trace = [TraceRequest(r.arrival_s / case.speedup, r.isl, r.osl)
                 for r in read_trace(FIXTURE_TRACES / case.trace)]
    else:
        trace = load_trace(TRACES / case.trace, speedup=case.speedup, duration_s=case.duration_s)
    perf = PerfModel.from_profile(H200_PROFILE).with_kv_transfer(KV_BYTES_LLAMA_8B_BF16, 100.0)
    config = SimConfig(prefill=case.prefill, decode=case.decode, slo=SLO, startup_delay_s=case.startup_delay_s)
    context = PolicyContext(initial=Desired(case.prefill, case.decode), slo=SLO, perf=perf,
                            interval_s=config.interval_s, startup_delay_s=case.startup_delay_s, trace=trace,
                            engine=config.engine)
    policy = Recording(build_policy(case.policy, context))
    result = Simulator(trace, perf, policy, config, case.policy).run()
    finite = [t for t in result.ttft_s if not math.isnan(t)]
    cache = {"cached_tokens": {role: sum(result.cached_tokens[role]) for role in sorted(result.cached_tokens)},
             "busy_seconds": result.busy_seconds,
             "cache_sha256": digest((result.cached_tokens, result.computed_tokens))} if case.duration_s else {}
    return {**cache,
        "requests": len(trace),
        "events": result.events,
        "end_s": result.end_s,
        "gpu_seconds": result.gpu_seconds,
        "ttft_s_sum": math.fsum(finite),
        "ttft_s_first": result.ttft_s[:5],
        "per_request_sha256": digest((result.ttft_s, result.e2e_s)),
        "observations_sha256": digest(policy.seen),
        "replicas": [list(asdict(sample).values()) for sample in result.replicas],
        "decisions": [list(asdict(call).values()) for call in result.decisions],
        "scaling_actions": result.scaling_actions,
    }
