"""The kubernetes backend against the fake cluster: the fake API (``tests/kube_api.py``)
and the fake kubelet (``tests/kubelet.py``) running the real agent in each pod, reached
over the real TLS channel. What a user sees: a session's code runs in a pod claimed from
the warm pool in at most three API writes, replicas never claim one pod twice, a pod
deleted behind the server's back fails the next run at once, and a closed session's pod
is gone. With a StorageClass: a stopped pod's workspace outlives it and a pod started
for its session finds its files, a claim still costs at most three writes, and the pool
deletes the workspaces of expired sessions and orphans, never a warm pod's."""

from __future__ import annotations

import asyncio

import pytest
from lightkube.resources.core_v1 import Pod

from mcp_code_sandbox.backends.kubernetes import pool
from mcp_code_sandbox.backends.kubernetes.backend import KubernetesBackend
from mcp_code_sandbox.backends.kubernetes.pods import claim_of
from mcp_code_sandbox.backends.kubernetes.spec import (
    LABEL_KEY,
    LABEL_POOL,
    workspace_claim,
)
from mcp_code_sandbox.errors import SandboxFailed
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.executor import Cell
from tests.kube_cluster import Cluster, cluster

__all__ = ["cluster"]  # the fixture

pytestmark = pytest.mark.timeout(180)

#: How long the tests wait for the pool to fill: pods start real agents.
FILL_WAIT_S = 90.0


async def filled(backend: KubernetesBackend, size: int) -> None:
    """Until ``size`` warm pods are ready to be claimed."""
    async with asyncio.timeout(FILL_WAIT_S):
        while len(backend.watch.claimable()) < size:
            await asyncio.sleep(0.05)


async def run(agent: AgentClient, code: str) -> str:
    out: list[str] = []

    outcome = await agent.execute(Cell("python", code, 30), lambda _, text: out.append(text))
    assert outcome.error is None, outcome.error
    return "".join(out) + (outcome.result or "")


async def test_a_session_runs_in_a_warm_pod_claimed_in_at_most_three_writes(
    cluster: Cluster,
) -> None:
    backend = cluster.backend(pool_size=2, instance="replica-a")
    try:
        await backend.check_ready()
        await filled(backend, 2)
        before = cluster.api.writes("pods")
        sandbox = await backend.create(cluster.spec("one"))
        await filled(backend, 2)  # the refill after the claim
        assert cluster.api.writes("pods") - before <= 3
        agent = AgentClient(sandbox.channel)
        assert (await run(agent, "x = 6 * 7\nprint(x)")).strip() == "42"
        assert (await run(agent, "print(x + 1)")).strip() == "43"  # the same interpreter
        [mine] = [
            p for p in await cluster.pods() if p.metadata and p.metadata.name == sandbox.backend_id
        ]
        assert mine.metadata is not None and mine.metadata.labels is not None
        assert mine.metadata.labels[LABEL_POOL] == "claimed"
        assert mine.metadata.labels[LABEL_KEY] == "alice-one"
        await backend.stop(sandbox)
        names = {p.metadata.name for p in await cluster.pods() if p.metadata}
        assert sandbox.backend_id not in names
    finally:
        await backend.aclose()


async def test_without_a_pool_a_session_gets_a_pod_of_its_own(cluster: Cluster) -> None:
    backend = cluster.backend(pool_size=0, instance="replica-a")
    try:
        sandbox = await backend.create(cluster.spec("cold"))
        agent = AgentClient(sandbox.channel)
        assert (await run(agent, "print('cold')")).strip() == "cold"
        await backend.stop(sandbox)
    finally:
        await backend.aclose()


async def test_two_replicas_never_claim_one_pod_twice(cluster: Cluster) -> None:
    a = cluster.backend(pool_size=6, instance="replica-a")
    b = cluster.backend(pool_size=6, instance="replica-b")
    try:
        await a.check_ready()
        await b.check_ready()
        await filled(a, 6)
        await filled(b, 6)
        specs = [cluster.spec(f"s{i}") for i in range(8)]
        made = await asyncio.gather(
            *((a if i % 2 else b).create(spec) for i, spec in enumerate(specs))
        )
        pods = [s.backend_id for s in made]
        assert len(set(pods)) == len(pods)  # every session a pod of its own
        claimed = {
            p.metadata.name: (p.metadata.labels or {}).get(LABEL_KEY, "")
            for p in await cluster.pods()
            if p.metadata and p.metadata.name in pods
        }
        assert sorted(claimed.values()) == sorted(s.key for s in specs)
        for sandbox in made:
            assert (await run(AgentClient(sandbox.channel), "print(1)")).strip() == "1"
        for sandbox in made:
            await (a if sandbox in made[1::2] else b).stop(sandbox)
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_pod_deleted_behind_the_servers_back_fails_the_next_run(
    cluster: Cluster,
) -> None:
    backend = cluster.backend(pool_size=0, instance="replica-a")
    try:
        sandbox = await backend.create(cluster.spec("doomed"))
        agent = AgentClient(sandbox.channel)
        assert (await run(agent, "print(1)")).strip() == "1"
        await cluster.kube.delete(Pod, sandbox.backend_id)
        async with asyncio.timeout(30):
            while sandbox.is_alive():
                await asyncio.sleep(0.05)
        with pytest.raises(SandboxFailed):
            async with asyncio.timeout(30):  # never a hang
                await run(agent, "print(2)")
    finally:
        await backend.aclose()


