"""Issue 10, findings 1 (host side) and 4, as attacks on the real HTTP server by two tenants.

Finding 1: what a sandbox writes to the stderr pipe the server reads (bwrap: the agent's
stderr, which sandboxed code reached through ``pidfd_getfd``) must neither kill the
server's reader, nor fail ``stop``, nor the reaper, close or shutdown, nor write raw
escapes and made-up lines into the server's log. Sandboxed code can no longer get that fd
(another part of the fix), so the test writes into the very same pipe from the host, as
root, through ``/proc/<bwrap>/fd/2``: the bytes and the pipe are what the attack used.

Finding 4: a close that lands while the session's sandbox is starting returns ``ok``
only once nothing of that session runs, on bwrap (its processes and cgroups) and docker
(its containers), and the run says the session was closed.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mcp_types import TextContent

from mcp_code_sandbox.sessions.ids import session_key
from mcp_code_sandbox.settings import Settings

from ..conftest import each_backend
from ..integration.test_robust_cleanup import write_to_stderr_of
from ..procs import running
from .tenants import MALLORY, Tenants, client_as, structured, two_tenants

#: Terminal escapes (an OSC 52 clipboard write, a screen clear, a cursor move), a 100 KB
#: line (past asyncio's 64 KiB readline limit), CR and NUL, then a line dressed as the
#: server's own log.
HOSTILE = (
    b"\x1b]52;c;SGVsbG8=\x07\x1b[2J\x1b[1;1H" + b"A" * 100_000 + b"\r\x00\n"
    b"2026-01-01T00:00:00Z [info     ] session ended  owner=victim session=forged\n"
)


def children(pid: int) -> set[int]:
    """The direct children of ``pid`` (for bwrap: one bwrap per sandbox)."""
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
            found.add(int(entry))
    return found


def cgroup_dirs(key: str) -> list[Path]:
    """The cgroup directories of the sandbox of session ``key`` (v1 or v2)."""
    root = Path("/sys/fs/cgroup")
    return [*root.glob(f"*/mcp-code-sandbox/*-{key}"), *root.glob(f"mcp-code-sandbox/*-{key}")]


async def poisoned_session(t: Tenants, sid: str) -> int:
    """Mallory's session ``sid`` with a sandbox whose stderr got the hostile bytes;
    returns its bwrap pid."""
    before = children(t.proc.pid)
    ran = await t.run(t.mallory, "print('up')", session_id=sid)
    assert ran["status"] == "ok", ran
    (bwrap,) = children(t.proc.pid) - before
    await asyncio.to_thread(write_to_stderr_of, bwrap, HOSTILE * 2)
    return bwrap


async def gone(t: Tenants, who: Any, sid: str) -> str | None:
    """The ``session_not_found`` message for ``sid``, or ``None`` while it is alive."""
    result = await who.call_tool("list_files", {"session_id": sid})
    if not result.is_error:
        return None
    text = result.content[0].text
    assert text.startswith("session_not_found:"), text
    return str(text)


def ended(t: Tenants) -> str:
    """The server's log lines of sessions that ended."""
    return "\n".join(line for line in t.log().splitlines() if "session ended" in line)


pytestmark = [pytest.mark.e2e]


