"""Server replicas on one (fake) Kubernetes cluster serve the same sessions.

Two real servers (``serve --transport http``, ``SANDBOX_BACKEND=kubernetes``), each with
a state directory of its own as the Deployment's pods have, against the fake API and
the fake kubelet (``tests/kube_api.py``, ``tests/kubelet.py``) that runs the real agent
in each pod; the official MCP client with two owners' tokens. A client sends its calls
to either replica, as a Service without affinity would: one session, its variables and
call order; another owner sees nothing of it through either; a replica killed with
SIGKILL loses no session.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from mcp import Client

from .kube_harness import ALICE, BOB, TOKENS, FakeCluster, Server, fake_cluster, scratch_dir
from .tenants import client_as, structured

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def servers() -> Iterator[tuple[Server, Server, FakeCluster]]:
    """Two replicas, each with a state directory of its own, on one fake cluster."""
    with fake_cluster() as cluster, scratch_dir() as state:
        env = {**cluster.server_env(), "SANDBOX_API_TOKENS": TOKENS, "SANDBOX_POOL_SIZE": "2"}
        with contextlib.ExitStack() as stack:
            a = stack.enter_context(Server(state, "a", env))
            b = stack.enter_context(Server(state, "b", env))
            yield a, b, cluster


async def run(client: Client, code: str, **args: Any) -> dict[str, Any]:
    return structured(await client.call_tool("run_code", {"code": code, **args}))


def claimed_pods(cluster: FakeCluster) -> list[str]:
    return [
        p["metadata"]["name"]
        for p in cluster.list()
        if p["metadata"].get("labels", {}).get("mcp-code-sandbox/pool") == "claimed"
    ]


async def test_either_replica_serves_one_session_in_order(
    servers: tuple[Server, Server, FakeCluster],
) -> None:
    a, b, cluster = servers
    async with client_as(a.base, ALICE) as via_a, client_as(b.base, ALICE) as via_b:
        first = await run(via_a, "calls = []", session_id="conv")
        assert first["session_created"]
        for i in range(50):
            out = await run(
                (via_a, via_b)[i % 2], f"calls.append({i}); len(calls)", session_id="conv"
            )
            assert out["result"] == str(i + 1) and not out.get("state_lost")
        assert (await run(via_b, "calls == list(range(50))", session_id="conv"))["result"] == "True"
    assert len(claimed_pods(cluster)) == 1


async def test_another_owner_sees_nothing_through_either(
    servers: tuple[Server, Server, FakeCluster],
) -> None:
    a, b, _ = servers
    async with client_as(a.base, ALICE) as alice, client_as(b.base, BOB) as bob_b:
        await run(alice, "secret = 'alice only'", session_id="conv")
        listed = structured(await bob_b.call_tool("list_sessions", {}))
        assert listed["sessions"] == []
        read = await bob_b.call_tool("read_file", {"session_id": "conv", "path": "x"})
        assert read.is_error and (read.meta or {}).get("error_code") == "session_not_found"
        mine = await run(bob_b, "'secret' in dir()", session_id="conv")
        assert mine["session_created"] and mine["result"] == "False"
        async with client_as(b.base, ALICE) as alice_b:
            listed = structured(await alice_b.call_tool("list_sessions", {}))
            assert [s["session_id"] for s in listed["sessions"]] == ["conv"]


async def test_a_replica_killed_loses_no_session(
    servers: tuple[Server, Server, FakeCluster],
) -> None:
    a, b, _ = servers
    async with client_as(a.base, ALICE) as via_a:
        await run(via_a, "x = 41", session_id="conv")
    a.kill()  # SIGKILL: no cleanup at all
    async with client_as(b.base, ALICE) as via_b:
        out = await run(via_b, "x + 1", session_id="conv")
    assert out["result"] == "42" and not out.get("state_lost") and not out["session_created"]
