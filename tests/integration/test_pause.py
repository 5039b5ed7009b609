"""Idle sessions paused to disk and resumed on their next call (issue 13), on every
backend, with real sandboxes.

What comes back depends on the backend (DESIGN-facing table in the README): under gVisor
the whole memory (a checkpoint: a generator half-consumed resumes where it was); on bwrap
and runc the variables the agent saved inside the sandbox (what cannot be pickled is
named in the notice). Files always. The reaper pauses a session idle past
``pause_after_m``; these tests set it to about a second and wait for the pause.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mcp_code_sandbox.backends import create_backend
from mcp_code_sandbox.errors import SandboxFailed, SessionNotFound
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.holder import Role
from mcp_code_sandbox.sessions.lifecycle import Phase
from mcp_code_sandbox.sessions.session import Session
from mcp_code_sandbox.settings import Settings

from ..conftest import MakeService, each_backend, each_runtime
from .test_lifecycle_backends import Before, leftovers, noting_service
from .test_lifecycle_backends import private_tmp as private_tmp

#: About a second idle before a pause (the reaper looks every 0.5 s then).
PAUSE_AFTER_M = 0.02
#: Generous: 2 cores, gVisor, a save of pandas; never a speed claim.
WAIT_S = 120.0

STATE = """
import numpy as np
import pandas as pd
df = pd.DataFrame({"a": range(1000)})
def total():
    return int(df.a.sum())
class Box:
    size = 7
