"""The simulated `xpyd` policy reacts to the gauges between decisions as the operator does by default
(`autoscaling.reactSeconds`), and `xpyd sim --react-seconds` sets or turns off that cadence (issue 30)."""

from __future__ import annotations

import argparse

import pytest

from tests.paths import FIXTURE_TRACES, H200_PROFILE
from xpyd.api.models import DEFAULT_REACT_SECONDS, AutoscalingSpec
from xpyd.autoscaler.observation import Desired, Slo
from xpyd.perf.model import PerfModel
from xpyd.sim import policies
from xpyd.sim.main import add_parser
from xpyd.sim.policies import XpydPolicy, xpyd_config
from xpyd.sim.policy import Policy, PolicyContext

pytestmark = pytest.mark.unit

AZURE = FIXTURE_TRACES / "azure_conv_2023_head200.csv"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="xpyd")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["sim", "--trace", str(AZURE), "--profile", str(H200_PROFILE), *argv])


def test_the_simulated_policy_reacts_at_the_operators_default() -> None:
    assert AutoscalingSpec().react_seconds == DEFAULT_REACT_SECONDS == 5
    context = PolicyContext(initial=Desired(1, 1), slo=Slo(), perf=PerfModel.from_profile(H200_PROFILE),
                            interval_s=30.0, startup_delay_s=120.0)
    assert context.react_s == 5.0 and xpyd_config(context).react_s == 5.0


@pytest.mark.parametrize(("argv", "react_s"), [((), 5.0), (("--react-seconds", "2"), 2.0),
                                               (("--react-seconds", "0"), None)])
def test_cli_passes_the_react_cadence_to_the_xpyd_policy(monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...],
                                                         react_s: float | None) -> None:
    built: list[Policy] = []
    build = policies.build_policy

    def spy(name: str, given: PolicyContext) -> Policy:
        built.append(build(name, given))
        return built[-1]

    monkeypatch.setattr(policies, "build_policy", spy)
    args = parse("--policy", "xpyd", "--speedup", "20", *argv)
    assert args.func(args) == 0
    assert isinstance(built[0], XpydPolicy) and built[0].react_s == react_s


def test_cli_refuses_a_negative_react_cadence(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--policy", "xpyd", "--react-seconds", "-1")
    assert args.func(args) == 2
    assert "--react-seconds must be 0 (off) or positive" in capsys.readouterr().err
