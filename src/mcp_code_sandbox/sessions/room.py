"""Room for one more running session, and which paused sessions give way to the
paused-state budgets: the reaper's and the limits' decisions, kept apart from acting.

Semantics (the manager owns one :class:`Room`):
- A session is *running* unless it is paused (with or without a sandbox: an upload makes
  one too), or while a call resumes it. ``max_sessions`` bounds running sessions, and
  ``sessions_per_owner`` each owner's; paused ones cost disk, not RAM, and are bounded
  apart (``max_paused_sessions``, ``paused_disk_bytes``: see :func:`over_disk_budget`).
- A call that creates a session, or resumes a paused one, when a limit is reached first
  pauses the longest-idle running session that no call holds (for an owner's limit, one
  of that owner's): it resumes on its own next call, as after any pause. Only when every
  running session is in a call, or pausing is off (``pause_after_m`` 0, or
  ``max_paused_sessions`` 0), does the call fail with ``max_sessions``.
- Deciding takes no lock and no time: each decision is one synchronous step on the event
  loop, and the pause it decides on runs after it, holding nothing but the victim's own
  lock. So no owner ever waits for another owner's pause (a pause can take long: a big
  session's checkpoint, or hostile code making its own save slow). Two calls never pick
  one victim (it is marked before the step ends), and a slot being freed is *claimed*:
  while its victim is paused it counts for the call that paused it, not for its old
  owner, so no other call takes it meanwhile; the call takes it in the same synchronous
  step in which :meth:`Room.make` returns (``check`` and registering, or the move to ``RESUMING``).
- Past ``paused_disk_bytes`` the owner whose paused state is largest gives way first,
  that owner's longest-idle paused session first; nobody else's is taken while that
  owner still has paused state (:func:`over_disk_budget`). Sizes are what the state
  holds on disk (allocated blocks), never what its files claim: a sparse file's holes
  cost nothing and count nothing.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

from mcp_code_sandbox.errors import MaxSessions
from mcp_code_sandbox.sessions.lifecycle import Phase
from mcp_code_sandbox.sessions.session import Session
from mcp_code_sandbox.settings import Settings

__all__ = ["Others", "Room", "over_disk_budget"]


class Others(Protocol):
    """The sessions other replicas run (``replicas.Replicas``)."""

    def running_elsewhere(self, owner: str | None) -> int:
        """Running sessions they hold: all, or ``owner``'s."""

    async def fetch(self, owner: str | None) -> bool:
        """Take the longest idle of them (``owner``'s, or anyone's) over, for this server
        to pause to make room as it would one of its own; False when none could be."""


class Room:
    """The running-session limits, and pausing to keep within them."""

    def __init__(
        self,
        settings: Settings,
        sessions: Callable[[], Iterable[Session]],
        pause: Callable[[Session], Awaitable[None]],
        others: Others | None = None,
    ) -> None:
        """``others``: the other replicas' sessions (``replicas``), which count toward
        the limits too."""
        self.settings = settings
        self._sessions = sessions
        self._pause = pause
        self._others = others
        #: Sessions being paused to make room, each with the owner whose call claimed the
        #: slot it frees (see the module docstring).
        self._freeing: dict[Session, str] = {}

    def running(self, owner: str | None = None) -> int:
        """Running sessions, with the slots claimed from sessions being paused for room
        and those other replicas run: all of them, or ``owner``'s."""
        sessions = sum(
            1
            for s in self._sessions()
            if s.phase is not Phase.PAUSED
            and s not in self._freeing
            and (owner is None or s.owner == owner)
        )
        claims = sum(1 for who in self._freeing.values() if owner is None or who == owner)
        elsewhere = 0 if self._others is None else self._others.running_elsewhere(owner)
        return sessions + claims + elsewhere

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
        be had (:meth:`check` then says so); the caller takes it (or is refused) before
        it awaits anything else."""
        s = self.settings
        if s.pause_after_m <= 0 or s.max_paused_sessions <= 0:
            return
        while True:
            victim = self.victim(owner, exclude)
            if victim is None:
                if await self._fetched(owner):
                    continue  # one of another replica's is this one's now: pause it
                return
            self._freeing[victim] = owner  # claimed: see the module docstring
            try:
                await self._pause(victim)
            finally:
                del self._freeing[victim]
            if victim.phase is not Phase.PAUSED:  # closed meanwhile, or could not: do not spin
                return

    async def _fetched(self, owner: str) -> bool:
        """Did a limit that another replica's sessions fill get one of them over here?"""
        others = self._others
        if others is None:
            return False
        per_owner = self.settings.sessions_per_owner
        if per_owner is not None and self.running(owner) >= per_owner:
            return others.running_elsewhere(owner) > 0 and await others.fetch(owner)
        if self.running() >= self.settings.max_sessions:
            return others.running_elsewhere(None) > 0 and await others.fetch(None)
        return False

    def victim(self, owner: str, exclude: Session | None = None) -> Session | None:
        """The session to pause so that ``owner`` may run one more; ``None`` when there
        is room already, or no session to pause."""
        per_owner = self.settings.sessions_per_owner
        if per_owner is not None and self.running(owner) >= per_owner:
            return self._idlest(owner, exclude)
        if self.running() >= self.settings.max_sessions:
            return self._idlest(None, exclude)
        return None

    def _idlest(self, owner: str | None, exclude: Session | None) -> Session | None:
        idle = [
            s
            for s in self._sessions()
            if s is not exclude
            and s.phase is Phase.RUNNING
            and s not in self._freeing
            and not s.lock.locked()
            and not s.queued  # a call waits for it: pausing would wait for that call
            and (owner is None or s.owner == owner)
        ]
        return min(idle, key=lambda s: s.last_active, default=None)


def over_disk_budget(sessions: Iterable[Session], budget: int) -> list[Session]:
    """The paused sessions to expire, in order, so that paused state fits in ``budget``
    bytes (each session's ``paused.bytes``: what it holds on disk). Each is taken from the
    owner whose paused state is largest at that moment (that owner is always over its
    fair share while the total is over), that owner's longest idle first. A session a call
    holds is not taken; while the largest owner has only such sessions, nobody else's is
    taken either (the reaper's next pass decides again)."""
    held = [s for s in sessions if s.paused is not None and not s.closed]
    by_owner: collections.Counter[str] = collections.Counter()
    for s in held:
        assert s.paused is not None
        by_owner[s.owner] += s.paused.bytes
    total = sum(by_owner.values())
    chosen: list[Session] = []
    while total > budget and by_owner:
        owner = max(by_owner, key=lambda o: (by_owner[o], o))
        free = [s for s in held if s.owner == owner and not s.lock.locked()]
        if not free:
            break
        victim = min(free, key=lambda s: s.last_active)
        assert victim.paused is not None
        held.remove(victim)
        chosen.append(victim)
        by_owner[owner] -= victim.paused.bytes
        total -= victim.paused.bytes
        if not any(s.owner == owner for s in held):
            del by_owner[owner]
    return chosen
