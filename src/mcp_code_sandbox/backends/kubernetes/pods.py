"""This backend's pods as one server replica sees them: one list, then one watch.

Every replica keeps a :class:`PodWatch` of the sandbox pods in its namespace (those with
the component label), fed by a single watch that resumes from the last resourceVersion
it saw; when the API server answers that it is too old (410 Gone) or the watch breaks,
the view is listed again whole, so a pod deleted meanwhile leaves the view too. Reads
(which warm pods are ready, where a pod is, whether it still exists) are answered from
the view, never by an API call: a claim costs its one write and nothing more.

Semantics: the view lags the cluster by a watch event, never more; a pod may have been
claimed by another replica or deleted since it was seen. Callers write with the
resourceVersion they read (a claim is a conditional update), so a stale view costs a
409 and a retry, never a double claim.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Protocol, TypeVar

from lightkube import ApiError, AsyncClient
from lightkube.codecs import from_dict
from lightkube.resources.core_v1 import PersistentVolumeClaim, Pod

from mcp_code_sandbox.backends.kubernetes.spec import (
    ANNOTATION_ACTIVE,
    ANNOTATION_CREATED,
    ANNOTATION_OWNER,
    ANNOTATION_PAUSED,
    ANNOTATION_SESSION,
    COMPONENT_SANDBOX,
    COMPONENT_WORKSPACE,
    LABEL_COMPONENT,
    LABEL_KEY,
    LABEL_NAME,
    LABEL_POOL,
    NAME,
    WARM,
)

__all__ = [
    "CLAIM_SELECTOR",
    "SELECTOR",
    "ClaimView",
    "ClaimWatch",
    "PodView",
    "PodWatch",
    "claim_of",
    "claim_view_of",
    "pod_of",
    "view_of",
]

log = logging.getLogger(__name__)

#: Every sandbox pod of this product, whoever made it.
SELECTOR: dict[str, str | None] = {LABEL_NAME: NAME, LABEL_COMPONENT: COMPONENT_SANDBOX}
#: Every workspace claim of this product (with ``SANDBOX_KUBERNETES_STORAGE_CLASS``).
CLAIM_SELECTOR: dict[str, str | None] = {LABEL_NAME: NAME, LABEL_COMPONENT: COMPONENT_WORKSPACE}

#: Between two tries to list and watch again after the API server failed: short, as
#: claims wait on the view; the client's own timeout bounds each try.
_RELIST_PAUSE_S = 0.5


@dataclass(frozen=True)
class PodView:
    """What the view knows of one pod."""

    name: str
    resource_version: str
    #: ``WARM`` (anonymous, claimable), ``CLAIMED`` (a session's), or ``None`` (not ours).
    pool: str | None
    key: str | None
    owner: str | None
    session_id: str | None
    phase: str
    ip: str | None
    ready: bool
    created: datetime | None
    deleting: bool
    #: The session's own times (wall-clock seconds), as its annotations record them.
    session_created: float | None = None
    active: float | None = None
    #: The PersistentVolumeClaim its workspace is on; ``None``: an ``emptyDir``.
    claim: str | None = None

    @property
    def claimable(self) -> bool:
        return self.pool == WARM and self.ready and self.ip is not None and not self.deleting

    @property
    def gone(self) -> bool:
        """It will never serve again (failed, finished, or being deleted)."""
        return self.deleting or self.phase in ("Failed", "Succeeded")


def view_of(pod: Pod) -> PodView:
    meta = pod.metadata
    assert meta is not None and meta.name is not None
    labels = meta.labels or {}
    annotations = meta.annotations or {}
    status = pod.status
    ready = (
        any(c.type == "Ready" and c.status == "True" for c in (status.conditions or []))
        if status is not None
        else False
    )
    return PodView(
        name=meta.name,
        resource_version=meta.resourceVersion or "",
        pool=labels.get(LABEL_POOL),
        key=labels.get(LABEL_KEY),
        owner=annotations.get(ANNOTATION_OWNER),
        session_id=annotations.get(ANNOTATION_SESSION),
        phase=(status.phase if status is not None and status.phase else "Pending"),
        ip=status.podIP if status is not None else None,
        ready=ready,
        created=meta.creationTimestamp,
        deleting=meta.deletionTimestamp is not None,
        session_created=_seconds(annotations.get(ANNOTATION_CREATED)),
        active=_seconds(annotations.get(ANNOTATION_ACTIVE)),
        claim=_claim_name(pod),
    )


def _claim_name(pod: Pod) -> str | None:
    for volume in (pod.spec.volumes or []) if pod.spec is not None else []:
        if volume.persistentVolumeClaim is not None:
            return volume.persistentVolumeClaim.claimName
    return None


@dataclass(frozen=True)
class ClaimView:
    """What the view knows of one workspace claim: anonymous (a warm pod's, ``key``
    None), or a session's (labelled by the first stop of its pod; ``paused`` set while
    no pod runs on it)."""

    name: str
    resource_version: str
    key: str | None
    owner: str | None
    session_id: str | None
    created: datetime | None
    deleting: bool
    session_created: float | None = None
    active: float | None = None
    #: How the session was paused (``sessions.session.Paused`` as JSON, ``{}`` when its
    #: pod was stopped without a pause's record): present exactly while no pod runs on
    #: it, so that a resume takes it from there by a conditional update.
    paused: dict[str, Any] | None = None


def claim_view_of(claim: PersistentVolumeClaim) -> ClaimView:
    meta = claim.metadata
    assert meta is not None and meta.name is not None
    labels = meta.labels or {}
    annotations = meta.annotations or {}
    return ClaimView(
        name=meta.name,
        resource_version=meta.resourceVersion or "",
        key=labels.get(LABEL_KEY),
        owner=annotations.get(ANNOTATION_OWNER),
        session_id=annotations.get(ANNOTATION_SESSION),
        created=meta.creationTimestamp,
        deleting=meta.deletionTimestamp is not None,
        session_created=_seconds(annotations.get(ANNOTATION_CREATED)),
        active=_seconds(annotations.get(ANNOTATION_ACTIVE)),
        paused=_paused(annotations.get(ANNOTATION_PAUSED)),
    )


def _paused(text: str | None) -> dict[str, Any] | None:
    """A claim's pause annotation; ``{}`` when it is there but not a JSON object (the
    session is paused all the same: its files are kept, what else is unknown)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _seconds(text: str | None) -> float | None:
    """An annotation's wall-clock seconds; ``None`` when missing or not a number."""
    try:
        value = None if text is None else float(text)
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


