"""The run path (``service.run_code`` → ``run.execute``) on the fake backend: output,
errors, timeouts, the files a run changed, notices, and what a call may not ask for."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from mcp_code_sandbox.errors import (
    CodeTooLarge,
    EnvNotAllowed,
    InvalidArgument,
    NetworkNotAllowed,
    UnsupportedLanguage,
)
from mcp_code_sandbox.run.execute import RunReport
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.workspace.seam import INLINE_SNAPSHOT_ENTRIES
from tests.fakes import FakeBackend, fake_service


async def run(
    svc: SandboxService, code: str, sid: str | None = "s", language: str = "python", **kw: object
) -> RunReport:
    return await svc.run_code("local", RunRequest(code, language, **kw), sid)  # type: ignore[arg-type]


async def test_output_result_and_execution_count(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        first = await run(svc, "import sys\nprint('out')\nprint('err', file=sys.stderr)\n6 * 7")
        assert (first.status, first.stdout, first.stderr, first.result) == (
            "ok",
            "out\n",
            "err\n",
            "42",
        )
        assert (first.language, first.error, first.files, first.state_lost) == (
            "python",
            None,
            [],
            False,
        )
        assert (first.stdout_truncated, first.full_output_path) == (False, None)
        second = await run(svc, "None")
        assert second.result is None
        assert second.execution_count is not None and first.execution_count is not None
        assert second.execution_count == first.execution_count + 1


async def test_user_errors_are_results_and_failed_runs_still_diff(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        code = "open('partial.csv', 'w').write('a,b')\ndef f():\n    1/0\nf()"
        report = await run(svc, code)
        assert report.status == "error"
        assert report.error is not None and report.error["name"] == "ZeroDivisionError"
        assert "1/0" in report.error["traceback"]
        assert [(f.path, f.change) for f in report.files] == [("partial.csv", "created")]
        shell = await run(svc, "echo out; echo err >&2; exit 3", language="bash")
        assert (shell.status, shell.exit_code, shell.stdout, shell.stderr) == (
            "error",
            3,
            "out\n",
            "err\n",
        )


async def test_a_timeout_interrupts_and_keeps_the_interpreter(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        await run(svc, "import time\nkept = 'yes'")
        report = await run(svc, "print('before', flush=True)\ntime.sleep(60)", timeout_s=0.5)
        assert (report.status, report.state_lost) == ("timeout", False)
        # What it printed is kept; on a busy machine the deadline may come before the
        # print (the output kept at a timeout is tested without a clock in test_agent.py).
        assert "before\n".startswith(report.stdout)
        assert (
            report.notice
            == "timed out after 0.5 s; the interpreter was interrupted, variables kept"
        )
        assert report.exit_code == 1
        after = await run(svc, "kept")
        assert (after.status, after.result, after.state_lost) == ("ok", "'yes'", False)


async def test_a_timeout_that_ignores_sigint_restarts_the_interpreter(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        await run(svc, "import signal, time\nkept = 'yes'")
        code = "signal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)"
        report = await run(svc, code, timeout_s=0.5)
        assert (report.status, report.state_lost) == ("timeout", True)
        assert report.notice == (
            "timed out after 0.5 s; the code did not stop when interrupted, so the "
            "interpreter was restarted: variables are gone, files in /mnt/data are kept"
        )
        after = await run(svc, "'kept' in dir()")
        assert (after.status, after.result) == ("ok", "False")


async def test_files_created_and_modified_are_listed(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        await svc.upload_file("local", "data.csv", b"a\n1\n", session_id="s", overwrite=False)
        await svc.upload_file("local", "gone.txt", b"x", session_id="s", overwrite=False)
        code = (
            "import os\n"
            "open('data.csv', 'a').write('2\\n')\n"
            "os.makedirs('out', exist_ok=True)\n"
            "open('out/chart.png', 'wb').write(b'\\x89PNG\\r\\n\\x1a\\n' + bytes(100))\n"
            "os.remove('gone.txt')\n"
        )
        report = await run(svc, code)
        assert report.status == "ok", report.error
        changes = {f.path: (f.change, f.size_bytes, f.mime_type) for f in report.files}
        assert changes == {
            "data.csv": ("modified", 6, "text/csv"),
            "out/chart.png": ("created", 108, "image/png"),
        }
        assert [(i.path, len(i.data)) for i in report.image_files] == [("out/chart.png", 108)]
        quiet = await run(svc, "open('data.csv').read()")
        assert quiet.files == [] and quiet.result == "'a\\n1\\n2\\n'"


async def test_changes_are_found_in_workspaces_on_both_sides_of_the_inline_snapshot(
    state_dir: Path,
) -> None:
    # Up to INLINE_SNAPSHOT_ENTRIES entries the snapshot before a run is taken on the event
    # loop, above it in a worker thread: the files a run changed are the same either way.
    async with fake_service(state_dir) as svc:
        for count in (INLINE_SNAPSHOT_ENTRIES - 2, INLINE_SNAPSHOT_ENTRIES * 3):
            sid = f"ws{count}"
            made = await run(svc, f"for i in range({count}): open(f'f{{i}}.txt', 'w')", sid)
            assert len(made.files) == count
            code = "open('f1.txt', 'w').write('x')\nopen('new.txt', 'w').write('y')"
            report = await run(svc, code, sid)
            changes = [(f.path, f.change) for f in report.files]
            assert changes == [("f1.txt", "modified"), ("new.txt", "created")], count


async def test_long_output_is_cut_and_saved_whole(state_dir: Path) -> None:
    async with fake_service(state_dir, max_output_bytes=1000) as svc:
        report = await run(svc, "for i in range(2000): print(f'line {i}')")
        assert report.stdout_truncated is True
        assert report.stdout.startswith("line 0\n") and report.stdout.endswith("line 1999\n")
        assert "bytes cut" in report.stdout and len(report.stdout) < 1200
        assert report.full_output_path == ".outputs/run-1.txt"
        saved = await svc.read_file("local", "s", report.full_output_path, offset=0, max_bytes=None)
        assert saved.data == "".join(f"line {i}\n" for i in range(2000)).encode()
        # The saved output is the server's, not an artifact of the run.
        assert all(not f.path.startswith(".outputs") for f in report.files)


async def test_a_workspace_over_its_quota_says_what_to_delete(state_dir: Path) -> None:
    async with fake_service(state_dir, workspace_quota_bytes=100_000) as svc:
        code = "for n in range(3): open(f'f{n}', 'wb').write(bytes(60_000))"
        report = await run(svc, code)
        assert report.notice is not None
        assert "more than its quota of 100000: delete at least" in report.notice


async def test_what_a_call_may_not_ask_for(state_dir: Path) -> None:
    async with fake_service(state_dir, max_code_bytes=100, max_exec_timeout_s=30) as svc:
        with pytest.raises(UnsupportedLanguage, match="'cobol' is not offered"):
            await run(svc, "1", language="cobol")
        with pytest.raises(CodeTooLarge):
            await run(svc, "x = 1  # " + "y" * 100)
        with pytest.raises(NetworkNotAllowed, match="SANDBOX_ALLOW_NETWORK"):
            await run(svc, "1", network=True)
        with pytest.raises(EnvNotAllowed):
            await run(svc, "1", env={"A": "b"})
        with pytest.raises(InvalidArgument, match="timeout_s"):
            await run(svc, "1", timeout_s=31)
        assert svc.sessions.count() == 0  # refused before any session was made
        assert svc.backend.created == []  # type: ignore[attr-defined]


async def test_env_per_call_where_allowed(state_dir: Path) -> None:
    async with fake_service(state_dir, allow_call_env=True) as svc:
        report = await run(svc, "import os; os.environ.get('GREETING')", env={"GREETING": "hi"})
        assert report.result == "'hi'"
        with pytest.raises(InvalidArgument, match="PATH"):
            await run(svc, "1", env={"PATH": "/evil"})


async def test_a_sandbox_that_dies_mid_run_is_an_error_result(state_dir: Path) -> None:
    async with fake_service(state_dir) as svc:
        await run(svc, "x = 1")
        # The cell kills its own agent (the kernel's parent): the sandbox is gone.
        report = await run(svc, "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")
        assert report.status == "error" and report.state_lost is True
        assert report.error is not None and report.error["name"] == "SandboxDied"
        after = await run(svc, "'x' in dir()")
        assert (after.status, after.result) == ("ok", "False")
        assert len(svc.backend.created) == 2  # type: ignore[attr-defined]


async def test_a_language_the_sandbox_lacks_is_refused_and_dropped(state_dir: Path) -> None:
    # A PATH with no bash, node or bun: the agent offers Python only.
    empty = tempfile.mkdtemp(prefix="mcs-nopath-")
    backend = FakeBackend(path=empty)
    try:
        async with fake_service(state_dir, backend) as svc:
            assert "bash" in svc.languages()  # nothing said otherwise yet
            with pytest.raises(UnsupportedLanguage, match="no interpreter for 'bash'"):
                await run(svc, "echo hi", language="bash")
            assert svc.languages() == ["python"]  # the server's own probe saw it too
            assert (await run(svc, "1")).result == "1"
    finally:
        await backend.end_all()
        os.rmdir(empty)
