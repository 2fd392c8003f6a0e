"""A mock Kubernetes API for operator integration tests: kmock's in-memory emulator plus the
API-server behaviour the operator relies on.

Added on top of kmock: server-side apply creates missing objects; uid, generation,
resourceVersion and creationTimestamp bookkeeping (generation moves only with the spec); the
status subresource (a PATCH to /status changes only status, a PATCH to the object never does);
optimistic concurrency (a PUT whose resourceVersion is not the stored one is 409 Conflict, as the
API server answers it, and a PUT of a missing object 404; kmock itself serves no PUT); label
selectors (equality and existence terms) on lists; `generateName`; error injection; and a log of
every write, with its client's User-Agent and when it arrived.
"""

from __future__ import annotations

import copy
import itertools
import time
import uuid
from collections import Counter
from dataclasses import dataclass

import aiohttp.web
import kmock
from kmock._internal import dicts as kdicts
from kmock._internal import rendering

from xpyd.common.jsontypes import JSON
from xpyd.common.timefmt import rfc3339
from xpyd.kube.cache import parse_selector, selector_matches

WRITE_METHODS = {"POST", "PUT", "PATCH", "DELETE"}

RESOURCES: dict[str, JSON] = {
    "xpyd.io/v1alpha1/disaggregatedservings": {"kind": "DisaggregatedServing", "namespaced": True,
                                               "subresources": {"status"}},
    "apps/v1/deployments": {"kind": "Deployment", "namespaced": True, "subresources": {"status", "scale"}},
    "v1/services": {"kind": "Service", "namespaced": True, "subresources": {"status"}},
    "v1/serviceaccounts": {"kind": "ServiceAccount", "namespaced": True},
    "v1/pods": {"kind": "Pod", "namespaced": True, "subresources": {"status"}},
    "v1/events": {"kind": "Event", "namespaced": True},
    "v1/namespaces": {"kind": "Namespace", "namespaced": False},
    "policy/v1/poddisruptionbudgets": {"kind": "PodDisruptionBudget", "namespaced": True,
                                       "subresources": {"status"}},
    "rbac.authorization.k8s.io/v1/roles": {"kind": "Role", "namespaced": True},
    "rbac.authorization.k8s.io/v1/rolebindings": {"kind": "RoleBinding", "namespaced": True},
    "coordination.k8s.io/v1/leases": {"kind": "Lease", "namespaced": True},
}
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


@dataclass(frozen=True)
class Write:
    method: str
    path: str
    content_type: str
    agent: str = ""
    #: time.monotonic() when it arrived.
    at: float = 0.0


def _matches(labels: dict[str, str], selector: str) -> bool:
    return selector_matches(labels, parse_selector(selector))


