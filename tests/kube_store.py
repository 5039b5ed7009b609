"""The object store behind the fake Kubernetes API (``tests/kube_api.py``): what the API
server and etcd do for a backend, in memory, without HTTP.

Semantics kept (those a backend relies on):

- one global ``resourceVersion`` counter: every change (create, update, patch, delete)
  takes the next value, and the object carries it in ``metadata.resourceVersion``;
  an update or patch that changes nothing takes none and makes no event;
- create: ``AlreadyExists`` (409) for a taken name, ``generateName``, uid and
  creationTimestamp filled in, the namespace must exist (404 otherwise), ``status`` of a
  kind with a status subresource reset to its default (a pod starts ``Pending``);
- update and patch (merge, strategic merge, JSON patch, apply): ``Conflict`` (409) when the
  body's ``metadata.resourceVersion`` is not the current one (a body without one is an
  unconditional write), ``NotFound`` (404) for a missing object; the main resource keeps
  ``status``, the ``status`` subresource changes only ``status``;
- delete (with ``preconditions``), delete of a collection by selector, a namespace's
  delete takes its objects with it (at once: no Terminating phase, no grace period, no
  finalizers, no garbage collection of owner references);
- label selectors (``=``, ``==``, ``!=``, ``in``, ``notin``, ``key``, ``!key``) and field
  selectors (``metadata.name``, ``metadata.namespace``, ``status.phase``, ``spec.nodeName``);
- watches: an event per change kept in a bounded history; a watch from a
  resourceVersion replays what came after it, or is ``Gone`` (410) when that part of the
  history is no longer kept; a watch with a selector sees an object that stops matching as
  DELETED and one that starts matching as ADDED, as the API server's watch cache does.

Not kept: admission, validation of the objects' schema, defaulting beyond the above,
field ownership of server-side apply (apply is a strategic merge), and the kubelet (see
``tests/kubelet.py``)."""

from __future__ import annotations

import base64
import collections
import copy
import datetime
import json
import secrets
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.kube_ops import EVERYTHING, KubeError, Obj, Selector, apply_patch, bad_request


@dataclass(frozen=True)
class Kind:
    """One resource the fake serves."""

    plural: str
    kind: str
    group: str  # "" for the core group
    version: str
    namespaced: bool
    #: Has a ``status`` subresource: writes to the object leave its status alone.
    status: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


KINDS = {
    k.plural: k
    for k in (
        Kind("namespaces", "Namespace", "", "v1", namespaced=False, status=True),
        Kind("pods", "Pod", "", "v1", namespaced=True, status=True),
        Kind("secrets", "Secret", "", "v1", namespaced=True, status=False),
        Kind("configmaps", "ConfigMap", "", "v1", namespaced=True, status=False),
        Kind("persistentvolumeclaims", "PersistentVolumeClaim", "", "v1", True, True),
        Kind("services", "Service", "", "v1", namespaced=True, status=True),
        Kind("networkpolicies", "NetworkPolicy", "networking.k8s.io", "v1", True, False),
        Kind("leases", "Lease", "coordination.k8s.io", "v1", namespaced=True, status=False),
    )
}

#: Changes kept for watches to resume from. A test makes far fewer, so a 410 comes only
#: from ``compact()`` or from a smaller history that a test asks for.
HISTORY = 1000

#: What a new object's ``status`` is (kinds with a status subresource).
DEFAULT_STATUS: dict[str, Obj] = {
    "namespaces": {"phase": "Active"},
    "pods": {"phase": "Pending"},
    "persistentvolumeclaims": {"phase": "Pending"},
    "services": {"loadBalancer": {}},
}


def not_found(kind: Kind, name: str) -> KubeError:
    return KubeError(
        404, "NotFound", f'{kind.plural} "{name}" not found', {"name": name, "kind": kind.plural}
    )


def conflict(kind: Kind, name: str) -> KubeError:
    return KubeError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {kind.plural} "{name}": the object has been '
        "modified; please apply your changes to the latest version and try again",
        {"name": name, "kind": kind.plural},
    )


def invalid(kind: Kind, name: str, why: str) -> KubeError:
    return KubeError(
        422,
        "Invalid",
        f'{kind.kind} "{name}" is invalid: {why}',
        {"name": name, "kind": kind.plural},
    )


# -- the store ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """One event of the history: an object before and after (``None``: absent)."""

    rv: int
    kind: Kind
    old: Obj | None
    new: Obj | None


def _event_for(change: Change, namespace: str | None, matches: Callable[[Obj], bool]) -> Obj | None:
    """The watch event a watcher of ``namespace`` with ``matches`` sees, if any."""
    obj = change.new or change.old
    assert obj is not None
    if namespace is not None and obj["metadata"].get("namespace") != namespace:
        return None
    was = change.old is not None and matches(change.old)
    now = change.new is not None and matches(change.new)
    if was and now:
        return {"type": "MODIFIED", "object": change.new}
    if now:
        return {"type": "ADDED", "object": change.new}
    if was:  # gone, or no longer matching: the last state it is seen in
        return {"type": "DELETED", "object": change.new or change.old}
    return None


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Watcher:
    """One open watch: events land in ``push`` (called under the store's lock)."""

    def __init__(
        self,
        kind: Kind,
        namespace: str | None,
        matches: Callable[[Obj], bool],
        push: Callable[[Obj], None],
    ) -> None:
        self.kind = kind
        self.namespace = namespace
        self.matches = matches
        self.push = push

    def offer(self, change: Change) -> None:
        if change.kind is self.kind:
            event = _event_for(change, self.namespace, self.matches)
            if event is not None:
                self.push(copy.deepcopy(event))


