"""Issue 27, findings 4, 5 and 7 (last bullet): the paused state, making room, and the
mounts of paused workspaces, attacked by one tenant (``mallory``) while another
(``victim``) works, over streamable HTTP with the official MCP client.

- Sparse files: Mallory's workspaces claim 100 GiB each and hold nothing; the paused-disk
  budget must count what is held, and when it is really over, Mallory (whose paused
  state is the largest) pays, never the victim.
- A slow pause: Mallory makes her own session's pause slow on purpose (a variable whose
  pickling waits for a gate the test opens) and then needs room for a new session; the
  victim's new session must be served while that pause is still under way.
- Mounts: a file call on a paused session (or one that never ran code) leaves no mount
  behind, and one owner holding its share of mounts open cannot take the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mcp_code_sandbox.settings import Settings

from ..conftest import each_backend, each_runtime
from .tenants import structured, two_tenants

pytestmark = [pytest.mark.e2e]

MIB = 1 << 20

REAL = """
import os
with open('real.bin', 'wb') as f:
    for _ in range({mib}):
        f.write(os.urandom(1 << 20))
kept = 'kept-{mib}'
"""

SPARSE = """
import os
# Each file as large as the sandbox may make one (RLIMIT_FSIZE: the quota), all holes.
for i in range(100):
    with open(f'holes{i}.bin', 'wb') as f:
        f.truncate((1 << 30) - 4096)
print(sum(os.stat(f'holes{i}.bin').st_size for i in range(100)) >> 30)
"""


async def sessions_of(client: Any) -> dict[str, dict[str, Any]]:
    listed = structured(await client.call_tool("list_sessions", {}))
    return {s["session_id"]: s for s in listed["sessions"]}


async def until(check: Callable[[], Any], what: str, limit_s: float = 180.0) -> None:
    """Poll ``check`` (a coroutine function) until it is true; the bound only ends a
    test that would otherwise wait for ever, it is not what the test asserts."""
    deadline = time.monotonic() + limit_s
    while not await check():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        await asyncio.sleep(0.25)


# Not under gVisor: there a pause is a memory checkpoint, whose size (counted by its
# blocks too) varies from run to run, so no budget set before the test fits it exactly.
@each_backend
async def test_sparse_files_cost_no_other_owner_its_paused_session(
    make_settings: Callable[..., Settings],
) -> None:
    # Every session is paused after 3 s idle; the budget holds the victim's 8 MiB and
    # Mallory's real bytes once, not twice.
    settings = make_settings()
    budget = str(48 * MIB)
    async with two_tenants(
        settings, SANDBOX_PAUSE_AFTER_M="0.05", SANDBOX_PAUSED_DISK_BYTES=budget
    ) as t:
        await t.run(t.victim, REAL.format(mib=8), session_id="victim-work")  # idlest
        await t.run(t.mallory, REAL.format(mib=24), session_id="mallory-real")
        sparse = await t.run(t.mallory, SPARSE, session_id="mallory-sparse")
        assert sparse["stdout"] == "99\n", sparse["error"]

        async def mallorys_paused() -> bool:
            states = {sid: s["state"] for sid, s in (await sessions_of(t.mallory)).items()}
            return states == {"mallory-real": "paused", "mallory-sparse": "paused"}

        await until(mallorys_paused, "Mallory's two sessions to be paused")
        # Over the budget for real now: Mallory's longest idle goes, nobody else's.
        await t.run(t.mallory, REAL.format(mib=24), session_id="mallory-more")

        async def mallory_paid() -> bool:
            return "mallory-real" not in await sessions_of(t.mallory)

        await until(mallory_paid, "Mallory's longest-idle paused session to expire")
        mine, theirs = await sessions_of(t.mallory), await sessions_of(t.victim)
        assert set(theirs) == {"victim-work"}, "the victim's paused session was expired"
        assert "mallory-sparse" in mine, "100 GiB of holes were counted as disk"
        back = await t.run(
            t.victim, "print(kept, os.path.getsize('real.bin'))", session_id="victim-work"
        )
        assert back["stdout"] == f"kept-8 {8 * MIB}\n", back
        await t.victim_is_fine()


GATED = """
import os, time
class Gated:
    def __reduce__(self):
        if os.path.exists('/mnt/data/armed'):
            open('/mnt/data/pausing', 'w').close()
            while not os.path.exists('/mnt/data/open'):
                time.sleep(0.05)
        return (Gated, ())
