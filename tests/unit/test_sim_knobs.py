"""The simulated policies' knobs (issue 30): the `xpyd` policy's target attainment
(`PolicyContext.attainment`, `xpyd sim --attainment`) and its react cadence, the operator's default
(`autoscaling.reactSeconds`; `xpyd sim --react-seconds`), and the `dynamo-sla` margin: what the
evaluation sweeps and how the command line passes them on."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from tests.paths import FIXTURE_TRACES, H200_PROFILE
from xpyd.api.models import DEFAULT_REACT_SECONDS, AutoscalingSpec
from xpyd.autoscaler.config import AutoscalerConfig
from xpyd.autoscaler.observation import Desired, Slo
from xpyd.perf.model import PerfModel
from xpyd.sim import policies
from xpyd.sim.dynamo import DynamoSlaPolicy
from xpyd.sim.main import add_parser
from xpyd.sim.policies import XpydPolicy, xpyd_config
from xpyd.sim.policy import Policy, PolicyContext
from xpyd.sim.simulator import SimConfig, simulate
from xpyd.traces import TraceRequest

AZURE = FIXTURE_TRACES / "azure_conv_2023_head200.csv"
KV_BYTES_LLAMA_8B_BF16 = 131072


def perf() -> PerfModel:
    return PerfModel.from_profile(H200_PROFILE).with_kv_transfer(KV_BYTES_LLAMA_8B_BF16, 100.0)


def context(**changes: Any) -> PolicyContext:
    return PolicyContext(initial=Desired(1, 1), slo=Slo(), perf=perf(), interval_s=30.0, startup_delay_s=120.0,
                         **changes)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="xpyd")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["sim", "--trace", str(AZURE), "--profile", str(H200_PROFILE), *argv])


def test_the_default_target_is_the_evaluations_95_percent() -> None:
    config = xpyd_config(context())
    assert context().attainment == 0.95 and config.attainment == 0.95
    assert config.model.quantile == pytest.approx(0.95)


@pytest.mark.parametrize("target", [0.80, 0.90, 0.97, 0.99])
def test_the_config_is_the_operators_for_a_spec_with_that_target(target: float) -> None:
    """The simulator's config sizes, paces scale-down and checks N-1 as `from_spec` does for a spec
    with the target and the CRD's defaults."""
    config = xpyd_config(context(attainment=target))
    spec = AutoscalingSpec.model_validate({"slo": {"attainment": target}})
    operator = AutoscalerConfig.from_spec(spec, perf())
    assert config.attainment == target and config.model.quantile == pytest.approx(target)
    assert (config.model.quantile, config.scale_down, config.down_margin) == (
        operator.model.quantile, operator.scale_down, operator.down_margin)


@pytest.mark.parametrize("target", [0.0, 1.0, -0.5, 95.0, float("nan")])
def test_a_target_outside_zero_to_one_is_refused(target: float) -> None:
    with pytest.raises(ValueError, match="target attainment must be between 0 and 1"):
        context(attainment=target)


@pytest.mark.parametrize("value", ["0", "1", "95", "-0.1", "nan"])
def test_cli_refuses_an_attainment_outside_zero_to_one(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--policy", "xpyd", "--attainment", value)
    assert args.func(args) == 2
    assert "--attainment must be between 0 and 1 (exclusive)" in capsys.readouterr().err


def policies_built(monkeypatch: pytest.MonkeyPatch) -> list[Policy]:
    """The policies `xpyd sim` builds from now on, as it builds them."""
    built: list[Policy] = []
    build = policies.build_policy

    def spy(name: str, given: PolicyContext) -> Policy:
        built.append(build(name, given))
        return built[-1]

    monkeypatch.setattr(policies, "build_policy", spy)
    return built


def test_cli_passes_the_attainment_to_the_xpyd_policy(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    built = policies_built(monkeypatch)
    args = parse("--policy", "xpyd", "--attainment", "0.9", "--speedup", "20")
    assert args.func(args) == 0
    assert isinstance(built[0], XpydPolicy) and built[0].config.attainment == 0.9
    assert "attainment" in capsys.readouterr().out
    built.clear()
    args = parse("--policy", "xpyd", "--speedup", "20")
    assert args.func(args) == 0
    assert isinstance(built[0], XpydPolicy) and built[0].config.attainment == 0.95


def test_dynamo_sizes_for_its_margin_more_load() -> None:
    trace = [TraceRequest(i / 6.0, 3000, 200) for i in range(6 * 900)]   # 6 req/s for 15 minutes
    config = SimConfig(prefill=1, decode=1, slo=Slo(ttft_s=1.0, tpot_s=0.05), startup_delay_s=30.0)
    desired = {}
    for margin in (0.0, 2.0):
        policy = DynamoSlaPolicy(perf(), 1.0, 0.05, Desired(1, 1), margin=margin)
        simulate(trace, perf(), config, policy)
        desired[margin] = policy.desired
    assert desired[2.0].prefill > desired[0.0].prefill and desired[2.0].decode >= desired[0.0].decode
    with pytest.raises(ValueError, match="margin must be above -1"):
        DynamoSlaPolicy(perf(), 1.0, 0.05, Desired(1, 1), margin=-1.0)


def test_the_simulated_policy_reacts_at_the_operators_default() -> None:
    assert AutoscalingSpec().react_seconds == DEFAULT_REACT_SECONDS == 5
    context = PolicyContext(initial=Desired(1, 1), slo=Slo(), perf=PerfModel.from_profile(H200_PROFILE),
                            interval_s=30.0, startup_delay_s=120.0)
    assert context.react_s == 5.0 and xpyd_config(context).react_s == 5.0


@pytest.mark.parametrize(("argv", "react_s"), [((), 5.0), (("--react-seconds", "2"), 2.0),
                                               (("--react-seconds", "0"), None)])
def test_cli_passes_the_react_cadence_to_the_xpyd_policy(monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...],
                                                         react_s: float | None) -> None:
    built = policies_built(monkeypatch)
    args = parse("--policy", "xpyd", "--speedup", "20", *argv)
    assert args.func(args) == 0
    assert isinstance(built[0], XpydPolicy) and built[0].react_s == react_s


def test_cli_refuses_a_negative_react_cadence(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--policy", "xpyd", "--react-seconds", "-1")
    assert args.func(args) == 2
    assert "--react-seconds must be 0 (off) or positive" in capsys.readouterr().err



@pytest.mark.parametrize("name", ["static-peak", "static-mean", "oracle"])
def test_the_hindsight_policies_search_the_oracle_for_the_target_asked(name: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """static-peak, static-mean and the oracle come from an oracle search for the context's target, not
    a fixed 95%."""
    asked: list[float] = []
    search = policies.oracle_schedule

    def spy(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs["attainment"])
        return search(*args, **kwargs)

    monkeypatch.setattr(policies, "oracle_schedule", spy)
    trace = [TraceRequest(float(i) / 20.0, 2_000, 64) for i in range(200)]
    policies.build_policy(name, context(attainment=0.9, trace=trace))
    assert asked and set(asked) == {0.9}
