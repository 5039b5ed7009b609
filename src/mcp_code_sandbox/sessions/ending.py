"""Ending a session, step by step: close, expiry and shutdown all end one here.

Semantics:
- Ending a session first takes it out of the table and marks it ``ENDING`` (queued calls
  then fail with ``session_not_found``, and no call starts a sandbox for it any more),
  lets its mount's place go and remembers why it ended (its tombstone). Then it stops
  its sandbox (which ends a running cell), waits, bounded, for the call in flight and
  for any sandbox start in flight, stops whatever those left, frees a checkpoint it
  was paused in and the slot it moved out of, and only then removes the workspace, the
  run log and the record, and lets its uid go (after the record: see ``uids``). A close
  that returns ``ok`` leaves no sandbox running.
- A start is never cancelled half-way (docker-py's calls run on in their threads, and
  what they create would be lost): it runs to its end, and a sandbox made for a closed
  session is stopped at once (:mod:`.sandboxes`).
- One session's failure never stops the others' cleanup: a backend step that fails is
  logged, the rest is still freed, and what remains keeps the session ``ENDING`` in
  :attr:`Ending.unfinished`, retried at every reaper pass and at shutdown. Freed
  entirely, it is ``ENDED``. Ends of one session take turns (``Session.ending``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Protocol

import structlog

from mcp_code_sandbox.backends.base import Sandbox
from mcp_code_sandbox.backends.runner_images import RunnerSandbox
from mcp_code_sandbox.metrics import EndReason, Metrics
from mcp_code_sandbox.sessions import runlog
from mcp_code_sandbox.sessions.lifecycle import Phase, transition
from mcp_code_sandbox.sessions.mounts import MountedWorkspaces
from mcp_code_sandbox.sessions.moving import forget_moved
from mcp_code_sandbox.sessions.session import END_WAIT_S, Paused, Session
from mcp_code_sandbox.sessions.table import SessionTable
from mcp_code_sandbox.sessions.workers import WorkerThreads
from mcp_code_sandbox.settings import Settings

__all__ = ["Ending", "Stops", "close"]

log = structlog.get_logger("mcp_code_sandbox.sessions.ending")


class Stops(Protocol):
    """What ending needs of the sandbox keeper (:class:`.sandboxes.Sandboxes`)."""

    async def free(self, session: Session, thing: Sandbox | RunnerSandbox) -> None:
        """Stop ``thing``; one whose stop failed stays in ``session.unstopped``."""

    async def discard(self, paused: Paused) -> None:
        """Free what a pause holds outside the workspace. Never raises."""


class Forgets(Protocol):
    """What ending needs where a session's workspace outlives its sandbox
    (:class:`.shared.Shared`, on a backend that keeps workspaces)."""

    def ending(self, session: Session) -> None:
        """``session`` ends: a stop of its sandbox from now on keeps nothing."""

    async def forget(self, session: Session) -> str | None:
        """Delete what is kept of ``session``'s workspace; what could not be, in words."""


def close(session: Session) -> None:
    """Mark ``session`` ending, whatever it was doing (a no-op once it is closed)."""
    if not session.closed:
        session.phase = transition(session.phase, Phase.ENDING)


