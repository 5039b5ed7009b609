"""``sessions/room.py``: which session is paused to make room for one more running one."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcp_code_sandbox.errors import MaxSessions
from mcp_code_sandbox.sessions.room import Room
from mcp_code_sandbox.sessions.session import Paused, Session
from mcp_code_sandbox.settings import load_settings
from mcp_code_sandbox.workspace import Workspace


def session(sid: str, owner: str, idle_since: float) -> Session:
    workspace = Workspace(Path("/nonexistent") / sid, quota_bytes=1)
    return Session(sid, owner, sid, sid, workspace, 0.0, idle_since, 0.0)


def room_of(sessions: list[Session], paused: list[str], **values: object) -> Room:
    async def pause(victim: Session) -> None:
        paused.append(victim.id)
        victim.paused = Paused("files", 0.0)

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
