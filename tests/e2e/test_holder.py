"""Who holds a session (``sessions.holder``), with real server processes: an HTTP service
pauses its tenants' sessions at SIGTERM for its successor, and nothing started meanwhile on
the same state directory (``exec``, a stdio server serving a call) takes them over or ends
them; the next service gives them back. A second service on one state directory refuses to
start and leaves the first unharmed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import httpx
from mcp import Client, StdioServerParameters

from mcp_code_sandbox.settings import Settings
from tests.conftest import each_backend

from .conftest import free_port, http_server_argv, http_server_process, settings_env
from .tenants import client_as, structured

ALICE = "alice-0123456789abcdef"
BOB = "bob-0123456789abcdef00"
#: The server's own defaults for keeping sessions ("": unset), and two owners.
SERVICE = {
    "SANDBOX_KEEP_SESSIONS_ON_SHUTDOWN": "",
    "SANDBOX_API_TOKENS": f"alice:{ALICE},bob:{BOB}",
}


def private_env(settings: Settings) -> dict[str, str]:
    """A stdio server's or ``exec``'s env, as a user's: the server's own defaults."""
    return settings_env(settings, SANDBOX_KEEP_SESSIONS_ON_SHUTDOWN="")


@each_backend
async def test_a_paused_tenant_survives_exec_and_a_stdio_server_on_its_state_dir(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    with http_server_process(settings, **SERVICE) as (base, _proc):
        async with client_as(base, ALICE) as alice, client_as(base, BOB) as bob:
            made = structured(
                await alice.call_tool(
                    "run_code",
                    {
                        "session_id": "long-job",
                        "code": "x = 41; open('keep.txt','w').write('important')",
                    },
                )
            )
            assert made["status"] == "ok", made
            structured(await bob.call_tool("run_code", {"session_id": "bobs", "code": "y = 2"}))
    # SIGTERM: both sessions were paused for the next service.
    kept = sorted(p.name for p in settings.sessions_dir.glob("*.json"))
    assert len(kept) == 2

    # What the README's Troubleshooting tells an operator to run.
    ran = subprocess.run(
        [sys.executable, "-m", "mcp_code_sandbox", "exec", "1+1"],
        env=private_env(settings),
        capture_output=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr.decode()[-3000:]
    assert b"Out[1]: 2" in ran.stdout
    # A stdio server (Claude Code starting it) that serves a call and exits.
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "mcp_code_sandbox", "serve"],
        env=private_env(settings),
    )
    async with Client(params, mode="legacy") as local:
        own = structured(await local.call_tool("run_code", {"session_id": "long-job", "code": "x"}))
        assert own["session_created"] is True  # its own session of that name, not alice's
        assert own["status"] == "error"
    assert sorted(p.name for p in settings.sessions_dir.glob("*.json")) == kept

    with http_server_process(settings, **SERVICE) as (base, _proc):
        async with client_as(base, ALICE) as alice, client_as(base, BOB) as bob:
            back = structured(
                await alice.call_tool(
                    "run_code",
                    {"session_id": "long-job", "code": "(x + 1, open('keep.txt').read())"},
                )
            )
            assert back["session_created"] is False and back["state_lost"] is False, back
            assert back["result"] == "(42, 'important')"
            assert (
                structured(await bob.call_tool("run_code", {"session_id": "bobs", "code": "y"}))[
                    "result"
                ]
                == "2"
            )


def test_a_second_service_on_one_state_dir_refuses_and_the_first_is_unharmed(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    with http_server_process(settings, **SERVICE) as (base, first):
        second = subprocess.run(
            http_server_argv(free_port()),
            env=settings_env(settings, **SERVICE),
            capture_output=True,
            timeout=60,
        )
        assert second.returncode == 2
        lines = second.stderr.decode().strip().splitlines()
        assert len(lines) == 1, lines
        assert f"pid {first.pid}" in lines[0] and "SANDBOX_STATE_DIR" in lines[0]
        assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
        assert first.poll() is None
