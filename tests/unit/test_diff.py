"""`is_subset`, the question a converged reconcile answers locally before any write: does the live
object already hold every field the operator would apply?"""

from __future__ import annotations

from typing import Any

import pytest

from xpyd.controller.diff import is_subset

pytestmark = pytest.mark.unit

# (case, desired, live, whether desired is a subset of live)
CASES: list[tuple[str, Any, Any, bool]] = [
    # Maps: every desired key, with its value; live may hold more (defaults, other managers).
    ("equal maps", {"a": 1, "b": "x"}, {"a": 1, "b": "x"}, True),
    ("live has extra keys", {"a": 1}, {"a": 1, "b": 2}, True),
    ("a value differs", {"a": 1}, {"a": 2}, False),
    ("a key is missing", {"a": 1}, {}, False),
    ("nested maps, live has more", {"spec": {"template": {"x": 1}}},
     {"spec": {"template": {"x": 1, "y": 2}, "replicas": 3}}, True),
    ("nested maps, a deep value differs", {"spec": {"template": {"x": 1}}}, {"spec": {"template": {"x": 2}}}, False),
    ("nested maps, a deep key is missing", {"spec": {"template": {"x": 1}}}, {"spec": {"template": {}}}, False),
    ("empty desired map against anything that is a map", {}, {"a": 1}, True),
    ("a map against a scalar", {"a": 1}, "a", False),
    ("a map against a list", {"a": 1}, [{"a": 1}], False),
    # None, {} and [] stand for "absent": the server omits empty fields.
    ("None matches a missing key", {"a": None}, {}, True),
    ("{} matches a missing key", {"a": {}}, {}, True),
    ("[] matches a missing key", {"a": []}, {}, True),
    ("{} matches a None value", {"a": {}}, {"a": None}, True),
    ("[] matches a None value", {"a": []}, {"a": None}, True),
    ("{} and [] are both empty", {"a": {}}, {"a": []}, True),
    ("[] and {} are both empty", {"a": []}, {"a": {}}, True),
    ("None is not a present value", {"a": None}, {"a": 1}, False),
    ("None matches None", {"a": None}, {"a": None}, True),
    ("a non-empty map does not match a missing key", {"a": {"b": 1}}, {}, False),
    ("a non-empty map does not match None", {"a": {"b": 1}}, {"a": None}, False),
    ("a non-empty list does not match None", {"a": [1]}, {"a": None}, False),
    ("an empty string is a value, not absent", {"a": ""}, {}, False),
    # Zero numbers and false are what the server omits (omitempty): minReadySeconds 0.
    ("0 matches a missing key", {"minReadySeconds": 0}, {}, True),
    ("false matches a missing key", {"a": False}, {}, True),
    ("0 does not match another value", {"minReadySeconds": 0}, {"minReadySeconds": 2400}, False),
    ("a non-zero number does not match a missing key", {"minReadySeconds": 2400}, {}, False),
    ("an empty list is not a subset of a non-empty one", {"a": []}, {"a": [1]}, False),
    # Lists of named items match by name, in any order, as the server merges them.
    ("named items in another order", [{"name": "a", "v": 1}, {"name": "b", "v": 2}],
     [{"name": "b", "v": 2}, {"name": "a", "v": 1}], True),
    ("live has more named items", [{"name": "a"}], [{"name": "a"}, {"name": "b"}], True),
    ("a named item is missing", [{"name": "a"}, {"name": "c"}], [{"name": "a"}, {"name": "b"}], False),
    ("a named item has a different field", [{"name": "A", "value": "1"}], [{"name": "A", "value": "2"}], False),
    ("a named item has extra live fields", [{"name": "vllm", "image": "v"}],
     [{"name": "vllm", "image": "v", "imagePullPolicy": "IfNotPresent"}], True),
    ("a named item's empty list matches its missing field", [{"name": "vllm", "env": []}], [{"name": "vllm"}], True),
    ("named items against an empty live list", [{"name": "a"}], [], False),
    ("named containers with named env and ports nested",
     {"containers": [{"name": "vllm", "env": [{"name": "B", "value": "2"}, {"name": "A", "value": "1"}],
                      "ports": [{"name": "http", "containerPort": 8000}]}]},
     {"containers": [{"name": "sidecar"},
                     {"name": "vllm", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                      "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]}]}, True),
    ("a nested named env value differs",
     {"containers": [{"name": "vllm", "env": [{"name": "A", "value": "1"}]}]},
     {"containers": [{"name": "vllm", "env": [{"name": "A", "value": "0"}]}]}, False),
    # Other lists match position by position and must have the same length.
    ("equal scalar lists", [1, 2], [1, 2], True),
    ("scalar lists in another order", [1, 2], [2, 1], False),
    ("live list longer", [1], [1, 2], False),
    ("live list shorter", [1, 2], [1], False),
    ("empty lists", [], [], True),
    ("unnamed maps position by position, live has more fields", [{"a": 1}, {"b": 2}],
     [{"a": 1, "x": 0}, {"b": 2}], True),
    ("unnamed maps in another order", [{"a": 1}, {"b": 2}], [{"b": 2}, {"a": 1}], False),
    ("unnamed maps, live list longer", [{"a": 1}], [{"a": 1}, {"a": 2}], False),
    ("items only partly named match by position", [{"name": "a"}, {"b": 1}], [{"b": 1}, {"name": "a"}], False),
    ("a list against a scalar", [1], 1, False),
    ("an empty list against None", [], None, True),
    # Scalars: equal, or the same quantity as the server canonicalises it.
    ("equal strings", "x", "x", True),
    ("different strings", "x", "y", False),
    ("equal ints", 3, 3, True),
    ("an int and a float of the same value", 1, 1.0, True),
    ("an int and a string of the same number", 8000, "8000", True),
    ("a string and an int of the same number", "2", 2, True),
    ("0.5 CPU canonicalised to millicores", "0.5", "500m", True),
    ("0.1 CPU canonicalised to millicores", "0.1", "100m", True),
    ("1000m is one", "1000m", 1, True),
    ("Gi spelt out in bytes", "16Gi", "17179869184", True),
    ("Mi against an int of bytes", "100Mi", 104857600, True),
    ("an exponent against a decimal suffix", "1e3", "1k", True),
    ("G is not Gi", "1G", "1Gi", False),
    ("Ki is not k", "1Ki", "1k", False),
    ("different quantities", "1Gi", "2Gi", False),
    ("strings that are not quantities", "abc", "abd", False),
    ("a float is not compared as a quantity", 1.5, "1.5", False),
    ("nor a float on the live side", "1.5", 1.5, False),
    ("a bool is not the string true", True, "true", False),
    ("the string true is not a bool", "true", True, False),
    ("a bool is not the quantity 1", True, "1", False),
    ("nor the quantity 0", False, "0", False),
    ("an empty string is not zero", "", 0, False),
    ("a value against None", "x", None, False),
    ("zero against None", 0, None, False),
    ("None against zero", None, 0, False),
    ("a quantity inside a map", {"resources": {"limits": {"cpu": "0.5", "memory": "1Gi", "nvidia.com/gpu": 1}}},
     {"resources": {"limits": {"cpu": "500m", "memory": "1Gi", "nvidia.com/gpu": "1"}}}, True),
]


@pytest.mark.parametrize(("desired", "live", "expected"), [(d, v, e) for _, d, v, e in CASES],
                         ids=[c for c, _, _, _ in CASES])
def test_is_subset(desired: Any, live: Any, expected: bool) -> None:
    assert is_subset(desired, live) is expected
