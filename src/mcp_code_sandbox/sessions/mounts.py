"""Mounted workspaces of sessions that have no sandbox: a bounded, shared resource.

A workspace with a filesystem of its own (``workspace.volume``) holds a loop device and
a mount while it is mounted. A running session's is bounded by the session limits
(``room``); a paused session's, or one that never ran code, is mounted only for a file
call (an upload, a read, a listing, an export) and unmounted again when the call ends
(the manager does both). What is left is calls in flight: one owner's many parallel file
calls on many paused sessions would each hold a mount, and loop devices are the host's.

Semantics: at most ``max_sessions`` such workspaces are mounted at once, all owners
together, and one owner at most ``sessions_per_owner`` of them (half, where owners may be
several): the same shares as running sessions, so the server's loop devices stay within
twice what its running sessions hold (plus the warm pool and spare images), and one
owner's flood never takes them all. A call that
needs one more waits until one is let go, at most its own wait; past it,
``session_busy``. A session keeps its place until its workspace is
unmounted (an unmount refused because a download still reads a file is retried by the
reaper), it gets a sandbox (its mount is then a running session's), or it ends.
"""

from __future__ import annotations

import asyncio

from mcp_code_sandbox.errors import SessionBusy
from mcp_code_sandbox.sessions.session import Session
from mcp_code_sandbox.settings import Settings

__all__ = ["MountedWorkspaces"]


class MountedWorkspaces:
    """Who holds the mounts of sandbox-less sessions' workspaces (see the docstring)."""

    def __init__(self, settings: Settings) -> None:
        self.limit = settings.max_sessions
        self.per_owner = min(self.limit, settings.sessions_per_owner or self.limit)
        self._held: set[Session] = set()
        self._changed = asyncio.Condition()

    def held(self, owner: str | None = None) -> int:
        """Mounts held now: all of them, or ``owner``'s."""
        self._held = {s for s in self._held if not s.closed}
        return sum(1 for s in self._held if owner is None or s.owner == owner)

    def holds(self, session: Session) -> bool:
        return session in self._held

    async def take(self, session: Session, wait_s: float) -> None:
        """Hold a place for ``session``'s mount (a no-op when it holds one), waiting at
        most ``wait_s`` for one; ``SessionBusy`` past it."""
        if session in self._held:
            return
        try:
            async with asyncio.timeout(wait_s), self._changed:
                await self._changed.wait_for(lambda: self._free_for(session.owner))
                self._held.add(session)
        except TimeoutError:
            raise SessionBusy(
                f"{self.held(session.owner)} workspaces of your sessions without a sandbox "
                f"are open for file calls (at most {self.per_owner} per owner, "
                f"{self.limit} in all, and {self.held()} are open now); wait for those "
                "calls or downloads to finish and try again"
            ) from None

    def _free_for(self, owner: str) -> bool:
        return self.held() < self.limit and self.held(owner) < self.per_owner

    async def give_back(self, session: Session) -> None:
        """``session`` holds no place any more (unmounted, running, or ended)."""
        if session in self._held:
            self._held.discard(session)
            async with self._changed:
                self._changed.notify_all()
