"""Session lifecycle with real sandboxes: state, names, owners, queueing, expiry, cleanup.

What depends on the sandbox (state between calls, queueing of runs, expiry and shutdown
stopping sandboxes, cancellation, the single-file limit) runs on every backend; what is
the manager's bookkeeping alone (ids, owners, names, max_sessions, pid-file leftovers)
on bwrap only."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import pytest

from mcp_code_sandbox.backends import create_backend
from mcp_code_sandbox.errors import MaxSessions, SessionNotFound
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.settings import Settings

from ..conftest import each_backend, each_runtime
from ..procs import containers, descendants, running, wait_gone


async def run(
    service: Any, code: str, sid: str | None = "s", owner: str = "local", **kw: Any
) -> Any:
    return await service.run_code(owner, RunRequest(code, **kw), sid)


@each_backend
async def test_variables_and_imports_survive_between_calls(service: Any) -> None:
    first = await run(service, "import json\ncounter = 41")
    assert first.session_created and first.execution_count == 1
    second = await run(service, "counter += 1\njson.dumps({'n': counter})")
    assert not second.session_created
    assert second.result == "'{\"n\": 42}'"
    assert second.execution_count == 2
    assert second.state_lost is False


@pytest.mark.bwrap
async def test_minted_ids(service: Any) -> None:
    r = await run(service, "1", None)
    assert r.session_created and r.session_id.startswith("sess_")
    again = await run(service, "2", r.session_id)
    assert again.session_id == r.session_id and not again.session_created


@pytest.mark.bwrap
async def test_owners_never_see_each_other(service: Any) -> None:
    await run(service, "open('mine.txt','w').write('alice')", "conv-1", owner="alice")
    with pytest.raises(SessionNotFound):
        await service.list_files("bob", "conv-1", ".", recursive=True)
    with pytest.raises(SessionNotFound):
        await service.read_file("bob", "conv-1", "mine.txt", offset=0, max_bytes=None)
    with pytest.raises(SessionNotFound):
        await service.close_session("bob", "conv-1")
    bobs = await run(service, "import os; print(os.listdir('.'))", "conv-1", owner="bob")
    assert bobs.session_created  # bob's own session of that name, empty
    assert bobs.stdout == "[]\n"


@each_backend
async def test_calls_to_one_session_queue_in_arrival_order(service: Any) -> None:
    await run(service, "order = []")
    # Tasks start in creation order, so this is the order the calls arrive in.
    calls = [
        asyncio.create_task(run(service, f"import time; time.sleep(0.3); order.append({i})"))
        for i in range(4)
    ]
    await asyncio.gather(*calls)
    final = await run(service, "order")
    assert final.result == "[0, 1, 2, 3]"


@pytest.mark.bwrap
async def test_closed_session_name_can_be_reused_with_a_notice(service: Any) -> None:
    await run(service, "x = 1\nopen('f.txt','w').write('old')", "named")
    await service.close_session("local", "named")
    with pytest.raises(SessionNotFound, match="closed"):
        await service.list_files("local", "named", ".", recursive=True)
    again = await run(service, "import os; print(os.listdir('.')); 'x' in globals()", "named")
    assert again.session_created
    assert again.notice and "closed" in again.notice and "gone" in again.notice
    assert again.stdout == "[]\n" and again.result == "False"


async def _service(settings: Settings) -> SandboxService:
    svc = SandboxService(settings, create_backend(settings))
    await svc.start()
    return svc


@each_backend
async def test_idle_sessions_expire(make_settings: Callable[..., Settings]) -> None:
    svc = await _service(make_settings(session_ttl_m=0.02))  # 1.2 s
    try:
        await run(svc, "1", "idle")
        await asyncio.sleep(1.5)
        await svc.sessions.reap()
        with pytest.raises(SessionNotFound, match=r"expired after 0\.02 min idle"):
            await svc.list_files("local", "idle", ".", recursive=True)
        again = await run(svc, "1", "idle")
        assert again.session_created
        assert "expired after 0.02 min idle; files and variables from before are gone" in (
            again.notice or ""
        )
    finally:
        await svc.aclose()


@each_backend
async def test_sessions_end_at_their_max_lifetime(make_settings: Callable[..., Settings]) -> None:
    svc = await _service(make_settings(session_max_lifetime_h=0.0005))  # 1.8 s
    try:
        await run(svc, "1", "old")
        for _ in range(4):  # keep it busy: activity does not extend the lifetime
            await asyncio.sleep(0.5)
            await run(svc, "1", "old")
        await svc.sessions.reap()
        with pytest.raises(SessionNotFound, match="maximum lifetime"):
            await svc.list_files("local", "old", ".", recursive=True)
    finally:
        await svc.aclose()


@pytest.mark.bwrap
async def test_past_max_sessions_the_idlest_is_paused_to_make_room(
    make_settings: Callable[..., Settings],
) -> None:
    svc = await _service(make_settings(max_sessions=2, pool_size=0))
    try:
        await run(svc, "x = 'a'", "a")
        await run(svc, "x = 'b'", "b")
        assert (await run(svc, "1", "c")).status == "ok"  # "a", the idlest, was paused
        running = {s.id for s in svc.sessions.listed() if s.sandbox is not None}
        assert running == {"b", "c"}
        back = await run(svc, "x", "a")  # resumed; "b" is the idlest now
        assert (back.result, back.resumed) == ("'a'", "variables"), back
        assert {s.id for s in svc.sessions.listed() if s.sandbox is not None} == {"a", "c"}
    finally:
        await svc.aclose()


@pytest.mark.bwrap
async def test_max_sessions_with_pausing_off(make_settings: Callable[..., Settings]) -> None:
    svc = await _service(make_settings(max_sessions=2, pause_after_m=0))
    try:
        await run(svc, "1", "a")
        await run(svc, "1", "b")
        with pytest.raises(MaxSessions):
            await run(svc, "1", "c")
        await svc.close_session("local", "a")
        assert (await run(svc, "1", "c")).status == "ok"
    finally:
        await svc.aclose()


@pytest.mark.bwrap
async def test_max_sessions_per_owner(make_settings: Callable[..., Settings]) -> None:
    # Pausing off: an owner's third session is refused, not made room for.
    svc = await _service(make_settings(max_sessions=5, max_sessions_per_owner=2, pause_after_m=0))

    async def upload(owner: str, sid: str) -> Any:
        return await svc.upload_file(owner, "f.txt", b"x", session_id=sid, overwrite=True)

    try:
        await upload("alice", "a")
        await upload("alice", "b")
        with pytest.raises(MaxSessions, match="most one owner may run"):
            await upload("alice", "c")
        assert (await upload("alice", "a")).session_created is False  # her own: still fine
        await upload("bob", "a")  # other owners have their own allowance
        await upload("bob", "b")
        await svc.close_session("alice", "a")
        assert (await upload("alice", "c")).session_created is True
    finally:
        await svc.aclose()


@each_backend
async def test_shutdown_removes_every_sandbox_and_workspace(
    make_settings: Callable[..., Settings], backend: str
) -> None:
    settings = make_settings()
    before = descendants(os.getpid())
    svc = await _service(settings)
    for sid in ("a", "b", "c"):
        await run(svc, "import subprocess; subprocess.Popen(['sleep', '300'])", sid)
    workspaces = settings.workspaces_dir
    assert any(workspaces.rglob("*"))
    started = descendants(os.getpid()) - before
    if backend == "bwrap":
        assert len(started) >= 9
    else:  # containers are the engine's children, not ours: found by their labels
        instance = svc.backend.instance  # type: ignore[attr-defined]
        assert len(await asyncio.to_thread(containers, instance)) == 3
        assert running(started) == set()
    await svc.aclose()
    assert await asyncio.to_thread(wait_gone, started) == set()
    if backend != "bwrap":
        assert await asyncio.to_thread(containers, instance) == []
    assert not any(workspaces.rglob("*"))


@pytest.mark.bwrap
async def test_leftovers_of_a_dead_server_are_removed_at_start(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    dead_ws = settings.workspaces_dir / "999999999-dead" / "sabc"
    dead_ws.mkdir(parents=True)
    (dead_ws / "file.txt").write_text("left behind")
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    (settings.run_dir / "999999999-dead.pid").write_text("999999999")
    live_ws = settings.workspaces_dir / "1-alive" / "sdef"  # pid 1 is alive: not ours to touch
    live_ws.mkdir(parents=True)
    (settings.run_dir / "1-alive.pid").write_text("1")
    svc = await _service(settings)
    try:
        assert not dead_ws.exists()
        assert not (settings.run_dir / "999999999-dead.pid").exists()
        assert live_ws.exists()
    finally:
        await svc.aclose()


#: The pids of processes that are still alive (not gone, not zombies), in the sandbox.
ALIVE = """
def alive(pid):
    try:
        return open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False