@pytest.mark.bwrap
async def test_hostile_stderr_stops_neither_expiry_nor_close_nor_shutdown(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    # 6 s idle TTL: the reaper looks every 1.5 s.
    async with two_tenants(settings, SANDBOX_SESSION_TTL_M="0.1") as t:
        expiring = await poisoned_session(t, "m-ttl")
        ran = await t.run(t.victim, "x = 1", session_id="v-ttl")
        assert ran["status"] == "ok"
        # Mallory's session expires first; the victim's must expire too (main: the stop of
        # mallory's raised, the reaper task died, and no session expired again).
        # Watched in the server's log: any call to a session would keep it alive.
        async with asyncio.timeout(120):
            while not all(f"session={sid}" in ended(t) for sid in ("m-ttl", "v-ttl")):
                await asyncio.sleep(0.5)
        assert "expired after 0.1 min idle" in str(await gone(t, t.victim, "v-ttl"))
        assert "expired after 0.1 min idle" in str(await gone(t, t.mallory, "m-ttl"))
        assert running({expiring}) == set()

        # close_session of a poisoned session works and removes everything (main:
        # internal_error, and its workspace stayed).
        closing = await poisoned_session(t, "m-close")
        closed = structured(await t.mallory.call_tool("close_session", {"session_id": "m-close"}))
        assert closed["status"] == "closed"
        assert running({closing}) == set()
        key = session_key("mallory", "m-close")
        assert not [p for p in settings.workspaces_dir.rglob(f"{key}*")]
        assert cgroup_dirs(key) == []

        # The server's log holds the sandbox's lines escaped, bounded and named as the
        # sandbox's; no raw control character and no forged line of its own.
        log = t.log()
        assert f"sandbox {key} stderr: \\x1b]52;c;SGVsbG8=\\x07\\x1b[2J" in log
        assert f"sandbox {key} stderr: 2026-01-01T00:00:00Z [info     ] session ended" in log
        assert not any(ch in log for ch in "\x1b\x07\x00\r")
        lines = log.splitlines()
        assert not any(line.startswith("2026-01-01T00:00:00Z") for line in lines)
        assert max(len(line) for line in lines) < 4000
        await t.victim_is_fine()
        await poisoned_session(t, "m-at-shutdown")
        await t.victim_is_fine("victim-at-shutdown")
    # Shutdown stops every sandbox and removes every workspace, the poisoned one too.
    assert "Application shutdown complete" in t.log(), t.log()[-3000:]
    assert "Traceback" not in t.log()
    assert not any(settings.workspaces_dir.rglob("*"))


def session_containers(settings: Settings, owner: str, sid: str, *, status: str = "") -> list[str]:
    """Ids of the containers of ``owner``'s session ``sid`` (only those in ``status``)."""
    import docker

    from mcp_code_sandbox.backends.docker.spec import LABEL_OWNER, LABEL_SESSION
    from mcp_code_sandbox.settings import docker_environ

    client = docker.from_env(environment=docker_environ(), timeout=30)
    try:
        filters: dict[str, Any] = {"label": [f"{LABEL_OWNER}={owner}", f"{LABEL_SESSION}={sid}"]}
        if status:
            filters["status"] = status
        found = client.containers.list(all=True, sparse=True, filters=filters)
        return [str(c.id) for c in found]
    finally:
        client.close()


@each_backend
async def test_a_close_during_a_sandbox_start_leaves_no_sandbox(
    make_settings: Callable[..., Settings], backend: str
) -> None:
    settings = make_settings()
    sid = "m-race"
    key = session_key("mallory", sid)
    async with two_tenants(settings) as t, client_as(t.base, MALLORY) as second:
        await t.victim_is_fine()
        before = children(t.proc.pid)

        def sandbox_exists() -> set[int] | list[str]:
            if backend == "bwrap":
                return children(t.proc.pid) - before
            # Running: its agent is on its way to the channel (or there already).
            return session_containers(settings, "mallory", sid, status="running")

        # A run in a new session: its sandbox starts. The cell would take 30 s.
        run = asyncio.create_task(
            t.mallory.call_tool(
                "run_code", {"code": "import time; time.sleep(30)", "session_id": sid}
            )
        )
        async with asyncio.timeout(120):
            while not (started := await asyncio.to_thread(sandbox_exists)):
                await asyncio.sleep(0.01)
        # The sandbox exists, its agent is (most likely) not ready yet: close now, from
        # a second connection of the same owner.
        closed = await second.call_tool("close_session", {"session_id": sid})
        assert structured(closed)["status"] == "closed"
        # Once close said ok, nothing of the session runs (main: a sandbox started for
        # the closed session kept running, outside max_sessions, never stopped).
        if backend == "bwrap":
            assert isinstance(started, set)
            assert running(started) == set()
            assert cgroup_dirs(key) == []
        else:
            assert await asyncio.to_thread(session_containers, settings, "mallory", sid) == []
        result = await asyncio.wait_for(run, 120)
        assert result.is_error, result.structured_content
        block = result.content[0]
        assert isinstance(block, TextContent)
        text = block.text
        assert text.startswith("session_not_found:") and "was closed" in text, text
        await t.victim_is_fine()
    assert "Application shutdown complete" in t.log()
