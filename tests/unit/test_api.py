"""The API's rules: every invalid case is rejected by the models and by the CRD's own CEL rules
(evaluated offline by a CEL interpreter), with the same message; valid specs pass both."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from tests import celcheck
from tests.servings import INVALID, SCHEMA_INVALID, TRANSITIONS, VALID, serving
from xpyd import vllm
from xpyd.api.base import transition_violations
from xpyd.api.models import DisaggregatedServing

pytestmark = pytest.mark.unit

ROOT_SCHEMA = celcheck.ROOT_SCHEMA
model_errors = celcheck.model_errors


@pytest.mark.parametrize("obj", VALID.values(), ids=VALID.keys())
def test_valid_specs_pass_models_and_cel(obj: dict[str, Any]) -> None:
    celcheck.judged(obj)


@pytest.mark.parametrize(("obj", "message"), [(o, m) for _, o, m in INVALID], ids=[c for c, _, _ in INVALID])
def test_invalid_specs_rejected_by_models_and_cel_alike(obj: dict[str, Any], message: str) -> None:
    celcheck.judged(obj, message)


@pytest.mark.parametrize(("obj", "field"), [(o, f) for _, o, f in SCHEMA_INVALID],
                         ids=[c for c, _, _ in SCHEMA_INVALID])
def test_schema_violations_name_the_field(obj: dict[str, Any], field: str) -> None:
    problems = model_errors(obj)
    assert any(line.strip().startswith(field + ":") for line in problems), problems


@pytest.mark.parametrize(("change", "message"), [(c, m) for _, c, m in TRANSITIONS],
                         ids=[c for c, _, _ in TRANSITIONS])
def test_immutable_fields(change: dict[str, Any], message: str) -> None:
    old, new = serving(), serving(change)
    old_model, new_model = DisaggregatedServing.model_validate(old), DisaggregatedServing.model_validate(new)
    assert any(message in p for p in transition_violations(new_model.spec, old_model.spec))
    assert any(message in p for p in celcheck.server_view(ROOT_SCHEMA, new, old))
    # Unchanged objects and other edits pass.
    assert transition_violations(old_model.spec, old_model.spec) == []
    assert celcheck.server_view(ROOT_SCHEMA, serving({"decode": {"replicas": 7}}), old) == []


def test_version_regexes_agree_with_boundaries() -> None:
    for minor in range(0, 40):
        text = f"0.{minor}"
        assert bool(re.match(vllm.UP_TO_0_23_REGEX, text)) == ((0, minor) <= vllm.P2P_NCCL_LAST)
        assert bool(re.match(vllm.UP_TO_0_23_REGEX, text)) == ((0, minor) < vllm.NIXL_PUSH_ADDED)
        assert bool(re.match(vllm.BEFORE_0_16_REGEX, text)) == ((0, minor) < vllm.MOONCAKE_BOOTSTRAP_ADDED)
        assert bool(re.match(vllm.BEFORE_0_23_REGEX, text)) == ((0, minor) < vllm.NIXL_KV_LEASE_ADDED)
        assert bool(re.match(vllm.BEFORE_0_23_REGEX, text)) == ((0, minor) < vllm.GPU_NIC_MAPPING_ADDED)
        assert bool(re.match(vllm.BEFORE_OLDEST_REGEX, text)) == ((0, minor) < vllm.OLDEST_SUPPORTED)
        assert bool(re.match(vllm.BEFORE_0_32_REGEX, text)) == ((0, minor) < vllm.MOONCAKE_DEVICE_NAME_ADDED)
        assert bool(re.match(vllm.BEFORE_0_32_REGEX, text)) == ((0, minor) < vllm.NIXL_PIPELINE_PARALLEL_ADDED)
        assert bool(re.match(vllm.BEFORE_0_12_REGEX, text)) == ((0, minor) < vllm.MULTI_NODE_ADDED)
    for regex in (vllm.UP_TO_0_23_REGEX, vllm.BEFORE_0_16_REGEX, vllm.BEFORE_0_23_REGEX, vllm.BEFORE_0_32_REGEX,
                  vllm.BEFORE_0_12_REGEX):
        assert not re.match(regex, "1.2")


def test_defaults_are_explicit_and_round_trip() -> None:
    obj = DisaggregatedServing.model_validate(serving())
    wire = obj.spec.to_wire()
    # What the API server stores after defaulting is what the models produce.
    server = celcheck.apply_defaults(ROOT_SCHEMA, serving())["spec"]
    assert server == wire
    assert wire["kvTransfer"]["connector"] == "NixlConnector"
    assert wire["autoscaling"]["decode"] == {"minReplicas": 1, "maxReplicas": 16}
    assert (wire["autoscaling"]["intervalSeconds"], wire["autoscaling"]["reactSeconds"]) == (30, 5)
    assert wire["model"]["source"] == {"hub": {}}


def test_status_accepts_fields_from_newer_operators() -> None:
    obj = serving()
    obj["status"] = {"observedGeneration": 2, "somethingNew": 1, "prefill": {"readyReplicas": 1, "ready": "1/1"}}
    parsed = DisaggregatedServing.model_validate(obj)
    assert parsed.status.prefill is not None and parsed.status.prefill.ready_replicas == 1


def test_validation_error_is_pydantic_underneath() -> None:
    with pytest.raises(ValidationError):
        DisaggregatedServing.model_validate(serving({"decode": {"replicas": "many"}}))
