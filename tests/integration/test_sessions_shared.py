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

from mcp_code_sandbox.backends.kubernetes.spec import LABEL_KEY, LABEL_POOL
from mcp_code_sandbox.errors import SessionNotFound
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService
from tests.fakes import fake_settings
from tests.kube_cluster import Cluster, cluster

__all__ = ["cluster"]  # the fixture

pytestmark = pytest.mark.timeout(300)


@asynccontextmanager
async def server(
    cluster: Cluster,
    state_dir: Path,
    name: str,
    *,
    storage_class: str | None = None,
    **settings: Any,
) -> AsyncIterator[SandboxService]:
    """A server (its own state directory, as a pod of the Deployment has) on the cluster;
    ``storage_class``: sessions' workspaces are claims of it, so sessions pause."""
    backend = cluster.backend(pool_size=2, instance=name, storage_class=storage_class)
    service = SandboxService(fake_settings(state_dir / name, **settings), backend)
    await service.start()
    try:
        yield service
    finally:
        await service.aclose()


@asynccontextmanager
async def two_servers(
    cluster: Cluster, state_dir: Path, *, storage_class: str | None = None
) -> AsyncIterator[tuple[SandboxService, SandboxService]]:
    """Servers ``a`` and ``b`` on the cluster (see :func:`server`)."""
    async with (
        server(cluster, state_dir, "a", storage_class=storage_class) as a,
        server(cluster, state_dir, "b", storage_class=storage_class) as b,
    ):
        yield a, b


async def run(service: SandboxService, code: str, sid: str, owner: str = "alice") -> Any:
    return await service.run_code(owner, RunRequest(code), sid)


async def test_two_servers_serve_one_session_alternately_in_order(
    cluster: Cluster, tmp_path: Path
) -> None:
    async with two_servers(cluster, tmp_path) as (a, b):
        first = await run(a, "calls = []", "conv")
        assert first.session_created
        for i in range(50):
            result = await run((b, a)[i % 2], f"calls.append({i}); len(calls)", "conv")
            assert not result.state_lost and not result.session_created
            assert result.result == str(i + 1)
        last = await run(b, "calls == list(range(50))", "conv")
        assert last.result == "True"
        assert await claimed_pods(cluster) == 1  # one session, one pod, whoever served it


async def test_another_owner_cannot_see_or_drive_it_through_either(
    cluster: Cluster, tmp_path: Path
) -> None:
    async with two_servers(cluster, tmp_path) as (a, b):
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
    quick: dict[str, Any] = {"session_ttl_m": 0.05}  # 3 s: a pass every 0.75 s
    async with server(cluster, tmp_path, "a", **quick) as a, server(cluster, tmp_path, "b") as b:
        await run(a, "kept = 'yes'", "conv")
        await run(b, "kept", "conv")  # the agent serves b now
        await asyncio.sleep(6)  # past a's TTL, a few reaper passes
        assert a.sessions.count() == 0  # a let it go
        result = await run(b, "kept", "conv")
        assert result.result == "'yes'" and not result.state_lost


async def claimed_pods(cluster: Cluster) -> int:
    pools = [(p.metadata.labels or {}).get(LABEL_POOL) for p in await cluster.pods() if p.metadata]
    return pools.count("claimed")


async def test_a_paused_session_is_resumed_by_either_server_with_its_variables_and_files(
    cluster: Cluster, tmp_path: Path
) -> None:
    async with two_servers(cluster, tmp_path, storage_class="standard") as (a, b):
        await run(a, "x = 41\nopen('notes.txt', 'w').write('kept')", "conv")
        paused = await a.sessions.pause("alice", "conv")
        assert paused is not None and paused.kind == "variables"
        assert await claimed_pods(cluster) == 0  # its memory is free: no pod runs it
        for service in (a, b):  # the cluster holds it, so every server lists it
            [listed] = await service.list_sessions("alice")
            assert (listed.session_id, listed.state) == ("conv", "paused")
            assert listed.saved_variables is not None and ("x", "int") in listed.saved_variables
            assert await service.list_sessions("bob") == []
        same = await run(a, "x + 1", "conv")  # resumed where it was paused
        assert same.result == "42" and same.resumed == "variables" and not same.session_created
        await a.sessions.pause("alice", "conv")
        other = await run(b, "x += 1\nx, open('notes.txt').read()", "conv")  # by the other
        assert other.result == "(42, 'kept')" and other.resumed == "variables"
        assert not other.session_created
        assert await claimed_pods(cluster) == 1
        await b.sessions.pause("alice", "conv")
        await a.close_session("alice", "conv")  # paused: whichever server is asked
        assert await claimed_pods(cluster) == 0
        keys = [
            (c.metadata.labels or {}).get(LABEL_KEY) for c in await cluster.claims() if c.metadata
        ]
        assert "alice-conv" not in keys  # its workspace is gone with it
        for service in (a, b):
            assert await service.list_sessions("alice") == []
            with pytest.raises(SessionNotFound):
                await service.read_file("alice", "conv", "notes.txt", offset=0, max_bytes=None)
        await run(b, "print(1)", "brief")
        await b.close_session("alice", "brief")  # running: its pod's workspace goes too
        async with asyncio.timeout(20):  # (the pool's refill makes a claim, then its pod)
            while set(await claim_names(cluster)) - set(await pod_claims(cluster)):
                await asyncio.sleep(0.1)


async def claim_names(cluster: Cluster) -> list[str]:
    return [c.metadata.name for c in await cluster.claims() if c.metadata and c.metadata.name]


async def pod_claims(cluster: Cluster) -> list[str]:
    """The claims that pods' workspaces are on."""
    return [
        volume.persistentVolumeClaim.claimName
        for pod in await cluster.pods()
        for volume in (pod.spec.volumes or [] if pod.spec else [])
        if volume.persistentVolumeClaim is not None
    ]


async def test_two_servers_resuming_one_paused_session_at_once_start_one_pod(
    cluster: Cluster, tmp_path: Path
) -> None:
    async with two_servers(cluster, tmp_path, storage_class="standard") as (a, b):
        await run(a, "calls = []", "conv")
        await a.sessions.pause("alice", "conv")
        both = await asyncio.gather(
            run(a, "calls.append('a')", "conv"),
            run(b, "calls.append('b')", "conv"),
            return_exceptions=True,
        )
        assert any(not isinstance(outcome, BaseException) for outcome in both)
        assert await claimed_pods(cluster) == 1  # never two pods on one workspace
        for service in (a, b):  # either server goes on with the one interpreter
            result = await run(service, "len(calls)", "conv")
            assert not result.session_created and not result.state_lost
        last = await run(a, "set(calls) <= {'a', 'b'} and len(calls)", "conv")
        ok = [o for o in both if not isinstance(o, BaseException)]
        assert last.result == str(len(ok))


async def test_either_server_closes_a_session_the_other_serves(
    cluster: Cluster, tmp_path: Path
) -> None:
    async with two_servers(cluster, tmp_path) as (a, b):
        await run(a, "x = 1", "conv")
        await b.close_session("alice", "conv")
        assert await claimed_pods(cluster) == 0  # its pod is gone
        again = await run(a, "'x' in dir()", "conv")
        assert again.result == "False"  # a fresh session of that name, not the closed one