class Ending:
    """Ends sessions, and keeps trying for those whose end left something behind."""

    def __init__(
        self,
        settings: Settings,
        threads: WorkerThreads,
        table: SessionTable,
        mounts: MountedWorkspaces,
        metrics: Metrics,
        stops: Stops,
    ) -> None:
        self.settings = settings
        self.threads = threads
        self.table = table
        self.mounts = mounts
        self.metrics = metrics
        self.stops = stops
        #: Ended sessions that still hold something (a sandbox a stop failed to free,
        #: files not removed), by slot: tried again at every reaper pass.
        self.unfinished: dict[str, Session] = {}
        #: What the backend keeps of a session beyond its sandbox, deleted with it; set
        #: by the manager on a backend that keeps workspaces.
        self.forgets: Forgets | None = None

    async def end(self, session: Session, reason: str, why: EndReason) -> list[str]:
        """End ``session`` (a live one of the table); what could not be freed, in words
        (empty: nothing). A session ended already is left alone."""
        if not self.table.remove(session):
            return []
        # Unfinished until destroyed: an end cut short (a cancelled close_session, a reaper
        # pass cancelled by shutdown) is finished by the reaper or by shutdown, not leaked.
        self.unfinished[session.slot] = session
        self.metrics.session_ended(why)
        close(session)
        await self.mounts.give_back(session)
        self.table.tombstone(session.owner, session.id, reason)
        remains = await self.destroy(session)
        log.info("session ended", owner=session.owner, session=session.id, reason=reason)
        return remains

    async def end_logged(self, session: Session, reason: str, why: EndReason) -> None:
        """:meth:`end`, for the reaper: what fails or remains is logged and retried."""
        await self._logged(session, self.end(session, reason, why))

    async def retry(self) -> None:
        """Try again to free what earlier ends left."""
        for session in list(self.unfinished.values()):
            await self._logged(session, self.destroy(session))

    async def destroy(self, session: Session) -> list[str]:
        """Stop everything of ``session`` and remove its files; what remains, in words.

        Never raises for a backend's or the disk's failure: the session is then kept in
        ``unfinished`` and this runs again at the reaper's next pass. Idempotent; calls
        for one session take turns."""
        async with session.ending:
            if session.phase is Phase.ENDED:
                return []
            close(session)
            remains = await self._destroy_now(session)
            if remains:
                self.unfinished[session.slot] = session
            else:
                self.unfinished.pop(session.slot, None)
                session.phase = transition(session.phase, Phase.ENDED)
            return remains

    async def _destroy_now(self, session: Session) -> list[str]:
        if self.forgets is not None:  # before its sandbox's stop, which would keep it
            self.forgets.ending(session)
        await self.release(session)  # ends a running cell: its call returns soon
        await self._settle(session)
        remains = await self.release(session, retry=False)  # what those calls left
        if session.paused is not None:
            await self.stops.discard(session.paused)
        if self.forgets is not None:  # what an earlier stop kept (a pause)
            left = await self.forgets.forget(session)
            if left is not None:
                remains.append(left)
        if session.replaces is not None:  # a slot it moved out of that could not go then
            moved = session.replaces
            if await forget_moved(self.settings, self.threads, session.owner, moved):
                session.replaces = None
            else:
                remains.append(f"its old files in {moved.workspace.root} could not be removed")
        try:
            await self.threads.run(session.owner, session.workspace.destroy)
        except Exception as exc:
            log.error("cannot remove a session's files", session=session.id, error=repr(exc))
            remains.append(f"its files in {session.workspace.root} could not be removed ({exc})")
        else:
            runlog.remove_log(self.settings.runlogs_dir, session.slot)  # before its record
            self.table.drop_record(session)
            if session.uid_lease is not None:
                session.uid_lease.release()  # after the record: see ``uids``
        return remains

    async def _settle(self, session: Session) -> None:
        """Wait (bounded) until no call holds ``session`` and no start is in flight."""
        try:
            async with asyncio.timeout(END_WAIT_S):
                async with session.lock:  # FIFO: the calls queued before fail at once
                    pass
                while session.starting:
                    await asyncio.wait(set(session.starting))
        except TimeoutError:
            log.error(
                "a call or sandbox start of an ended session is still in flight; "
                "what it starts will be stopped when it ends",
                session=session.id,
                waited_s=END_WAIT_S,
            )

    async def release(self, session: Session, *, retry: bool = True) -> list[str]:
        """Stop the session's sandbox and runners; those that a stop failed to free (in
        words). A failed stop is logged, kept in ``unstopped`` and tried again next time
        (``retry``: this time too)."""
        held: list[Sandbox | RunnerSandbox] = []
        if retry:
            held, session.unstopped = session.unstopped, []
        if session.sandbox is not None:
            held.append(session.sandbox)
        held.extend(session.runners.values())
        session.sandbox, session.agent = None, None
        session.runners.clear()
        for thing in held:
            await self.stops.free(session, thing)
        return [
            f"its sandbox {thing.backend_id} could not be stopped" for thing in session.unstopped
        ]

    async def _logged(self, session: Session, end: Awaitable[list[str]]) -> None:
        try:
            remains = await end
        except Exception:
            log.exception("ending a session failed", owner=session.owner, session=session.id)
            self.unfinished[session.slot] = session
            return
        if remains:
            log.warning(
                "an ended session still holds resources; trying again at the next pass",
                owner=session.owner,
                session=session.id,
                remains=remains,
            )
