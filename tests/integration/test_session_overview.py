"""What the operator's page reads of live sessions (``SandboxService.session_overview``),
on each backend with real sandboxes: state, memory and CPU from the backend
(``Backend.usage``: bwrap's cgroup, Docker's stats), workspace size, owners kept apart,
and the recent-runs ring fed by the run path."""

from __future__ import annotations

import pytest

from mcp_code_sandbox.backends.bwrap.backend import BwrapBackend
from mcp_code_sandbox.errors import SessionBusy
from mcp_code_sandbox.run.request import RunRequest

from ..conftest import MakeService, each_backend

pytestmark = each_backend

HOLD_MEMORY = (
    "block = bytearray(80 * 1024 * 1024); sum(range(3_000_000)); open('f', 'w').write('x' * 30000)"
)


async def test_figures_of_live_sessions(make_service: MakeService) -> None:
    async with make_service() as svc:
        await svc.run_code("alice", RunRequest(HOLD_MEMORY), "a1")
        await svc.upload_file("bob", "in.txt", b"hello", session_id="b1", overwrite=False)

        [a1, b1] = await svc.session_overview(None)
        assert (a1.owner, a1.session_id, a1.state, a1.runs) == ("alice", "a1", "running", 1)
        assert (b1.owner, b1.session_id, b1.state, b1.runs) == ("bob", "b1", "no sandbox", 0)
        assert a1.workspace_bytes is not None and a1.workspace_bytes >= 30000
        assert b1.workspace_bytes == 5
        assert b1.memory_bytes is None and b1.cpu_seconds is None  # no sandbox: unknown
        knows_memory = not isinstance(svc.backend, BwrapBackend) or (
            "memory" in svc.backend.cgroups.enforceable
        )
        if knows_memory:
            assert a1.memory_bytes is not None and a1.memory_bytes > 60 * 1024**2
        if a1.cpu_seconds is not None or not isinstance(svc.backend, BwrapBackend):
            assert a1.cpu_seconds is not None and a1.cpu_seconds > 0.05
        assert 0 <= a1.idle_s <= a1.age_s

        assert [v.session_id for v in await svc.session_overview("bob")] == ["b1"]
        assert await svc.session_overview("mallory") == []


async def test_recent_runs_record_results_and_failures(make_service: MakeService) -> None:
    async with make_service() as svc:
        await svc.run_code("alice", RunRequest("1/0"), "a1")
        with pytest.raises(SessionBusy):
            async with svc.sessions.acquire("alice", "a1", create=False, wait_s=1):
                await svc.run_code("alice", RunRequest("1", timeout_s=0.5), "a1")
        [busy, failed] = svc.recent_runs.listed("alice")
        assert (failed.status, failed.error, failed.language) == (
            "error",
            "ZeroDivisionError",
            "python",
        )
        assert (busy.status, busy.error, busy.session_id) == ("failed", "session_busy", "a1")
        assert svc.recent_runs.listed("bob") == []
