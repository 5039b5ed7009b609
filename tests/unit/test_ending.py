"""``sessions/ending.py``: ending a session step by step, with a stub for the sandbox
keeper (no backend): what is stopped, what is removed, what is retried."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mcp_code_sandbox.backends.base import Sandbox
from mcp_code_sandbox.backends.checkpoints import Checkpoint
from mcp_code_sandbox.backends.runner_images import RunnerSandbox
from mcp_code_sandbox.errors import SessionNotFound
from mcp_code_sandbox.metrics import Metrics
from mcp_code_sandbox.sessions import records
from mcp_code_sandbox.sessions.ending import Ending
from mcp_code_sandbox.sessions.ids import session_key
from mcp_code_sandbox.sessions.lifecycle import Phase
from mcp_code_sandbox.sessions.mounts import MountedWorkspaces
from mcp_code_sandbox.sessions.session import Paused, Session, check_open
from mcp_code_sandbox.sessions.table import SessionTable
from mcp_code_sandbox.sessions.workers import WorkerThreads
from mcp_code_sandbox.settings import Settings, load_settings
from mcp_code_sandbox.workspace import Workspace


class Box:
    """A sandbox as ending sees it: something to stop, with a name."""

    def __init__(self, backend_id: str) -> None:
        self.backend_id = backend_id
        self.spec = SimpleNamespace(egress=None)  # no network: what its record reads


class Stops:
    """The sandbox keeper's side: a stop of a name in ``failing`` fails (and the thing
    stays in ``unstopped``, as :meth:`.sandboxes.Sandboxes.free` keeps it)."""

    def __init__(self) -> None:
        self.stopped: list[str] = []
        self.discarded: list[str] = []
        self.failing: set[str] = set()

    async def free(self, session: Session, thing: Sandbox | RunnerSandbox) -> None:
        session.unstopped.append(thing)
        if thing.backend_id not in self.failing:
            self.stopped.append(thing.backend_id)
            session.unstopped.remove(thing)

    async def discard(self, paused: Paused) -> None:
        assert paused.checkpoint is not None
        self.discarded.append(paused.checkpoint.backend_id)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return load_settings({"state_dir": str(tmp_path)}, environ={})


def ending_of(settings: Settings, stops: Stops) -> Ending:
    def workspace(slot: str, uid: int | None) -> Workspace:
        return Workspace(settings.workspaces_dir / slot, quota_bytes=1 << 20)

    table = SessionTable(settings, instance="me-1", handover=False, workspace_for=workspace)
    return Ending(
        settings, WorkerThreads(2), table, MountedWorkspaces(settings), Metrics("fake"), stops
    )


def live(ending: Ending, sid: str, box: str | None = "box") -> Session:
    key = session_key("alice", sid)
    slot = records.new_slot(key)
    workspace = Workspace(ending.settings.workspaces_dir / slot, quota_bytes=1 << 20)
    workspace.create()
    now = time.monotonic()
    session = Session(sid, "alice", key, slot, workspace, now, now, time.time())
    if box is not None:
        session.sandbox = Box(box)  # type: ignore[assignment]
    ending.table.add(session)
    ending.table.save(session, force=True)
    return session


def recorded(settings: Settings) -> set[str]:
    return {r.slot for r in records.load_records(settings.sessions_dir)}


async def test_an_end_stops_the_sandbox_removes_the_files_and_leaves_a_tombstone(
    settings: Settings,
) -> None:
    stops = Stops()
    ending = ending_of(settings, stops)
    session = live(ending, "s")
    session.runners["node"] = Box("runner")  # type: ignore[assignment]
    assert await ending.end(session, "session s was closed", "closed") == []
    assert stops.stopped == ["box", "runner"] and session.sandbox is None
    assert not session.workspace.root.exists() and recorded(settings) == set()
    assert session.phase is Phase.ENDED and not ending.unfinished
    assert ending.table.get("alice", "s") is None
    assert ending.table.gone("alice", "s") == (
        "session s was closed; files and variables from before are gone"
    )
    assert await ending.end(session, "again", "closed") == []  # ended already: left alone


async def test_a_paused_sessions_checkpoint_is_freed(settings: Settings) -> None:
    stops = Stops()
    ending = ending_of(settings, stops)
    session = live(ending, "s", box=None)
    session.paused = Paused("memory", 0.0, checkpoint=Checkpoint("ckpt-1", 10))
    session.phase = Phase.PAUSED
    assert await ending.end(session, "expired", "idle") == []
    assert stops.discarded == ["ckpt-1"] and session.phase is Phase.ENDED


async def test_a_failed_stop_is_said_and_retried_until_it_goes(settings: Settings) -> None:
    stops = Stops()
    stops.failing = {"stuck"}
    ending = ending_of(settings, stops)
    session = live(ending, "s", box="stuck")
    remains = await ending.end(session, "expired", "idle")
    assert remains == ["its sandbox stuck could not be stopped"]
    # The files go all the same; the session is closed and waits for its retry.
    assert not session.workspace.root.exists()
    assert session.phase is Phase.ENDING and session.slot in ending.unfinished
    with pytest.raises(SessionNotFound):
        check_open(session)
    await ending.retry()  # still failing: still there
    assert session.slot in ending.unfinished
    stops.failing.clear()
    await ending.retry()
    assert stops.stopped == ["stuck"] and not ending.unfinished
    ended: Phase = session.phase  # moved by the retry (mypy narrowed it above)
    assert ended is Phase.ENDED and session.unstopped == []


async def test_an_end_waits_for_the_call_in_flight(settings: Settings) -> None:
    stops = Stops()
    ending = ending_of(settings, stops)
    session = live(ending, "s")
    await session.lock.acquire()  # a call holds it
    end = asyncio.create_task(ending.end(session, "closed", "closed"))
    await asyncio.sleep(0.05)
    assert session.closed and not end.done()  # closed at once; files wait for the call
    assert session.workspace.root.exists()
    session.lock.release()
    assert await end == []
    assert not session.workspace.root.exists()


async def test_an_end_that_fails_outright_is_kept_for_the_next_pass(settings: Settings) -> None:
    stops = Stops()
    ending = ending_of(settings, stops)
    session = live(ending, "s")

    async def broken(session: Session, thing: object) -> None:
        raise RuntimeError("a bug in a stop")

    stops.free = broken  # type: ignore[method-assign]
    await ending.end_logged(session, "expired", "idle")  # logged, never raised
    assert session.slot in ending.unfinished and session.closed
