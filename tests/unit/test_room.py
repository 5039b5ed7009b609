"""``sessions/room.py``: which session is paused to make room for one more running one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mcp_code_sandbox.errors import MaxSessions
from mcp_code_sandbox.sessions.lifecycle import Phase
from mcp_code_sandbox.sessions.room import Room, over_disk_budget
from mcp_code_sandbox.sessions.session import Paused, Session
from mcp_code_sandbox.settings import load_settings
from mcp_code_sandbox.workspace import Workspace


def session(sid: str, owner: str, idle_since: float) -> Session:
    workspace = Workspace(Path("/nonexistent") / sid, quota_bytes=1)
    return Session(sid, owner, sid, sid, workspace, 0.0, idle_since, 0.0)


def room_of(sessions: list[Session], paused: list[str], **values: object) -> Room:
    async def pause(victim: Session) -> None:
        paused.append(victim.id)
        victim.paused, victim.phase = Paused("files", 0.0), Phase.PAUSED

    settings = load_settings({"max_sessions": 2, **values}, environ={})
    return Room(settings, lambda: sessions, pause)


async def test_the_idlest_session_no_call_holds_or_waits_for_is_paused() -> None:
    oldest, older, newer = session("a", "x", 1.0), session("b", "x", 2.0), session("c", "x", 3.0)
    oldest.queued = 1  # a call waits for it: its lock is free only between two calls
    await older.lock.acquire()  # in a call
    paused: list[str] = []
    room = room_of([oldest, older, newer], paused, max_sessions=3)
    await room.make("y")
    assert paused == ["c"]
    assert room.running() == 2
    room.check("y")  # room now


async def test_no_room_to_be_had_is_max_sessions() -> None:
    a, b = session("a", "x", 1.0), session("b", "x", 2.0)
    for s in (a, b):
        await s.lock.acquire()
    paused: list[str] = []
    room = room_of([a, b], paused)
    await room.make("y")
    assert paused == []
    with pytest.raises(MaxSessions, match="each of them in a call"):
        room.check("y")


async def test_pausing_off_pauses_nothing() -> None:
    paused: list[str] = []
    room = room_of([session("a", "x", 1.0), session("b", "x", 2.0)], paused, pause_after_m=0)
    await room.make("y")
    assert paused == []
    with pytest.raises(MaxSessions):
        room.check("y")


async def test_another_owners_slow_pause_is_never_waited_for() -> None:
    alices = session("a", "alice", 1.0)
    sessions = [alices]
    pausing = asyncio.Event()
    finish = asyncio.Event()

    async def slow_pause(victim: Session) -> None:
        pausing.set()
        await finish.wait()  # a big checkpoint, or hostile code making its save slow
        victim.paused, victim.phase = Paused("files", 0.0), Phase.PAUSED

    settings = load_settings({"max_sessions": 2, "max_sessions_per_owner": 1}, environ={})
    room = Room(settings, lambda: sessions, slow_pause)
    alice = asyncio.create_task(room.make("alice"))
    await pausing.wait()
    # Bob makes his room and takes it while Alice's pause is still under way.
    await asyncio.wait_for(room.make("bob"), timeout=5)
    room.check("bob")
    sessions.append(session("b", "bob", 2.0))
    assert not alice.done()
    # The slot Alice's pause frees is hers: neither Bob nor a third owner takes it.
    with pytest.raises(MaxSessions):
        room.check("carol")
    finish.set()
    await alice
    room.check("alice")


async def test_two_calls_never_pause_one_session_for_two_slots() -> None:
    a, b = session("a", "x", 1.0), session("b", "x", 2.0)
    started: list[str] = []
    finish = asyncio.Event()

    async def pause(victim: Session) -> None:
        started.append(victim.id)
        await finish.wait()
        victim.paused, victim.phase = Paused("files", 0.0), Phase.PAUSED

    settings = load_settings({"max_sessions": 2}, environ={})
    room = Room(settings, lambda: [a, b], pause)
    first = asyncio.create_task(room.make("y"))
    second = asyncio.create_task(room.make("z"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert started == ["a", "b"]  # each its own victim, the idlest first
    finish.set()
    await asyncio.gather(first, second)
    assert room.running() == 0


def paused(sid: str, owner: str, idle_since: float, size: int) -> Session:
    s = session(sid, owner, idle_since)
    s.paused, s.phase = Paused("variables", 0.0, bytes=size), Phase.PAUSED
    return s


def test_the_owner_whose_paused_state_is_largest_gives_way_first() -> None:
    bobs = paused("bob", "bob", 1.0, 30)  # the longest idle of all
    alice_old = paused("a1", "alice", 2.0, 40)
    alice_new = paused("a2", "alice", 3.0, 10)
    chosen = over_disk_budget([bobs, alice_old, alice_new], budget=50)
    assert [s.id for s in chosen] == ["a1"]  # 80 -> 40: Bob's is never touched
    chosen = over_disk_budget([bobs, alice_old, alice_new], budget=25)
    assert [s.id for s in chosen] == ["a1", "bob"]  # 80 -> 40, then Bob's 30 is the largest


async def test_no_other_owner_pays_while_the_largest_is_in_a_call() -> None:
    bobs = paused("bob", "bob", 1.0, 5)
    alices = paused("a", "alice", 2.0, 100)
    await alices.lock.acquire()  # in a file call right now
    assert over_disk_budget([bobs, alices], budget=50) == []
    alices.lock.release()
    assert over_disk_budget([bobs, alices], budget=50) == [alices]


def test_within_the_budget_nobody_pays() -> None:
    sessions = [paused("a", "alice", 1.0, 30), paused("b", "bob", 2.0, 20)]
    assert over_disk_budget(sessions, budget=50) == []
