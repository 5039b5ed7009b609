"""Pausing on the fake backend (the real agent as a host process, plain shell): what the
session manager does around a pause, fast. The real pauses, on every backend, are in
tests/integration/test_pause.py and tests/e2e/test_pause.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.errors import SandboxFailed
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.sessions import moving, records
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.holder import Role
from mcp_code_sandbox.workspace import Workspace
from tests.fakes import FakeBackend, fake_service


def sample(svc: object, name: str, labels: dict[str, str]) -> float:
    value = svc.metrics.registry.get_sample_value(name, labels)  # type: ignore[attr-defined]
    return value or 0.0


async def test_a_pause_that_cannot_save_keeps_the_files_and_says_why(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refuse(*args: object, **kwargs: object) -> None:
        raise SandboxFailed("the disk is full")

    async with fake_service(state_dir) as svc:
        made = await svc.run_code("alice", RunRequest("x = 1\nopen('f.txt', 'w').write('a')"))
        monkeypatch.setattr(AgentClient, "save_state", refuse)
        paused = await svc.sessions.pause("alice", made.session_id)
        assert paused is not None and paused.kind == "files"
        assert paused.why is not None and "the disk is full" in paused.why
        labels = {"kind": "files", "reason": "save_failed"}
        assert sample(svc, "mcp_sandbox_pause_fallbacks_total", labels) == 1
        back = await svc.run_code("alice", RunRequest("open('f.txt').read()"), made.session_id)
        assert (back.result, back.resumed, back.state_lost) == ("'a'", None, True)
        assert back.notice is not None and "the disk is full" in back.notice
        assert "files only" in back.notice


async def test_a_session_paused_with_nothing_running_resumes_quietly(state_dir: Path) -> None:
    backend = FakeBackend()
    try:
        async with fake_service(state_dir, backend, keep_sessions_on_shutdown=True) as svc:
            await svc.upload_file("alice", "data.txt", b"rows", session_id="up", overwrite=False)
        [record] = [json.loads(p.read_text()) for p in (state_dir / "sessions").glob("*.json")]
        assert record["paused"]["kind"] == "files" and record["paused"]["why"] is None
        async with fake_service(state_dir, backend, role=Role.SERVICE) as svc:
            [listed] = await svc.list_sessions("alice")
            assert (listed.session_id, listed.state, listed.file_count) == ("up", "paused", 1)
            assert listed.saved_variables is None
            back = await svc.run_code("alice", RunRequest("open('data.txt').read()"), "up")
            assert (back.result, back.resumed, back.notice) == ("'rows'", None, None)
    finally:
        await backend.end_all()


async def test_a_restart_of_a_paused_session_forgets_its_saved_variables(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        await svc.run_code("alice", RunRequest("x = 1\nopen('f.txt', 'w').write('a')"), "s")
        paused = await svc.sessions.pause("alice", "s")
        assert paused is not None and paused.kind == "variables"
        done = await svc.restart_interpreter("alice", "s")
        assert done.state == "paused" and "next run starts a fresh one" in done.message
        [listed] = await svc.list_sessions("alice")
        assert (listed.state, listed.saved_variables) == ("paused", None)
        check = RunRequest("print(open('f.txt').read()); 'x' in dir()")
        back = await svc.run_code("alice", check, "s")
        assert (back.stdout, back.result) == ("a\n", "False")
        assert (back.resumed, back.notice, back.state_lost) == (None, None, False)


async def test_a_damaged_pause_in_a_record_is_kept_as_files(state_dir: Path) -> None:
    backend = FakeBackend()
    try:
        async with fake_service(state_dir, backend, keep_sessions_on_shutdown=True) as svc:
            await svc.run_code("alice", RunRequest("v = 5"), "s")
        [path] = (state_dir / "sessions").glob("*.json")
        record = json.loads(path.read_text())
        record["paused"]["kind"] = "teleported"
        path.write_text(json.dumps(record))
        async with fake_service(state_dir, backend, role=Role.SERVICE) as svc:
            back = await svc.run_code("alice", RunRequest("v"), "s")
            # The record's pause is not trusted: the last complete saved state is loaded.
            assert (back.result, back.resumed, back.session_created) == ("5", "variables", False)
    finally:
        await backend.end_all()


async def test_list_sessions_shows_the_callers_sessions_only(state_dir: Path) -> None:
    async with fake_service(state_dir, pause_after_m=60) as svc:
        await svc.run_code("alice", RunRequest("a = [1, 2]"), "mine")
        await svc.run_code("bob", RunRequest("b = 2"), "mine")
        await svc.sessions.pause("alice", "mine")
        [alice] = await svc.list_sessions("alice")
        assert (alice.session_id, alice.state) == ("mine", "paused")
        assert alice.saved_variables == (("a", "list"),)
        [bob] = await svc.list_sessions("bob")
        assert (bob.session_id, bob.state, bob.saved_variables) == ("mine", "running", None)
        assert await svc.list_sessions("carol") == []
        assert sample(svc, "mcp_sandbox_sessions", {"state": "paused"}) == 1
        assert sample(svc, "mcp_sandbox_sessions", {"state": "running"}) == 1
        assert svc.sessions.paused_bytes() > 0


# -- a paused session moved into a warm sandbox: the bad paths ---------------------------------


async def paused_with_a_warm_sandbox(svc: Any) -> tuple[str, str, Any]:
    """A session paused by its variables, and the pool ready again: (its id, its slot,
    the pool's warm sandbox)."""
    made = await svc.run_code("alice", RunRequest("x = 41\nopen('f.txt', 'w').write('a')"))
    sid = made.session_id
    paused = await svc.sessions.pause("alice", sid)
    assert paused is not None and paused.kind == "variables"
    pool = svc.sessions.pool
    deadline = asyncio.get_running_loop().time() + 30
    while not pool.ready_sandboxes():
        assert asyncio.get_running_loop().time() < deadline, "the pool did not refill"
        await asyncio.sleep(0.02)
    [session] = [s for s in svc.sessions.listed("alice") if s.id == sid]
    [warm] = pool.ready_sandboxes()
    return sid, session.slot, warm


async def test_a_move_whose_record_cannot_be_written_changes_nothing(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with fake_service(state_dir, pool_size=1) as svc:
        sid, slot, warm = await paused_with_a_warm_sandbox(svc)

        def full(*args: object, **kwargs: object) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(records, "write_record", full)
        back = await svc.run_code("alice", RunRequest("x + 1, open('f.txt').read()"), sid)
        assert (back.result, back.resumed) == ("(42, 'a')", "variables"), back
        [session] = [s for s in svc.sessions.listed("alice") if s.id == sid]
        # Resumed in a new sandbox in its own slot; the warm one (and its copy) discarded.
        assert session.slot == slot and session.sandbox is not warm.sandbox
        assert session.replaces is None
        assert not (state_dir / "runlogs" / f"{warm.slot}.jsonl").exists()


async def test_an_old_slot_that_cannot_go_at_the_move_goes_with_the_session(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with fake_service(state_dir, pool_size=1) as svc:
        sid, slot, warm = await paused_with_a_warm_sandbox(svc)
        old_root = state_dir / "workspaces" / slot
        destroy = Workspace.destroy

        def stuck(self: Workspace) -> None:
            if self.root == old_root:
                raise OSError(16, "Device or resource busy")
            destroy(self)

        monkeypatch.setattr(Workspace, "destroy", stuck)
        back = await svc.run_code("alice", RunRequest("x + 1"), sid)
        assert (back.result, back.resumed) == ("42", "variables"), back
        [session] = [s for s in svc.sessions.listed("alice") if s.id == sid]
        assert session.slot == warm.slot and session.replaces is not None
        # Both records on disk; the new one names the old: a server dying now keeps one.
        saved = {r.slot: r for r in records.load_records(state_dir / "sessions")}
        assert saved[warm.slot].replaces == slot and slot in saved
        monkeypatch.setattr(Workspace, "destroy", destroy)
        await svc.close_session("alice", sid)
        assert not old_root.exists()
        # Only the pool's own record is left.
        assert all(r.pool for r in records.load_records(state_dir / "sessions"))


async def test_a_move_cut_short_by_the_unexpected_discards_the_warm_sandbox(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = FakeBackend()
    try:
        async with fake_service(state_dir, backend, pool_size=1) as svc:
            sid, slot, warm = await paused_with_a_warm_sandbox(svc)

            def broken(*args: object, **kwargs: object) -> None:
                raise RuntimeError("a bug in the copy")

            monkeypatch.setattr(moving, "copy_tree", broken)
            with pytest.raises(RuntimeError, match="a bug in the copy"):
                await svc.run_code("alice", RunRequest("x + 1"), sid)
            deadline = asyncio.get_running_loop().time() + 30
            while warm.sandbox.is_alive():  # retired, in the background
                assert asyncio.get_running_loop().time() < deadline, "the warm one still runs"
                await asyncio.sleep(0.02)
            [session] = [s for s in svc.sessions.listed("alice") if s.id == sid]
            assert session.slot == slot and session.paused is not None
            monkeypatch.undo()
            back = await svc.run_code("alice", RunRequest("x + 1"), sid)
            assert (back.result, back.resumed) == ("42", "variables"), back
    finally:
        await backend.end_all()
