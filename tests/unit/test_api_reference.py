"""docs/api.md: current with the models, complete against the CRD, links that resolve."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest

from xpyd.api.crd import build_crd
from xpyd.api.reference import main, reference_markdown

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
API_DOC = ROOT / "docs" / "api.md"
STALE = "docs/api.md is stale: regenerate it with `make docs` (python -m xpyd.api.reference > docs/api.md)"


def _crd_fields(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every named field of the schema as `a.b[].c`, walked independently of the generator."""
    found = []
    for name, child in node.get("properties", {}).items():
        child_path = f"{path}.{name}" if path else name
        found.append((child_path, child))
        found += _crd_fields(child, child_path)
        if isinstance(child.get("items"), dict):
            found += _crd_fields(child["items"], child_path + "[]")
        if isinstance(child.get("additionalProperties"), dict):
            found += _crd_fields(child["additionalProperties"], child_path + "{}")
    return found


ROOT_SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
FIELDS = _crd_fields(ROOT_SCHEMA)


def _rules(node: dict[str, Any]) -> list[dict[str, str]]:
    found = list(node.get("x-kubernetes-validations", []))
    for child in node.get("properties", {}).values():
        found += _rules(child)
    for member in ("items", "additionalProperties"):
        if isinstance(node.get(member), dict):
            found += _rules(node[member])
    return found


@pytest.fixture(scope="module")
def doc() -> str:
    assert API_DOC.exists(), STALE
    return API_DOC.read_text()


def test_committed_reference_is_current(doc: str) -> None:
    assert doc == reference_markdown(), STALE


def test_module_prints_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert main() == 0
    assert capsys.readouterr().out == reference_markdown()


def test_every_crd_field_is_documented(doc: str) -> None:
    assert len(FIELDS) > 100  # the walk found the schema
    rows = {line.split(" | ")[0].removeprefix("| ") for line in doc.splitlines() if line.startswith("| `")}
    missing = [path for path, _ in FIELDS if f"`{path}`" not in rows]
    assert missing == [], f"fields of the CRD missing from docs/api.md: {missing}. {STALE}"


def test_every_status_and_spec_field_has_its_description(doc: str) -> None:
    for path, node in FIELDS:
        if path.startswith(("spec.", "status.")):
            description = " ".join(node["description"].split()).replace("|", "\\|")
            row = next(line for line in doc.splitlines() if line.startswith(f"| `{path}` |"))
            assert description.replace("<", "&lt;").replace(">", "&gt;") in row, path


def test_every_rule_is_documented(doc: str) -> None:
    rules = _rules(ROOT_SCHEMA)
    assert rules
    for rule in rules:
        assert f"`{rule['message']}`" in doc, rule["message"]
        assert f"  {rule['rule']}\n" in doc, rule["rule"]


def _github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_links_resolve(doc: str) -> None:
    anchors = {_github_anchor(line.lstrip("#").strip()) for line in doc.splitlines() if line.startswith("#")}
    links = set(re.findall(r"\]\(#([^)]+)\)", doc))
    assert links
    assert links <= anchors, sorted(links - anchors)


def test_new_fields_appear_without_changes_to_the_generator() -> None:
    # What another model field would add: a map of objects, a scalar with its own rule, a union.
    crd = copy.deepcopy(build_crd())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    size = {"type": "integer", "minimum": 1, "description": "Pods.",
            "x-kubernetes-validations": [{"rule": "self % 2 == 0", "message": "size must be even"}]}
    spec["properties"]["extraPools"] = {
        "type": "object", "description": "Named extra pools.",
        "additionalProperties": {"type": "object", "description": "One pool.", "required": ["size"],
                                 "properties": {"size": size}},
    }
    spec["properties"]["window"] = {"anyOf": [{"type": "integer"}, {"type": "number"}], "default": 60,
                                    "description": "Window | seconds."}
    doc = reference_markdown(crd)
    assert "| `spec.extraPools` | map[string][object](#specextrapools) | " in doc
    assert "### `spec.extraPools{}`" in doc
    assert "| `spec.extraPools{}.size` | integer |  | **required**; ≥ 1 | Pods. |" in doc
    assert "- `size must be even` (on `spec.extraPools{}.size`)" in doc
    assert "| `spec.window` | integer or number | `60` |  | Window \\| seconds. |" in doc
