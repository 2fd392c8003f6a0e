"""The generated CRD: committed copy current, structural, described, printable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cel
import pytest
import yaml

from xpyd.api.crd import build_crd, crd_yaml
from xpyd.cli import main

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "xpyd.io_disaggregatedservings.yaml"


def test_committed_crd_is_current() -> None:
    assert CRD_FILE.read_text() == crd_yaml(), "crds/ is stale: run `make crd`"


def test_cli_prints_the_crd(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == CRD_FILE.read_text()


def _walk(node: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    found = [(path, node)]
    for name, child in node.get("properties", {}).items():
        found += _walk(child, f"{path}.{name}")
    if "items" in node:
        found += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        found += _walk(node["additionalProperties"], f"{path}{{}}")
    return found


NODES = _walk(build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"], "")


def test_every_field_has_a_description() -> None:
    # Fields (what `kubectl explain` lists); scalar list items and map values share their field's.
    missing = [path for path, node in NODES
               if path not in ("", ".metadata") and not path.endswith(("[]", "{}")) and "description" not in node]
    assert missing == []


def test_schema_is_structural() -> None:
    for path, node in NODES:
        if node.get("x-kubernetes-int-or-string"):
            assert node.get("anyOf") == [{"type": "integer"}, {"type": "string"}], path
            assert "type" not in node, path
            continue
        assert "type" in node, f"{path} has no type"
        assert "anyOf" not in node and "oneOf" not in node and "$ref" not in node, path
        assert node.get("additionalProperties") is not False, path
        if node["type"] == "object" and "properties" not in node:
            # Free-form or map: must say which.
            assert node.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in node \
                or path == ".metadata", path


def test_defaults_satisfy_their_own_rules_as_written() -> None:
    """The API server evaluates a node's CEL rules on its default value without nested defaulting
    (a default missing a key a rule reads makes the whole CRD invalid)."""
    for path, node in NODES:
        if "default" in node and node.get("x-kubernetes-validations"):
            for rule in node["x-kubernetes-validations"]:
                if "oldSelf" in rule["rule"]:
                    continue
                assert cel.evaluate(rule["rule"], {"self": node["default"]}), (path, rule["message"])


def test_cel_rules_have_messages() -> None:
    rules = [rule for _, node in NODES for rule in node.get("x-kubernetes-validations", [])]
    assert len(rules) >= 15
    assert all(rule["message"] and rule["rule"] for rule in rules)


def test_names_and_printer_columns() -> None:
    crd = build_crd()
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        "DisaggregatedServing", "disaggregatedservings", ["xpyd", "dsv"])
    assert crd["spec"]["scope"] == "Namespaced"
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert [n for n, c in columns.items() if not c.get("priority")] == ["Prefill", "Decode", "Ready", "Scaling", "Age"]
    assert columns["TTFT-ms"]["priority"] == 1 and columns["TPOT-ms"]["priority"] == 1


def test_crd_yaml_parses_to_the_same_object() -> None:
    assert yaml.safe_load(crd_yaml()) == build_crd()