gated = Gated()
"""


def gate_dir(settings: Settings) -> Path:
    """The workspace (on the host) whose pause is waiting at the gate."""
    found = list(settings.workspaces_dir.glob("*/pausing"))
    assert len(found) <= 1, found
    return found[0].parent if found else Path()


@each_runtime
async def test_a_slow_pause_of_one_owner_never_stalls_another(
    make_settings: Callable[..., Settings],
) -> None:
    # Two running sessions, one each: Mallory's next new session needs her idle one
    # paused. No pause happens on its own (60 min idle), only to make room.
    settings = make_settings()
    async with two_tenants(settings, SANDBOX_MAX_SESSIONS="2", SANDBOX_PAUSE_AFTER_M="60") as t:
        await t.run(t.mallory, GATED, session_id="mallory-slow")
        # Paused once and resumed, so that even where memory is checkpointed the next
        # pause saves variables (a restored gVisor sandbox is never checkpointed again).
        await t.run(t.mallory, "1", session_id="mallory-other")
        await t.run(t.mallory, GATED + "open('armed', 'w').close()", session_id="mallory-slow")

        mallory_new = asyncio.create_task(t.run(t.mallory, "print('m')", session_id="m-new"))

        async def at_the_gate() -> bool:
            return gate_dir(settings) != Path()

        await until(at_the_gate, "Mallory's pause to reach its gate")
        victim_new = await t.run(t.victim, "print('v')", session_id="v-new")
        assert victim_new["stdout"] == "v\n"
        # Served while Mallory's pause still waits at its gate (a finished pause, or one
        # given up, unmounts her workspace, and the gate with it).
        assert gate_dir(settings) != Path(), "the victim waited for Mallory's pause"
        assert not mallory_new.done()
        (gate_dir(settings) / "open").touch()
        assert (await mallory_new)["stdout"] == "m\n"
        back = await t.run(t.mallory, "type(gated).__name__", session_id="mallory-slow")
        assert back["result"] == "'Gated'", back


def workspace_mounts(settings: Settings) -> int:
    below = f"{settings.workspaces_dir}/"
    with open("/proc/self/mountinfo") as info:
        return sum(1 for line in info if line.split()[4].startswith(below))


@contextlib.contextmanager
def held_open(url: str) -> Iterator[None]:
    """A download started and never read: the server keeps the file open."""
    with httpx.stream("GET", url, timeout=30) as response:
        assert response.status_code == 200
        yield


@each_runtime
async def test_file_calls_leave_no_mounts_and_one_owner_takes_only_its_share(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    limits = {"SANDBOX_MAX_SESSIONS": "4", "SANDBOX_PAUSE_AFTER_M": "60"}
    async with two_tenants(settings, SANDBOX_EXEC_TIMEOUT_S="5", **limits) as t:
        # 1. Uploads into new sessions (no code runs), then reads of them: every call
        #    lets its mount go before it returns.
        for i in range(6):
            args = {"filename": "f.txt", "content_text": "x", "session_id": f"up{i}"}
            structured(await t.mallory.call_tool("upload_file", args))
            structured(
                await t.mallory.call_tool("read_file", {"session_id": "up0", "path": "f.txt"})
            )
            assert workspace_mounts(settings) == 0, f"mounts left after upload {i}"
        uploaded = await sessions_of(t.mallory)  # its files, as noted at the unmount
        assert uploaded["up5"]["file_count"] == 1 and uploaded["up5"]["workspace_bytes"] == 1

        # 2. Mallory holds downloads open on two paused sessions, her share of the
        #    mounts of sessions without a sandbox; her third file call waits and is
        #    refused, the victim's are served.
        await t.run(t.victim, "x = 1", session_id="victim-paused")
        await t.run(t.victim, "1", session_id="victim-a")
        await t.run(t.victim, "1", session_id="victim-b")  # pauses victim-paused
        links = []
        for i in range(2):
            made = await t.run(
                t.mallory, "open('big.bin', 'wb').truncate(512 << 20)", session_id=f"held{i}"
            )
            links.append(made["files"][0]["download_url"])
        await t.run(t.mallory, "1", session_id="m-running")  # pauses held0
        await t.run(t.mallory, "1", session_id="m-running2")  # pauses held1
        with held_open(links[0]), held_open(links[1]):
            assert workspace_mounts(settings) == 4 + 2  # four running, two held open
            refused = await t.mallory.call_tool("list_files", {"session_id": "up1"})
            assert refused.is_error and "session_busy" in str(refused.content), refused
            listed = await t.victim.call_tool("list_files", {"session_id": "victim-paused"})
            assert isinstance(structured(listed)["entries"], list)
            assert workspace_mounts(settings) == 4 + 2  # the victim's let go already
