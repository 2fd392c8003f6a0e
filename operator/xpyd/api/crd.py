"""Generate the DisaggregatedServing CRD from the pydantic models.

The output is a structural OpenAPI v3 schema as the API server wants it: references inlined,
no `nullable` unions, explicit defaults (default factories evaluated), descriptions everywhere,
and the models' `Rule`s as `x-kubernetes-validations`.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, NoDefault
from pydantic_core import core_schema as cs

from xpyd.api import models
from xpyd.common.jsontypes import JSON

# Keys of pydantic's JSON Schema that a CRD schema does not take.
_DROPPED_KEYS = frozenset({"title", "$defs"})


class _CRDSchemaGenerator(GenerateJsonSchema):
    """Evaluates default factories, so nested objects get explicit defaults in the CRD."""

    def get_default_value(self, schema: cs.WithDefaultSchema) -> Any:
        factory = schema.get("default_factory")
        if factory is not None and not schema.get("default_factory_takes_data"):
            return factory()  # type: ignore[call-arg]
        return schema.get("default", NoDefault)

    def encode_default(self, dft: Any) -> Any:
        if isinstance(dft, BaseModel):
            # Complete: the API server checks each default against the CEL rules of its node as
            # written, without filling in the defaults nested inside it.
            return dft.model_dump(by_alias=True, exclude_none=True, mode="json")
        return super().encode_default(dft)


def _inline(node: Any, defs: JSON) -> Any:
    """Resolve `$ref`s and turn pydantic's JSON Schema idioms into structural CRD schema."""
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    ref = node.pop("$ref", None)
    if ref is not None:
        target = _inline(defs[ref.rsplit("/", 1)[-1]], defs)
        # The property's own keys (description, default) win over the referenced type's.
        node = {**target, **{k: v for k, v in node.items() if k not in _DROPPED_KEYS}}
    any_of = node.get("anyOf")
    if any_of is not None and {"type": "null"} in any_of:
        # `X | None` is an optional field, not a nullable one: the field is left out instead.
        rest = [option for option in any_of if option != {"type": "null"}]
        node.pop("anyOf")
        if node.get("default", NoDefault) is None:
            node.pop("default")
        if len(rest) == 1:
            node = {**_inline(rest[0], defs), **{k: v for k, v in node.items() if k != "description"},
                    **({"description": node["description"]} if "description" in node else {})}
        else:
            node["anyOf"] = rest
    if node.get("additionalProperties") is False:
        # Structural schemas prune unknown fields; `false` is not accepted next to `properties`.
        node.pop("additionalProperties")
    return {key: _inline(value, defs) for key, value in node.items() if key not in _DROPPED_KEYS}


def _schema_of(model: type[BaseModel]) -> JSON:
    raw = model.model_json_schema(by_alias=True, schema_generator=_CRDSchemaGenerator)
    schema: JSON = _inline(raw, raw.get("$defs", {}))
    return schema


def _status_schema() -> JSON:
    schema = _schema_of(models.DisaggregatedServingStatus)
    conditions = schema["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    return schema


PRINTER_COLUMNS: list[JSON] = [
    {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.ready",
     "description": "Prefill replicas ready/desired"},
    {"name": "Decode", "type": "string", "jsonPath": ".status.decode.ready",
     "description": "Decode replicas ready/desired"},
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
     "description": "Whether the pool serves requests"},
    {"name": "Scaling", "type": "string", "jsonPath": ".status.autoscaler.lastDecision.reason",
     "description": "The autoscaler's last decision (e.g. ScaleFromZero, ScaleToZero, IdleAtZero)"},
    {"name": "Connector", "type": "string", "jsonPath": ".spec.kvTransfer.connector", "priority": 1,
     "description": "KV connector"},
    {"name": "Prefill-GPUs", "type": "integer", "jsonPath": ".status.prefill.gpus", "priority": 1,
     "description": "GPUs the desired prefill replicas request"},
    {"name": "Decode-GPUs", "type": "integer", "jsonPath": ".status.decode.gpus", "priority": 1,
     "description": "GPUs the desired decode replicas request"},
    {"name": "TTFT-ms", "type": "number", "jsonPath": ".status.autoscaler.observed.ttftMs", "priority": 1,
     "description": "Observed time to first token at the SLO percentile"},
    {"name": "TPOT-ms", "type": "number", "jsonPath": ".status.autoscaler.observed.tpotMs", "priority": 1,
     "description": "Observed inter-token latency at the SLO percentile"},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1,
     "description": "In-cluster URL of the proxy"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_crd() -> JSON:
    """The CustomResourceDefinition of DisaggregatedServing, as a dict."""
    spec_schema = _schema_of(models.DisaggregatedServingSpec)
    spec_schema["description"] = models.DisaggregatedServingSpec.__doc__
    status_schema = _status_schema()
    status_schema["description"] = models.DisaggregatedServingStatus.__doc__
    root: JSON = {
        "type": "object",
        "description": "DisaggregatedServing runs a vLLM model as a prefill pool, a decode pool and a "
        "routing proxy that hands each request's KV cache from prefill to decode.",
        "required": ["spec"],
        "x-kubernetes-validations": [models.NAME_RULE.to_crd()],
        "properties": {
            "apiVersion": {"type": "string", "description": "API version of this object (xpyd.io/v1alpha1)."},
            "kind": {"type": "string", "description": "Kind of this object (DisaggregatedServing)."},
            # The API server refuses anything but a bare type here (metadata is its own schema).
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{models.PLURAL}.{models.GROUP}",
            "labels": {"app.kubernetes.io/name": "xpyd-operator", "app.kubernetes.io/part-of": "xpyd"},
        },
        "spec": {
            "group": models.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": models.KIND,
                "listKind": f"{models.KIND}List",
                "plural": models.PLURAL,
                "singular": models.SINGULAR,
                "shortNames": list(models.SHORT_NAMES),
                "categories": ["all", "xpyd"],
            },
            "versions": [
                {
                    "name": models.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def crd_yaml() -> str:
    """The CRD as YAML, exactly as committed under crds/."""
    header = "# Generated by `xpyd crd` from operator/xpyd/api/models.py. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=True, width=100)
