"""The watch-fed cache's pure parts: selectors, which reads it may answer, version order, the stored
views, the request labels the operator counts, and what the operator queues for which event."""

from __future__ import annotations

from typing import Any, cast

import pytest

from xpyd.api import models
from xpyd.api.load import parse_serving
from xpyd.api.naming import SERVING_LABEL
from xpyd.controller.watches import (
    CHILD_KINDS,
    CHILD_SELECTOR,
    LWS_KIND,
    cache_kinds,
    is_urgent,
    owner_of,
    pod_signal,
    pod_view,
)
from xpyd.kube import Kube
from xpyd.kube.cache import (
    Cache,
    Kind,
    Reflector,
    implies,
    is_not_older,
    parse_selector,
    selector_matches,
    without_managed_fields,
)
from xpyd.kube.client import request_kind
from xpyd.render import render

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("selector", "terms"), [
    ("", []),
    ("a=b", [("a", "b")]),
    ("a==b, c", [("a", "b"), ("c", None)]),
    ("app.kubernetes.io/managed-by=xpyd-operator,xpyd.io/serving",
     [("app.kubernetes.io/managed-by", "xpyd-operator"), ("xpyd.io/serving", None)]),
])
def test_selectors_parse(selector: str, terms: list[tuple[str, str | None]]) -> None:
    assert parse_selector(selector) == terms


@pytest.mark.parametrize("selector", ["a!=b", "a in (b,c)", "!a", "a notin (b)"])
def test_set_based_selectors_are_refused(selector: str) -> None:
    with pytest.raises(ValueError, match="unsupported"):
        parse_selector(selector)


@pytest.mark.parametrize(("labels", "selector", "matches"), [
    ({"a": "b"}, "a=b", True),
    ({"a": "c"}, "a=b", False),
    ({"a": ""}, "a", True),
    ({}, "a", False),
    (None, "", True),
    ({"a": "b", "c": "d"}, "a=b,c", True),
])
def test_selector_matching(labels: dict[str, str] | None, selector: str, matches: bool) -> None:
    assert selector_matches(labels, parse_selector(selector)) is matches


@pytest.mark.parametrize(("query", "own", "answers"), [
    ("xpyd.io/serving=llama", "xpyd.io/serving", True),      # a pool's pods, from the pods cache
    ("", "xpyd.io/serving", False),                           # every pod: the cache holds only some
    ("xpyd.io/serving=llama", "a=b", False),
    ("a=b,c=d", "a=b", True),
    ("a", "a=b", False),
    ("anything", "", True),
])
def test_a_list_is_answered_only_when_its_selector_implies_the_caches(query: str, own: str, answers: bool) -> None:
    assert implies(parse_selector(query), parse_selector(own)) is answers


def obj(version: str) -> dict[str, Any]:
    return {"metadata": {"resourceVersion": version}}


@pytest.mark.parametrize(("candidate", "current", "replaces"), [
    ("11", "10", True), ("10", "10", True), ("9", "10", False), ("100", "99", True),  # integers, not strings
    ("abc", "10", True), ("", "", True),
])
def test_version_order(candidate: str, current: str, replaces: bool) -> None:
    assert is_not_older(obj(candidate), obj(current)) is replaces


def test_stored_views_drop_managed_fields_and_most_of_a_pod() -> None:
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p", "labels": {"a": "b"}, "managedFields": [{"manager": "x"}]},
           "spec": {"nodeName": "gpu-0", "containers": [{"name": "vllm", "args": ["--x"] * 100}]},
           "status": {"phase": "Pending"}}
    assert pod_view(pod) == {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {"a": "b"}},
                             "spec": {"nodeName": "gpu-0"}, "status": {"phase": "Pending"}}
    assert "managedFields" in pod["metadata"]  # the input is not changed
    assert without_managed_fields({"metadata": {"name": "x"}}) == {"metadata": {"name": "x"}}


