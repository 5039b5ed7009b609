"""The server's own runtime probe: one sandbox at a time, its answer shared and kept, a
failure not retried in a loop (the backend is a stand-in: the probe's bookkeeping is
what is under test; tests/e2e/test_hostile_small.py runs it on Docker for real)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

from mcp_code_sandbox.backends.base import Backend, Limits, SandboxSpec
from mcp_code_sandbox.errors import BackendUnavailable
from mcp_code_sandbox.run.languages import RUNTIMES
from mcp_code_sandbox.run.probe import RuntimeProbe
from mcp_code_sandbox.settings import load_settings


class _Sandbox:
    def __init__(self, spec: SandboxSpec) -> None:
        self.spec = spec
        self.ready = {"languages": {"python": "3.11.2", "bash": "5.2.15", "perl": "5"}}


class _Backend:
    workspace_owner = None

    def __init__(self) -> None:
        self.created: list[SandboxSpec] = []
        self.stopped = 0
        self.fail = False

    async def create(self, spec: SandboxSpec) -> _Sandbox:
        self.created.append(spec)
        assert spec.workspace.is_dir() and not any(spec.workspace.iterdir())  # empty, ours
        await asyncio.sleep(0.01)
        if self.fail:
            raise BackendUnavailable("engine down")
        return _Sandbox(spec)

    async def stop(self, sandbox: Any) -> None:
        self.stopped += 1


def _limits() -> Limits:
    return Limits(memory_bytes=1, cpu=1.0, pids=16, tmp_bytes=1, file_bytes=1)


async def test_one_probe_serves_every_caller_and_its_workspace_goes(tmp_path: Path) -> None:
    backend = _Backend()
    probe = RuntimeProbe(
        load_settings({"state_dir": str(tmp_path)}, environ={}),
        cast(Backend, backend),  # the fake has only what the probe calls
        _limits,
        RUNTIMES,
    )
    answers = await asyncio.gather(*(probe.get() for _ in range(20)))
    assert answers == [{"python": "3.11.2", "bash": "5.2.15"}] * 20  # no unknown language
    assert len(backend.created) == 1 and backend.stopped == 1
    assert backend.created[0].owner == "" and not backend.created[0].workspace.exists()
    await probe.get(again=True)  # within RETRY_S: no second sandbox
    assert len(backend.created) == 1


async def test_a_failed_probe_is_not_retried_at_once(tmp_path: Path) -> None:
    backend = _Backend()
    backend.fail = True
    probe = RuntimeProbe(
        load_settings({"state_dir": str(tmp_path)}, environ={}),
        cast(Backend, backend),  # the fake has only what the probe calls
        _limits,
        RUNTIMES,
    )
    assert await probe.get() is None
    assert await probe.get() is None
    assert len(backend.created) == 1
