"""Sessions' workspaces that outlive their pods: a PersistentVolumeClaim per pod, with a
StorageClass (``SANDBOX_KUBERNETES_STORAGE_CLASS``).

Every sandbox pod's workspace is a claim of its own, made with it (by the pool for warm
pods, :mod:`.pool`; by the backend for a pod made for a session), anonymous at first.
A claim is a session's record while no pod runs it:

- **Stop** of a session's pod (a pause, a restart, the session's end) first labels the
  claim with the session's key and annotates its owner, id and times, and marks it
  paused (:data:`.spec.ANNOTATION_PAUSED`: no pod runs on it): :meth:`KeptWorkspaces.keep`.
- **A pause** then writes how the session was kept into that mark (:meth:`~KeptWorkspaces.kept`),
  by a conditional update: only while it is still paused as this server saw it.
- **A resume** takes a paused claim by one conditional update that removes the mark
  (:meth:`~KeptWorkspaces.take`): of two servers resuming one session, one wins and the
  other's call fails (it adopts the winner's pod at its next call). A start that fails
  gives the claim back, marked paused as it was.
- **Every server** lists the paused claims from one watch (:meth:`~KeptWorkspaces.paused`)
  and finds one by key with a read (:meth:`~KeptWorkspaces.find`): a session paused by
  another server a moment ago is found.
- **The end** of a session deletes its claim: announced first (:attr:`~KeptWorkspaces.ending`),
  so the stop of its pod deletes the claim instead of keeping it (no other server can
  take it as paused meanwhile), then whatever an earlier stop kept
  (:meth:`~KeptWorkspaces.forget`). The pool's reaper deletes the claims of sessions
  past their lifetime or idle TTL, and anonymous ones whose pod is gone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from lightkube import ApiError, AsyncClient
from lightkube.resources.core_v1 import PersistentVolumeClaim
from lightkube.types import PatchType

from mcp_code_sandbox.backends.base import Leftover, SandboxSpec
from mcp_code_sandbox.backends.kubernetes.pods import (
    ClaimView,
    ClaimWatch,
    claim_of,
    claim_view_of,
)
from mcp_code_sandbox.backends.kubernetes.spec import (
    ANNOTATION_ACTIVE,
    ANNOTATION_CREATED,
    ANNOTATION_OWNER,
    ANNOTATION_PAUSED,
    ANNOTATION_SESSION,
    LABEL_KEY,
)
from mcp_code_sandbox.errors import SandboxFailed

__all__ = ["KeptWorkspaces"]

#: The most of a pause's record written on a claim: the API server takes 256 KiB of
#: annotations per object; past this the names of saved variables are left out.
_PAUSED_RECORD_CHARS = 64 * 1024


class KeptWorkspaces:
    """The workspace claims of one namespace (see the module docstring)."""

    def __init__(
        self, client: AsyncClient, namespace: str, make: Callable[[str], dict[str, Any]]
    ) -> None:
        self._client = client
        self._namespace = namespace
        self._make = make
        self.watch = ClaimWatch(client, namespace)
        #: Keys of sessions ending here: their pods' stops delete their claims, until
        #: :meth:`forget` is done with them.
        self.ending: set[str] = set()

    async def start(self) -> None:
        await self.watch.start()

    async def aclose(self) -> None:
        await self.watch.aclose()

    def of(self, key: str) -> ClaimView | None:
        """The claim of the session filed under ``key``, as this server's view has it."""
        return self.watch.of(key)

    async def make(self, name: str) -> None:
        """An anonymous claim named ``name``, for the pod of that name."""
        claim = await self._client.create(claim_of(self._make(name), self._namespace))
        self.watch.note(claim)

    async def keep(
        self, name: str, spec: SandboxSpec, made: float | None, active: float | None
    ) -> None:
        """Make claim ``name`` ``spec``'s session's record, marked paused, before its pod
        goes. A claim deleted already (the session ended elsewhere) is let be."""
        now = time.time()
        annotations = {
            ANNOTATION_OWNER: spec.owner,
            ANNOTATION_SESSION: spec.session_id,
            ANNOTATION_CREATED: _stamp(made if made is not None else now),
            ANNOTATION_ACTIVE: _stamp(active if active is not None else now),
            ANNOTATION_PAUSED: "{}",
        }
        patch = {"metadata": {"labels": {LABEL_KEY: spec.key}, "annotations": annotations}}
        try:
            await self._patch(name, patch)
        except ApiError as exc:
            if exc.status.code != 404:
                raise

    async def take(self, kept: ClaimView, session_id: str) -> None:
        """Take the paused claim ``kept`` for a pod of its session, by one conditional
        update; ``SandboxFailed`` when another server took it first (or it is gone)."""
        annotations = {ANNOTATION_PAUSED: None, ANNOTATION_ACTIVE: _stamp(time.time())}
        patch = {"metadata": {"resourceVersion": kept.resource_version, "annotations": annotations}}
        try:
            await self._patch(kept.name, patch)
        except ApiError as exc:
            if exc.status.code not in (404, 409):
                raise
            raise SandboxFailed(
                f"session {session_id} was resumed by another server meanwhile (or ended); "
                "call again"
            ) from None

    async def give_back(self, kept: ClaimView) -> None:
        """Mark claim ``kept`` paused again as it was (its pod did not start)."""
        record = json.dumps(kept.paused, separators=(",", ":"))
        await self._patch(kept.name, {"metadata": {"annotations": {ANNOTATION_PAUSED: record}}})

    async def kept(self, key: str, paused: dict[str, Any]) -> None:
        """Record how the session filed under ``key`` was paused, while its claim is still
        paused as this server saw it (a 409 else)."""
        view = self.watch.of(key)
        if view is None or view.paused is None:
            return  # resumed elsewhere meanwhile, or ended: its record is theirs
        record = json.dumps(paused, separators=(",", ":"))
        if len(record) > _PAUSED_RECORD_CHARS:
            short = {k: v for k, v in paused.items() if k not in ("saved", "dropped")}
            record = json.dumps(short, separators=(",", ":"))
        annotations = {ANNOTATION_PAUSED: record}
        patch = {"metadata": {"resourceVersion": view.resource_version, "annotations": annotations}}
        await self._patch(view.name, patch)

    async def forget(self, key: str) -> None:
        """Delete the claims of the session filed under ``key`` (read, not the view)."""
        found = self._client.list(
            PersistentVolumeClaim, namespace=self._namespace, labels={LABEL_KEY: key}
        )
        async for claim in found:
            assert claim.metadata is not None and claim.metadata.name is not None
            await self.delete(claim.metadata.name)
        self.ending.discard(key)

    async def delete(self, name: str) -> None:
        """Delete claim ``name`` (gone already: nothing to do)."""
        try:
            await self._client.delete(PersistentVolumeClaim, name, namespace=self._namespace)
        except ApiError as exc:
            if exc.status.code != 404:
                raise
        self.watch.forget(name)

    async def find(self, key: str) -> Leftover | None:
        """The paused session filed under ``key``, read from the API server: another
        server may have paused it a moment ago."""
        found = self._client.list(
            PersistentVolumeClaim, namespace=self._namespace, labels={LABEL_KEY: key}
        )
        async for claim in found:
            self.watch.note(claim)
            view = claim_view_of(claim)
            if view.paused is not None and not view.deleting:
                return _leftover(view)
        return None

    def paused(self, owner: str | None) -> list[Leftover]:
        """The paused sessions (``owner``'s, or everyone's), from the view."""
        return [
            _leftover(view)
            for view in self.watch.all()
            if view.paused is not None and not view.deleting and owner in (None, view.owner)
        ]

    async def _patch(self, name: str, patch: dict[str, Any]) -> None:
        claim = await self._client.patch(
            PersistentVolumeClaim, name, patch, namespace=self._namespace,
            patch_type=PatchType.MERGE,
        )  # fmt: skip
        self.watch.note(claim)


def _leftover(view: ClaimView) -> Leftover:
    """A claim marked paused as the session it keeps."""
    return Leftover(
        backend_id=view.name,
        key=view.key,
        owner=view.owner,
        session_id=view.session_id,
        running=False,
        created_at=view.session_created,
        active_at=view.active,
        paused=view.paused,
    )


def _stamp(when: float) -> str:
    return f"{when:.0f}"
