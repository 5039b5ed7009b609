"""Room for one more running session: the session limits count running sessions, and a
call that needs one more pauses the longest-idle session to make room.

Semantics (the manager owns one :class:`Room`):
- A session is *running* unless it is paused (with or without a sandbox: an upload makes
  one too), or while a call resumes it. ``max_sessions`` bounds running sessions, and
  ``sessions_per_owner`` each owner's; paused ones cost disk, not RAM, and are bounded
  apart (``max_paused_sessions``, ``paused_disk_bytes``: see the manager's reaper).
- A call that creates a session, or resumes a paused one, when a limit is reached first
  pauses the longest-idle running session that no call holds (for an owner's limit, one
  of that owner's): it resumes on its own next call, as after any pause. Only when every
  running session is in a call, or pausing is off (``pause_after_m`` 0, or
  ``max_paused_sessions`` 0), does the call fail with ``max_sessions``.
- Making room is serialised (:attr:`Room.lock`): two calls never pause for one slot, and
  a resume is counted as running from the moment it has its room.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from mcp_code_sandbox.errors import MaxSessions
from mcp_code_sandbox.sessions.session import Session
from mcp_code_sandbox.settings import Settings

__all__ = ["Room"]


class Room:
    """The running-session limits, and pausing to keep within them."""

    def __init__(
        self,
        settings: Settings,
        sessions: Callable[[], Iterable[Session]],
        pause: Callable[[Session], Awaitable[None]],
    ) -> None:
        self.settings = settings
        self._sessions = sessions
        self._pause = pause
        #: Held while room is made and taken (see the module docstring).
        self.lock = asyncio.Lock()

    def running(self, owner: str | None = None) -> int:
        """Running sessions: all of them, or ``owner``'s."""
        return sum(
            1
            for s in self._sessions()
            if (s.paused is None or s.resuming) and (owner is None or s.owner == owner)
        )

    def check(self, owner: str) -> None:
        """Raise ``MaxSessions`` when ``owner`` may not have one more running session."""
        limit = self.settings.max_sessions
        if self.running() >= limit:
            raise MaxSessions(
                f"this server already runs {limit} sessions, each of them in a call right "
                "now (an idle one would have been paused to make room); wait for one to "
                "finish, close one with close_session, or reuse an existing session_id"
            )
        per_owner = self.settings.sessions_per_owner
        if per_owner is not None and self.running(owner) >= per_owner:
            raise MaxSessions(
                f"you already have {per_owner} sessions running, the most one owner may run "
                "at once, each of them in a call right now; wait for one to finish, close "
                "one with close_session, or reuse an existing session_id"
            )

    async def make(self, owner: str, exclude: Session | None = None) -> None:
        """Pause idle running sessions until ``owner`` may run one more (``exclude``: the
        session that wants to run). Returns when there is room, or when there is none to
        be had (:meth:`check` then says so). Call with :attr:`lock` held."""
        s = self.settings
        if s.pause_after_m <= 0 or s.max_paused_sessions <= 0:
            return
        while True:
            per_owner = s.sessions_per_owner
            if per_owner is not None and self.running(owner) >= per_owner:
                victim = self._idlest(owner, exclude)
            elif self.running() >= s.max_sessions:
                victim = self._idlest(None, exclude)
            else:
                return
            if victim is None:
                return
            await self._pause(victim)
            if victim.paused is None:  # closed meanwhile, or could not: do not spin
                return

    def _idlest(self, owner: str | None, exclude: Session | None) -> Session | None:
        idle = [
            s
            for s in self._sessions()
            if s is not exclude
            and s.paused is None
            and not s.resuming
            and not s.pausing
            and not s.closed
            and not s.lock.locked()
            and not s.queued  # a call waits for it: pausing would wait for that call
            and (owner is None or s.owner == owner)
        ]
        return min(idle, key=lambda s: s.last_active, default=None)
