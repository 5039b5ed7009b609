"""Per-session host uids with real sandboxes: each session's sandbox and files have a host
uid of their own, given back when the session ends; an exhausted pool is ``max_sessions``.

Runs as root only (as CI does): without it no backend can use per-session uids."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.errors import MaxSessions
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.sessions.uids import uid_pool
from mcp_code_sandbox.settings import Settings

from ..conftest import MakeService, each_backend

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="per-session uids need root")


async def run(service: Any, code: str, sid: str) -> Any:
    return await service.run_code("local", RunRequest(code), sid)


@each_backend
async def test_each_session_runs_and_owns_its_files_as_its_own_uid(
    make_service: MakeService,
) -> None:
    async with make_service() as service:
        await run(service, "open('made.txt', 'w').write('x')", "one")
        await run(service, "open('made.txt', 'w').write('y')", "two")
        await service.upload_file("local", "up.txt", b"z", session_id="two", overwrite=False)
        one, two = (service.sessions.table.get("local", sid) for sid in ("one", "two"))
        assert one.uid is not None and two.uid is not None and one.uid != two.uid
        settings = service.settings
        assert settings.uid_range_start <= one.uid < settings.uid_range_start + 65536
        for session in (one, two):
            root = session.workspace.root
            assert root.stat().st_uid == session.uid  # what the server made
            assert (root / "made.txt").stat().st_uid == session.uid  # what the sandbox made
        assert (two.workspace.root / "up.txt").stat().st_uid == two.uid
        uid = one.uid
        await service.close_session("local", "one")
        # Given back once the session ended: nothing reserves it any more.
        lease = uid_pool(settings).reclaim(uid, "/test/reclaims/it.json")
        assert lease is not None
        lease.release()


@pytest.mark.bwrap
async def test_a_pool_used_up_by_other_servers_is_max_sessions(
    make_service: MakeService, make_settings: Callable[..., Settings], state_dir: Path
) -> None:
    private = {
        "uid_lease_dir": str(state_dir / "uids"),
        "uid_range_start": 0x7000_0000 + 60_000,
        "uid_range_size": 2,
        "max_sessions": 2,
        "max_paused_sessions": 0,
    }
    other_server = uid_pool(make_settings(**private)).lease("/another/server.json")
    try:
        async with make_service(**private) as service:
            await run(service, "1", "first")
            with pytest.raises(MaxSessions, match="sandbox uid"):
                await run(service, "1", "second")
            assert service.sessions.count() == 1
            assert len(list(service.settings.sessions_dir.glob("*.json"))) == 1
            await service.close_session("local", "first")
            await run(service, "1", "second")  # its uid came back
    finally:
        other_server.release()