[p for p in PIDS if alive(p)]
"""


@each_runtime
async def test_restart_interpreter_keeps_the_sandbox_and_its_files(service: Any) -> None:
    spawn = (
        "import subprocess\nx = 1\nopen('kept.txt', 'w').write('k')\n"
        "open('/tmp/same-sandbox', 'w').write('t')\n"
        "PIDS = [subprocess.Popen(['sleep', '300']).pid,\n"
        "        subprocess.Popen(['sleep', '300'], start_new_session=True).pid]\nPIDS"
    )
    pids = (await run(service, spawn)).result
    assert (await run(service, "PIDS = " + pids + ALIVE)).result == pids
    done = await service.restart_interpreter("local", "s")
    assert done.state == "running" and "files in /mnt/data are kept" in done.message
    after = await run(service, "x")
    assert after.error is not None and after.error["name"] == "NameError"
    assert (after.state_lost, after.notice, after.execution_count) == (False, None, 1)
    assert (await run(service, "open('kept.txt').read()")).result == "'k'"
    # Its /tmp too: the same sandbox, not a new one.
    assert (await run(service, "open('/tmp/same-sandbox').read()")).result == "'t'"
    assert (await run(service, "PIDS = " + pids + ALIVE)).result == "[]"
    assert (await run(service, "import json; json.dumps([1])")).result == "'[1]'"


@each_backend
async def test_cancelled_run_leaves_the_session_usable(service: Any) -> None:
    await run(service, "kept = 'yes'")
    task = asyncio.create_task(run(service, "import time\nfor i in range(100): time.sleep(0.1)"))
    await asyncio.sleep(1.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    after = await run(service, "kept")
    assert after.status == "ok" and after.result == "'yes'"
    assert after.state_lost is False


@each_backend
async def test_writing_past_the_quota_is_reported_and_blocks_uploads(
    make_settings: Callable[..., Settings],
) -> None:
    svc = await _service(make_settings(workspace_quota_bytes=1_000_000))
    try:
        r = await run(svc, "for i in range(3): open(f'part{i}', 'wb').write(bytes(600_000))", "q")
        assert "more than its quota of 1000000" in (r.notice or "")
        from mcp_code_sandbox.errors import QuotaExceeded

        with pytest.raises(QuotaExceeded):
            await svc.upload_file("local", "more.txt", b"x", session_id="q", overwrite=False)
        big = await run(svc, "open('one', 'wb').write(bytes(2_000_000))", "q")
        assert big.status == "error"  # a single file larger than the quota: RLIMIT_FSIZE
    finally:
        await svc.aclose()