async def test_with_a_storage_class_a_stopped_pods_workspace_outlives_it(
    cluster: Cluster,
) -> None:
    backend = cluster.backend(pool_size=2, instance="replica-a", storage_class="standard")
    try:
        await backend.check_ready()
        await filled(backend, 2)
        before = cluster.api.writes("pods") + cluster.api.writes("persistentvolumeclaims")
        spec = cluster.spec("kept")
        sandbox = await backend.create(spec)
        await filled(backend, 2)  # the refill after the claim: a claim and a pod
        after = cluster.api.writes("pods") + cluster.api.writes("persistentvolumeclaims")
        assert after - before <= 3
        agent = AgentClient(sandbox.channel)
        await run(agent, "open('notes.txt', 'w').write('kept')")
        await backend.stop(sandbox)  # a pause's stop: the pod goes, its workspace stays
        assert sandbox.backend_id not in {
            p.metadata.name for p in await cluster.pods() if p.metadata
        }
        found = await backend.find(spec.key)
        assert found is not None and not found.running and found.paused == {}
        assert (found.owner, found.session_id) == ("alice", "kept")
        again = await backend.create(spec)  # a resume: a pod on the same workspace
        assert again.backend_id != sandbox.backend_id
        assert (
            await run(AgentClient(again.channel), "print(open('notes.txt').read())")
        ).strip() == "kept"
        found = await backend.find(spec.key)
        assert found is not None and found.running  # not paused while a pod runs on it
        await backend.stop(again)
        await backend.forget(spec.key)  # the session ended
        keys = [
            (c.metadata.labels or {}).get(LABEL_KEY) for c in await cluster.claims() if c.metadata
        ]
        assert spec.key not in keys
        assert await backend.find(spec.key) is None
    finally:
        await backend.aclose()


async def test_the_pool_deletes_expired_paused_workspaces_and_orphans_not_warm_ones(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past its idle TTL at once: no grace for a lagging activity note, none for a claim
    # whose pod is still to be made.
    monkeypatch.setattr(pool, "_IDLE_GRACE_S", 0.0)
    monkeypatch.setattr(pool, "_ORPHAN_S", 0.0)
    backend = cluster.backend(pool_size=1, instance="replica-a", idle_s=1, storage_class="std")
    try:
        await backend.check_ready()
        await filled(backend, 1)
        sandbox = await backend.create(cluster.spec("idle"))
        await backend.stop(sandbox)  # paused: its claim is its record
        settings = cluster.settings.model_copy(update={"kubernetes_storage_class": "std"})
        orphan = workspace_claim("mcp-sandbox-orphan", None, settings)
        await cluster.kube.create(claim_of(orphan, settings.kubernetes_namespace))

        async def claims() -> dict[str, str | None]:
            """Every claim's name and session key."""
            return {
                c.metadata.name: (c.metadata.labels or {}).get(LABEL_KEY)
                for c in await cluster.claims()
                if c.metadata and c.metadata.name
            }

        async with asyncio.timeout(30):
            while "mcp-sandbox-orphan" in (now := await claims()) or "alice-idle" in now.values():
                await asyncio.sleep(0.2)
        await filled(backend, 1)
        warm = {view.name for view in backend.watch.claimable()}
        assert warm and warm <= set(await claims())  # every warm pod keeps its own
        assert await backend.find("alice-idle") is None
    finally:
        await backend.aclose()


async def test_a_burst_of_claims_on_one_replica_patches_each_pod_once(cluster: Cluster) -> None:
    backend = cluster.backend(pool_size=8, instance="replica-a")
    try:
        await backend.check_ready()
        await filled(backend, 8)
        before = cluster.api.counts[("patch", "pods")]
        made = await asyncio.gather(*(backend.create(cluster.spec(f"b{i}")) for i in range(8)))
        assert len({s.backend_id for s in made}) == 8
        # One claim write per session: no claim lost a race to another of its replica's.
        assert cluster.api.counts[("patch", "pods")] - before == 8
        for sandbox in made:
            await backend.stop(sandbox)
    finally:
        await backend.aclose()
