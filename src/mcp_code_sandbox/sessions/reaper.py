"""The reaper: what to pause or end, decided by pure functions, and the loop that asks
them and has the manager act (the manager owns one :class:`Reaper`).

Semantics:
- ``last_active`` moves at the start and end of every call; a session idle past the TTL
  or older than the max lifetime ends, never in the middle of a call (:func:`verdict`).
- One idle past ``pause_after_m`` (a running one with a sandbox or runner) is paused, a
  few at a time; a session without a sandbox whose workspace stayed mounted (busy when
  its call ended: a download) is unmounted.
- Paused state is kept within its budgets by ending paused sessions: past
  ``paused_disk_bytes`` the owner whose paused state is largest first
  (:func:`.room.over_disk_budget`), past ``max_paused_sessions`` the owner holding the
  most paused sessions first (:func:`over_paused_limit`): one owner's flood costs that
  owner. Both the longest idle first.
- Each session on its own: one that fails is logged and tried again at the next pass,
  as is what earlier ends left. The loop catches everything but its cancellation, and
  is started again if it dies anyway: with no reaper, no session would expire again.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import structlog

from mcp_code_sandbox.metrics import EndReason
from mcp_code_sandbox.sessions.lifecycle import Phase
from mcp_code_sandbox.sessions.room import over_disk_budget
from mcp_code_sandbox.sessions.session import Session
from mcp_code_sandbox.settings import Settings

__all__ = [
    "End",
    "Policy",
    "Reaper",
    "Tidy",
    "mount_left",
    "over_disk",
    "over_limit",
    "over_paused_limit",
    "verdict",
]

log = structlog.get_logger("mcp_code_sandbox.sessions.reaper")

#: Idle sessions the reaper pauses at once: each waits on its sandbox (a save, a
#: checkpoint), not on the CPU, and a few in parallel bound how many run at once.
_PAUSES_AT_ONCE = 4


@dataclass(frozen=True)
class Policy:
    """The settings the reaper decides by."""

    ttl_m: float
    lifetime_h: float
    #: 0: pausing is off.
    pause_after_m: float
    paused_disk_bytes: int
    max_paused_sessions: int

    @classmethod
    def of(cls, settings: Settings) -> Policy:
        return cls(
            settings.session_ttl_m,
            settings.session_max_lifetime_h,
            settings.pause_after_m,
            settings.paused_disk_bytes,
            settings.max_paused_sessions,
        )

    @property
    def interval_s(self) -> float:
        """Between two passes: a quarter of the shortest span it watches, within
        0.5-15 s (an expiry is then late by at most a quarter of its span)."""
        spans = [self.ttl_m * 60]
        if self.pause_after_m > 0:
            spans.append(self.pause_after_m * 60)
        return max(0.5, min(15.0, min(spans) / 4))


@dataclass(frozen=True)
class End:
    """End the session: ``reason`` in words (its tombstone), ``why`` for the metrics."""

    reason: str
    why: EndReason


class Tidy(enum.Enum):
    """Keep the session, but put it away: pause it, or let its idle mount go."""

    PAUSE = "pause"
    UNMOUNT = "unmount"


def verdict(session: Session, now: float, policy: Policy) -> End | Tidy | None:
    """What the reaper does with ``session`` at monotonic time ``now``; ``None``: nothing
    (a call holds it, or it is neither idle nor old enough)."""
    if session.lock.locked():
        return None
    idle = now - session.last_active
    if idle > policy.ttl_m * 60:
        return End(f"session {session.id} expired after {policy.ttl_m:g} min idle", "idle")
    if now - session.created_at > policy.lifetime_h * 3600:
        return End(
            f"session {session.id} reached its maximum lifetime of {policy.lifetime_h:g} h",
            "lifetime",
        )
    if (
        policy.pause_after_m > 0
        and idle > policy.pause_after_m * 60
        and session.phase is Phase.RUNNING
        and (session.sandbox is not None or bool(session.runners))
    ):
        return Tidy.PAUSE
    if mount_left(session):
        return Tidy.UNMOUNT
    return None


def mount_left(session: Session) -> bool:
    """Is a session without a sandbox still mounted, no call holding or awaiting it?"""
    return (
        session.workspace_made
        and session.workspace.volume is not None
        and session.sandbox is None
        and not session.runners
        and not session.queued
        and not session.lock.locked()
    )


def over_disk(session: Session, budget: int) -> End:
    return End(
        f"session {session.id} was paused and then expired to keep paused sessions "
        f"within SANDBOX_PAUSED_DISK_BYTES ({budget} bytes); the owner whose paused "
        "sessions take the most disk loses its longest idle first",
        "disk",
    )


def over_paused_limit(sessions: Iterable[Session], limit: int) -> tuple[int, Session | None]:
    """How many paused sessions are over ``limit``, and the one to end first: the longest
    idle of the owner holding the most paused sessions, no call holding it (``None``:
    none over, or every one of them is in a call)."""
    paused = [s for s in sessions if s.paused is not None]
    excess = len(paused) - limit
    if excess <= 0:
        return 0, None
    by_owner = collections.Counter(s.owner for s in paused)
    free = [s for s in paused if not s.lock.locked() and not s.closed]
    victim = min(free, key=lambda s: (-by_owner[s.owner], s.last_active), default=None)
    return excess, victim


def over_limit(session: Session, limit: int) -> End:
    return End(
        f"session {session.id} was paused and then expired to keep within "
        f"SANDBOX_MAX_PAUSED_SESSIONS ({limit}); the owner holding the most paused "
        "sessions loses its longest idle first",
        "limit",
    )


class Reaper:
    """Asks the functions above about every session, and has the manager act: ``end``
    (logs and retries what fails itself), ``pause``, ``unmount`` (called with the
    session's lock held) and ``retry`` (what earlier ends left)."""

    def __init__(
        self,
        settings: Settings,
        sessions: Callable[[], Iterable[Session]],
        *,
        end: Callable[[Session, str, EndReason], Awaitable[None]],
        pause: Callable[[Session], Awaitable[None]],
        unmount: Callable[[Session], Awaitable[None]],
        retry: Callable[[], Awaitable[None]],
    ) -> None:
        self.policy = Policy.of(settings)
        self._sessions = sessions
        self._end = end
        self._pause = pause
        self._unmount = unmount
        self._retry = retry
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    async def reap(self) -> None:
        """One pass (see the module docstring)."""
        now = time.monotonic()
        to_pause: list[Session] = []
        for session in list(self._sessions()):
            what = verdict(session, now, self.policy)
            if isinstance(what, End):
                await self._end(session, what.reason, what.why)
            elif what is Tidy.PAUSE:
                to_pause.append(session)
            elif what is Tidy.UNMOUNT:
                async with session.lock:  # free (checked above): taken at once
                    await self._unmount(session)  # busy at its call's end (a download)
        for start in range(0, len(to_pause), _PAUSES_AT_ONCE):
            batch = to_pause[start : start + _PAUSES_AT_ONCE]
            await asyncio.gather(*(self._paused_logged(s) for s in batch))
        budget = self.policy.paused_disk_bytes
        for session in over_disk_budget(self._sessions(), budget):
            if session.lock.locked():  # a call came meanwhile: decide again next pass
                break
            end = over_disk(session, budget)
            await self._end(session, end.reason, end.why)
        limit = self.policy.max_paused_sessions
        excess, _ = over_paused_limit(self._sessions(), limit)
        for _ in range(excess):  # each end leaves the table: ask again
            _, victim = over_paused_limit(self._sessions(), limit)
            if victim is None:
                break
            end = over_limit(victim, limit)
            await self._end(victim, end.reason, end.why)
        await self._retry()

    async def _paused_logged(self, session: Session) -> None:
        try:
            await self._pause(session)
        except Exception:
            log.exception("pausing a session failed", owner=session.owner, session=session.id)

    # -- the loop ----------------------------------------------------------------------

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The loop's task while it runs (a new one after it died)."""
        return self._task

    def start(self, each_pass: Callable[[], Awaitable[None]] | None = None) -> None:
        """Run ``each_pass`` (:meth:`reap` by default) every ``interval_s`` until
        :meth:`stop`."""
        self._each_pass = each_pass or self.reap
        self._task = asyncio.create_task(self._forever(), name="session-reaper")
        self._task.add_done_callback(self._ended)

    async def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})  # whatever it ended with, shutdown goes on

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The loop catches every failure, so this is for one it did not foresee."""
        if self._stopped or task.cancelled():
            return
        log.error("the session reaper died; starting it again", error=repr(task.exception()))
        self.start(self._each_pass)

    async def _forever(self) -> None:
        while True:
            await asyncio.sleep(self.policy.interval_s)
            try:
                await self._each_pass()
            except Exception:  # a pass isolates sessions; this is the last guard
                log.exception("a reaper pass failed; the next one tries again")