class _Named(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def resource_version(self) -> str: ...


V = TypeVar("V", bound=_Named)


class _Watch(Generic[V]):
    """The objects of one kind and selector in one namespace, kept current by a watch
    (see the module doc)."""

    _kind: Any
    _selector: dict[str, str | None]

    def __init__(self, client: AsyncClient, namespace: str) -> None:
        self._client = client
        self._namespace = namespace
        self._seen: dict[str, V] = {}
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()

    async def start(self) -> None:
        """List once (raising what the API server answers), then watch in the background."""
        version = await self._list()
        self._task = asyncio.create_task(self._follow(version), name="kubernetes-watch")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _view(self, obj: Any) -> V:
        raise NotImplementedError

    def get(self, name: str) -> V | None:
        return self._seen.get(name)

    def all(self) -> list[V]:
        return list(self._seen.values())

    def forget(self, name: str) -> None:
        """Drop ``name`` from the view now (this replica deleted it)."""
        self._seen.pop(name, None)

    def note(self, pod: Any) -> None:
        """Take an object this replica just wrote, ahead of its watch event."""
        view = self._view(pod)
        known = self._seen.get(view.name)
        if known is None or _newer(view.resource_version, known.resource_version):
            self._seen[view.name] = view

    async def wait_for(
        self, name: str, done: Callable[[V | None], bool], timeout_s: float
    ) -> V | None:
        """The view of ``name`` once ``done`` holds for it (``None``: not there), or
        raise ``TimeoutError`` after ``timeout_s``."""
        async with asyncio.timeout(timeout_s), self._changed:
            while not done(self._seen.get(name)):
                await self._changed.wait()
        return self._seen.get(name)

    async def _list(self) -> str:
        listing = self._client.list(
            self._kind, namespace=self._namespace, labels=dict(self._selector)
        )
        pods = {}
        async for pod in listing:
            view = self._view(pod)
            pods[view.name] = view
        async with self._changed:
            self._seen = pods
            self._changed.notify_all()
        self._synced.set()
        return listing.resourceVersion

    async def _follow(self, version: str) -> None:
        while True:
            try:
                async for kind, pod in self._client.watch(
                    self._kind,
                    namespace=self._namespace,
                    labels=dict(self._selector),
                    resource_version=version,
                ):
                    view = self._view(pod)
                    version = view.resource_version or version
                    async with self._changed:
                        if kind == "DELETED":
                            self._seen.pop(view.name, None)
                        else:
                            self._seen[view.name] = view
                        self._changed.notify_all()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # 410 Gone, a broken stream, an API server away
                if not (isinstance(exc, ApiError) and exc.status.code == 410):
                    log.warning("kubernetes: a watch broke (%s); listing again", exc)
                await asyncio.sleep(_RELIST_PAUSE_S)
            # The watch ended (the server's timeout) or broke: list again, whole, so
            # that what was deleted meanwhile leaves the view too.
            while True:
                try:
                    version = await self._list()
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("kubernetes: cannot list (%s)", exc)
                    await asyncio.sleep(_RELIST_PAUSE_S)


class PodWatch(_Watch[PodView]):
    """The sandbox pods of one namespace (see the module doc)."""

    _kind = Pod
    _selector = SELECTOR

    def _view(self, obj: Any) -> PodView:
        return view_of(obj)

    def claimable(self) -> list[PodView]:
        """Warm pods ready to be claimed, the oldest first."""
        ready = [p for p in self._seen.values() if p.claimable]
        ready.sort(key=lambda p: (p.created is None, p.created or datetime.min, p.name))
        return ready


class ClaimWatch(_Watch[ClaimView]):
    """The workspace claims of one namespace (with a StorageClass): a paused session's
    record, which every replica lists its sessions from."""

    _kind = PersistentVolumeClaim
    _selector = CLAIM_SELECTOR

    def _view(self, obj: Any) -> ClaimView:
        return claim_view_of(obj)

    def of(self, key: str) -> ClaimView | None:
        """The claim of the session filed under ``key``, if the view has one."""
        for view in self._seen.values():
            if view.key == key and not view.deleting:
                return view
        return None


def _newer(a: str, b: str) -> bool:
    try:
        return int(a) > int(b)
    except ValueError:
        return a != b


def claim_of(manifest: dict[str, Any], namespace: str) -> PersistentVolumeClaim:
    """The typed claim of ``manifest`` (:func:`.spec.workspace_claim`), in ``namespace``."""
    claim = from_dict(manifest)
    assert isinstance(claim, PersistentVolumeClaim) and claim.metadata is not None
    claim.metadata.namespace = namespace
    return claim


def pod_of(manifest: dict[str, Any], namespace: str) -> Pod:
    """The typed pod of ``manifest`` (a plain dict, as :mod:`.spec` makes them), placed in
    ``namespace``."""
    pod = from_dict(manifest)
    assert isinstance(pod, Pod) and pod.metadata is not None
    pod.metadata.namespace = namespace
    return pod