def test_cache_answers_only_for_kinds_and_namespaces_it_has_listed() -> None:
    cache = Cache(cast(Kube, None), [Kind("v1", "Pod", SERVING_LABEL, index_label=SERVING_LABEL)], ["a", "b"])
    assert not cache.serves("v1", "Pod", "a")  # nothing listed yet
    for reflector in cache.all():
        reflector.synced.set()
    assert cache.serves("v1", "Pod", "a") and cache.serves("v1", "Pod", "b", "xpyd.io/serving=x")
    assert not cache.serves("v1", "Pod", "c")            # outside its namespaces
    assert not cache.serves("v1", "Pod", None, "xpyd.io/serving=x")  # every namespace: only two are held
    assert not cache.serves("v1", "Pod", "a", "")        # pods without the label are not held
    assert not cache.serves("apps/v1", "Deployment", "a")


def pod(name: str, pool: str, version: str, namespace: str = "ns") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace,
                                                            "resourceVersion": version,
                                                            "labels": {SERVING_LABEL: pool}}}


def test_the_reflector_index_follows_relabelled_and_removed_objects() -> None:
    events: list[tuple[Any, Any]] = []
    reflector = Reflector(cast(Kube, None), "v1", "Pod", None, SERVING_LABEL,
                          on_change=lambda old, new: events.append((old, new)), index_label=SERVING_LABEL)
    reflector._upsert(pod("p1", "a", "1"))
    reflector._upsert(pod("p2", "a", "2"))
    reflector._upsert(pod("p3", "b", "3"))
    assert [p["metadata"]["name"] for p in reflector.select("ns", f"{SERVING_LABEL}=a")] == ["p1", "p2"]
    reflector._upsert(pod("p2", "b", "4"))          # moved to another pool
    reflector._upsert(pod("p1", "a", "1"))          # the same version again: no change, not announced
    reflector._upsert(pod("p3", "b", "2"))          # older than what is held: ignored
    assert sorted(p["metadata"]["name"] for p in reflector.select("ns", f"{SERVING_LABEL}=b")) == ["p2", "p3"]
    assert reflector.get("ns", "p3")["metadata"]["resourceVersion"] == "3"  # type: ignore[index]
    reflector._remove(("ns", "p2"))
    assert [p["metadata"]["name"] for p in reflector.select("ns", f"{SERVING_LABEL}=b")] == ["p3"]
    assert reflector.select("other", f"{SERVING_LABEL}=b") == []
    assert len(events) == 5  # three added, one moved, one removed
    reflector.observe(pod("p3", "b", "9"))          # written through: stored, not announced
    assert reflector.get("ns", "p3")["metadata"]["resourceVersion"] == "9"  # type: ignore[index]
    assert len(events) == 5
    reflector._upsert({**pod("p3", "b", "10"), "metadata": {"name": "p3", "namespace": "ns",
                                                           "resourceVersion": "10", "labels": {}}})
    assert reflector.get("ns", "p3") is None        # lost the label the reflector selects


@pytest.mark.parametrize(("method", "path", "query", "expected"), [
    ("GET", "/apis/apps/v1/namespaces/ns/deployments", [], ("LIST", "deployments")),
    ("GET", "/apis/apps/v1/namespaces/ns/deployments", [("watch", "true")], ("WATCH", "deployments")),
    ("GET", "/apis/apps/v1/namespaces/ns/deployments/d", [], ("GET", "deployments")),
    ("PATCH", "/apis/xpyd.io/v1alpha1/namespaces/n/disaggregatedservings/x/status", [],
     ("PATCH", "disaggregatedservings/status")),
    ("GET", "/api/v1/namespaces/foo", [], ("GET", "namespaces")),
    ("GET", "/api/v1/namespaces", [], ("LIST", "namespaces")),
    ("GET", "/apis/xpyd.io/v1alpha1/disaggregatedservings", [], ("LIST", "disaggregatedservings")),
    ("POST", "/api/v1/namespaces/x/serviceaccounts/sa/token", [], ("POST", "serviceaccounts/token")),
    ("POST", "/api/v1/namespaces/x/events", [], ("POST", "events")),
])
def test_requests_are_counted_as_the_api_server_counts_them(method: str, path: str, query: list[tuple[str, str]],
                                                           expected: tuple[str, str]) -> None:
    assert request_kind(method, path, query) == expected


# ---- what the operator does with an event ---------------------------------------------------------

SERVING = {"apiVersion": models.API_VERSION, "kind": models.KIND, "metadata": {"name": "llama", "namespace": "ns"},
           "spec": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}}}


