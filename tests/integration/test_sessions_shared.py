"""Two servers on one (fake) cluster serve the same sessions (``sessions/shared.py``): a
session's pod is its record, any server adopts it at a call, and none ends a session
another one serves. The real agent runs in each pod (``tests/kube_cluster.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.backends.kubernetes.spec import LABEL_POOL
from mcp_code_sandbox.errors import SessionNotFound
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService
from tests.fakes import fake_settings
from tests.kube_cluster import Cluster, cluster

__all__ = ["cluster"]  # the fixture

pytestmark = pytest.mark.timeout(300)


@asynccontextmanager
async def server(
    cluster: Cluster, state_dir: Path, name: str, **settings: Any
) -> AsyncIterator[SandboxService]:
    """A server (its own state directory, as a pod of the Deployment has) on the cluster."""
    backend = cluster.backend(pool_size=2, instance=name)
    service = SandboxService(fake_settings(state_dir / name, **settings), backend)
    await service.start()
    try:
        yield service
    finally:
        await service.aclose()


async def run(service: SandboxService, code: str, sid: str, owner: str = "alice") -> Any:
    return await service.run_code(owner, RunRequest(code), sid)


async def test_two_servers_serve_one_session_alternately_in_order(
    cluster: Cluster, tmp_path: Path
) -> None:
    async with server(cluster, tmp_path, "a") as a, server(cluster, tmp_path, "b") as b:
        first = await run(a, "calls = []", "conv")
        assert first.session_created
        for i in range(50):
            result = await run((b, a)[i % 2], f"calls.append({i}); len(calls)", "conv")
            assert not result.state_lost and not result.session_created
            assert result.result == str(i + 1)
        last = await run(b, "calls == list(range(50))", "conv")
        assert last.result == "True"
        pools = [
            (p.metadata.labels or {}).get(LABEL_POOL) for p in await cluster.pods() if p.metadata
        ]
        assert pools.count("claimed") == 1  # one session, one pod, whoever served it


async def test_another_owner_cannot_see_or_drive_it_through_either(
    cluster: Cluster, tmp_path: Path
) -> None:
    async with server(cluster, tmp_path, "a") as a, server(cluster, tmp_path, "b") as b:
        await run(a, "open('secret.txt', 'w').write('alice only')\nmine = 1", "conv")
        for service in (a, b):
            assert [s.session_id for s in await service.list_sessions("alice")] == ["conv"]
            assert await service.list_sessions("bob") == []
            with pytest.raises(SessionNotFound):
                await service.read_file("bob", "conv", "secret.txt", offset=0, max_bytes=None)
            with pytest.raises(SessionNotFound):
                await service.close_session("bob", "conv")
        bobs = await run(b, "import os; print(os.listdir('.'), 'mine' in dir())", "conv", "bob")
        assert bobs.session_created  # bob's own session of that name: empty
        assert bobs.stdout == "[] False\n"
        again = await run(b, "mine", "conv")  # alice's, untouched
        assert again.result == "1"


async def test_a_server_shutting_down_leaves_its_sessions_to_the_other(
    cluster: Cluster, tmp_path: Path
) -> None:
    async with server(cluster, tmp_path, "b") as b:
        async with server(cluster, tmp_path, "a") as a:
            await run(a, "x = 41", "conv")
        # a stopped (a rolling restart): the session runs on, in its pod
        result = await run(b, "x + 1", "conv")
        assert result.result == "42" and not result.state_lost and not result.session_created


async def test_a_session_idle_here_but_served_elsewhere_is_let_go_not_ended(
    cluster: Cluster, tmp_path: Path
) -> None:
    # a's reaper finds the session idle within seconds; b served it meanwhile
    quick = {"session_ttl_m": 0.05}  # 3 s: a pass every 0.75 s
    async with server(cluster, tmp_path, "a", **quick) as a, server(cluster, tmp_path, "b") as b:
        await run(a, "kept = 'yes'", "conv")
        await run(b, "kept", "conv")  # the agent serves b now
        await asyncio.sleep(6)  # past a's TTL, a few reaper passes
        assert a.sessions.count() == 0  # a let it go
        result = await run(b, "kept", "conv")
        assert result.result == "'yes'" and not result.state_lost
