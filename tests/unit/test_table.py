"""``sessions/table.py``: the live sessions, their tombstones and their records."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mcp_code_sandbox.sessions import records
from mcp_code_sandbox.sessions.ids import session_key
from mcp_code_sandbox.sessions.lifecycle import Phase
from mcp_code_sandbox.sessions.session import Paused, Session
from mcp_code_sandbox.sessions.table import SessionTable
from mcp_code_sandbox.settings import Settings, load_settings
from mcp_code_sandbox.workspace import Workspace


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    settings = load_settings({"state_dir": str(tmp_path)}, environ={})
    settings.sessions_dir.mkdir(parents=True)
    return settings


def table_of(settings: Settings) -> SessionTable:
    def workspace(slot: str, uid: int | None) -> Workspace:
        return Workspace(settings.workspaces_dir / slot, quota_bytes=1)

    return SessionTable(settings, instance="me-1", handover=False, workspace_for=workspace)


def session(table: SessionTable, sid: str, owner: str) -> Session:
    key = session_key(owner, sid)
    slot = records.new_slot(key)
    workspace = Workspace(table.settings.workspaces_dir / slot, quota_bytes=1)
    return Session(sid, owner, key, slot, workspace, 0.0, 0.0, time.time())


def written(settings: Settings) -> dict[str, records.SessionRecord]:
    return {r.slot: r for r in records.load_records(settings.sessions_dir)}


def test_one_owner_never_finds_another_owners_session(settings: Settings) -> None:
    table = table_of(settings)
    alices, bobs = session(table, "s", "alice"), session(table, "s", "bob")
    table.add(alices)
    table.add(bobs)
    assert table.get("alice", "s") is alices and table.get("carol", "s") is None
    assert set(table.with_id("s")) == {alices, bobs}
    assert table.listed("bob") == [bobs] and table.count() == 2 and table.count("alice") == 1
    assert table.remove(alices) and not table.remove(alices)
    assert table.get("alice", "s") is None and table.get("bob", "s") is bobs


def test_a_tombstone_says_why_until_the_id_is_used_again(settings: Settings) -> None:
    table = table_of(settings)
    table.tombstone("alice", "s", "session s expired after 30 min idle")
    assert table.gone("alice", "s") == (
        "session s expired after 30 min idle; files and variables from before are gone"
    )
    assert table.gone("bob", "s") is None
    assert table.reborn("alice", "s") is not None
    assert table.gone("alice", "s") is None and table.tombstones() == {}


def test_a_record_is_written_at_most_every_few_seconds_unless_its_pause_changed(
    settings: Settings,
) -> None:
    table = table_of(settings)
    s = session(table, "s", "alice")
    table.add(s)
    table.save(s, force=True)
    assert written(settings)[s.slot].owner == "alice"
    records.remove_record(settings.sessions_dir, s.slot)
    table.touch(s)  # written just now, and its pause did not change: no write
    assert s.slot not in written(settings)
    s.paused, s.phase = Paused("files", 0.0), Phase.PAUSED
    table.touch(s)  # the record must say paused at once
    assert written(settings)[s.slot].paused is not None
    s.paused, s.phase = None, Phase.RUNNING
    table.touch(s)  # and running again at once (a checkpoint is no longer its state)
    assert written(settings)[s.slot].paused is None
    table.drop_record(s)
    assert written(settings) == {}


def test_a_session_loaded_from_its_record_is_as_recorded(settings: Settings) -> None:
    table = table_of(settings)
    s = session(table, "s", "alice")
    record = table.record(s)
    loaded = table.from_record(record, None, Phase.PAUSED)
    assert (loaded.owner, loaded.id, loaded.slot, loaded.phase) == (
        "alice",
        "s",
        s.slot,
        Phase.PAUSED,
    )
    assert loaded.workspace.root == settings.workspaces_dir / s.slot
    assert table.get("alice", "s") is None  # not added until the caller says so
