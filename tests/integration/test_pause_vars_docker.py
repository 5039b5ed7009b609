"""The variables pause and ``park`` in Docker containers (runc), through the real agent of
the image named by ``SANDBOX_IMAGE`` (built from this tree: it needs cloudpickle).

Skipped with the reason when no engine answers; failing when ``SANDBOX_REQUIRE_DOCKER=1``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from mcp_code_sandbox.backends.base import Leftover, Limits, SandboxSpec
from mcp_code_sandbox.backends.docker.backend import DockerBackend, DockerSandbox
from mcp_code_sandbox.errors import SandboxFailed
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.executor import Cell

from ..conftest import sandbox_owner
from .test_docker_backend import backend as backend
from .test_docker_backend import settings as settings

pytestmark = pytest.mark.docker

LIMITS = Limits(memory_bytes=768 << 20, cpu=1.0, pids=64, tmp_bytes=8 << 20, file_bytes=64 << 20)


def spec_for(backend: DockerBackend, key: str, uid: int | None) -> SandboxSpec:
    workspace = backend.settings.state_dir / "workspaces" / "shared"
    if not workspace.exists():
        workspace.mkdir(parents=True)
        if (owner := sandbox_owner(backend, uid)) is not None:
            os.chown(workspace, *owner)
    uid = uid if backend.per_sandbox_uids else None
    return SandboxSpec(key=key, owner="alice", session_id=f"id-{key}", workspace=workspace,
                       limits=LIMITS, uid=uid)  # fmt: skip


async def run(client: AgentClient, code: str) -> Any:
    outcome = await client.execute(Cell("python", code, 60), lambda n, t: None)
    assert outcome.status == "ok", outcome.error
    return outcome


async def test_save_in_one_container_and_load_in_another(
    backend: DockerBackend, host_uid: int | None
) -> None:
    box = await backend.create(spec_for(backend, "one", host_uid))
    try:
        client = AgentClient(box.channel)
        code = "import pandas as pd\ndf = pd.DataFrame({'a': range(10)})\n"
        await run(client, code + "def f():\n    return int(df.a.sum())\ngen = (i for i in [])")
        report = await client.save_state(max_bytes=16 << 20, timeout_s=60)
        assert {v.name for v in report.kept} == {"df", "f"}
        assert [(v.name, v.type) for v in report.dropped] == [("gen", "generator")]
    finally:
        await backend.stop(box)
    box = await backend.create(spec_for(backend, "two", host_uid))
    try:
        client = AgentClient(box.channel)
        loaded = await client.load_state(timeout_s=60)
        assert loaded.found and set(loaded.restored) == {"df", "f"} and loaded.modules == ("pd",)
        assert (await run(client, "f()")).result == "45"
        assert (await run(client, "df = pd.DataFrame({'a': [1]}); f()")).result == "1"
    finally:
        await backend.stop(box)


async def test_park_then_the_agent_comes_back_with_its_variables(
    backend: DockerBackend, host_uid: int | None
) -> None:
    spec = spec_for(backend, "park", host_uid)
    box = await backend.create(spec)
    assert isinstance(box, DockerSandbox)
    back: DockerSandbox | None = None
    try:
        client = AgentClient(box.channel)
        await run(client, "kept = [1, 2, 3]")
        await client.park(wait_s=10)  # returns at the channel's EOF
        box.close()
        leftover = Leftover(backend_id=box.backend_id, key=spec.key, owner=spec.owner,
                            session_id=spec.session_id, running=True,
                            workspace=spec.workspace, uid=spec.uid)  # fmt: skip
        found = await backend.reattach(leftover, spec)
        assert isinstance(found, DockerSandbox)
        back = found
        assert back.ready.get("reattached") is True and back.ready.get("execution_count") == 1
        again = AgentClient(back.channel)
        outcome = await run(again, "sum(kept)")
        assert outcome.result == "6" and outcome.execution_count == 2
    finally:
        await backend.stop(back or box)


async def test_park_on_a_closed_channel_is_sandbox_failed(
    backend: DockerBackend, host_uid: int | None
) -> None:
    box = await backend.create(spec_for(backend, "closed", host_uid))
    try:
        client = AgentClient(box.channel)
        box.channel.close()
        with pytest.raises(SandboxFailed):
            await client.park(wait_s=2)
    finally:
        await backend.stop(box)
