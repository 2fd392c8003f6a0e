"""A thin, synchronous Kubernetes client for the kinds the operator and the local cluster touch.

Everything goes through the official client's ApiClient (kubeconfig or in-cluster credentials,
TLS, auth) but with raw JSON in and out: the operator works on plain dicts, the same shape
rendering produces. Every call has a timeout, so a hung API server never wedges a worker.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import kubernetes

from xpyd.api import models
from xpyd.api.naming import FIELD_MANAGER
from xpyd.common.jsontypes import JSON
from xpyd.common.timefmt import rfc3339

log = logging.getLogger(__name__)

#: (apiVersion, kind) -> plural, for every kind the operator reads or writes.
PLURALS: Final[dict[tuple[str, str], str]] = {
    ("apps/v1", "Deployment"): "deployments",
    ("v1", "Service"): "services",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Pod"): "pods",
    ("v1", "Event"): "events",
    ("v1", "Node"): "nodes",
    ("v1", "Namespace"): "namespaces",
    ("v1", "Secret"): "secrets",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("v1", "PersistentVolume"): "persistentvolumes",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("coordination.k8s.io/v1", "Lease"): "leases",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkersets",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): "customresourcedefinitions",
    ("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration"): "mutatingwebhookconfigurations",
    ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration"): "validatingwebhookconfigurations",
    (models.API_VERSION, models.KIND): models.PLURAL,
}

CLUSTER_SCOPED: Final = frozenset({"Node", "Namespace", "PersistentVolume", "CustomResourceDefinition",
                                   "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"})

REQUEST_TIMEOUT_SECONDS: Final = 15.0
#: Connections kept per API server: the operator's workers and their concurrent applies share them.
CONNECTION_POOL_SIZE: Final = 32
#: Writes `apply_all` sends at once (all callers together).
PARALLEL_APPLIES: Final = 16


class KubeError(Exception):
    """An API call failed; `status` is the HTTP status (0 when no answer came)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status


class Fenced(KubeError):
    """A write refused before it was sent: this replica does not hold the leader's Lease."""

    def __init__(self, method: str, path: str) -> None:
        super().__init__(0, f"{method} {path}: not sent, this operator replica is not the leader")


def resource_path(api_version: str, kind: str, namespace: str | None, name: str | None = None,
                  subresource: str | None = None) -> str:
    """The URL path of a kind's collection, or of one object (and its subresource).
    `namespace` None means every namespace (or a cluster-scoped kind)."""
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    plural = PLURALS[(api_version, kind)]
    path = f"{prefix}/{plural}" if namespace is None or kind in CLUSTER_SCOPED else \
        f"{prefix}/namespaces/{namespace}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def request_kind(method: str, path: str, query: list[tuple[str, str]]) -> tuple[str, str]:
    """The verb and resource of a request as the API server counts them (`apiserver_request_total`):
    GET of a collection is LIST, with `watch` WATCH; the resource is the plural, plus
    `/subresource`."""
    parts = [p for p in path.split("/") if p]
    parts = parts[2:] if parts[:1] == ["api"] else parts[3:]  # /api/v1/... or /apis/group/version/...
    if len(parts) >= 2 and parts[0] == "namespaces" and len(parts) != 2:
        parts = parts[2:]  # a namespaced resource, not a Namespace object
    resource = parts[0] if parts else ""
    if len(parts) >= 3:
        resource += "/" + parts[2]
    verb = method.upper()
    if verb == "GET":
        if any(key == "watch" and value in ("true", "1") for key, value in query):
            verb = "WATCH"
        elif len(parts) == 1:
            verb = "LIST"
    return verb, resource


def load_client_config() -> kubernetes.client.Configuration:
    """In-cluster credentials when running in a pod, else the current kubeconfig."""
    config = kubernetes.client.Configuration()
    config.connection_pool_maxsize = CONNECTION_POOL_SIZE
    try:
        kubernetes.config.load_incluster_config(client_configuration=config)  # type: ignore[no-untyped-call]
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(client_configuration=config)  # type: ignore[no-untyped-call]
    return config


class ReadCache(Protocol):
    """What `Kube` asks of a read cache (`xpyd.kube.cache.Cache` is the one there is)."""

    def serves(self, api_version: str, kind: str, namespace: str | None, selector: str | None = None) -> bool:
        """Whether a read of `kind` in `namespace` (a get: `selector` None; else a list) is answered."""
        ...

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> JSON | None: ...

    def select(self, api_version: str, kind: str, namespace: str | None, selector: str = "") -> list[JSON]: ...

    def observe(self, obj: JSON) -> None:
        """Write through an object an API write returned."""
        ...


