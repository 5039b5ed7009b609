"""Pausing a session, step by step, and letting go of the mount of one without a sandbox.

Semantics (the manager owns one :class:`Pausing`; the reaper, the room and shutdown
pause through it):
- A pause holds the session's lock (a call arriving meanwhile waits for it, then
  resumes it), moves it ``RUNNING -> PAUSING -> PAUSED`` (:mod:`.lifecycle`), and its
  record says ``pausing`` until the pause is complete, so a server that dies meanwhile
  leaves a session the next one keeps. A pause that fails or is cut short leaves it
  ``RUNNING``; one closed meanwhile stays closed (its end frees what the pause kept).
- A paused session's size is what its state holds on the host's disk (allocated
  blocks): the checkpoint's, and the workspace's measured each time it is unmounted.
- Shutdown of a service keeping its sessions pauses every one for its successor
  (:meth:`Pausing.leave`).
- A backend whose sessions' files live in their sandboxes (``workspace_in_sandbox``)
  pauses only when it keeps a session's workspace beyond its sandbox (``keeps_workspaces``
  of :class:`~.backends.shared.SharedSandboxes`: kubernetes with a StorageClass); the
  paused session is then handed on (:attr:`Pausing.hand_on`): the kept workspace is its
  record, and whichever server gets its next call resumes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

import structlog

from mcp_code_sandbox.errors import SandboxError
from mcp_code_sandbox.sessions.lifecycle import Phase, transition
from mcp_code_sandbox.sessions.mounts import MountedWorkspaces
from mcp_code_sandbox.sessions.overview import files_held
from mcp_code_sandbox.sessions.sandboxes import Sandboxes
from mcp_code_sandbox.sessions.session import Paused, Session
from mcp_code_sandbox.sessions.shared import shared_of
from mcp_code_sandbox.sessions.table import SessionTable
from mcp_code_sandbox.sessions.workers import WorkerThreads

__all__ = ["Pausing"]

log = structlog.get_logger("mcp_code_sandbox.sessions.pausing")


class Pausing:
    """Pauses sessions on the sandbox keeper, and unmounts and measures paused ones."""

    def __init__(
        self,
        sandboxes: Sandboxes,
        threads: WorkerThreads,
        table: SessionTable,
        mounts: MountedWorkspaces,
    ) -> None:
        self.sandboxes = sandboxes
        self.threads = threads
        self.table = table
        self.mounts = mounts
        registry = shared_of(sandboxes.backend)
        #: A session's files outlive its stopped sandbox (see the module docstring).
        self.keeps_files = not sandboxes.backend.workspace_in_sandbox or (
            registry is not None and registry.keeps_workspaces
        )
        #: What a complete pause hands the paused session to (lock held): set by the
        #: manager when the backend's kept workspaces are the sessions' records.
        self.hand_on: Callable[[Session], Awaitable[None]] | None = None

    async def pause(self, session: Session, *, wait: bool = True) -> None:
        """Pause ``session`` (see :meth:`.sandboxes.Sandboxes.pause`) under its lock: a
        call arriving meanwhile waits for the pause, then resumes it. Its record says
        ``pausing`` until the pause is complete, so a server that dies meanwhile leaves
        a session the next one keeps. ``wait`` False (shutdown): a call still holding
        the session is not waited for; its sandbox is stopped under it."""
        if wait:
            await session.lock.acquire()
        try:
            if not _pausable(session) or not self.keeps_files:
                # Its files live in its sandbox: stopping it would lose them.
                return
            session.phase = transition(session.phase, Phase.PAUSING)
            self.table.save(session, force=True)
            try:
                paused = await self.sandboxes.pause(session)
                count, size = await files_held(self.threads, session) or (0, 0)
            except BaseException:
                if session.phase is Phase.PAUSING:  # its next pause tries again
                    session.phase = transition(session.phase, Phase.RUNNING)
                raise
            # Its bytes: the checkpoint's, then the workspace's on disk (measured by
            # ``unmount``; saved variables are in the workspace).
            paused = dataclasses.replace(
                paused, bytes=_outside_bytes(paused), file_count=count, files_bytes=size
            )
            session.paused = paused  # also when it was closed meanwhile: its end frees it
            if session.phase is Phase.PAUSING:
                session.phase = transition(session.phase, Phase.PAUSED)
            session.files_kept = (count, size)
            self.table.save(session, force=True)
            await self.unmount(session)
            log.info("session paused", owner=session.owner, session=session.id, kind=paused.kind)
            if self.hand_on is not None and session.phase is Phase.PAUSED:
                await self.hand_on(session)
        finally:
            if wait:
                session.lock.release()

    async def unmount(self, session: Session) -> None:
        """Let go of the filesystem of a session without a sandbox (mounted again by its
        next call), then measure a paused one's state on disk. A filesystem still busy
        (a download reading a file) stays mounted, and the reaper tries again."""
        if session.workspace_made and session.workspace.volume is not None:
            try:
                gone = await self.threads.run(session.owner, session.workspace.unmount)
            except (SandboxError, OSError) as exc:
                log.warning("cannot unmount a paused workspace", session=session.id, error=str(exc))
                gone = False
            if gone:
                session.workspace_made = False
                await self.mounts.give_back(session)
        await self._measure(session)

    async def _measure(self, session: Session) -> None:
        """Set a paused session's ``bytes`` to what its state holds on the host's disk
        now: allocated blocks, never the sizes its files claim (a hostile session's
        sparse files would else count terabytes against every owner's budget)."""
        paused = session.paused
        if paused is None:
            return
        try:
            disk = await self.threads.run(session.owner, session.workspace.disk_bytes)
        except (SandboxError, OSError) as exc:
            log.warning("cannot measure a paused workspace", session=session.id, error=str(exc))
            return
        if session.paused is paused and paused.bytes != _outside_bytes(paused) + disk:
            session.paused = dataclasses.replace(paused, bytes=_outside_bytes(paused) + disk)
            self.table.save(session, force=True)

    async def after_call(self, session: Session) -> None:
        """At the end of a call (lock held): a session left without a sandbox (paused,
        or one that never ran code) lets its workspace's mount go now, unless another
        call waits for it; a paused one's state is measured again (a file call may have
        changed it). One with a sandbox now gives its place in ``mounts`` back."""
        if session.sandbox is not None or session.runners:
            await self.mounts.give_back(session)
        elif not session.queued:
            if session.workspace_made and session.workspace.volume is not None:
                session.files_kept = await files_held(self.threads, session)
            await self.unmount(session)

    async def leave(self, session: Session) -> None:
        """Shut down without ending ``session``: it is paused (its record says how), its
        workspace kept. The next server on this state dir keeps it and resumes it on
        its first call (see :mod:`.recovery`)."""
        await self.pause(session, wait=False)
        await self.unmount(session)  # one paused earlier may have been mounted since
        if session.uid_lease is not None:
            session.uid_lease.release()  # reserved by its record for the next server
        log.info("session paused for the next server", owner=session.owner, session=session.id)


def _outside_bytes(paused: Paused) -> int:
    """What a pause holds outside the workspace: its checkpoint image, if any."""
    return (paused.checkpoint.bytes or 0) if paused.checkpoint is not None else 0


def _pausable(session: Session) -> bool:
    """Running, or (shutdown, not waiting for the call) resuming with its pause let go."""
    return session.phase is Phase.RUNNING or (
        session.phase is Phase.RESUMING and session.paused is None
    )
