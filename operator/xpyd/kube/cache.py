"""Watch-fed read caches (client-go's informers, in small).

A `Reflector` LISTs one kind (in one namespace, or in all) with a label selector, then follows it
with WATCHes from the list's resourceVersion, keeping the objects in memory and calling
`on_change(old, new)` after every change. A watch that ends normally (its timeoutSeconds) is
resumed from the last resourceVersion (bookmarks keep that fresh); one that fails (410 Gone, a
dropped connection, a refused verb) is followed by a fresh LIST after a pause, and the LIST's
differences are announced like watch events. `synced` is set once the first LIST has landed:
until then the cache does not answer for the kind, and readers go to the API server.

A `Cache` holds the reflectors of several kinds, one per kind and namespace scope, and answers
`get` and `list` the way `Kube` does. `Kube.cache` plugs it into the client: reads of a kind the
cache serves are answered from memory, writes still go to the API server, and the objects they
return are written through, so a reconcile right after a write sees it before its watch event
arrives. An object is replaced only by one at least as new (resourceVersions are compared as
integers when both are, which the API server's are; otherwise the latest arrival wins).

Objects are stored through a `transform` (managedFields dropped; a kind may reduce them further,
as the operator does its pods), which keeps the memory of a thousand pools small. `get` and
`select` hand out the cache's own objects, not copies (a deep copy of a Deployment costs more than
the rest of a reconcile): callers must not modify them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from xpyd.common.jsontypes import JSON
from xpyd.kube.client import Kube, KubeError, resource_path

log = logging.getLogger(__name__)

#: Server-side end of one watch request (jittered by up to a fifth, so reflectors do not all
#: reconnect at once); the reflector then re-watches from the last resourceVersion.
WATCH_SECONDS: Final = 300
#: Pause before a LIST after a failed or expired watch.
RELIST_PAUSE_SECONDS: Final = 1.0
CONNECT_TIMEOUT_SECONDS: Final = 10.0
LIST_TIMEOUT_SECONDS: Final = 60.0

Transform = Callable[[JSON], JSON]
OnChange = Callable[[JSON | None, JSON | None], None]


def parse_selector(selector: str) -> list[tuple[str, str | None]]:
    """`a=b,c` as [("a", "b"), ("c", None)]: equality and existence terms, the kinds of selector
    the operator and the proxy use. Anything else (`!=`, `in (...)`) is refused."""
    terms: list[tuple[str, str | None]] = []
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if any(op in term for op in ("!", " in ", " notin ", "(")):
            raise ValueError(f"unsupported label selector term {term!r}")
        key, sep, value = term.partition("==" if "==" in term else "=")
        terms.append((key.strip(), value.strip() if sep else None))
    return terms


def selector_matches(labels: dict[str, str] | None, terms: list[tuple[str, str | None]]) -> bool:
    labels = labels or {}
    return all(key in labels if value is None else labels.get(key) == value for key, value in terms)


def implies(terms: list[tuple[str, str | None]], other: list[tuple[str, str | None]]) -> bool:
    """Whether every object matching `terms` matches `other`."""
    given = dict(terms)
    return all(key in given and (value is None or given[key] == value) for key, value in other)


def without_managed_fields(obj: JSON) -> JSON:
    """The object without metadata.managedFields (often half of its size, and never read here)."""
    meta = obj.get("metadata")
    if isinstance(meta, dict) and "managedFields" in meta:
        obj = {**obj, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}
    return obj


def _version(obj: JSON) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def is_not_older(candidate: JSON, current: JSON) -> bool:
    """Whether `candidate` may replace `current` (see the module docstring)."""
    new, old = _version(candidate), _version(current)
    if new.isdigit() and old.isdigit():
        return int(new) >= int(old)
    return True


def _key(obj: JSON) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def watch_lines(raw: Any, stopping: threading.Event) -> Iterator[JSON]:
    """The JSON events of one streaming watch response, as they arrive."""
    buffer = b""
    for chunk in raw.stream(amt=None, decode_content=False):
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)
        if stopping.is_set():
            return


class Reflector:
    """One kind in one scope, listed and watched into memory (see the module docstring)."""

    def __init__(self, kube: Kube, api_version: str, kind: str, namespace: str | None, selector: str = "",
                 transform: Transform = without_managed_fields, on_change: OnChange | None = None,
                 watch_seconds: float = WATCH_SECONDS, index_label: str | None = None) -> None:
        self.kube = kube
        self.api_version, self.kind, self.namespace, self.selector = api_version, kind, namespace, selector
        self.transform = transform
        self.on_change = on_change
        self.watch_seconds = watch_seconds
        self.synced = threading.Event()
        self.stopping = threading.Event()
        try:
            self._terms: list[tuple[str, str | None]] | None = parse_selector(selector)
        except ValueError:
            self._terms = None  # a set-based selector: only the server filters
        self._objects: dict[tuple[str, str], JSON] = {}
        #: (namespace, value of `index_label`) -> keys: a list by that label reads only its objects.
        self.index_label = index_label
        self._index: dict[tuple[str, str], dict[tuple[str, str], None]] = {}  # an ordered set
        self._lock = threading.Lock()
        self._response: Any = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        scope = self.namespace or "*"
        return f"{self.kind}[{scope}{' ' + self.selector if self.selector else ''}]"

    # --- reads --------------------------------------------------------------------------------

    def get(self, namespace: str, name: str) -> JSON | None:
        with self._lock:
            return self._objects.get((namespace, name))

    def select(self, namespace: str | None, selector: str = "") -> list[JSON]:
        terms = parse_selector(selector)
        indexed = dict(terms).get(self.index_label) if self.index_label and namespace is not None else None
        with self._lock:
            if indexed is not None:
                candidates = [(key, self._objects[key]) for key in self._index.get((namespace or "", indexed), ())]
            else:
                candidates = list(self._objects.items())
            return [obj for (ns, _), obj in candidates if (namespace is None or ns == namespace)
                    and selector_matches((obj.get("metadata") or {}).get("labels"), terms)]

    def _index_key(self, key: tuple[str, str], obj: JSON) -> tuple[str, str] | None:
        if self.index_label is None:
            return None
        value = ((obj.get("metadata") or {}).get("labels") or {}).get(self.index_label)
        return (key[0], value) if value is not None else None

    def _store(self, key: tuple[str, str], obj: JSON | None) -> JSON | None:
        """Set (or, with None, drop) one object and its index entry, under the lock; the old one."""
        old = self._objects.pop(key, None) if obj is None else self._objects.get(key)
        if obj is not None:
            self._objects[key] = obj
        if self.index_label is not None:
            before = self._index_key(key, old) if old is not None else None
            after = self._index_key(key, obj) if obj is not None else None
            if before != after and before is not None:
                self._index[before].pop(key, None)
                if not self._index[before]:
                    del self._index[before]
            if after is not None:
                self._index.setdefault(after, {})[key] = None
        return old

    def keys(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._objects)

    def __len__(self) -> int:
        return len(self._objects)

    # --- writes -------------------------------------------------------------------------------

    def observe(self, obj: JSON) -> None:
        """Write through an object an API write returned. Not announced: the writer knows, and the
        watch event of the same version is then no change."""
        self._upsert(self.transform(obj), announce=False)

    def _upsert(self, obj: JSON, announce: bool = True) -> None:
        key = _key(obj)
        if self._terms is not None and not selector_matches((obj.get("metadata") or {}).get("labels"), self._terms):
            self._remove(key, announce)  # it lost the labels the reflector selects
            return
        with self._lock:
            old = self._objects.get(key)
            if old is not None and (_version(old) == _version(obj) or not is_not_older(obj, old)):
                return
            self._store(key, obj)
        if announce:
            self._announce(old, obj)

    def _remove(self, key: tuple[str, str], announce: bool = True) -> None:
        with self._lock:
            old = self._store(key, None)
        if old is not None and announce:
            self._announce(old, None)

    def _announce(self, old: JSON | None, new: JSON | None) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(old, new)
        except Exception:  # a bug in a consumer must not stop the watch
            log.exception("%r: change handler failed", self)

    # --- the thread ---------------------------------------------------------------------------

    def start(self) -> threading.Thread:
        """Run in a daemon thread (a blocked watch read never delays the process's exit)."""
        self._thread = threading.Thread(target=self.run, name=f"reflector-{self!r}", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """End the thread soon: interrupts a watch blocked in a read."""
        self.stopping.set()
        response = self._response
        if response is not None:
            with contextlib.suppress(Exception):
                response.shutdown()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def run(self) -> None:
        """LIST, WATCH, repeat until `stopping` is set."""
        while not self.stopping.is_set():
            try:
                version = self.relist()
                while version and not self.stopping.is_set():
                    started = time.monotonic()
                    version = self._watch(version)
                    if time.monotonic() - started < RELIST_PAUSE_SECONDS:  # never spin on a watch that ends at once
                        self.stopping.wait(RELIST_PAUSE_SECONDS)
            except (KubeError, OSError, ValueError) as error:
                if self.stopping.is_set():
                    return
                log.warning("%r: %s", self, error)
            except Exception:  # the thread must outlive any surprise from the client library
                if self.stopping.is_set():
                    return
                log.exception("%r: unexpected error", self)
            self.stopping.wait(RELIST_PAUSE_SECONDS)

    def _query(self) -> list[tuple[str, str]]:
        return [("labelSelector", self.selector)] if self.selector else []

    def relist(self) -> str:
        """One LIST into the store (differences announced); the resourceVersion to watch from."""
        response = self.kube.open("GET", self._path(), self._query(), (CONNECT_TIMEOUT_SECONDS, LIST_TIMEOUT_SECONDS))
        result: JSON = json.loads(response.read())
        listed: dict[tuple[str, str], JSON] = {}
        for item in result.get("items") or []:
            item.setdefault("apiVersion", self.api_version)  # lists omit these per item
            item.setdefault("kind", self.kind)
            listed[_key(item)] = self.transform(item)
        with self._lock:
            gone = [key for key in self._objects if key not in listed]
        for key in gone:
            self._remove(key)
        for obj in listed.values():
            self._upsert(obj)
        self.synced.set()
        return str((result.get("metadata") or {}).get("resourceVersion") or "")

    def _path(self) -> str:
        return resource_path(self.api_version, self.kind, self.namespace)

    def _watch(self, version: str) -> str:
        """One watch request; the resourceVersion to continue from, or "" to LIST again."""
        seconds = int(self.watch_seconds * random.uniform(0.8, 1.0))
        query = [*self._query(), ("watch", "true"), ("resourceVersion", version), ("allowWatchBookmarks", "true"),
                 ("timeoutSeconds", str(max(1, seconds)))]
        response = self.kube.open("GET", self._path(), query, (CONNECT_TIMEOUT_SECONDS, seconds + 30.0))
        raw = self._response = response.response
        try:
            for event in watch_lines(raw, self.stopping):
                kind = event.get("type")
                obj = event.get("object") or {}
                if kind == "ERROR":  # 410 Gone: the version is too old
                    log.info("%r: watch error %s; listing again", self, obj.get("message"))
                    return ""
                version = _version(obj) or version
                if kind == "BOOKMARK" or "name" not in (obj.get("metadata") or {}):
                    continue
                obj.setdefault("apiVersion", self.api_version)
                obj.setdefault("kind", self.kind)
                if kind == "DELETED":
                    self._remove(_key(obj))
                else:
                    self._upsert(self.transform(obj))
        finally:
            self._response = None
            raw.release_conn()
        return version


@dataclass(frozen=True)
class Kind:
    """One kind a `Cache` holds: which objects (the label selector) and how they are stored."""

    api_version: str
    kind: str
    selector: str = ""
    transform: Transform = without_managed_fields
    #: A label whose value lists of this kind usually select (indexed: see `Reflector.select`).
    index_label: str | None = None


@dataclass
class Cache:
    """Reflectors of several kinds, in every namespace (`namespaces` empty) or in the listed ones."""

    kube: Kube
    kinds: Iterable[Kind]
    namespaces: list[str] = field(default_factory=list)
    on_change: Callable[[Kind, JSON | None, JSON | None], None] | None = None
    watch_seconds: float = WATCH_SECONDS
    reflectors: dict[tuple[str, str], list[Reflector]] = field(init=False, default_factory=dict)
    _started: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        kinds, self.kinds = list(self.kinds), []
        for spec in kinds:
            self.add(spec)

    def add(self, spec: Kind) -> None:
        """Hold one more kind from now on (started at once when the cache has started)."""
        key = (spec.api_version, spec.kind)
        if key in self.reflectors:
            return
        scopes: list[str | None] = list(self.namespaces) or [None]
        group = [Reflector(self.kube, spec.api_version, spec.kind, scope, spec.selector, spec.transform,
                           self._forward(spec), self.watch_seconds, spec.index_label) for scope in scopes]
        self.kinds = [*self.kinds, spec]
        self.reflectors[key] = group
        if self._started:
            for reflector in group:
                reflector.start()

    def _forward(self, spec: Kind) -> OnChange | None:
        if self.on_change is None:
            return None
        on_change = self.on_change
        return lambda old, new: on_change(spec, old, new)

    def all(self) -> list[Reflector]:
        return [r for group in list(self.reflectors.values()) for r in group]

    def start(self) -> None:
        self._started = True
        for reflector in self.all():
            reflector.start()

    def stop(self) -> None:
        for reflector in self.all():
            reflector.stop()
        for reflector in self.all():
            reflector.join(5.0)

    def wait_synced(self, timeout: float) -> list[Reflector]:
        """Wait until every reflector has listed once; the ones that have not, after `timeout`."""
        deadline = time.monotonic() + timeout
        for reflector in self.all():
            reflector.synced.wait(max(0.0, deadline - time.monotonic()))
        return [r for r in self.all() if not r.synced.is_set()]

    def _covering(self, api_version: str, kind: str, namespace: str | None) -> list[Reflector] | None:
        """The reflectors answering for `namespace` (None: every namespace), or None if the cache
        cannot answer (kind not cached, namespace outside its scopes, not listed yet)."""
        group = self.reflectors.get((api_version, kind))
        if group is None:
            return None
        if namespace is not None:
            group = [r for r in group if r.namespace is None or r.namespace == namespace]
        elif any(r.namespace is not None for r in group):
            return None  # every namespace asked, but only some are cached
        if not group or not all(r.synced.is_set() for r in group):
            return None
        return group

    def serves(self, api_version: str, kind: str, namespace: str | None, selector: str | None = None) -> bool:
        """Whether the cache can answer a read of `kind` in `namespace`: a get by name (`selector`
        None: an object the cache does not hold is not one of the operator's), or a list restricted
        to `selector`, which must imply the cache's own selector (it holds nothing else)."""
        group = self._covering(api_version, kind, namespace)
        if group is None:
            return False
        return selector is None or implies(parse_selector(selector), parse_selector(group[0].selector))

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> JSON | None:
        for reflector in self._covering(api_version, kind, namespace) or []:
            found = reflector.get(namespace, name)
            if found is not None:
                return found
        return None

    def select(self, api_version: str, kind: str, namespace: str | None, selector: str = "") -> list[JSON]:
        return [obj for reflector in self._covering(api_version, kind, namespace) or []
                for obj in reflector.select(namespace, selector)]

    def observe(self, obj: JSON) -> None:
        """Write through an object an API write returned (ignored when the kind is not cached)."""
        namespace = (obj.get("metadata") or {}).get("namespace")
        for reflector in self.reflectors.get((obj.get("apiVersion", ""), obj.get("kind", "")), []):
            if reflector.namespace is None or reflector.namespace == namespace:
                reflector.observe(obj)
