"""A fake Kubernetes API server over real HTTP on 127.0.0.1, for the kubernetes backend's
tests: no Kubernetes API server installs from the package registries this project uses.

    async with KubeApi() as api:                  # listening at api.url
        async with api.client("sandboxes") as k:  # a lightkube AsyncClient for it
            await k.create(Namespace(metadata=ObjectMeta(name="sandboxes")))
        api.writes("pods")                        # write requests on pods so far
        api.store.find("pods", "sandboxes")       # the objects, without HTTP
        api.store.compact()                       # every older watch resumes to a 410

    with in_thread(KubeApi()) as api:             # the same, served from its own thread,
        api.kubeconfig(tmp_path / "kubeconfig")   # for a server run as a subprocess

What it emulates is the object store's (``tests/kube_store.py`` says which semantics, and
which not); here is the HTTP: the REST paths of the kinds in ``kube_store.KINDS``, their
``status`` subresource, errors as ``Status`` objects, watches (``?watch=true``) as a
stream of JSON lines ending with an ERROR event of code 410 when the resourceVersion to
resume from is too old, ``limit``/``continue`` paging, and the discovery documents
(``/version``, ``/api``, ``/apis``, ``/api/v1``, ``/apis/<group>/<version>``). Bodies are
JSON only: kubectl (``api.kubeconfig``) can get, list, watch and delete, but its creates
and updates of built-in kinds are protobuf, answered 415.

Built on aiohttp directly rather than on kmock's ``KubernetesEmulator``: the emulator has
no resourceVersions, conflicts, selectors, resumable watches or 410, and adding them
means overriding its private ``_internal`` request path; what is left of it to reuse is
the routing, which is 30 lines here.

Counts: ``api.counts`` has every request by (verb, resource), verbs as Kubernetes names
them (get, list, watch, create, update, patch, delete, deletecollection) and a
subresource written after its resource (``pods/status``); ``api.writes()`` sums the
writes, accepted or refused, so a bench can report API writes per claimed sandbox."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web
from lightkube import AsyncClient, KubeConfig
from lightkube.config.models import Cluster, User

from tests.kube_ops import PATCH_APPLY, KubeError, Obj, Selector, bad_request
from tests.kube_store import HISTORY, KINDS, Store, dumps

__all__ = ["KubeApi", "client_for", "in_thread"]

WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
#: Bounded waits of the threaded runner (start, stop): a loaded machine, never forever.
THREAD_WAIT_S = 30.0
#: The API server's own limit on a request body.
MAX_BODY = 3 * 1024 * 1024
JSON = "application/json"  # lightkube maps an error to ApiError only for exactly this type

T = TypeVar("T")


class KubeApi:
    """The fake API server. ``history``: how many changes stay resumable by watches."""

    def __init__(self, *, history: int = HISTORY) -> None:
        self.store = Store(history=history)
        #: Every request served, by (verb, resource); see the module's docstring.
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._streams: set[asyncio.Queue[Obj | None]] = set()

    # -- for tests ---------------------------------------------------------------------

    def writes(self, resource: str | None = None) -> int:
        """Write requests so far (any outcome), of one resource (``"pods/status"`` for a
        subresource) or of all."""
        return sum(
            n
            for (verb, res), n in self.counts.items()
            if verb in WRITE_VERBS and resource in (None, res)
        )

    def client(self, namespace: str = "default") -> AsyncClient:
        """A lightkube ``AsyncClient`` for this server (``async with`` it to close it)."""
        return client_for(self.url, namespace)

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """Write a kubeconfig file for this server (JSON is YAML), for KUBECONFIG."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake"}}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {"cluster": "fake", "user": "fake", "namespace": namespace},
                }
            ],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config))
        return path

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        site = web.SockSite(self._runner, sock)
        await site.start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def stop(self) -> None:
        for stream in list(self._streams):  # end every watch, so that none holds the stop
            stream.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> KubeApi:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- HTTP ----------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            parts = [p for p in request.path.split("/") if p]
            found = _discovery(parts)
            if found is not None:
                return _json(found)
            target = _Target.parse(parts)
            return await self._serve(request, target)
        except KubeError as exc:
            return _json(exc.status(), exc.code)
        except Exception as exc:  # a bug of the fake: seen by the client, as a real 500
            return _json(KubeError(500, "InternalError", f"the fake failed: {exc!r}").status(), 500)

    async def _serve(self, request: web.Request, t: _Target) -> web.StreamResponse:
        query = request.query
        selector = Selector(query.get("labelSelector", ""), query.get("fieldSelector", ""))
        resource = t.plural + (f"/{t.subresource}" if t.subresource else "")
        verb = _verb(request.method, t.name, query.get("watch") in ("true", "1"))
        self.counts[(verb, resource)] += 1
        store = self.store
        if verb == "watch":
            return await self._watch(request, t, selector)
        if verb == "list":
            items, rv = store.find(t.plural, t.namespace, selector)
            return _json(_page(t, items, rv, query.get("limit"), query.get("continue")))
        if verb == "deletecollection":
            gone = store.delete_collection(t.plural, t.namespace, selector)
            return _json(_list_of(t, gone, store.rv))
        if verb == "create":
            body = await _body(request)
            return _json(store.create(t.plural, t.namespace, body), 201)
        assert t.name is not None
        if verb == "get":
            # of pods/x/status too: the whole object, as the API server answers
            return _json(store.get(t.plural, t.namespace, t.name))
        if verb == "update":
            body = await _body(request)
            new = store.replace(t.plural, t.namespace, t.name, body, subresource=t.subresource)
            return _json(new)
        if verb == "patch":
            return _json(await self._patch(request, t))
        preconditions = (await _body(request, required=False)).get("preconditions")
        return _json(store.delete(t.plural, t.namespace, t.name, preconditions))

    async def _patch(self, request: web.Request, t: _Target) -> Obj:
        assert t.name is not None
        patch_type = request.content_type
        try:  # an apply patch may be YAML; lightkube's is JSON, the only one read here
            patch = json.loads(await request.text())
        except ValueError:
            raise bad_request("the patch is not JSON") from None
        if patch_type == PATCH_APPLY and not t.subresource:
            try:
                self.store.get(t.plural, t.namespace, t.name)
            except KubeError:  # apply creates what is missing (in a namespace that exists)
                return self.store.create(t.plural, t.namespace, patch)
        return self.store.patch(
            t.plural, t.namespace, t.name, patch_type, patch, subresource=t.subresource
        )

    async def _watch(self, request: web.Request, t: _Target, sel: Selector) -> web.StreamResponse:
        queue: asyncio.Queue[Obj | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def push(event: Obj) -> None:  # from the store, maybe on another thread
            loop.call_soon_threadsafe(queue.put_nowait, event)

        sel.compile()  # a bad selector is a 400, before the stream starts
        response = web.StreamResponse(headers={"Content-Type": JSON})
        await response.prepare(request)
        try:
            watcher = self.store.watch(
                t.plural, t.namespace, sel, request.query.get("resourceVersion"), push
            )
        except KubeError as exc:  # a watch fails inside its stream: an ERROR event
            await response.write(dumps({"type": "ERROR", "object": exc.status()}) + b"\n")
            return response
        timeout = float(request.query.get("timeoutSeconds") or 0) or None
        self._streams.add(queue)
        try:
            async with asyncio.timeout(timeout):
                while (event := await queue.get()) is not None:
                    await response.write(dumps(event) + b"\n")
        except (TimeoutError, ConnectionError):
            pass  # the watch's time is up, or its client went away
        finally:
            self.store.unwatch(watcher)
            self._streams.discard(queue)
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response


def client_for(url: str, namespace: str = "default") -> AsyncClient:
    """A lightkube ``AsyncClient`` for the fake API at ``url``."""
    # lightkube wants a user; the fake checks no credentials. trust_env=False: no proxy
    # from the environment between the test and 127.0.0.1.
    config = KubeConfig.from_one(
        cluster=Cluster(server=url), user=User(token="fake"), namespace=namespace
    )
    return AsyncClient(config, trust_env=False)


class _Target:
    """What a resource path names: a kind, maybe a namespace, name and subresource."""

    def __init__(self, plural: str, namespace: str | None, name: str | None, sub: str) -> None:
        self.plural = plural
        self.namespace = namespace
        self.name = name
        self.subresource = sub

    @classmethod
    def parse(cls, parts: list[str]) -> _Target:
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise _no_such_path()
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] in KINDS:
            namespace, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3 or rest[0] not in KINDS:
            raise _no_such_path()
        kind = KINDS[rest[0]]
        if (kind.group, kind.version) != (group, version):
            raise _no_such_path()
        if kind.namespaced and namespace is None and len(rest) > 1:
            raise _no_such_path()  # a namespaced object is reached through its namespace
        sub = rest[2] if len(rest) == 3 else ""
        if sub and (sub != "status" or not kind.status):
            raise _no_such_path()
        return cls(kind.plural, namespace, rest[1] if len(rest) > 1 else None, sub)


