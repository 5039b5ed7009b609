"""What ``list_sessions`` and the operator's page show (``sessions.overview``) of sessions
other replicas hold, from their records, beside this server's own. Built by hand: no
sandbox runs, no workspace is read."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mcp_code_sandbox.sessions.overview import (
    _recorded_summary,
    _recorded_view,
    overview,
    summaries,
)
from mcp_code_sandbox.sessions.records import SessionRecord
from mcp_code_sandbox.sessions.session import Paused, Session
from mcp_code_sandbox.sessions.workers import WorkerThreads
from mcp_code_sandbox.workspace import Workspace
from tests.fakes import FakeBackend

NOW = time.time()


def record(sid: str, created_at: float, **kw: Any) -> SessionRecord:
    key = "s" + "a" * 31
    values: dict[str, Any] = {
        "owner": "alice",
        "session_id": sid,
        "key": key,
        "slot": f"{key}-0000abcd",
        "instance": "77-other",
        "created_at": created_at,
        "last_active": NOW - 30,
        "runs": 3,
    }
    values.update(kw)
    return SessionRecord(**values)


def own(sid: str, created_wall: float) -> Session:
    """A session of this server, files only, as measured when it was unmounted."""
    mono = time.monotonic()
    session = Session(
        sid, "alice", "s" + "b" * 31, f"{'s' + 'b' * 31}-0000abcd",
        Workspace(Path("/nonexistent") / sid, quota_bytes=1),
        created_at=mono - 60, last_active=mono - 5, created_wall=created_wall,
    )  # fmt: skip
    session.files_kept = (4, 4096)
    session.runs = 2
    return session


PAUSED = Paused(
    "variables",
    NOW - 60,
    saved=(("df", "DataFrame"), ("x", "int")),
    file_count=5,
    files_bytes=12_345,
).to_json()


def test_a_paused_session_elsewhere_shows_its_saved_variables_and_files() -> None:
    summary = _recorded_summary(record("conv", NOW - 100, paused=PAUSED))
    assert summary.state == "paused"
    assert summary.saved_variables == (("df", "DataFrame"), ("x", "int"))
    assert (summary.file_count, summary.workspace_bytes) == (5, 12_345)
    assert (summary.created_at, summary.last_active) == (NOW - 100, NOW - 30)


def test_a_session_paused_whole_elsewhere_shows_its_files_and_no_variables() -> None:
    memory = {**PAUSED, "kind": "memory", "checkpoint": {"backend_id": "c1"}}
    summary = _recorded_summary(record("conv", NOW - 100, paused=memory))
    assert (summary.state, summary.saved_variables, summary.file_count) == ("paused", None, 5)


def test_a_running_session_elsewhere_has_unknown_files() -> None:
    """Its files are the holder's to measure: unknown here, never zero."""
    summary = _recorded_summary(record("conv", NOW - 100))
    assert summary.state == "running"
    assert (summary.file_count, summary.workspace_bytes, summary.saved_variables) == (
        None,
        None,
        None,
    )


def test_a_damaged_pause_elsewhere_still_lists_the_session_as_paused() -> None:
    summary = _recorded_summary(record("conv", NOW - 100, paused={"kind": "bogus"}))
    assert (summary.state, summary.file_count, summary.saved_variables) == ("paused", None, None)


def test_the_page_names_the_replica_that_holds_a_session_elsewhere() -> None:
    view = _recorded_view(record("conv", NOW - 100, paused=PAUSED))
    assert (view.state, view.replica, view.runs) == ("paused", "77-other", 3)
    assert (view.memory_bytes, view.cpu_seconds, view.workspace_bytes) == (None, None, None)
    assert view.idle_s >= 30 and view.age_s >= 100
    assert _recorded_view(record("conv", NOW - 100)).state == "running"


async def test_own_and_recorded_sessions_are_listed_oldest_first_together() -> None:
    mine = [own("mine-2", NOW - 200), own("mine-4", NOW - 50)]
    theirs = [record("theirs-3", NOW - 100), record("theirs-1", NOW - 300)]
    listed = await summaries(mine, WorkerThreads(), theirs)
    assert [s.session_id for s in listed] == ["theirs-1", "mine-2", "theirs-3", "mine-4"]
    assert [s.file_count for s in listed] == [None, 4, None, 4]
    views = await overview(mine, FakeBackend(), WorkerThreads(), replica="me", elsewhere=theirs)
    assert [(v.session_id, v.replica) for v in views] == [
        ("theirs-1", "77-other"),
        ("mine-2", "me"),
        ("theirs-3", "77-other"),
        ("mine-4", "me"),
    ]
