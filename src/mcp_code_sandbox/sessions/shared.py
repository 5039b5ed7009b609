"""Sessions on a backend whose sandboxes are their registry, which any server serves.

With a backend that implements :class:`~.backends.shared.SharedSandboxes` (kubernetes: a
session's pod carries its owner, id, key and times, and its agent takes connections from
any server), nothing of a session lives only in one server: this server's table is what
it holds now, and:

- **A call for a session it does not hold** finds the session's sandbox by its key and
  adopts it (:meth:`Shared.adopt`): the owner and id the sandbox records must be the
  call's, then the server connects to its agent, which serves the newest connection once
  idle. The session goes on where it was: variables, files, run count are the sandbox's.
  One adoption of a key at a time here.
- **A session another server reached since** (``handed_on``: the agent let this server's
  connection go) is let go here when this server's reaper finds it idle, instead of being
  ended: it looks idle here only because it was served elsewhere. Ending it for good is
  then the business of the server holding it, or of the backend's reaper of sessions no
  server holds (which judges by the activity each call notes: :meth:`Shared.touch`).
- **Network**: a session let go has its egress proxy here closed (its credential opens
  nothing any more); the server that adopts it opens its own at the session's next call
  with network (:meth:`.sandboxes.Sandboxes.handout`, behind the egress gate).
- **At shutdown** every session is let go, running: the other replicas (or this one's
  successor) adopt them at their next call; a rolling restart ends nothing.
- **A pause** is possible only where the backend keeps a session's workspace beyond its
  sandbox (``keeps_workspaces``: kubernetes with a StorageClass); else a session's files
  live in its sandbox, and stopping it would lose them (:mod:`.pausing` declines). A
  complete pause records how the session was kept on its kept workspace and lets the
  session go (:meth:`Shared.paused`): from then on the cluster holds it, listed by every
  server as paused, and the server that gets its next call adopts it as a paused
  session (:meth:`Shared.adopt`) and resumes it, loading its saved variables. Ending a
  session deletes its kept workspace (:meth:`Shared.forget`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from mcp_code_sandbox.backends.base import Backend, SandboxSpec
from mcp_code_sandbox.backends.shared import SharedSandboxes
from mcp_code_sandbox.errors import BackendUnavailable
from mcp_code_sandbox.metrics import EndReason, Metrics
from mcp_code_sandbox.sessions import records
from mcp_code_sandbox.sessions.egress import EgressProxies
from mcp_code_sandbox.sessions.ids import session_key
from mcp_code_sandbox.sessions.lifecycle import Phase, transition
from mcp_code_sandbox.sessions.recovery import Adopted, Kept, adopted_session, kept_session
from mcp_code_sandbox.sessions.session import Paused, Session
from mcp_code_sandbox.sessions.table import SessionTable

__all__ = ["Shared", "shared_of"]

log = structlog.get_logger("mcp_code_sandbox.sessions.shared")

SpecFor = Callable[[records.SessionRecord], SandboxSpec]


def shared_of(backend: Backend) -> SharedSandboxes | None:
    return backend if isinstance(backend, SharedSandboxes) else None


class Shared:
    """This server's part in sessions any server serves (see the module docstring)."""

    def __init__(
        self,
        backend: Backend,
        registry: SharedSandboxes,
        table: SessionTable,
        spec_for: SpecFor,
        metrics: Metrics,
        *,
        instance: str,
        egress: EgressProxies | None = None,
    ) -> None:
        self._backend = backend
        self._egress = egress
        self._registry = registry
        self._table = table
        self._spec_for = spec_for
        self._metrics = metrics
        self._instance = instance
        #: One adoption at a time here (each is a connect), so that two calls for one
        #: session adopt it once.
        self._adopting = asyncio.Lock()

    async def start(self) -> None:
        """Start following the sessions' sandboxes (for ``list_sessions`` and ``/ui``),
        at the server's start; an API that does not answer yet is logged, and asked
        again at the next call."""
        try:
            await self._registry.follow()
        except BackendUnavailable as exc:
            log.warning("cannot list the sessions' sandboxes yet", error=str(exc))

    async def adopt(self, owner: str, session_id: str) -> Session | None:
        """``owner``'s session ``session_id``, adopted from its sandbox wherever it was
        made, or as a paused session from its kept workspace, and added to the table;
        ``None`` when neither records it (or its agent cannot be reached)."""
        key = session_key(owner, session_id)
        async with self._adopting:
            held = self._table.get(owner, session_id)
            if held is not None:  # adopted by a call that came first
                return held
            found = await self._registry.find(key)
            if found is None or (found.owner, found.session_id) != (owner, session_id):
                return None
            now = time.time()
            record = records.SessionRecord(
                owner=owner,
                session_id=session_id,
                key=key,
                slot=records.new_slot(key),
                instance=self._instance,
                created_at=found.created_at if found.created_at is not None else now,
                last_active=now,
                paused=_pause_record(found.paused, found.active_at or now),
            )
            if not found.running:  # paused: its call resumes it
                paused = kept_session(self._table, Kept(record, None))
                self._table.add(paused)
                self._table.save(paused, force=True)
                self._metrics.handed_over("in")
                return paused
            sandbox = await self._backend.reattach(found, self._spec_for(record))
            if sandbox is None:
                return None
            session = adopted_session(self._table, Adopted(record, sandbox, None))
            self._table.add(session)
            self._table.save(session, force=True)
            self._metrics.handed_over("in")
            await self._registry.touch(sandbox)
            return session

    async def touch(self, session: Session) -> None:
        """Note a call's activity on ``session``'s sandbox (see the module docstring)."""
        if session.sandbox is not None:
            await self._registry.touch(session.sandbox)

    def elsewhere(self, owner: str | None) -> list[records.SessionRecord]:
        """The running sessions other servers hold (``owner``'s, or everyone's), as
        their sandboxes record them: those this server does not hold."""
        found = []
        for sandbox in self._registry.sessions(owner):
            if sandbox.owner is None or sandbox.session_id is None or sandbox.key is None:
                continue
            if self._table.get(sandbox.owner, sandbox.session_id) is not None:
                continue
            made = sandbox.created_at or 0.0
            record = records.SessionRecord(
                owner=sandbox.owner,
                session_id=sandbox.session_id,
                key=sandbox.key,
                slot=sandbox.key,
                instance="",
                created_at=made,
                last_active=sandbox.active_at or made,
                paused=_pause_record(sandbox.paused, sandbox.active_at or made),
            )
            found.append(record)
        return found

    async def paused(self, session: Session) -> None:
        """Hand on ``session``, just paused (lock held): record how on its kept workspace
        (a failure costs only that record: its saved variables are loaded all the same),
        then let it go (see the module docstring)."""
        if session.paused is not None:
            try:
                await self._registry.kept(session.key, session.paused.to_json())
            except Exception as exc:
                log.warning("cannot record a pause", session=session.id, error=repr(exc))
        await self.let_go(session)

    def ending(self, session: Session) -> None:
        """``session`` ends here: its sandbox's stop deletes its kept workspace."""
        self._registry.ending(session.key)

    async def forget(self, session: Session) -> str | None:
        """Delete ``session``'s kept workspace (its end); what could not be, in words."""
        try:
            await self._registry.forget(session.key)
        except Exception as exc:
            log.warning("cannot delete a kept workspace", session=session.id, error=repr(exc))
            return f"its kept workspace could not be deleted ({exc})"
        return None

    def handed_on(self, session: Session) -> bool:
        return session.sandbox is not None and self._registry.handed_on(session.sandbox)

    async def let_go(self, session: Session) -> None:
        """Forget ``session`` here without ending it: its sandbox runs on for the server
        that adopts it next. For shutdown, a session handed on, or one paused into its
        kept workspace (see the docstring)."""
        self._table.forget(session)
        if session.phase is not Phase.HANDED_ON:
            session.phase = transition(session.phase, Phase.HANDED_ON)
        sandbox, session.sandbox, session.agent = session.sandbox, None, None
        if sandbox is not None:
            sandbox.channel.close()
            if self._egress is not None:
                await self._egress.close(sandbox.spec.egress)
        # What this server kept of it is a cache (the sandbox is the record): its record
        # and its unused workspace directory go, so that they do not pile up here.
        sessions_dir = self._table.settings.sessions_dir
        try:
            await asyncio.to_thread(records.remove_record, sessions_dir, session.slot)
            await asyncio.to_thread(session.workspace.destroy)
        except Exception as exc:  # logged: the session itself is safe in its sandbox
            log.warning("cannot remove a let-go session's local files", error=repr(exc))
        self._metrics.handed_over("out")
        log.info("session let go", owner=session.owner, session=session.id)

    def end_idle(
        self, end: Callable[[Session, str, EndReason], Awaitable[None]]
    ) -> Callable[[Session, str, EndReason], Awaitable[None]]:
        """The reaper's ``end``: a session served elsewhere since is let go, not ended."""

        async def end_or_let_go(session: Session, reason: str, why: EndReason) -> None:
            if self.handed_on(session) and not session.lock.locked():
                async with session.lock:
                    if self._table.get(session.owner, session.id) is session:
                        await self.let_go(session)
                return
            await end(session, reason, why)

        return end_or_let_go


def _pause_record(paused: dict[str, Any] | None, at: float) -> dict[str, Any] | None:
    """A record's pause from a kept workspace's (``{}``, or one that does not parse: its
    files and whatever variables its last complete pause saved)."""
    if paused is None:
        return None
    try:
        # A checkpoint is a host's: nothing a pod's session could have.
        return dataclasses.replace(Paused.from_json(paused), checkpoint=None).to_json()
    except (ValueError, TypeError):
        return Paused("files", at, load=True).to_json()