def _no_such_path() -> KubeError:
    return KubeError(404, "NotFound", "the server could not find the requested resource")


def _verb(method: str, name: str | None, watch: bool) -> str:
    if method == "GET":
        return "watch" if watch else ("get" if name else "list")
    verbs = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
    if method not in verbs:
        raise KubeError(405, "MethodNotAllowed", f"method {method} is not supported")
    verb = verbs[method]
    if verb == "create" and name:
        raise KubeError(405, "MethodNotAllowed", "create is on a collection")
    if verb in ("update", "patch") and not name:
        raise KubeError(405, "MethodNotAllowed", f"{verb} needs an object's name")
    return "deletecollection" if verb == "delete" and not name else verb


async def _body(request: web.Request, *, required: bool = True) -> Obj:
    if request.can_read_body and request.content_type != JSON:
        # kubectl writes built-in kinds as protobuf; the fake reads JSON only (lightkube's)
        raise KubeError(415, "UnsupportedMediaType", f"{request.content_type} is not read here")
    text = await request.text()
    if not text and not required:
        return {}
    try:
        body = json.loads(text)
    except ValueError:
        raise bad_request("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the request body is not a JSON object")
    return body


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=dumps(body), status=status, headers={"Content-Type": JSON})


def _list_of(t: _Target, items: list[Obj], rv: int, cont: str = "") -> Obj:
    kind = KINDS[t.plural]
    meta: Obj = {"resourceVersion": str(rv)}
    if cont:
        meta["continue"] = cont
    return {
        "kind": f"{kind.kind}List",
        "apiVersion": kind.api_version,
        "metadata": meta,
        "items": items,
    }


