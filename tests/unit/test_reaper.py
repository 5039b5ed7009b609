"""``sessions/reaper.py``: what the reaper pauses or ends, decided from plain sessions,
and its pass acting through stubs (no backend, no sandbox)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from mcp_code_sandbox.metrics import EndReason
from mcp_code_sandbox.sessions.lifecycle import Phase
from mcp_code_sandbox.sessions.reaper import End, Policy, Reaper, Tidy, over_paused_limit, verdict
from mcp_code_sandbox.sessions.session import Paused, Session
from mcp_code_sandbox.settings import load_settings
from mcp_code_sandbox.workspace import Workspace

#: 30 min TTL, 1 h lifetime, pause after 10 min idle; at most 2 paused, 100 bytes of them.
POLICY = Policy(
    ttl_m=30, lifetime_h=1, pause_after_m=10, paused_disk_bytes=100, max_paused_sessions=2
)
MIN = 60.0


class Box:
    """Stands for a running sandbox: the policy only asks whether there is one."""


def session(
    sid: str, owner: str = "x", *, idle_m: float = 0.0, age_m: float = 0.0, now: float = 1e6
) -> Session:
    workspace = Workspace(Path("/nonexistent") / sid, quota_bytes=1)
    s = Session(sid, owner, sid, sid, workspace, now - age_m * MIN, now - idle_m * MIN, 0.0)
    s.sandbox = Box()  # type: ignore[assignment]
    return s


def paused(sid: str, owner: str, idle_m: float, now: float = 1e6) -> Session:
    s = session(sid, owner, idle_m=idle_m, age_m=idle_m, now=now)
    s.sandbox, s.paused, s.phase = None, Paused("files", 0.0), Phase.PAUSED
    return s


def test_idle_past_the_ttl_or_older_than_the_lifetime_ends_and_says_why() -> None:
    idle = verdict(session("a", idle_m=31, age_m=31), 1e6, POLICY)
    assert idle == End("session a expired after 30 min idle", "idle")
    old = verdict(session("b", idle_m=1, age_m=61), 1e6, POLICY)
    assert old == End("session b reached its maximum lifetime of 1 h", "lifetime")


def test_idle_past_pause_after_pauses_a_running_session_with_a_sandbox() -> None:
    assert verdict(session("a", idle_m=11, age_m=11), 1e6, POLICY) is Tidy.PAUSE
    assert verdict(session("b", idle_m=9, age_m=11), 1e6, POLICY) is None
    no_sandbox = session("c", idle_m=11, age_m=11)
    no_sandbox.sandbox = None  # nothing ran: nothing in RAM to put away
    assert verdict(no_sandbox, 1e6, POLICY) is None
    assert verdict(paused("d", "x", idle_m=11), 1e6, POLICY) is None
    off = Policy(
        ttl_m=30, lifetime_h=1, pause_after_m=0, paused_disk_bytes=0, max_paused_sessions=0
    )
    assert verdict(session("e", idle_m=29, age_m=29), 1e6, off) is None


async def test_a_session_in_a_call_is_never_ended_or_paused() -> None:
    s = session("a", idle_m=999, age_m=999)
    await s.lock.acquire()
    assert verdict(s, 1e6, POLICY) is None


def test_past_the_paused_limit_the_owner_with_the_most_loses_its_idlest_first() -> None:
    sessions = [
        paused("a1", "alice", idle_m=5),
        paused("a2", "alice", idle_m=9),
        paused("b1", "bob", idle_m=50),
    ]
    excess, victim = over_paused_limit(sessions, 2)
    assert excess == 1 and victim is not None and victim.id == "a2"
    assert over_paused_limit(sessions, 3) == (0, None)


class Acts:
    """The manager's side, as the reaper sees it: records what it is told to do."""

    def __init__(self, sessions: list[Session]) -> None:
        self.sessions = sessions
        self.done: list[tuple[str, str]] = []

    async def end(self, s: Session, reason: str, why: EndReason) -> None:
        self.sessions.remove(s)  # an end takes it out of the table
        self.done.append(("end " + why, s.id))

    async def pause(self, s: Session) -> None:
        s.sandbox, s.paused, s.phase = None, Paused("files", 0.0), Phase.PAUSED
        self.done.append(("pause", s.id))

    async def unmount(self, s: Session) -> None:
        assert s.lock.locked()  # the reaper holds the lock for it
        self.done.append(("unmount", s.id))

    async def retry(self) -> None:
        self.done.append(("retry", ""))


def reaper_of(acts: Acts, **values: object) -> Reaper:
    settings = load_settings(values, environ={})
    return Reaper(
        settings,
        lambda: acts.sessions,
        end=acts.end,
        pause=acts.pause,
        unmount=acts.unmount,
        retry=acts.retry,
    )


async def test_a_pass_ends_pauses_and_keeps_paused_state_within_its_limits() -> None:
    now = time.monotonic()
    expired = session("old", idle_m=31, age_m=31, now=now)
    idle = session("idle", idle_m=11, age_m=11, now=now)
    busy = session("busy", idle_m=31, age_m=31, now=now)
    await busy.lock.acquire()
    kept = [
        paused("p1", "alice", 20, now),
        paused("p2", "alice", 25, now),
        paused("p3", "bob", 15, now),
    ]
    acts = Acts([expired, idle, busy, *kept])
    await reaper_of(acts, session_ttl_m=30, pause_after_m=10, max_paused_sessions=2).reap()
    assert acts.done[:2] == [("end idle", "old"), ("pause", "idle")]
    # Now four are paused (idle too), two over the limit: alice's, then the idlest.
    assert [d for d in acts.done[2:] if d[0] == "end limit"] == [
        ("end limit", "p2"),
        ("end limit", "p1"),
    ]
    assert acts.done[-1] == ("retry", "")
    assert busy in acts.sessions


async def test_the_loop_is_started_again_after_an_unforeseen_death() -> None:
    class Unforeseen(BaseException):
        pass

    passes: list[int] = []

    async def each_pass() -> None:
        passes.append(1)
        if len(passes) == 1:
            raise Unforeseen

    reaper = reaper_of(Acts([]), session_ttl_m=0.001)  # the shortest interval: 0.5 s
    reaper.start(each_pass)
    first = reaper.task
    try:
        async with asyncio.timeout(10):
            while len(passes) < 2:
                await asyncio.sleep(0.05)
        assert reaper.task is not first and reaper.task is not None
        assert not reaper.task.done()
    finally:
        await reaper.stop()
    assert reaper.task is not None and reaper.task.done()
