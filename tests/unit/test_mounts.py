"""``sessions/mounts.py``: the mounts of sessions without a sandbox, shared fairly."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mcp_code_sandbox.errors import SessionBusy
from mcp_code_sandbox.sessions.lifecycle import Phase
from mcp_code_sandbox.sessions.mounts import MountedWorkspaces
from mcp_code_sandbox.sessions.session import Session
from mcp_code_sandbox.settings import load_settings
from mcp_code_sandbox.workspace import Workspace


def session(sid: str, owner: str) -> Session:
    workspace = Workspace(Path("/nonexistent") / sid, quota_bytes=1)
    return Session(sid, owner, sid, sid, workspace, 0.0, 0.0, 0.0)


def mounts() -> MountedWorkspaces:
    tokens = "a:" + "a" * 20 + ",b:" + "b" * 20
    return MountedWorkspaces(load_settings({"max_sessions": 4, "api_tokens": tokens}, environ={}))


async def test_one_owner_takes_its_share_and_the_other_still_gets_in() -> None:
    held = mounts()
    for i in range(2):
        await held.take(session(f"m{i}", "mallory"), wait_s=1)
    with pytest.raises(SessionBusy, match="at most 2 per owner"):
        await held.take(session("m2", "mallory"), wait_s=0.01)
    await held.take(session("v0", "victim"), wait_s=0.01)
    assert held.held() == 3 and held.held("mallory") == 2


async def test_a_place_given_back_lets_a_waiting_call_in() -> None:
    held = mounts()
    first, second = session("m0", "mallory"), session("m1", "mallory")
    await held.take(first, wait_s=1)
    await held.take(second, wait_s=1)
    waiting = asyncio.create_task(held.take(session("m2", "mallory"), wait_s=30))
    await asyncio.sleep(0)
    assert not waiting.done()
    await held.give_back(first)
    await asyncio.wait_for(waiting, timeout=5)
    second.phase = Phase.ENDING  # an ended session holds no place
    assert held.held("mallory") == 1
