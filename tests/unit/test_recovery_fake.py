"""What a starting server does with what earlier servers left, on the fake backend: the
plan of ``sessions.records.plan_recovery`` carried out by ``sessions.recovery`` through the
manager (the plan's own cases are in ``test_records``)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from mcp_code_sandbox.backends.base import Leftover
from mcp_code_sandbox.run.execute import RunReport
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.sessions import records
from mcp_code_sandbox.sessions.holder import Role
from mcp_code_sandbox.sessions.ids import session_key
from mcp_code_sandbox.settings import Settings
from tests.fakes import FakeBackend, fake_service, fake_settings

#: An instance name no pid file answers for: a server that is gone.
DEAD = "4242-deadbeef"


async def run(svc: SandboxService, code: str, sid: str, owner: str = "alice") -> RunReport:
    return await svc.run_code(owner, RunRequest(code), sid)


def plant(
    settings: Settings,
    backend: FakeBackend,
    sid: str,
    *,
    idle_s: float = 5.0,
    sandbox: bool = True,
    labels_owner: str = "alice",
) -> Path:
    """A session of a dead server: its record and workspace, and (``sandbox``) its still
    running sandbox, labelled as owned by ``labels_owner``. Returns the workspace."""
    key = session_key("alice", sid)
    slot = records.new_slot(key)
    root = settings.workspaces_dir / slot
    root.mkdir(parents=True)
    (root / "data.txt").write_text(f"from {sid}")
    now = time.time()
    record = records.SessionRecord("alice", sid, key, slot, DEAD, now - 60, now - idle_s)
    records.write_record(settings.sessions_dir, record)
    if sandbox:
        backend.planted.append(Leftover(f"old-{sid}", key, labels_owner, sid, True, root))
    return root


async def test_a_kept_session_is_paused_for_the_next_server_with_its_variables(
    state_dir: Path,
) -> None:
    backend = FakeBackend()
    try:
        async with fake_service(state_dir, backend, keep_sessions_on_shutdown=True) as svc:
            await run(svc, "x = 41\nopen('f.txt', 'w').write('kept')", "conv")
        assert backend.running() == []  # paused: its variables saved, its sandbox gone
        async with fake_service(state_dir, backend, keep_sessions_on_shutdown=True) as svc:
            report = await run(svc, "x + 1", "conv")
            assert (report.result, report.session_created) == ("42", False)
            assert (report.state_lost, report.notice, report.resumed) == (False, None, "variables")
            listing = await svc.list_files("alice", "conv", ".", recursive=True)
            assert [e.path for e in listing.entries] == ["f.txt"]
            assert backend.removed == []
    finally:
        await backend.end_all()


async def test_without_keep_a_clean_shutdown_leaves_nothing(state_dir: Path) -> None:
    backend = FakeBackend()
    try:
        async with fake_service(state_dir, backend) as svc:
            await run(svc, "x = 1", "conv")
        assert backend.running() == []
        async with fake_service(state_dir, backend) as svc:
            report = await run(svc, "'x' in dir()", "conv")
            assert (report.result, report.session_created, report.notice) == ("False", True, None)
    finally:
        await backend.end_all()


async def test_a_dead_servers_sessions_are_adopted_or_dropped(state_dir: Path) -> None:
    backend = FakeBackend()
    settings = fake_settings(state_dir)
    kept = plant(settings, backend, "kept")
    lost = plant(settings, backend, "lost", sandbox=False)
    stale = plant(settings, backend, "stale", idle_s=8 * 24 * 3600)  # past the 7-day TTL
    forged = plant(settings, backend, "forged", labels_owner="mallory")
    stray = settings.workspaces_dir / records.new_slot(session_key("alice", "stray"))
    stray.mkdir()
    try:
        async with fake_service(state_dir, backend, role=Role.SERVICE) as svc:
            # Re-attached: same owner and id, files kept; a new agent (the fake's planted
            # sandboxes come back fresh), so the session is not new.
            report = await run(svc, "open('data.txt').read()", "kept")
            assert (report.result, report.session_created) == ("'from kept'", False)
            assert kept.exists()
            assert sorted(lo.backend_id for lo in backend.removed) == ["old-forged", "old-stale"]
            for root in (lost, stale, forged, stray):
                assert not root.exists()
            again = await run(svc, "import os; os.listdir('.')", "lost")
            assert (again.result, again.session_created) == ("[]", True)
            assert again.notice and "was lost when the server restarted" in again.notice
            expired = await run(svc, "1", "stale")
            assert expired.notice and "session stale expired after 10080 min idle" in expired.notice
            # Nobody else sees the adopted session.
            other = await run(svc, "import os; os.listdir('.')", "kept", owner="bob")
            assert (other.result, other.session_created) == ("[]", True)
            saved = records.load_records(settings.sessions_dir)
            assert {(r.owner, r.session_id) for r in saved} == {
                ("alice", "kept"),
                ("alice", "lost"),
                ("alice", "stale"),
                ("bob", "kept"),
            }
            assert {r.instance for r in saved} == {svc.sessions.instance}  # all ours now
    finally:
        await backend.end_all()


async def test_a_live_servers_sessions_are_left_alone(state_dir: Path) -> None:
    backend = FakeBackend()
    try:
        async with fake_service(state_dir, backend) as first:
            await run(first, "x = 1", "busy")
            (session,) = first.sessions.with_id("busy")
            root = session.workspace.root
            # A second server on the same state dir (two stdio servers of one user).
            second_backend = FakeBackend()
            async with fake_service(state_dir, second_backend) as second:
                assert root.exists()
                assert second.sessions.count() == 0
            assert (await run(first, "x", "busy")).result == "1"
    finally:
        await backend.end_all()


async def test_a_session_that_moved_into_a_warm_sandbox_keeps_the_new_slot(
    state_dir: Path,
) -> None:
    # A server died after a paused session's files were copied into a warm sandbox's
    # slot and that slot's record written (naming the old one), before the old slot went.
    backend = FakeBackend()
    settings = fake_settings(state_dir)
    old = plant(settings, backend, "conv", sandbox=False)
    moved = plant(settings, backend, "conv", sandbox=False)
    (moved / "data.txt").write_text("the copy")
    pause = {"kind": "variables", "at": time.time() - 30, "load": True}
    for root, replaces in ((old, None), (moved, old.name)):
        [record] = [r for r in records.load_records(settings.sessions_dir) if r.slot == root.name]
        records.write_record(
            settings.sessions_dir, dataclasses.replace(record, paused=pause, replaces=replaces)
        )
    try:
        async with fake_service(state_dir, backend, role=Role.SERVICE) as svc:
            report = await run(svc, "open('data.txt').read()", "conv")
            assert (report.result, report.session_created) == ("'the copy'", False)
            assert report.notice is None or "lost" not in report.notice
            assert not old.exists() and moved.exists()
            saved = records.load_records(settings.sessions_dir)
            assert [r.slot for r in saved] == [moved.name]
    finally:
        await backend.end_all()
