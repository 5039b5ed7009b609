"""Forking a session (issue 29, "Sessions from a warm state"), with real sandboxes on
bwrap and Docker (and gVisor for the main case): the fork has the source's files and
variables and diverges from it; what a hostile source left in its workspace is left out
or copied as harmless links; a paused source is forked without being resumed; a fork is
a session like any other for the limits and for other owners.
"""

from __future__ import annotations

import errno
import os
import stat

import pytest

from mcp_code_sandbox.errors import MaxSessions, QuotaExceeded, SessionNotFound
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService

from ..conftest import MakeService, each_backend, each_runtime
from .test_pause import PAUSE_AFTER_M, paused, session_of

STATE = """
import pandas as pd
df = pd.DataFrame({"a": range(1000)})
def total():
    return int(df.a.sum())
open("data.txt", "w").write("source")
"""


async def ok(svc: SandboxService, sid: str, code: str) -> str:
    done = await svc.run_code("alice", RunRequest(code), sid)
    assert done.status == "ok", done
    return str(done.stdout)


@each_runtime
async def test_a_fork_has_the_files_and_variables_then_diverges(
    make_service: MakeService,
) -> None:
    async with make_service(pool_size=1) as svc:
        await ok(svc, "src", STATE)
        forked = await svc.fork_session("alice", "src", "copy")
        assert forked.state == "variables", forked
        assert {"df", "total", "pd"} <= set(forked.variables)
        fork = session_of(svc, "alice", "copy")
        if fork.uid is not None:  # every entry is the fork's sandbox's own
            assert os.stat(fork.workspace.root / "data.txt").st_uid == fork.uid
        code = "df['a'] = df.a * 2\nopen('data.txt', 'w').write('fork')\nprint(total())"
        assert await ok(svc, "copy", code) == "999000\n"
        check = "print(total(), open('data.txt').read())"
        assert await ok(svc, "src", check) == "499500 source\n"
        assert await ok(svc, "copy", check) == "999000 fork\n"


@each_backend
async def test_another_owner_cannot_fork_a_session_it_cannot_see(
    make_service: MakeService,
) -> None:
    async with make_service() as svc:
        await ok(svc, "mine", "secret = 42")
        with pytest.raises(SessionNotFound):
            await svc.fork_session("mallory", "mine", "stolen")
        assert await svc.list_sessions("mallory") == []


@each_backend
async def test_hostile_source_files_are_refused_or_made_safe(make_service: MakeService) -> None:
    async with make_service(workspace_quota_bytes=64 << 20) as svc:
        code = "import os\nv = 7\nos.symlink('/etc/passwd', 'passwd-link')\nos.mkfifo('pipe')\n"
        await ok(svc, "src", code)
        root = session_of(svc, "alice", "src").workspace.root
        outside = svc.settings.state_dir / "outside.txt"
        outside.write_text("host secret")
        try:  # planted from the host: the sandbox cannot reach the file
            os.link(outside, root / "hard")
        except OSError as exc:  # a workspace of its own filesystem: no link leaves it
            assert exc.errno == errno.EXDEV
            (root / "inside").write_text("linked")
            os.link(root / "inside", root / "hard")
        with open(root / "sparse", "wb") as f:
            f.truncate(100 << 30)  # 100 GB of holes in a 64 MiB quota
        with pytest.raises(QuotaExceeded):
            await svc.fork_session("alice", "src", "copy")
        assert [s.session_id for s in await svc.list_sessions("alice")] == ["src"]
        os.unlink(root / "sparse")
        forked = await svc.fork_session("alice", "src", "copy")
        assert forked.notice is not None and "hard" in forked.notice and "pipe" in forked.notice
        copy = session_of(svc, "alice", "copy").workspace.root
        assert not os.path.lexists(copy / "hard") and not os.path.lexists(copy / "pipe")
        assert stat.S_ISLNK(os.lstat(copy / "passwd-link").st_mode)
        assert os.readlink(copy / "passwd-link") == "/etc/passwd"
        assert outside.read_text() == "host secret"
        assert await ok(svc, "copy", "print(v, os.path.exists('hard'))") == "7 False\n"


@each_backend
async def test_a_paused_session_is_forked_without_resuming_it(make_service: MakeService) -> None:
    async with make_service(pause_after_m=PAUSE_AFTER_M) as svc:
        await ok(svc, "src", STATE)
        source = await paused(svc, "alice", "src")
        assert source.paused is not None and source.paused.kind == "variables"
        forked = await svc.fork_session("alice", "src", "copy")
        assert forked.state == "variables", forked
        source = session_of(svc, "alice", "src")
        assert source.paused is not None and source.sandbox is None
        assert await ok(svc, "copy", "print(total(), open('data.txt').read())") == (
            "499500 source\n"
        )


@each_backend
async def test_a_fork_counts_toward_the_session_limit(make_service: MakeService) -> None:
    async with make_service(max_sessions_per_owner=1, pause_after_m=0) as svc:
        await ok(svc, "src", "x = 1")
        with pytest.raises(MaxSessions):
            await svc.fork_session("alice", "src", "copy")
        assert [s.session_id for s in await svc.list_sessions("alice")] == ["src"]
        assert await ok(svc, "src", "print(x)") == "1\n"