def _page(t: _Target, items: list[Obj], rv: int, limit: str | None, cont: str | None) -> Obj:
    """One page of a list: ``continue`` is the offset of the next page (a fake's token)."""
    start = int(cont or 0)
    if not limit:
        return _list_of(t, items[start:], rv)
    end = start + int(limit)
    return _list_of(t, items[start:end], rv, str(end) if end < len(items) else "")


def _discovery(parts: list[str]) -> Obj | None:
    """The discovery documents, for the kinds served; ``None``: not a discovery path."""
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for kind in KINDS.values():
        groups[kind.group].append(kind.version)
    if parts == ["version"]:
        return {
            "major": "1",
            "minor": "33",
            "gitVersion": "v1.33.0-fake",
            "platform": "linux/amd64",
        }
    if parts == ["api"]:
        return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
    if parts == ["apis"]:
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [_group(g, groups[g][0]) for g in sorted(groups) if g],
        }
    if len(parts) == 2 and parts[0] == "apis" and parts[1] in groups and parts[1]:
        return {"kind": "APIGroup", "apiVersion": "v1", **_group(parts[1], groups[parts[1]][0])}
    if parts == ["api", "v1"]:
        return _resources("", "v1")
    if len(parts) == 3 and parts[0] == "apis" and parts[2] in groups.get(parts[1], ()):
        return _resources(parts[1], parts[2])
    return None


#: kubectl's short names of the kinds (``kubectl get cm``).
SHORT_NAMES = {
    "configmaps": ("cm",),
    "namespaces": ("ns",),
    "pods": ("po",),
    "persistentvolumeclaims": ("pvc",),
    "services": ("svc",),
    "networkpolicies": ("netpol",),
}


def _group(group: str, version: str) -> Obj:
    gv = {"groupVersion": f"{group}/{version}", "version": version}
    return {"name": group, "versions": [gv], "preferredVersion": gv}


def _resources(group: str, version: str) -> Obj:
    verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
    found: list[Obj] = []
    for kind in KINDS.values():
        if (kind.group, kind.version) != (group, version):
            continue
        found.append(
            {
                "name": kind.plural,
                "singularName": kind.kind.lower(),
                "shortNames": list(SHORT_NAMES.get(kind.plural, ())),
                "namespaced": kind.namespaced,
                "kind": kind.kind,
                "verbs": verbs,
            }
        )
        if kind.status:
            found.append(
                {
                    "name": f"{kind.plural}/status",
                    "singularName": "",
                    "namespaced": kind.namespaced,
                    "kind": kind.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
    gv = f"{group}/{version}" if group else version
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": found}


@contextlib.contextmanager
def in_thread(server: AbstractAsyncContextManager[T]) -> Iterator[T]:
    """Enter an async context manager (a :class:`KubeApi`, a ``Kubelet``) on an event loop
    of its own thread, for a synchronous test or while the test's loop is busy elsewhere;
    leave it there on the way out. Neither uses lightkube, whose decoder (msgspec) can
    crash the process when two threads first decode one type at once: keep a process's
    lightkube clients on one thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="kube-fake", daemon=True)
    thread.start()
    try:
        entered = asyncio.run_coroutine_threadsafe(server.__aenter__(), loop)
        value = entered.result(THREAD_WAIT_S)
        try:
            yield value
        finally:
            left = asyncio.run_coroutine_threadsafe(_leave(server), loop)
            left.result(THREAD_WAIT_S)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(THREAD_WAIT_S)
        loop.close()


async def _leave(server: AbstractAsyncContextManager[Any]) -> None:
    exc: tuple[None, None, None] = (None, None, None)
    await server.__aexit__(*exc)
