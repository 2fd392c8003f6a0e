"""The autoscaler's decision state as JSON (`autoscaler.state`): what it keeps, that it survives a
round trip through strict JSON, and what it refuses."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import pytest

from xpyd.autoscaler.decide import AutoscalerState, RoleState
from xpyd.autoscaler.forecast import SeriesState
from xpyd.autoscaler.observation import Quantiles
from xpyd.autoscaler.sizing import Burst
from xpyd.autoscaler.state import VERSION, decode, encode

pytestmark = pytest.mark.unit

STATE = AutoscalerState(
    time_s=1_764_633_600.5,
    rate=SeriesState(level=31.5, trend_per_s=-0.02, time_s=1_764_633_600.5, samples=12),
    isl=SeriesState(level=1287.0, time_s=1_764_633_600.5, samples=12),   # trend 0, osl never seen (NaN)
    isl_quantiles=Quantiles(p50=900.0, p90=2100.0, p99=4000.0, mean=1287.0),
    suspect_since_s=math.nan,
    prefill=RoleState(correction=0.93, correction_updates=4,
                      recommendations=((1_764_633_570.5, 3), (1_764_633_600.5, 2)), last_scale_up_s=1_764_633_540.0,
                      waiting=12.0, starting_since_s=math.nan,
                      bursts=(Burst(1_764_633_560.0, 40.0, 2, 1.0e4, 3.0e4, 5.5e4),), requests_seen=820.0,
                      seen_since_s=1_764_633_300.0),
    decode=RoleState(),   # last_scale_up_s -inf, waiting NaN: the defaults JSON cannot hold
)


def test_a_state_survives_strict_json_and_comes_back_equal() -> None:
    text = json.dumps(encode(STATE), allow_nan=False)   # what the API server accepts
    back = decode(json.loads(text))
    assert encode(back) == encode(STATE)
    assert back.decode.last_scale_up_s == -math.inf and math.isnan(back.decode.waiting)
    assert back.prefill.recommendations == STATE.prefill.recommendations
    assert back.prefill.bursts == STATE.prefill.bursts and isinstance(back.prefill.bursts[0], Burst)
    assert isinstance(back.rate.samples, int) and back.rate == STATE.rate
    assert encode(AutoscalerState())["version"] == VERSION


def test_fields_a_state_lacks_take_their_defaults() -> None:
    data = encode(STATE)
    del data["prefill"]["bursts"], data["isl_quantiles"]
    back = decode(data)
    assert back.prefill.bursts == () and math.isnan(back.isl_quantiles.p50)
    assert back.prefill.correction == 0.93


def _edit(path: list[Any], value: Any) -> dict[str, Any]:
    data = encode(replace(STATE))
    target = data
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return data


@pytest.mark.parametrize(("data", "problem"), [
    ([], "not an object"),
    ({**encode(STATE), "version": VERSION + 1}, "version"),
    ({k: v for k, v in encode(STATE).items() if k != "version"}, "version"),
    (_edit(["rate", "level"], "fast"), "state.rate.level: not a number"),
    (_edit(["rate", "samples"], 1.5), "state.rate.samples: not an integer"),
    (_edit(["prefill", "recommendations"], [[1.0, 2, 3]]), "state.prefill.recommendations[0]: 3 items"),
    (_edit(["prefill", "bursts"], [{"time_s": 1.0}]), "missing"),
    (_edit(["decode", "mystery"], 1), "unknown field(s) mystery"),
    (_edit(["decode"], 3), "state.decode: not an object"),
    (_edit(["time_s"], True), "not a number"),
])
def test_a_state_that_does_not_fit_is_refused(data: Any, problem: str) -> None:
    with pytest.raises(ValueError) as error:
        decode(data)
    assert problem in str(error.value)