class FakeKube(kmock.KubernetesEmulator):  # type: ignore[misc]
    """See the module docstring. `writes` logs every write; `fail(method, plural, n, status)`
    makes the next n matching requests fail before they reach the store."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for name, info in RESOURCES.items():
            self.resources[name] = kmock.ResourceInfo(verbs=VERBS, **info)
        self.writes: list[Write] = []
        self._failures: Counter[tuple[str, str]] = Counter()
        self._fail_status: dict[tuple[str, str], int] = {}
        self._versions = itertools.count(1)

    def fail(self, method: str, plural: str, times: int = 1, status: int = 500) -> None:
        self._failures[(method, plural)] += times
        self._fail_status[(method, plural)] = status

    def writes_by(self, *, exclude_events: bool = True) -> list[Write]:
        return [w for w in self.writes if not (exclude_events and "/events" in w.path)]

    def get_object(self, resource: str, namespace: str, name: str) -> JSON | None:
        key = (kmock.resource(resource), namespace, name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    def objects_of(self, resource: str) -> list[JSON]:
        """Every live object of a resource (e.g. "v1/events")."""
        wanted = kmock.resource(resource)
        return [copy.deepcopy(self._objects[key].raw) for key in list(self._objects)
                if key[0] == wanted and not self._objects[key].deleted]

    async def put_object(self, resource: str, obj: JSON) -> None:
        """Set an object as a controller would (e.g. a Deployment's status), announcing it on watches."""
        meta = obj["metadata"]
        key = (kmock.resource(resource), meta["namespace"], meta["name"])
        meta["resourceVersion"] = str(next(self._versions))
        async with self._lock:
            self._objects[key] = obj
            await self._buses[kmock.resource(resource)].put({"type": "MODIFIED", "object": obj})

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        method = request.method.value if request.method else ""
        if request.resource is not None and method in WRITE_METHODS:
            key = (method, request.resource.plural)
            if self._failures[key] > 0:
                self._failures[key] -= 1
                return await self._render_error(kmock.KubernetesError(status=self._fail_status[key],
                                                                      message="injected failure"))
            self.writes.append(Write(method, str(request.url.path), request.headers.get("Content-Type", ""),
                                     request.headers.get("User-Agent", ""), time.monotonic()))
            if method == "PUT":
                return await self._replace(request)
            async with self._lock:
                self._prepare(request, method)
        return await super()._handle(request)  # type: ignore[no-any-return]

    async def _replace(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """A PUT (kmock serves none): the whole object replaced, only if it names the stored
        resourceVersion (checked and written under one lock, so two PUTs of one version cannot
        both pass)."""
        key = (request.resource, request.namespace, request.name)
        obj = copy.deepcopy(request.data) if isinstance(request.data, dict) else {}
        async with self._lock:
            current = self._objects[key].raw if key in self._objects and not self._objects[key].deleted else None
            if current is None:
                error = kmock.KubernetesError(status=404, message="not found")
            elif obj.get("metadata", {}).get("resourceVersion") != current["metadata"].get("resourceVersion"):
                error = kmock.KubernetesError(status=409, message="Operation cannot be fulfilled: the object "
                                              "has been modified; please apply your changes to the latest version")
            else:
                meta = obj.setdefault("metadata", {})
                meta.update({k: current["metadata"][k] for k in ("uid", "creationTimestamp", "generation")
                             if k in current["metadata"]}, resourceVersion=str(next(self._versions)))
                self._objects[key] = obj
                await self._buses[request.resource].put({"type": "MODIFIED", "object": obj})
                return aiohttp.web.json_response(obj)
        return await self._render_error(error)  # type: ignore[no-any-return]

    def _prepare(self, request: rendering.Request, method: str) -> None:
        """Shape a write the way the API server would, before kmock stores it."""
        data = request.data if isinstance(request.data, dict) else None
        if data is None:
            return
        meta = data.setdefault("metadata", {})
        version = str(next(self._versions))
        if method == "POST":
            if "name" not in meta and "generateName" in meta:
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta.update(uid=str(uuid.uuid4()), generation=1, resourceVersion=version, creationTimestamp=rfc3339())
            meta.setdefault("namespace", request.namespace)
            return
        key = (request.resource, request.namespace, request.name)
        existing = self._objects[key] if key in self._objects else None  # noqa: SIM401 (no .get on it)
        if existing is None or existing.deleted:
            if "apply-patch" not in request.headers.get("Content-Type", ""):
                return  # kmock answers 404
            # Server-side apply of a missing object creates it.
            meta.update(uid=str(uuid.uuid4()), generation=1, resourceVersion=version, creationTimestamp=rfc3339(),
                         namespace=request.namespace)
            self._objects[key] = {"metadata": {}}
            return
        current = existing.raw
        if request.subresource == "status":
            status = data.get("status")
            data.clear()  # the request is frozen, its payload is not: a status write changes only status
            data.update(status=status, metadata={"resourceVersion": version})
            return
        if RESOURCES.get(f"{request.resource.group + '/' if request.resource.group else ''}"
                         f"{request.resource.version}/{request.resource.plural}", {}).get("subresources"):
            data.pop("status", None)
        merged = kdicts.patch_dict(copy.deepcopy(current), data)
        meta["resourceVersion"] = version
        if merged.get("spec") != current.get("spec"):
            meta["generation"] = current["metadata"].get("generation", 1) + 1

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        result: JSON = await super()._serve_list(request)
        selector = request.params.get("labelSelector", "")
        if selector:
            result["items"] = [item for item in result["items"]
                               if _matches(item.get("metadata", {}).get("labels", {}), selector)]
        return result
