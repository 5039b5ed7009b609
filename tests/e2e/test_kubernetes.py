"""The real server on the kubernetes backend (``SANDBOX_BACKEND=kubernetes``), driven by the
official MCP client over streamable HTTP, against the fake cluster: the fake API
(``tests/kube_api.py``) and the fake kubelet (``tests/kubelet.py``, the real agent in each
pod on a 127/8 address) from threads of this process, the certificates from
``mcp-code-sandbox kubernetes certs``, two API tokens. One cluster and one server (a warm
pool of two) for the module; each test its own sessions.

What a user sees: runs, variables, and the workspace that lives in the pod; a closed
session's pod gone; a pod deleted behind the server's back costing the session its
state (``state_lost``), never a hang; an agent that gives a plain TCP peer nothing; each
owner's sessions their own; the pool full again after claims. ``test_kubernetes_cluster.py``
makes the same checks against a real cluster."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from mcp import Client

from .conftest import held
from .kube_harness import (
    ALICE,
    BOB,
    TOKENS,
    FakeCluster,
    Server,
    check_a_lost_pod_loses_state_not_the_session,
    check_close_deletes_the_pod,
    check_plain_tcp_gets_no_frame,
    check_runs_files_and_variables,
    check_sessions_are_their_owners,
    check_the_pool_refills,
    fake_cluster,
    scratch_dir,
)
from .tenants import client_as

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

POOL_SIZE = 2


@pytest.fixture(scope="module")
def cluster() -> Iterator[FakeCluster]:
    with fake_cluster() as made:
        yield made


@pytest.fixture(scope="module")
def server(cluster: FakeCluster) -> Iterator[Server]:
    env = {
        **cluster.server_env(),
        "SANDBOX_API_TOKENS": TOKENS,
        "SANDBOX_POOL_SIZE": str(POOL_SIZE),
    }
    with scratch_dir() as state, Server(state, "server", env) as started:
        yield started


@pytest.fixture
async def alice(server: Server) -> AsyncIterator[Client]:
    async with held(lambda: client_as(server.base, ALICE)) as client:
        yield client


async def test_code_variables_and_the_workspace_in_the_pod(alice: Client) -> None:
    await check_runs_files_and_variables(alice)


async def test_closing_a_session_deletes_its_pod(alice: Client, cluster: FakeCluster) -> None:
    await check_close_deletes_the_pod(alice, cluster)


async def test_a_pod_deleted_behind_the_servers_back_is_state_lost(
    alice: Client, cluster: FakeCluster
) -> None:
    await check_a_lost_pod_loses_state_not_the_session(alice, cluster)


async def test_a_plain_tcp_peer_gets_nothing_from_an_agent(
    alice: Client, cluster: FakeCluster
) -> None:
    await check_plain_tcp_gets_no_frame(alice, cluster)


async def test_an_owner_sees_only_their_sessions(alice: Client, server: Server) -> None:
    async with client_as(server.base, BOB) as bob:
        await check_sessions_are_their_owners(alice, bob)


async def test_the_warm_pool_fills_at_start_and_refills_after_claims() -> None:
    """On a cluster and server of its own: the pool fills before the server's first call."""
    with fake_cluster() as cluster:
        env = {**cluster.server_env(), "SANDBOX_API_TOKENS": TOKENS, "SANDBOX_POOL_SIZE": "2"}
        with scratch_dir() as state, Server(state, "server", env) as server:
            async with client_as(server.base, ALICE) as alice:
                await check_the_pool_refills(alice, cluster, POOL_SIZE)