class Store:
    """All objects, the resourceVersion counter, and the recent history of changes.

    Thread-safe (one lock): the HTTP server calls it on its loop, a test may read it from
    another thread. ``history``: how many changes are kept for watches to resume from."""

    def __init__(self, history: int = HISTORY) -> None:
        self._lock = threading.RLock()
        self.rv = 0
        self._objects: dict[tuple[str, str, str], Obj] = {}
        self._history: collections.deque[Change] = collections.deque(maxlen=history)
        #: Changes up to this resourceVersion are forgotten: resuming before it is Gone.
        self._forgotten = 0
        self._watchers: set[Watcher] = set()
        self.create("namespaces", None, {"metadata": {"name": "default"}})

    # -- reads -------------------------------------------------------------------------

    def get(self, plural: str, namespace: str | None, name: str) -> Obj:
        kind = KINDS[plural]
        with self._lock:
            obj = self._objects.get((plural, namespace or "", name))
            if obj is None:
                raise not_found(kind, name)
            return copy.deepcopy(obj)

    def find(
        self, plural: str, namespace: str | None, selector: Selector = EVERYTHING
    ) -> tuple[list[Obj], int]:
        """Matching objects, by namespace and name, and the resourceVersion they are at."""
        matches = selector.compile()
        with self._lock:
            found = [
                copy.deepcopy(obj)
                for (p, ns, _), obj in sorted(self._objects.items())
                if p == plural and (namespace is None or ns == namespace) and matches(obj)
            ]
            return found, self.rv

    # -- writes ------------------------------------------------------------------------

    def create(self, plural: str, namespace: str | None, body: Obj) -> Obj:
        kind = KINDS[plural]
        meta = dict(body.get("metadata") or {})
        name = meta.get("name") or ""
        if not name and meta.get("generateName"):
            name = meta["generateName"] + secrets.token_hex(3)[:5]
        if not name:
            raise invalid(
                kind, "", "metadata.name: Required value: name or generateName is required"
            )
        if meta.get("resourceVersion"):
            raise invalid(kind, name, "metadata.resourceVersion: must be empty on create")
        ns = self._namespace_of(kind, namespace, meta)
        with self._lock:
            if kind.namespaced and ("namespaces", "", ns) not in self._objects:
                raise not_found(KINDS["namespaces"], ns)
            if (plural, ns, name) in self._objects:
                raise KubeError(
                    409,
                    "AlreadyExists",
                    f'{plural} "{name}" already exists',
                    {"name": name, "kind": plural},
                )
            obj = _with_secret_data(kind, copy.deepcopy(body))
            obj["apiVersion"], obj["kind"] = kind.api_version, kind.kind
            meta.update(name=name, uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
            if kind.namespaced:
                meta["namespace"] = ns
            obj["metadata"] = meta
            if kind.status:
                obj["status"] = copy.deepcopy(DEFAULT_STATUS.get(plural, {}))
            return self._commit(kind, None, obj)

    def replace(
        self, plural: str, namespace: str | None, name: str, body: Obj, *, subresource: str = ""
    ) -> Obj:
        """PUT: the body is the whole new object (or its status, for ``status``)."""
        kind = KINDS[plural]
        if (body.get("metadata") or {}).get("name", name) != name:
            raise bad_request("the name of the object does not match the name in the URL")
        with self._lock:
            old = self._current(kind, namespace, name)
            return self._write(kind, old, _with_secret_data(kind, copy.deepcopy(body)), subresource)

    def patch(
        self,
        plural: str,
        namespace: str | None,
        name: str,
        patch_type: str,
        patch: Any,
        *,
        subresource: str = "",
    ) -> Obj:
        kind = KINDS[plural]
        with self._lock:
            old = self._current(kind, namespace, name)
            new = apply_patch(patch_type, old, patch)
            return self._write(kind, old, _with_secret_data(kind, new), subresource)

    def delete(
        self, plural: str, namespace: str | None, name: str, preconditions: Obj | None = None
    ) -> Obj:
        kind = KINDS[plural]
        with self._lock:
            old = self._current(kind, namespace, name)
            wanted = preconditions or {}
            if wanted.get("resourceVersion") not in (None, old["metadata"]["resourceVersion"]):
                raise conflict(kind, name)
            if wanted.get("uid") not in (None, old["metadata"]["uid"]):
                raise conflict(kind, name)
            if plural == "namespaces":
                for p, ns, n in sorted(self._objects):
                    if ns == name:
                        self._delete(KINDS[p], self._objects[(p, ns, n)])
            return self._delete(kind, old)

    def delete_collection(
        self, plural: str, namespace: str | None, selector: Selector
    ) -> list[Obj]:
        with self._lock:
            found, _ = self.find(plural, namespace, selector)
            return [
                self.delete(plural, o["metadata"].get("namespace"), o["metadata"]["name"])
                for o in found
            ]

    # -- watches -----------------------------------------------------------------------

    def watch(
        self,
        plural: str,
        namespace: str | None,
        selector: Selector,
        since: str | None,
        push: Callable[[Obj], None],
    ) -> Watcher:
        """Register a watcher; first push what it must see before live changes: every
        matching object as ADDED (no ``since``, or "0"), or the history after ``since``
        (``Gone`` when part of it is forgotten)."""
        kind = KINDS[plural]
        matches = selector.compile()
        watcher = Watcher(kind, namespace, matches, push)
        with self._lock:
            if since in (None, "", "0"):
                for obj in self.find(plural, namespace, selector)[0]:
                    push({"type": "ADDED", "object": obj})
            else:
                try:
                    start = int(since or "")
                except ValueError:
                    raise bad_request(f"invalid resourceVersion: {since!r}") from None
                if start < self._forgotten:
                    raise KubeError(
                        410, "Expired", f"too old resource version: {start} ({self._forgotten + 1})"
                    )
                for change in self._history:
                    if change.rv > start:
                        watcher.offer(change)
            self._watchers.add(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        with self._lock:
            self._watchers.discard(watcher)

    def compact(self) -> None:
        """Forget the whole history, as etcd's compaction does: every watch that resumes
        from a resourceVersion before now is ``Gone``."""
        with self._lock:
            self._history.clear()
            self._forgotten = self.rv

    # -- inside ------------------------------------------------------------------------

    def _namespace_of(self, kind: Kind, namespace: str | None, meta: Obj) -> str:
        if not kind.namespaced:
            return ""
        if namespace and meta.get("namespace") not in (None, namespace):
            raise bad_request("the namespace of the object does not match the namespace in the URL")
        ns = namespace or meta.get("namespace")
        if not ns:
            raise bad_request("a namespace is required")
        return str(ns)

    def _current(self, kind: Kind, namespace: str | None, name: str) -> Obj:
        obj = self._objects.get((kind.plural, namespace or "", name))
        if obj is None:
            raise not_found(kind, name)
        return copy.deepcopy(obj)

    def _write(self, kind: Kind, old: Obj, new: Obj, subresource: str) -> Obj:
        name = old["metadata"]["name"]
        given = (new.get("metadata") or {}).get("resourceVersion")
        if given not in (None, "", old["metadata"]["resourceVersion"]):
            raise conflict(kind, name)
        if subresource == "status":
            result = copy.deepcopy(old)
            result["status"] = new.get("status", {})
        elif subresource:
            raise not_found(kind, f"{name}/{subresource}")
        else:
            result = new
            result["apiVersion"], result["kind"] = kind.api_version, kind.kind
            meta = result.setdefault("metadata", {})
            for kept in ("name", "namespace", "uid", "creationTimestamp", "generation"):
                if kept in old["metadata"]:
                    meta[kept] = old["metadata"][kept]
                else:
                    meta.pop(kept, None)
            if kind.status and "status" in old:
                result["status"] = old["status"]
            elif kind.status:
                result.pop("status", None)
            if result.get("spec") != old.get("spec"):
                meta["generation"] = old["metadata"].get("generation", 1) + 1
        result["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if result == old:  # a no-op: no new resourceVersion, no event
            return result
        return self._commit(kind, old, result)

    def _delete(self, kind: Kind, old: Obj) -> Obj:
        meta = old["metadata"]
        del self._objects[(kind.plural, meta.get("namespace", ""), meta["name"])]
        self.rv += 1
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = str(self.rv)
        # A DELETED event carries the object as it was, at the deletion's resourceVersion.
        self._record(Change(self.rv, kind, gone, None))
        return gone

    def _commit(self, kind: Kind, old: Obj | None, new: Obj) -> Obj:
        self.rv += 1
        new["metadata"]["resourceVersion"] = str(self.rv)
        meta = new["metadata"]
        self._objects[(kind.plural, meta.get("namespace", ""), meta["name"])] = new
        self._record(Change(self.rv, kind, old, new))
        return copy.deepcopy(new)

    def _record(self, change: Change) -> None:
        if len(self._history) == self._history.maxlen:
            self._forgotten = self._history[0].rv
        self._history.append(change)
        for watcher in list(self._watchers):
            watcher.offer(change)


def _with_secret_data(kind: Kind, obj: Obj) -> Obj:
    """A Secret's ``stringData`` goes into ``data``, base64-encoded (write-only field)."""
    if kind.plural == "secrets" and isinstance(obj.get("stringData"), dict):
        data = dict(obj.get("data") or {})
        for key, value in obj.pop("stringData").items():
            data[key] = base64.b64encode(str(value).encode()).decode()
        obj["data"] = data
    return obj


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
