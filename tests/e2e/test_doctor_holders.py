"""``doctor``'s view of who holds what (``doctor.holders``): a stdio server killed together
with its janitor leaves records and workspaces that ``doctor`` lists, and the next start
of any server on the state directory removes them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from mcp_code_sandbox.settings import Settings

from ..procs import wait_nothing_left
from .conftest import settings_env
from .test_stdio import call, handshake, stop


def cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mcp_code_sandbox", *args],
        env=settings_env(settings, SANDBOX_KEEP_SESSIONS_ON_SHUTDOWN=""),
        capture_output=True,
        text=True,
        timeout=120,
    )


def janitor_of(state_dir: Path) -> int:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if b"sessions.janitor" in cmdline and str(state_dir).encode() in environ:
            return int(pid)
    raise AssertionError("no janitor runs for this state directory")


def test_doctor_lists_what_a_killed_server_left_and_the_next_start_removes_it(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcp_code_sandbox", "serve"],
        env=settings_env(settings, SANDBOX_KEEP_SESSIONS_ON_SHUTDOWN=""),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        handshake(proc)
        done = call(proc, 10, "run_code", session_id="s", code="open('f.txt','w').write('x')")
        assert done["structuredContent"]["status"] == "ok", done
        os.kill(janitor_of(settings.state_dir), signal.SIGKILL)  # nobody cleans up now
    finally:
        stop(proc)  # SIGKILL
    report = cli(settings, "doctor")
    [line] = [row for row in report.stdout.splitlines() if "leftovers:" in row]
    assert line.lstrip().startswith("FAIL") and "1 records of servers that died" in line, line
    assert len(list(settings.sessions_dir.glob("*.json"))) == 1

    ran = cli(settings, "exec", "1")  # any start on the state directory
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert list(settings.sessions_dir.glob("*.json")) == []
    assert [p.name for p in settings.workspaces_dir.iterdir()] == []
    assert wait_nothing_left(settings.state_dir) == []
    report = cli(settings, "doctor")
    [line] = [row for row in report.stdout.splitlines() if "leftovers:" in row]
    assert "nothing held by a server that is gone" in line, line
