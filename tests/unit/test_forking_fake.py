"""Forking sessions on the fake backend (the real agent as a host process): what a fork
copies, what it refuses, and how it counts. The same on bwrap and Docker is in
tests/integration/test_fork.py."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from mcp_code_sandbox.backends.checkpoints import Checkpoint
from mcp_code_sandbox.errors import (
    InvalidArgument,
    InvalidPath,
    MaxSessions,
    NotFound,
    QuotaExceeded,
    SessionNotFound,
)
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.server.app import build_server
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.sessions import forking, records
from mcp_code_sandbox.workspace import transfer
from tests.fakes import fake_service


async def run(svc: SandboxService, sid: str, code: str, owner: str = "alice") -> Any:
    return await svc.run_code(owner, RunRequest(code), sid)


def workspace(svc: SandboxService, sid: str, owner: str = "alice") -> Path:
    [session] = [s for s in svc.sessions.listed(owner) if s.id == sid]
    return session.workspace.root


async def test_a_fork_has_the_files_and_variables_then_both_diverge(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        await run(svc, "src", "import json\nrows = [1, 2, 3]\nopen('f.txt', 'w').write('a')")
        forked = await svc.fork_session("alice", "src", "copy")
        assert (forked.session_id, forked.source_id, forked.state) == ("copy", "src", "variables")
        assert "rows" in forked.variables and "json" in forked.variables
        assert forked.files >= 1 and forked.notice is not None
        assert "open files, threads and running processes" in forked.notice
        back = await run(svc, "copy", "rows.append(4)\nopen('f.txt', 'w').write('b')\nrows")
        assert (back.result, back.session_created, back.state_lost) == (
            "[1, 2, 3, 4]",
            False,
            False,
        )
        source = await run(svc, "src", "rows, open('f.txt').read(), json.dumps(1)")
        assert source.result == "([1, 2, 3], 'a', '1')"  # the source ran on: same interpreter
        assert (await run(svc, "copy", "open('f.txt').read()")).result == "'b'"
        assert {s.session_id for s in await svc.list_sessions("alice")} == {"src", "copy"}


async def test_a_fork_without_a_name_gets_a_new_id_and_a_name_in_use_is_refused(
    state_dir: Path,
) -> None:
    async with fake_service(state_dir) as svc:
        await run(svc, "src", "x = 1")
        forked = await svc.fork_session("alice", "src")
        assert forked.session_id.startswith("sess_")
        with pytest.raises(InvalidArgument, match="already have a session"):
            await svc.fork_session("alice", "src", forked.session_id)
        with pytest.raises(InvalidArgument, match="already have a session"):
            await svc.fork_session("alice", "src", "src")
        await run(svc, "old", "y = 1")
        await svc.close_session("alice", "old")
        reused = await svc.fork_session("alice", "src", "old")
        assert reused.notice is not None and reused.notice.startswith("session old was closed")


async def test_another_owner_cannot_fork_a_session_it_cannot_see(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        await run(svc, "mine", "secret = 42")
        with pytest.raises(SessionNotFound):
            await svc.fork_session("mallory", "mine", "stolen")
        with pytest.raises(SessionNotFound):
            await svc.fork_session("alice", "nothing-here")
        assert await svc.list_sessions("mallory") == []


async def test_hostile_files_are_left_out_or_copied_as_links(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        await run(svc, "src", "v = 7\nopen('plain.txt', 'w').write('ok')")
        root = workspace(svc, "src")
        outside = state_dir / "outside.txt"
        outside.write_text("host secret")
        os.link(outside, root / "hard")
        (root / "passwd").symlink_to("/etc/passwd")
        os.mkfifo(root / "pipe")
        forked = await svc.fork_session("alice", "src", "copy")
        assert forked.state == "variables" and forked.notice is not None
        assert "hard" in forked.notice and "pipe" in forked.notice
        copy = workspace(svc, "copy")
        assert not (copy / "hard").exists() and not (copy / "pipe").exists()
        assert os.readlink(copy / "passwd") == "/etc/passwd"  # a link, never followed
        with pytest.raises((InvalidPath, NotFound)):
            await svc.read_file("alice", "copy", "passwd", offset=0, max_bytes=100)
        assert (await run(svc, "copy", "v, open('plain.txt').read()")).result == "(7, 'ok')"


async def test_a_sparse_file_past_the_quota_refuses_the_fork(state_dir: Path) -> None:
    async with fake_service(state_dir, workspace_quota_bytes=64 << 20) as svc:
        await run(svc, "src", "x = 1")
        # Planted from outside: in a sandbox RLIMIT_FSIZE stops a file past the quota.
        with open(workspace(svc, "src") / "sparse", "wb") as f:
            f.truncate(100 << 30)
        with pytest.raises(QuotaExceeded, match="quota"):
            await svc.fork_session("alice", "src", "copy")
        assert [s.session_id for s in await svc.list_sessions("alice")] == ["src"]
        again = await run(svc, "src", "import os\nos.remove('sparse')\n1")
        assert again.result == "1" and again.notice is None  # the source ran on
        # The name was never used: taking it now makes a new session without a notice.
        fresh = await run(svc, "copy", "2")
        assert (fresh.session_created, fresh.notice) == (True, None)


async def test_a_paused_session_is_forked_without_resuming_it(state_dir: Path) -> None:
    async with fake_service(state_dir, pause_after_m=60) as svc:
        await run(svc, "src", "df = {'a': [1, 2]}\nopen('f.txt', 'w').write('a')")
        paused = await svc.sessions.pause("alice", "src")
        assert paused is not None and paused.kind == "variables"
        started = len(svc.backend.created)  # type: ignore[attr-defined]
        forked = await svc.fork_session("alice", "src", "copy")
        assert forked.state == "variables" and "df" in forked.variables
        states = {s.session_id: s.state for s in await svc.list_sessions("alice")}
        assert states == {"src": "paused", "copy": "running"}
        assert len(svc.backend.created) == started + 1  # type: ignore[attr-defined]  # the fork's
        assert (await run(svc, "copy", "df['a'][1]")).result == "2"


async def test_a_fork_of_a_session_that_never_ran_code_has_its_files_only(
    state_dir: Path,
) -> None:
    async with fake_service(state_dir) as svc:
        await svc.upload_file("alice", "data.txt", b"rows", session_id="up", overwrite=False)
        forked = await svc.fork_session("alice", "up", "copy")
        assert (forked.state, forked.files, forked.notice) == ("files", 1, None)
        assert (await run(svc, "copy", "open('data.txt').read()")).result == "'rows'"


async def test_variables_that_cannot_be_saved_are_named(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        await run(svc, "src", "import threading\nlock = threading.Lock()\nn = 3")
        forked = await svc.fork_session("alice", "src", "copy")
        assert forked.state == "variables" and "n" in forked.variables
        assert forked.notice is not None and "lock (" in forked.notice


async def test_a_fork_counts_toward_the_session_limits(state_dir: Path) -> None:
    async with fake_service(state_dir, max_sessions_per_owner=1, pause_after_m=0) as svc:
        await run(svc, "src", "x = 1")
        with pytest.raises(MaxSessions):
            await svc.fork_session("alice", "src", "copy")
        assert [s.session_id for s in await svc.list_sessions("alice")] == ["src"]
    async with fake_service(state_dir, max_sessions_per_owner=2, pause_after_m=60) as svc:
        await run(svc, "src", "x = 1")
        await run(svc, "other", "y = 2")
        await run(svc, "src", "x = 2")  # "other" is the longest idle: it makes room
        forked = await svc.fork_session("alice", "src", "copy")
        assert forked.state == "variables"
        states = {s.session_id: s.state for s in await svc.list_sessions("alice")}
        assert states == {"src": "running", "other": "paused", "copy": "running"}


async def test_a_fork_takes_a_warm_sandbox_when_one_is_ready(state_dir: Path) -> None:
    async with fake_service(state_dir, pool_size=1) as svc:
        await run(svc, "src", "x = 41")
        pool = svc.sessions.pool
        deadline = asyncio.get_running_loop().time() + 30
        while not pool.ready_sandboxes():
            assert asyncio.get_running_loop().time() < deadline, "the pool did not refill"
            await asyncio.sleep(0.02)
        [warm] = pool.ready_sandboxes()
        await svc.fork_session("alice", "src", "copy")
        [fork] = [s for s in svc.sessions.listed("alice") if s.id == "copy"]
        assert fork.sandbox is warm.sandbox
        assert (await run(svc, "copy", "x + 1")).result == "42"


async def test_the_tool_returns_the_fork_and_errors_by_code(state_dir: Path) -> None:
    async with (
        fake_service(state_dir) as svc,
        Client(build_server(svc), mode="legacy") as client,
    ):
        made = await client.call_tool("run_code", {"code": "z = 5", "session_id": "src"})
        assert not made.is_error
        result = await client.call_tool("fork_session", {"session_id": "src"})
        assert not result.is_error and isinstance(result.structured_content, dict)
        out = result.structured_content
        assert (out["forked_from"], out["state"], out["variables"]) == ("src", "variables", ["z"])
        missing = await client.call_tool("fork_session", {"session_id": "nope"})
        assert missing.is_error and (missing.meta or {}).get("error_code") == "session_not_found"
        bad = await client.call_tool(
            "fork_session", {"session_id": "src", "new_session_id": "../x"}
        )
        assert bad.is_error and (bad.meta or {}).get("error_code") == "invalid_session_id"


async def test_a_forks_record_says_forking_until_its_copy_is_done(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []
    real = transfer.copy_tree

    def copy(*args: Any, **kwargs: Any) -> Any:
        [record] = [
            r for r in records.load_records(state_dir / "sessions") if r.session_id == "copy"
        ]
        seen.append(record.forking)
        return real(*args, **kwargs)

    monkeypatch.setattr(forking, "copy_tree", copy)
    async with fake_service(state_dir) as svc:
        await run(svc, "src", "x = 1")
        await svc.fork_session("alice", "src", "copy")
        [record] = [
            r for r in records.load_records(state_dir / "sessions") if r.session_id == "copy"
        ]
        assert seen == [True] and record.forking is False


async def test_a_source_paused_with_its_memory_is_forked_with_its_files_and_says_so(
    state_dir: Path,
) -> None:
    async with fake_service(state_dir, pause_after_m=60) as svc:
        await run(svc, "src", "x = 1\nopen('f.txt', 'w').write('a')")
        await svc.sessions.pause("alice", "src")
        [source] = [s for s in svc.sessions.listed("alice") if s.id == "src"]
        assert source.paused is not None  # as gVisor keeps it: a checkpoint, no variables
        memory = Checkpoint("checkpointed-elsewhere", 1)
        source.paused = dataclasses.replace(
            source.paused, kind="memory", checkpoint=memory, load=False
        )
        forked = await svc.fork_session("alice", "src", "copy")
        assert (forked.state, forked.variables) == ("files", ())
        assert forked.notice is not None and "whole memory" in forked.notice
        assert (await run(svc, "copy", "open('f.txt').read()")).result == "'a'"