def test_the_operator_caches_every_kind_it_renders() -> None:
    rendered = {(o["apiVersion"], o["kind"]) for o in render("llama", "ns", parse_serving(SERVING).spec)}
    assert rendered == set(CHILD_KINDS)
    assert {(k.api_version, k.kind) for k in cache_kinds()} == {*CHILD_KINDS, (models.API_VERSION, models.KIND),
                                                                ("v1", "Pod")}
    # A multi-node role swaps its Deployment for a LeaderWorkerSet, which is cached once usable.
    multi_node = {**SERVING, "spec": {**SERVING["spec"], "kvTransfer": {"connector": "NixlConnector"},
                                      "decode": {"nodesPerReplica": 2, "tensorParallelSize": 2}}}
    rendered = {(o["apiVersion"], o["kind"]) for o in render("llama", "ns", parse_serving(multi_node).spec)}
    assert rendered == {*CHILD_KINDS, (LWS_KIND.api_version, LWS_KIND.kind)}
    assert LWS_KIND.selector == CHILD_SELECTOR


CR = Kind(models.API_VERSION, models.KIND)
DEPLOYMENT = Kind("apps/v1", "Deployment")
SERVICE = Kind("v1", "Service")
POD = Kind("v1", "Pod")


def child(generation: int | None = 1, annotations: dict[str, str] | None = None,
          status: dict[str, Any] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "llama-decode", "namespace": "ns", "labels": {SERVING_LABEL: "llama"},
                            "annotations": annotations or {}}
    if generation is not None:
        meta["generation"] = generation
    return {"metadata": meta, "status": status or {}}


def test_events_are_queued_for_their_pool() -> None:
    assert owner_of(CR, SERVING) == ("ns", "llama")
    assert owner_of(DEPLOYMENT, child()) == ("ns", "llama")
    assert owner_of(DEPLOYMENT, {"metadata": {"name": "x", "namespace": "ns"}}) is None


@pytest.mark.parametrize(("kind", "old", "new", "urgent"), [
    (CR, None, SERVING, True),                                        # a new pool
    (CR, {"metadata": {"generation": 1}}, {"metadata": {"generation": 2}}, True),   # a spec change
    (CR, {"metadata": {"generation": 1}}, {"metadata": {"generation": 1}, "status": {"x": 1}}, False),
    (CR, SERVING, None, False),                                       # a deleted pool: nothing to write
    (DEPLOYMENT, child(), None, True),                                # a deleted child comes back
    (DEPLOYMENT, child(1), child(2), True),                           # kubectl scale / edit of the spec
    (DEPLOYMENT, child(1), child(1, status={"readyReplicas": 1}), False),  # its status moved
    (DEPLOYMENT, child(1), child(1, annotations={"x": "y"}), True),   # its metadata was edited
    (DEPLOYMENT, None, child(), False),                               # first sight: its own creation
    (SERVICE, child(None), child(None, annotations={"x": "y"}), True),  # no generation: any change
    (POD, None, child(), False),
])
def test_urgent_events_are_those_that_may_need_a_write(kind: Kind, old: Any, new: Any, urgent: bool) -> None:
    assert is_urgent(kind, old, new) is urgent


def test_pod_events_matter_only_when_the_reconcile_reads_something_new() -> None:
    base = {"metadata": {"name": "p"}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/5 nodes"}]}}
    assert pod_signal(base) == pod_signal({**base, "status": {**base["status"], "podIP": "127.0.0.9"}})
    scheduled = {**base, "status": {"conditions": [{"type": "PodScheduled", "status": "True"}]}}
    assert pod_signal(base) != pod_signal(scheduled)
    crashing = {**base, "status": {"containerStatuses": [{"state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}}
    assert pod_signal(base) != pod_signal(crashing)
    assert pod_signal(base) != pod_signal({**base, "metadata": {"name": "p", "deletionTimestamp": "now"}})
    assert pod_signal(None) != pod_signal(base)
    # Readiness (a held rollout ends when the other role's new pod is Ready), not its reason or time.
    ready = {**base, "status": {"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "t1"}]}}
    assert pod_signal(ready) != pod_signal(base)
    later = {**base, "status": {"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "t2"}]}}
    assert pod_signal(ready) == pod_signal(later)
