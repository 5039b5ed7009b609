"""A stdio server leaves nothing behind (``sessions.janitor``): not when its client shuts
it down as the official SDK client does (stdin closed, then signals), and not when it is
killed with SIGKILL in the middle of a run, with no other server started on its state
directory afterwards: no process, container, mount, loop device or record of it remains
within seconds."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable

from mcp import Client, StdioServerParameters

from mcp_code_sandbox.settings import Settings
from tests.conftest import each_backend

from ..procs import of_state_dir, wait_nothing_left
from .conftest import settings_env
from .tenants import structured
from .test_stdio import call, handshake, send, stop

#: What a session leaves in its workspace, and keeps running in its sandbox.
WORK = (
    "import subprocess\n"
    "open('notes.txt', 'w').write('x' * 1000)\n"
    "subprocess.Popen(['sleep', '600'])\n"
    "'started'"
)


def user_env(settings: Settings) -> dict[str, str]:
    """The env a client gives a stdio server: the server's own defaults."""
    return settings_env(settings, SANDBOX_KEEP_SESSIONS_ON_SHUTDOWN="")


def busy_server(settings: Settings, *, stderr: int) -> subprocess.Popen[bytes]:
    """A stdio server spoken to as raw JSON-RPC, holding three sessions that each have a
    file and a process running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcp_code_sandbox", "serve"],
        env=user_env(settings),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
    )
    try:
        handshake(proc)
        for n in range(3):
            done = call(proc, 10 + n, "run_code", session_id=f"s{n}", code=WORK)
            assert done["structuredContent"]["result"] == "'started'", done
    except BaseException:
        stop(proc)
        raise
    return proc


@each_backend
async def test_a_client_that_leaves_leaves_nothing_behind(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "mcp_code_sandbox", "serve"], env=user_env(settings)
    )
    async with Client(params, mode="legacy") as client:
        for n in range(3):
            made = structured(
                await client.call_tool("run_code", {"session_id": f"s{n}", "code": WORK})
            )
            assert made["result"] == "'started'", made
        assert of_state_dir(settings.state_dir) != []  # sandboxes, at least, are there
    assert wait_nothing_left(settings.state_dir) == []
    assert list(settings.sessions_dir.glob("*.json")) == []
    assert [p.name for p in settings.workspaces_dir.iterdir()] == []


@each_backend
def test_a_killed_stdio_server_leaves_nothing_behind(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    proc = busy_server(settings, stderr=subprocess.DEVNULL)
    try:
        # A run in flight when the server is killed.
        send(
            proc,
            {
                "jsonrpc": "2.0",
                "id": 20,
                "method": "tools/call",
                "params": {
                    "name": "run_code",
                    "arguments": {"session_id": "s0", "code": "import time; time.sleep(60)"},
                },
            },
        )
        time.sleep(1)
        assert len(list(settings.sessions_dir.glob("*.json"))) == 3
    finally:
        stop(proc)  # SIGKILL
    assert wait_nothing_left(settings.state_dir, timeout=20) == []
    assert list(settings.sessions_dir.glob("*.json")) == []
    assert [p.name for p in settings.workspaces_dir.iterdir()] == []


@each_backend
def test_a_sigterm_during_the_cleanup_does_not_cut_it_short(
    make_settings: Callable[..., Settings],
) -> None:
    """The client's shutdown: stdin closed, and (when the server is slow to go) SIGTERM."""
    settings = make_settings()
    proc = busy_server(settings, stderr=subprocess.PIPE)
    try:
        assert proc.stdin is not None and proc.stderr is not None
        proc.stdin.close()
        for line in proc.stderr:
            if b"shutting down: ending every session" in line:
                break
        else:
            raise AssertionError("the server never said it was shutting down")
        proc.send_signal(signal.SIGTERM)  # while it ends its sessions
        proc.stderr.read()
        assert proc.wait(timeout=60) == 0
    finally:
        stop(proc)
        if proc.stderr is not None:
            proc.stderr.close()
    assert wait_nothing_left(settings.state_dir) == []