@dataclass
class Kube:
    """JSON-in, JSON-out access to the API server. With a `cache` (see `xpyd.kube.cache`), reads of
    the kinds it serves are answered from memory and the objects writes return are written through."""

    api: kubernetes.client.ApiClient
    cache: ReadCache | None = None
    #: When set, a write (of anything but a Lease) is sent only while it returns True: a replica that
    #: lost the leader's Lease cannot finish a decision it started under it (see controller.leader).
    fence: Callable[[], bool] | None = None
    #: Requests sent, by (verb, resource, HTTP status; 0 when no answer came): the operator's /metrics.
    requests: Counter[tuple[str, str, int]] = field(default_factory=Counter, init=False, compare=False)
    _requests_guard: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    _applier: ThreadPoolExecutor | None = field(default=None, init=False, repr=False, compare=False)
    _applier_guard: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    @classmethod
    def from_environment(cls) -> Kube:
        return cls(kubernetes.client.ApiClient(load_client_config()))

    def _call(self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None,
              content_type: str = "application/json") -> JSON | None:
        """One request; None for a GET of a missing object, KubeError for any other failure."""
        if self.fence is not None and method != "GET" and request_kind(method, path, [])[1] != "leases" \
                and not self.fence():
            raise Fenced(method, path)
        try:
            method, url, headers, body, _ = self.api.param_serialize(
                method=method, resource_path=path, query_params=query or [], body=body,
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                auth_settings=["BearerToken"],
            )
            response = self.api.call_api(method, url, header_params=headers, body=body,
                                         _request_timeout=REQUEST_TIMEOUT_SECONDS)
            raw = response.read()  # type: ignore[no-untyped-call]
        except Exception as error:  # connection refused, timeouts, TLS: all retried by the caller
            self._count(method, path, query, 0)
            raise KubeError(0, f"{method} {path}: {error}") from None
        self._count(method, path, query, response.status)
        if response.status == 404 and method == "GET":
            return None
        if not 200 <= response.status < 300:
            raise KubeError(response.status, f"{method} {path}: {_reason(raw)}")
        result: JSON = json.loads(raw) if raw else {}
        return result

    def open(self, method: str, path: str, query: list[tuple[str, str]],
             timeout: tuple[float, float]) -> Any:
        """A request whose body the caller reads (e.g. a watch stream); KubeError unless 200."""
        method, url, headers, body, _ = self.api.param_serialize(
            method=method, resource_path=path, query_params=query, header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"])
        try:
            response = self.api.call_api(method, url, header_params=headers, body=body, _request_timeout=timeout)
        except Exception as error:
            self._count(method, path, query, 0)
            raise KubeError(0, f"{method} {path}: {error}") from None
        self._count(method, path, query, response.status)
        if response.status != 200:
            raw = response.read()  # type: ignore[no-untyped-call]
            raise KubeError(response.status, f"{method} {path}: {_reason(raw)}")
        return response

    def request_counts(self) -> dict[tuple[str, str, int], int]:
        """A copy of `requests`."""
        with self._requests_guard:
            return dict(self.requests)

    def _count(self, method: str, path: str, query: list[tuple[str, str]] | None, status: int) -> None:
        key = (*request_kind(method, path, query or []), status)
        with self._requests_guard:
            self.requests[key] += 1

    def _observe(self, obj: JSON | None) -> JSON:
        if obj and self.cache is not None:
            self.cache.observe(obj)
        return obj or {}

    @classmethod
    def from_kubeconfig(cls, path: Path) -> Kube:
        config = kubernetes.client.Configuration()
        config.connection_pool_maxsize = CONNECTION_POOL_SIZE
        kubernetes.config.load_kube_config(config_file=str(path), client_configuration=config)  # type: ignore[no-untyped-call]
        return cls(kubernetes.client.ApiClient(config))

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> JSON | None:
        """The object, or None when it does not exist."""
        if self.cache is not None and namespace is not None and self.cache.serves(api_version, kind, namespace):
            return self.cache.get(api_version, kind, namespace, name)
        return self._call("GET", resource_path(api_version, kind, namespace, name))

    def list_objects(self, api_version: str, kind: str, namespace: str | None, selector: str = "",
                     field_selector: str = "") -> list[JSON]:
        if self.cache is not None and not field_selector and self.cache.serves(api_version, kind, namespace, selector):
            return self.cache.select(api_version, kind, namespace, selector)
        query = [(k, v) for k, v in (("labelSelector", selector), ("fieldSelector", field_selector)) if v]
        result = self._call("GET", resource_path(api_version, kind, namespace), query=query)
        items: list[JSON] = (result or {}).get("items", [])
        return items

    def discover(self, api_version: str) -> set[str]:
        """The resources (plurals) the API server serves in a group version; empty when it serves none."""
        prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        found = self._call("GET", prefix)
        return {str(r.get("name")) for r in (found or {}).get("resources", [])}

    def create(self, obj: JSON) -> JSON:
        meta = obj["metadata"]
        result = self._call("POST", resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace")), body=obj)
        return result or {}

    def replace(self, obj: JSON) -> JSON:
        """PUT the whole object. The API server refuses it (409) unless `metadata.resourceVersion`
        is the stored one: an update only of what was read."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        return self._call("PUT", path, body=obj) or {}

    def patch(self, api_version: str, kind: str, namespace: str | None, name: str, patch: JSON,
              subresource: str | None = None, strategic: bool = False) -> JSON:
        """A JSON merge patch of an object or of its subresource; `strategic`: a strategic merge patch
        (built-in kinds only), which merges lists such as a Pod's conditions by their key instead of
        replacing them."""
        content_type = "application/strategic-merge-patch+json" if strategic else "application/merge-patch+json"
        result = self._call("PATCH", resource_path(api_version, kind, namespace, name, subresource), body=patch,
                            content_type=content_type)
        return self._observe(result)

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str,
               grace_seconds: int | None = None, uid: str | None = None) -> None:
        """Delete an object (already gone is fine); `uid` guards against deleting a successor."""
        options: JSON = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if grace_seconds is not None:
            options["gracePeriodSeconds"] = grace_seconds
        if uid is not None:
            options["preconditions"] = {"uid": uid}
        try:
            self._call("DELETE", resource_path(api_version, kind, namespace, name), body=options)
        except KubeError as error:
            if error.status not in (404, 409):
                raise

    def service_account_token(self, namespace: str, service_account: str, seconds: int = 3600) -> str:
        """A bound token of a ServiceAccount (the TokenRequest API, as the kubelet uses)."""
        path = resource_path("v1", "ServiceAccount", namespace, service_account, "token")
        result = self._call("POST", path, body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                                "spec": {"expirationSeconds": seconds}})
        return str((result or {}).get("status", {}).get("token", ""))

    def list_servings(self, namespace: str | None) -> list[JSON]:
        """Every DisaggregatedServing in `namespace`, or in the cluster when None."""
        if self.cache is not None and self.cache.serves(models.API_VERSION, models.KIND, namespace, ""):
            return self.cache.select(models.API_VERSION, models.KIND, namespace)
        path = (resource_path(models.API_VERSION, models.KIND, namespace) if namespace
                else f"/apis/{models.API_VERSION}/{models.PLURAL}")
        result = self._call("GET", path)
        items: list[JSON] = (result or {}).get("items", [])
        for item in items:  # lists omit these per item
            item.setdefault("apiVersion", models.API_VERSION)
            item.setdefault("kind", models.KIND)
        return items

    def apply(self, obj: JSON) -> JSON:
        """Server-side apply with the operator's field manager, taking ownership of its fields."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        result = self._call("PATCH", path, body=obj, content_type="application/apply-patch+yaml",
                            query=[("fieldManager", FIELD_MANAGER), ("force", "true")])
        return self._observe(result)

    def apply_all(self, objects: list[JSON]) -> list[JSON]:
        """Server-side apply of several objects at once; their results in order. Every apply is
        attempted; the first failure is raised after all have finished."""
        if len(objects) <= 1:
            return [self.apply(obj) for obj in objects]
        with self._applier_guard:
            if self._applier is None:
                self._applier = ThreadPoolExecutor(max_workers=PARALLEL_APPLIES, thread_name_prefix="apply")
            applier = self._applier
        futures = [applier.submit(self.apply, obj) for obj in objects]
        errors = [error for future in futures if (error := future.exception()) is not None]
        if errors:
            raise errors[0]
        return [future.result() for future in futures]

    def patch_status(self, namespace: str, name: str, status: JSON) -> JSON:
        """Merge-patch the status subresource of a DisaggregatedServing; the object it returns."""
        path = resource_path(models.API_VERSION, models.KIND, namespace, name, "status")
        result = self._call("PATCH", path, body={"status": status}, content_type="application/merge-patch+json")
        if result is not None:
            result.setdefault("apiVersion", models.API_VERSION)
            result.setdefault("kind", models.KIND)
        return self._observe(result)

    def event(self, owner: JSON, event_type: str, reason: str, message: str) -> None:
        """Record an Event on `owner` (shown by `kubectl describe`). Failures are logged, not raised:
        an Event is never worth failing a reconcile for."""
        meta = owner["metadata"]
        now = rfc3339()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid")},
            "type": event_type,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self._call("POST", resource_path("v1", "Event", meta["namespace"]), body=event)
        except KubeError as error:
            log.warning("could not record event %s on %s: %s", reason, meta["name"], error)


def _reason(raw: bytes | None) -> str:
    """The message of a Kubernetes Status body, or the raw text."""
    try:
        return str(json.loads(raw or b"{}").get("message") or raw)
    except (TypeError, ValueError, AttributeError):
        return str(raw)
