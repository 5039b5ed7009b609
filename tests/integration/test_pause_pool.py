"""A paused session resumed into a warm sandbox of the pool (issue 13: "resume starts a
sandbox, from the pool where it fits"), with real sandboxes on bwrap and Docker.

The session's files move into the warm sandbox's workspace (``sessions/moving.py``): its
saved variables load there, its run log and files come along, its old slot is gone. What
the copy refuses (a hard link) or cannot carry (a FIFO) is checked from the host side.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time

from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.sessions import records
from mcp_code_sandbox.sessions.pool import Pooled

from ..conftest import MakeService, each_backend
from .test_pause import PAUSE_AFTER_M, WAIT_S, paused, session_of

STATE = """
import os
import numpy as np
def twice(v):
    return 2 * v
x = 21
os.makedirs("sub/deeper", exist_ok=True)
open("sub/deeper/data.txt", "w").write("deep file")
os.chmod("sub/deeper/data.txt", 0o640)
os.symlink("/etc/passwd", "passwd-link")
os.mkfifo("a-fifo")
"""

CHECK = """
print(twice(x), np.__name__, open("sub/deeper/data.txt").read(), os.readlink("passwd-link"))
print(oct(os.stat("sub/deeper/data.txt").st_mode & 0o777), os.path.exists("a-fifo"))
"""


async def warm_one(svc: SandboxService) -> Pooled:
    """The pool's ready sandbox, once it has one again."""
    deadline = time.monotonic() + WAIT_S
    while not svc.sessions.pool.ready_sandboxes():
        assert time.monotonic() < deadline, "the pool did not refill"
        await asyncio.sleep(0.1)
    [warm] = svc.sessions.pool.ready_sandboxes()
    return warm


@each_backend
async def test_a_paused_session_resumes_into_a_warm_sandbox(make_service: MakeService) -> None:
    async with make_service(pause_after_m=PAUSE_AFTER_M, pool_size=1) as svc:
        made = await svc.run_code("alice", RunRequest(STATE))
        assert made.status == "ok", made
        sid = made.session_id
        session = await paused(svc, "alice", sid)
        assert session.paused is not None and session.paused.kind == "variables"
        old_slot, old_root = session.slot, session.workspace.root
        warm = await warm_one(svc)
        back = await svc.run_code("alice", RunRequest(CHECK), sid)
        assert back.status == "ok", back
        assert back.resumed == "variables", back
        assert back.stdout == "42 numpy deep file /etc/passwd\n0o640 False\n", back
        assert back.execution_count == 2, back
        session = session_of(svc, "alice", sid)
        # The warm sandbox is the session's now, with its slot; the old slot is gone.
        assert session.sandbox is warm.sandbox and session.slot == warm.slot != old_slot
        assert session.workspace.root == warm.workspace.root
        assert not old_root.exists()
        sessions_dir = svc.settings.sessions_dir
        assert not records.record_path(sessions_dir, old_slot).exists()
        [record] = [r for r in records.load_records(sessions_dir) if r.session_id == sid]
        assert (record.slot, record.owner, record.pool, record.replaces) == (
            warm.slot,
            "alice",
            False,
            None,
        )
        assert record.paused is None
        # Copied as a link (never followed), owned by the new sandbox's uid.
        link = session.workspace.root / "passwd-link"
        assert stat.S_ISLNK(os.lstat(link).st_mode)
        if session.uid is not None:
            data = session.workspace.root / "sub" / "deeper" / "data.txt"
            assert os.stat(data).st_uid == session.uid
        # The run log moved too: both runs are in the notebook.
        exported = await svc.export_notebook("alice", sid, "runs.ipynb")
        assert exported.runs == 2, exported


@each_backend
async def test_a_hard_link_keeps_the_session_out_of_the_pool(make_service: MakeService) -> None:
    async with make_service(pause_after_m=PAUSE_AFTER_M, pool_size=1) as svc:
        code = 'import os\nx = 5\nopen("a", "w").write("A")\nos.link("a", "b")\n'
        made = await svc.run_code("alice", RunRequest(code))
        assert made.status == "ok", made
        sid = made.session_id
        session = await paused(svc, "alice", sid)
        slot = session.slot
        warm = await warm_one(svc)
        back = await svc.run_code("alice", RunRequest("print(x, open('b').read())"), sid)
        assert (back.resumed, back.stdout) == ("variables", "5 A\n"), back
        session = session_of(svc, "alice", sid)
        # Resumed in a new sandbox of its own, in its own slot; the warm one was discarded.
        assert session.slot == slot and session.sandbox is not warm.sandbox
