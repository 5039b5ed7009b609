"""The session manager through the service, on the fake backend (the real agent, no walls):
ids, owners, limits, the per-session queue, TTL and lifetime, close, a dead sandbox,
shutdown. Recovery of what a dead server left is in ``test_recovery_fake``."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from mcp_code_sandbox.backends.base import Sandbox
from mcp_code_sandbox.errors import (
    InvalidSessionId,
    MaxSessions,
    SandboxFailed,
    SessionBusy,
    SessionNotFound,
)
from mcp_code_sandbox.run.execute import RunReport
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.settings import ConfigError, load_settings
from tests.fakes import FakeBackend, fake_service


def run(
    svc: SandboxService,
    code: str,
    session_id: str | None = None,
    owner: str = "local",
    timeout_s: float | None = None,
) -> asyncio.Task[RunReport]:
    """Start a ``run_code`` call now (its place in the session's queue is taken at once)."""
    request = RunRequest(code, timeout_s=timeout_s)
    return asyncio.ensure_future(svc.run_code(owner, request, session_id))


def workspace(svc: SandboxService, session_id: str) -> Path:
    (session,) = svc.sessions.with_id(session_id)
    return session.workspace.root


def fake(svc: SandboxService) -> FakeBackend:
    assert isinstance(svc.backend, FakeBackend)
    return svc.backend


def test_the_fake_backend_cannot_be_chosen_by_configuration() -> None:
    with pytest.raises(ConfigError, match="SANDBOX_BACKEND"):
        load_settings({"backend": "fake"}, environ={})


# -- ids ------------------------------------------------------------------------------------


async def test_minted_ids_are_new_sessions_and_reuse_keeps_variables(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        first = await run(svc, "x = 41")
        assert first.session_created is True
        # sess_ + at least 128 random bits, URL-safe (DESIGN §2).
        assert re.fullmatch(r"sess_[A-Za-z0-9_-]{22,}", first.session_id)
        again = await run(svc, "x + 1", first.session_id)
        assert (again.session_created, again.result) == (False, "42")
        other = await run(svc, "'x' in dir()")
        assert other.session_id != first.session_id and other.result == "False"


async def test_an_unknown_named_id_is_created_under_that_name(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        report = await run(svc, "1", "conv-7.a_b")
        assert (report.session_id, report.session_created, report.notice) == (
            "conv-7.a_b",
            True,
            None,
        )
        with pytest.raises(InvalidSessionId):
            await run(svc, "1", "../etc")
        with pytest.raises(SessionNotFound):  # the tools that create nothing
            await svc.list_files("local", "never-made", ".", recursive=True)


# -- owners ---------------------------------------------------------------------------------


async def test_another_owners_session_is_invisible(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        await run(svc, "secret = 'alice'", "shared", owner="alice")
        await svc.upload_file("alice", "a.txt", b"alice's", session_id="shared", overwrite=False)
        for call in (
            svc.list_files("bob", "shared", ".", recursive=True),
            svc.read_file("bob", "shared", "a.txt", offset=0, max_bytes=None),
            svc.close_session("bob", "shared"),
        ):
            with pytest.raises(SessionNotFound):
                await call
        # Bob naming it gets a session of his own, with none of Alice's state or files.
        bob = await run(svc, "'secret' in dir()", "shared", owner="bob")
        assert (bob.session_created, bob.result) == (True, "False")
        listing = await svc.list_files("bob", "shared", ".", recursive=True)
        assert list(listing.entries) == []
        assert (svc.sessions.count("alice"), svc.sessions.count("bob")) == (1, 1)
        alice = await run(svc, "secret", "shared", owner="alice")
        assert alice.result == "'alice'"


# -- limits ---------------------------------------------------------------------------------


async def test_past_max_sessions_the_longest_idle_session_is_paused_to_make_room(
    state_dir: Path,
) -> None:
    async with fake_service(state_dir, max_sessions=2) as svc:
        assert (await run(svc, "x = 'one'", "one", owner="a")).status == "ok"
        assert (await run(svc, "x = 'two'", "two", owner="b")).status == "ok"
        third = await run(svc, "1", owner="c")  # a third running session: "one" pauses
        assert third.session_created is True
        states = {s.id: s.paused is not None for s in svc.sessions.listed()}
        assert states == {"one": True, "two": False, third.session_id: False}
        assert svc.sessions.room.running() == 2
        # "one" comes back with its variables; the idlest running one ("two") makes room.
        back = await run(svc, "x", "one", owner="a")
        assert (back.result, back.resumed) == ("'one'", "variables"), back
        states = {s.id: s.paused is not None for s in svc.sessions.listed()}
        assert states == {"one": False, "two": True, third.session_id: False}


async def test_max_sessions_refuses_when_every_running_session_is_in_a_call(
    state_dir: Path,
) -> None:
    async with fake_service(state_dir, max_sessions=2) as svc:
        await svc.upload_file("a", "f", b"1", session_id="one", overwrite=False)
        await svc.upload_file("b", "f", b"1", session_id="two", overwrite=False)
        held = svc.sessions.listed()
        for session in held:  # both in a call: neither may be paused
            await session.lock.acquire()
        with pytest.raises(MaxSessions, match="already runs 2 sessions") as caught:
            await run(svc, "1", owner="c")
        assert caught.value.code == "max_sessions"
        assert all(s.paused is None for s in held)
        for session in held:
            session.lock.release()
        assert (await run(svc, "1", owner="c")).session_created is True  # room again


async def test_with_pausing_off_max_sessions_refuses_the_next_new_session(
    state_dir: Path,
) -> None:
    async with fake_service(state_dir, max_sessions=2, pause_after_m=0) as svc:
        await svc.upload_file("a", "f", b"1", session_id="one", overwrite=False)
        await svc.upload_file("b", "f", b"1", session_id="two", overwrite=False)
        with pytest.raises(MaxSessions, match="already runs 2 sessions"):
            await run(svc, "1", owner="c")
        assert (await run(svc, "1", "one", owner="a")).status == "ok"  # existing ones work
        await svc.close_session("a", "one")
        assert (await run(svc, "1", owner="c")).session_created is True  # room again


async def test_sessions_per_owner_pauses_the_owners_own_idlest(state_dir: Path) -> None:
    async with fake_service(state_dir, max_sessions_per_owner=1) as svc:
        await svc.upload_file("bob", "f", b"1", session_id="theirs", overwrite=False)
        await svc.upload_file("alice", "f", b"1", session_id="mine", overwrite=False)
        assert (await run(svc, "1", "another", owner="alice")).session_created is True
        states = {(s.owner, s.id): s.paused is not None for s in svc.sessions.listed()}
        # Alice's own session made room; Bob's, idler still, was not touched.
        assert states == {("bob", "theirs"): False, ("alice", "mine"): True,
                          ("alice", "another"): False}  # fmt: skip
        [mine] = [s for s in svc.sessions.listed("alice") if s.id == "mine"]
        async with mine.lock:  # Alice's only other session is in a call now
            [another] = [s for s in svc.sessions.listed("alice") if s.id == "another"]
            async with another.lock:
                with pytest.raises(MaxSessions, match="you already have 1 sessions running"):
                    await run(svc, "1", "third", owner="alice")


async def test_past_max_paused_sessions_the_biggest_holder_loses_its_idlest(
    state_dir: Path,
) -> None:
    async with fake_service(state_dir, max_paused_sessions=2) as svc:
        for owner, sid in (("bob", "b1"), ("alice", "a1"), ("alice", "a2"), ("alice", "a3")):
            assert (await run(svc, "1", sid, owner=owner)).status == "ok"
            assert await svc.sessions.pause(owner, sid) is not None
        await svc.sessions.reap()
        kept = sorted((s.owner, s.id) for s in svc.sessions.listed())
        # Alice held three of four: her two idlest went, Bob's idler one stayed.
        assert kept == [("alice", "a3"), ("bob", "b1")]
        gone = await run(svc, "1", "a1", owner="alice")
        assert gone.notice is not None and "SANDBOX_MAX_PAUSED_SESSIONS (2)" in gone.notice


# -- one call at a time ---------------------------------------------------------------------


async def test_calls_to_one_session_queue_in_arrival_order(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        sid = (await run(svc, "log = []")).session_id
        calls = [
            run(svc, f"import time; time.sleep(0.05 * ({3 - i})); log.append({i})", sid)
            for i in range(3)
        ]
        await asyncio.gather(*calls)
        assert (await run(svc, "log", sid)).result == "[0, 1, 2]"


async def test_a_call_waiting_longer_than_its_timeout_is_session_busy(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        sid = (await run(svc, "import os, time")).session_id
        gate = workspace(svc, sid) / "go"
        holder = run(svc, "while not os.path.exists('go'): time.sleep(0.01)\n'released'", sid)
        while not svc.sessions.with_id(sid)[0].lock.locked():
            await asyncio.sleep(0.01)
        with pytest.raises(SessionBusy, match="still running an earlier call"):
            await run(svc, "1", sid, timeout_s=0.2)
        other = await run(svc, "'others run meanwhile'")  # other sessions are not held up
        assert other.status == "ok"
        gate.write_text("")
        assert (await holder).result == "'released'"


async def test_a_call_queued_behind_a_close_fails_not_found(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        sid = (await run(svc, "import time")).session_id
        running = run(svc, "time.sleep(30)", sid)
        while not svc.sessions.with_id(sid)[0].lock.locked():
            await asyncio.sleep(0.01)
        queued = run(svc, "1", sid)
        await asyncio.sleep(0.05)  # queued behind the running call
        await svc.close_session("local", sid)
        with pytest.raises(SessionNotFound):
            await queued
        with pytest.raises(SessionNotFound, match="closed while this call ran"):
            await running
        assert fake(svc).running() == []


# -- lifetimes ------------------------------------------------------------------------------


async def test_the_reaper_expires_idle_sessions_and_the_id_says_so(state_dir: Path) -> None:
    async with fake_service(state_dir, session_ttl_m=0.005) as svc:  # 0.3 s
        first = await run(svc, "x = 1", "idle")
        root = workspace(svc, "idle")
        for _ in range(400):  # the reaper's own pass (every 0.5 s here) ends it
            if svc.sessions.count() == 0 and not root.exists() and not fake(svc).running():
                break
            await asyncio.sleep(0.05)
        assert svc.sessions.count() == 0
        assert not root.exists()
        assert fake(svc).running() == []
        again = await run(svc, "'x' in dir()", "idle")
        assert (again.session_created, again.result) == (True, "False")
        assert again.notice is not None
        assert "session idle expired after 0.005 min idle" in again.notice
        assert "files and variables from before are gone" in again.notice
        assert first.session_id == again.session_id


async def test_a_session_past_its_max_lifetime_ends(state_dir: Path) -> None:
    async with fake_service(state_dir, session_max_lifetime_h=0.0001) as svc:  # 0.36 s
        await run(svc, "1", "old")
        await asyncio.sleep(0.5)
        await svc.sessions.reap()
        with pytest.raises(SessionNotFound, match="reached its maximum lifetime"):
            await svc.list_files("local", "old", ".", recursive=True)


async def test_the_reaper_never_ends_a_session_mid_call(state_dir: Path) -> None:
    async with fake_service(state_dir, session_ttl_m=0.005) as svc:  # 0.3 s
        sid = (await run(svc, "import time")).session_id
        running = run(svc, "time.sleep(1); 'done'", sid)
        while not svc.sessions.with_id(sid)[0].lock.locked():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # idle by the clock since the call began, but in a call
        await svc.sessions.reap()
        assert (await running).result == "'done'"
        assert svc.sessions.count() == 1  # and the call counted as activity


# -- close and shutdown ---------------------------------------------------------------------


async def test_close_stops_the_sandbox_and_deletes_the_files(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        report = await run(svc, "open('kept.txt', 'w').write('x')", "c1")
        root = workspace(svc, "c1")
        assert (root / "kept.txt").exists()
        await svc.close_session("local", "c1")
        assert not root.exists()
        assert fake(svc).running() == []
        assert fake(svc).stopped == [fake(svc).created[0].key]
        assert report.session_id == "c1"
        with pytest.raises(SessionNotFound, match="already closed, or never existed"):
            await svc.close_session("local", "c1")
        again = await run(svc, "import os; os.listdir('.')", "c1")
        assert again.result == "[]"
        assert again.notice and "session c1 was closed" in again.notice


async def test_shutdown_ends_every_session_and_removes_its_records(state_dir: Path) -> None:
    backend = FakeBackend()
    try:
        async with fake_service(state_dir, backend) as svc:
            for sid in ("a", "b", "c"):
                await run(svc, "1", sid)
            assert len(backend.running()) == 3
            sessions_dir = svc.settings.sessions_dir
            assert len(list(sessions_dir.glob("*.json"))) == 3
        assert backend.running() == []
        assert list(sessions_dir.glob("*.json")) == []
        assert list(svc.settings.workspaces_dir.iterdir()) == []
    finally:
        await backend.end_all()


class _StopHeld(FakeBackend):
    """A fake whose ``stop`` waits (``hold``) before stopping: a stop that takes long."""

    def __init__(self) -> None:
        super().__init__()
        self.stopping = asyncio.Event()
        self.hold = True

    async def stop(self, sandbox: Sandbox) -> None:
        self.stopping.set()
        while self.hold:
            await asyncio.sleep(0.01)
        await super().stop(sandbox)


async def test_a_close_cancelled_half_way_is_finished_not_leaked(state_dir: Path) -> None:
    """A client that cancels close_session while the sandbox stops (or shutdown cancelling
    a reaper pass) leaves an ended session whose sandbox, files and record are still
    there: shutdown (or the reaper) finishes the end instead of forgetting it."""
    backend = _StopHeld()
    try:
        async with fake_service(state_dir, backend) as svc:
            await run(svc, "open('f.txt', 'w').write('x')", "gone")
            root = workspace(svc, "gone")
            closing = asyncio.ensure_future(svc.close_session("local", "gone"))
            await asyncio.wait_for(backend.stopping.wait(), 30)
            closing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await closing
            assert svc.sessions.count() == 0  # ended for the client all the same
            assert backend.running() and root.exists()  # nothing freed yet
            backend.hold = False
        assert backend.running() == []
        assert not root.exists()
        assert list(svc.settings.sessions_dir.glob("*.json")) == []
    finally:
        await backend.end_all()


# -- the session's sandbox ------------------------------------------------------------------


async def test_a_sandbox_that_died_is_replaced_once_with_files_kept(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        await run(svc, "x = 1\nopen('f.txt', 'w').write('kept')", "s")
        (session,) = svc.sessions.with_id("s")
        assert session.sandbox is not None
        await fake(svc).kill(session.sandbox)
        report = await run(svc, "print(open('f.txt').read()); 'x' in dir()", "s")
        assert (report.status, report.stdout, report.result) == ("ok", "kept\n", "False")
        assert report.state_lost is True
        assert report.notice and "had stopped; a new one was started" in report.notice
        assert len(fake(svc).created) == 2


async def test_a_restart_gives_a_fresh_interpreter_in_the_same_sandbox(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        spawn = "import subprocess\nx = 1\nopen('f.txt', 'w').write('kept')\n"
        spawn += "subprocess.Popen(['sleep', '300']).pid"
        child = int((await run(svc, spawn, "s")).result or "0")
        started = len(fake(svc).created)
        done = await svc.restart_interpreter("local", "s")
        assert (done.session_id, done.state) == ("s", "running")
        assert "variables, imports" in done.message and "files in /mnt/data are kept" in (
            done.message
        )
        after = await run(svc, "print(open('f.txt').read()); 'x' in dir()", "s")
        assert (after.status, after.stdout, after.result) == ("ok", "kept\n", "False")
        assert (after.state_lost, after.notice, after.execution_count) == (False, None, 1)
        assert len(fake(svc).created) == started  # the same sandbox
        assert _gone(child)


async def test_a_sandbox_whose_agent_cannot_restart_is_replaced(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refuse(*args: object, **kwargs: object) -> None:
        raise SandboxFailed("the sandbox's agent cannot restart: unknown op 'restart'")

    async with fake_service(state_dir) as svc:
        await run(svc, "x = 1\nopen('f.txt', 'w').write('kept')", "s")
        monkeypatch.setattr(AgentClient, "restart", refuse)
        done = await svc.restart_interpreter("local", "s")
        assert done.state == "running"
        after = await run(svc, "print(open('f.txt').read()); 'x' in dir()", "s")
        assert (after.stdout, after.result, after.state_lost, after.notice) == (
            "kept\n", "False", False, None,
        )  # fmt: skip
        assert len(fake(svc).stopped) == 1


async def test_a_restart_of_an_unknown_session_is_not_found(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        with pytest.raises(SessionNotFound):
            await svc.restart_interpreter("local", "nope")
        await run(svc, "1", "theirs", owner="bob")
        with pytest.raises(SessionNotFound):
            await svc.restart_interpreter("local", "theirs")


def _gone(pid: int) -> bool:
    """Killed: no such process, or a zombie nobody reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def test_a_sandbox_that_cannot_start_fails_the_call_not_the_session(
    state_dir: Path,
) -> None:
    async with fake_service(state_dir) as svc:
        fake(svc).fail_creates = 1
        with pytest.raises(SandboxFailed, match="told to fail"):
            await run(svc, "1", "s")
        report = await run(svc, "1 + 1", "s")
        assert (report.result, report.session_created) == ("2", False)