box = Box()
same = shared = [1, 2]
gen = (i for i in range(10))
first = next(gen)
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.plot([1, 2, 3])
open("kept.txt", "w").write("files stay")
x = 41
"""

CHECK = """
print(x + 1, total(), box.size, np.__name__, same is shared, open("kept.txt").read())
print(len(ax.lines), fig.axes[0] is ax, len(In), "import numpy" in In[1])
"""


def session_of(svc: SandboxService, owner: str, session_id: str) -> Session:
    [session] = [s for s in svc.sessions.listed(owner) if s.id == session_id]
    return session


async def paused(svc: SandboxService, owner: str, session_id: str) -> Session:
    """Wait until the reaper paused the session; the session then."""
    deadline = time.monotonic() + WAIT_S
    while True:
        session = session_of(svc, owner, session_id)
        if session.paused is not None and not session.lock.locked():
            return session
        assert time.monotonic() < deadline, "the session was not paused"
        await asyncio.sleep(0.1)


@each_runtime
async def test_an_idle_session_pauses_and_resumes_with_what_its_backend_keeps(
    make_service: MakeService, backend: str
) -> None:
    async with make_service(pause_after_m=PAUSE_AFTER_M) as svc:
        made = await svc.run_code("alice", RunRequest(STATE))
        assert made.status == "ok", made
        sid = made.session_id
        session = await paused(svc, "alice", sid)
        # Its sandbox is gone: nothing of it holds RAM while paused.
        assert session.sandbox is None and session.agent is None
        [listed] = await svc.list_sessions("alice")
        assert (listed.session_id, listed.state) == (sid, "paused")
        back = await svc.run_code("alice", RunRequest(CHECK + "print(next(gen))"), sid)
        # The interpreter's history goes on: this is its second cell.
        assert (back.session_created, back.execution_count) == (False, 2), back
        if backend == "runsc":
            why = svc.sessions.sandboxes.no_memory_pause
            assert why is None, f"the engine must offer checkpoints: {why}"
            # The whole memory: even the generator goes on where it was.
            assert back.resumed == "memory", back
            lines = "42 499500 7 numpy True files stay\n1 True 3 True\n1\n"
            assert back.stdout == lines, back
            assert (back.notice, back.state_lost) == (None, False)
        else:
            assert back.resumed == "variables", back
            lines = "42 499500 7 numpy True files stay\n1 True 3 True\n"
            assert back.stdout.startswith(lines), back
            # The generator could not be pickled: named, with its type.
            assert back.notice is not None and "gen (generator" in back.notice, back.notice
            assert back.error is not None and back.error["name"] == "NameError"
        session = session_of(svc, "alice", sid)
        assert session.paused is None and session.sandbox is not None
        [listed] = await svc.list_sessions("alice")
        assert listed.state == "running"


@each_backend
async def test_a_call_racing_a_pause_waits_for_it_and_succeeds(
    make_service: MakeService,
) -> None:
    async with make_service(pause_after_m=PAUSE_AFTER_M) as svc:
        # A state that takes a moment to save: the call below lands during the pause.
        made = await svc.run_code(
            "alice", RunRequest("import numpy as np\nbig = np.arange(20_000_000)\ny = 5")
        )
        sid = made.session_id
        deadline = time.monotonic() + WAIT_S
        while session_of(svc, "alice", sid).phase is not Phase.PAUSING:
            assert time.monotonic() < deadline, "no pause began"
            await asyncio.sleep(0.005)
        raced = await svc.run_code("alice", RunRequest("print(y * 2, int(big[-1]))"), sid)
        assert raced.status == "ok", raced
        assert raced.stdout == "10 19999999\n"
        assert raced.resumed in ("memory", "variables")


async def test_the_disk_budget_expires_the_longest_idle_paused_session_first(
    make_service: MakeService,
) -> None:
    # Each session holds about 3 MB of files; the budget holds one of them.
    budget = 4 * 1024 * 1024
    async with make_service(pause_after_m=PAUSE_AFTER_M, paused_disk_bytes=budget) as svc:
        fill = "open('blob.bin', 'wb').write(b'x' * 3_000_000)\nv = {}"
        older = await svc.run_code("alice", RunRequest(fill.format(1)))
        await paused(svc, "alice", older.session_id)
        newer = await svc.run_code("alice", RunRequest(fill.format(2)))
        await paused(svc, "alice", newer.session_id)
        deadline = time.monotonic() + WAIT_S
        while any(s.id == older.session_id for s in svc.sessions.listed("alice")):
            assert time.monotonic() < deadline, "the budget was not kept"
            await asyncio.sleep(0.1)
        assert [s.session_id for s in await svc.list_sessions("alice")] == [newer.session_id]
        again = await svc.run_code("alice", RunRequest("v"), older.session_id)
        assert again.session_created is True
        assert again.notice is not None and "SANDBOX_PAUSED_DISK_BYTES" in again.notice
        kept = await svc.run_code("alice", RunRequest("v"), newer.session_id)
        assert (kept.result, kept.resumed) == ("2", "variables")


async def test_a_paused_session_stays_invisible_to_other_owners(
    make_service: MakeService,
) -> None:
    async with make_service(pause_after_m=PAUSE_AFTER_M) as svc:
        await svc.run_code("alice", RunRequest("secret = 'alice only'"), "shared-name")
        await paused(svc, "alice", "shared-name")
        assert await svc.list_sessions("bob") == []
        with pytest.raises(SessionNotFound):
            await svc.list_files("bob", "shared-name", ".", recursive=True)
        theirs = await svc.run_code("bob", RunRequest("'secret' in dir()"), "shared-name")
        assert (theirs.session_created, theirs.result, theirs.resumed) == (True, "False", None)
        # Alice's is still paused, and still hers.
        assert session_of(svc, "alice", "shared-name").paused is not None
        mine = await svc.run_code("alice", RunRequest("secret"), "shared-name")
        assert (mine.result, mine.resumed) == ("'alice only'", "variables")


@each_runtime
@pytest.mark.parametrize("pool_size", [0, 1], ids=["no-pool", "pool"])
async def test_nothing_leaks_after_pause_and_resume_cycles(
    make_settings: Callable[..., Settings], backend: str, private_tmp: Path, pool_size: int
) -> None:
    # With a pool, each resume by variables moves the session into a warm sandbox: the
    # slots it moves out of, and the pool's own sandboxes, must leave nothing either.
    before = Before.now(backend)
    settings = make_settings(pause_after_m=PAUSE_AFTER_M, pool_size=pool_size)
    async with noting_service(settings) as (svc, created):
        made = await svc.run_code("alice", RunRequest("n = 0"))
        sid = made.session_id
        for cycle in range(1, 4):
            await paused(svc, "alice", sid)
            report = await svc.run_code("alice", RunRequest("n += 1\nn"), sid)
            assert report.result == str(cycle), report
        await svc.close_session("alice", sid)
    assert leftovers(svc, backend, before, created, private_tmp) == {}
    if backend != "bwrap":
        engine_dirs = [
            Path(pattern.format(cid))
            for cid in created
            for pattern in (
                "/var/lib/docker/containers/{}",
                "/run/docker/containerd/{}",
                "/var/lib/docker/containerd/daemon/io.containerd.runtime.v2.task/moby/{}",
            )
        ]
        assert [d for d in engine_dirs if d.exists()] == []
        runtime_state = [
            p for cid in created for p in Path("/run/docker").glob(f"runtime-*/moby/{cid}*")
        ]
        assert runtime_state == []


async def test_a_server_that_dies_mid_pause_loses_no_files(
    make_settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(pause_after_m=PAUSE_AFTER_M)
    first = SandboxService(settings, create_backend(settings), role=Role.SERVICE)
    await first.start()
    code = "x = 1\nopen('f.txt', 'w').write('kept')"
    await first.run_code("alice", RunRequest(code), "s")
    await paused(first, "alice", "s")  # a complete pause: x = 1 is saved
    code = "x = 2\nopen('g.txt', 'w').write('after')"
    again = await first.run_code("alice", RunRequest(code), "s")
    assert again.resumed == "variables"
    # The next pause never completes: the server dies while its save is under way.
    never = asyncio.Event()

    async def stuck(*args: object, **kwargs: object) -> None:
        await never.wait()

    monkeypatch.setattr(AgentClient, "save_state", stuck)
    deadline = time.monotonic() + WAIT_S
    while session_of(first, "alice", "s").phase is not Phase.PAUSING:
        assert time.monotonic() < deadline, "no pause began"
        await asyncio.sleep(0.05)
    [record] = [json.loads(p.read_text()) for p in settings.sessions_dir.glob("*.json")]
    assert record["pausing"] is True and record["paused"] is None
    await die(first)
    monkeypatch.undo()

    second = SandboxService(settings, create_backend(settings), role=Role.SERVICE)
    await second.start()
    try:
        back = await second.run_code(
            "alice",
            RunRequest("import os\n(x, sorted(n for n in os.listdir() if n[0] != '.'))"),
            "s",
        )
        assert back.session_created is False, back
        # Every file, and the variables of the last complete pause (said so).
        assert (back.result, back.resumed) == ("(1, ['f.txt', 'g.txt'])", "variables"), back
        assert back.notice is not None and "last complete pause" in back.notice
    finally:
        await second.aclose()


async def die(svc: SandboxService) -> None:
    """What SIGKILL does to an in-process server: its reaper stops where it is, its
    sandboxes go (bwrap's die with their server), its uid locks are let go, and its pid
    file names no process; its records and workspaces stay."""
    manager = svc.sessions
    reaper = manager.reaper.task
    assert reaper is not None
    reaper.cancel()
    await asyncio.wait({reaper})
    for session in list(manager.table):
        if session.sandbox is not None:
            await svc.backend.stop(session.sandbox)
        if session.uid_lease is not None:
            session.uid_lease.release()
    (manager.settings.run_dir / f"{manager.instance}.pid").unlink()
    if manager._service_lock is not None:
        manager._service_lock.release()
    manager._closed = True


async def test_a_session_cannot_resume_into_another_sessions_saved_state(
    make_service: MakeService,
) -> None:
    async with make_service(pause_after_m=PAUSE_AFTER_M) as svc:
        await svc.run_code("bob", RunRequest("secret = 'bob only'"), "bobs")
        bob = await paused(svc, "bob", "bobs")
        theirs = bob.workspace.root / ".session"  # his saved state's host path
        # Mallory points her own saved state at bob's (the host path of his workspace,
        # which bwrap's mount table shows her), every way she can, then pauses.
        plant = f"""
import os, shutil
os.symlink({str(theirs)!r}, "/mnt/data/elsewhere")
os.makedirs("/mnt/data/.session", exist_ok=True)
for name in ("manifest.json", "data"):
    try:
        os.symlink({str(theirs)!r} + "/" + name, "/mnt/data/.session/" + name)
    except OSError as exc:
        print("refused", name, exc)
mine = 1
"""
        made = await svc.run_code("mallory", RunRequest(plant), "mallorys")
        assert made.status == "ok", made
        await paused(svc, "mallory", "mallorys")
        back = await svc.run_code("mallory", RunRequest("sorted(dir())"), "mallorys")
        assert back.resumed == "variables", back
        assert back.result is not None and "'secret'" not in back.result and "'mine'" in back.result
        # Bob's state is his, untouched.
        again = await svc.run_code("bob", RunRequest("secret"), "bobs")
        assert (again.result, again.resumed) == ("'bob only'", "variables")


@pytest.mark.parametrize(
    "backend", [pytest.param("runsc", marks=pytest.mark.docker)], indirect=True
)
async def test_a_failed_checkpoint_falls_back_to_the_variables(
    make_service: MakeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mcp_code_sandbox.backends.docker import backend as docker_backend

    def refuse(api: object, container_id: str) -> None:
        raise SandboxFailed("the engine refused the checkpoint (as the test asked)")

    monkeypatch.setattr(docker_backend, "_create_checkpoint", refuse)
    async with make_service() as svc:
        await svc.run_code("alice", RunRequest("kept = 'yes'"), "s")
        paused = await svc.sessions.pause("alice", "s")
        # The parked agent was taken back and saved its variables instead.
        assert paused is not None and paused.kind == "variables", paused
        labels = {"kind": "variables", "reason": "checkpoint_failed"}
        value = svc.metrics.registry.get_sample_value("mcp_sandbox_pause_fallbacks_total", labels)
        assert value == 1
        back = await svc.run_code("alice", RunRequest("kept"), "s")
        assert (back.result, back.resumed) == ("'yes'", "variables"), back
