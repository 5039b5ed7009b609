"""The backend seam itself: what every backend shares, checked without a sandbox.

The agent's ``ready`` handshake is read by one helper for every backend
(:func:`~mcp_code_sandbox.backends.base.wait_ready`); ``Backend`` is lifecycle only, and
runner images and checkpoints are capabilities only the Docker backend has."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.agent.protocol import encode_frame
from mcp_code_sandbox.backends.base import (
    Backend,
    Channel,
    Limits,
    Sandbox,
    SandboxSpec,
    wait_ready,
)
from mcp_code_sandbox.backends.bwrap.backend import BwrapBackend
from mcp_code_sandbox.backends.checkpoints import Checkpoints, checkpoints_of
from mcp_code_sandbox.backends.docker.backend import DockerBackend, no_checkpoints
from mcp_code_sandbox.backends.runner_images import RunnerImages, runner_images_of
from mcp_code_sandbox.errors import SandboxFailed
from mcp_code_sandbox.settings import load_settings

LIMITS = Limits(memory_bytes=1, cpu=1.0, pids=16, tmp_bytes=1, file_bytes=1)


class _Box(Sandbox):
    def is_alive(self) -> bool:
        return True


async def _box(frames: bytes, *, eof: bool = True) -> _Box:
    reader = asyncio.StreamReader()
    reader.feed_data(frames)
    if eof:
        reader.feed_eof()
    writer: Any = None  # never written to here
    spec = SandboxSpec("k", "o", "s", Path("/nonexistent"), LIMITS)
    return _Box(spec, Channel(reader, writer), "1")


async def _why(message: dict[str, Any] | None, timed_out: bool) -> str:
    return f"not ready: {message}, timed out: {timed_out}"


async def test_wait_ready_returns_the_ready_message() -> None:
    box = await _box(encode_frame({"ev": "ready", "languages": {"python": "3"}}))
    assert box.ready == {}  # declared on every sandbox, empty until the backend sets it
    ready = await wait_ready(box, 5, _why)
    assert ready["languages"] == {"python": "3"}


async def test_wait_ready_says_what_came_instead() -> None:
    box = await _box(encode_frame({"ev": "error", "message": "boom"}))
    with pytest.raises(SandboxFailed, match=r"'message': 'boom'.*timed out: False"):
        await wait_ready(box, 5, _why)
    with pytest.raises(SandboxFailed, match="not ready: None, timed out: False"):
        await wait_ready(await _box(b""), 5, _why)  # EOF
    with pytest.raises(SandboxFailed, match="not ready: None, timed out: True"):
        await wait_ready(await _box(b"", eof=False), 0.05, _why)


def test_only_docker_has_runner_images(tmp_path: Path) -> None:
    settings = load_settings({"state_dir": str(tmp_path)}, environ={})
    bwrap = BwrapBackend(settings)
    assert not isinstance(bwrap, RunnerImages)
    assert not hasattr(bwrap, "create_runner")  # nothing inherited that only raises
    with pytest.raises(SandboxFailed, match="bwrap backend has no runner images"):
        runner_images_of(bwrap)
    docker = DockerBackend(settings, {})
    assert runner_images_of(docker) is docker


def test_the_backend_seam_is_lifecycle_only() -> None:
    # What only some backends can do is a capability beside it (runner images,
    # checkpoints), so that the seam every backend implements stays this small.
    members = {name for name, value in vars(Backend).items() if callable(value)}
    assert members == {
        "create",
        "stop",
        "reattach",
        "list_leftovers",
        "remove_leftover",
        "check_ready",
        "describe",
        "usage",
        "aclose",
    }


async def test_only_docker_can_checkpoint_and_under_gvisor_only(tmp_path: Path) -> None:
    settings = load_settings({"state_dir": str(tmp_path)}, environ={})
    bwrap = BwrapBackend(settings)
    assert checkpoints_of(bwrap) is None
    assert not hasattr(bwrap, "checkpoint")  # nothing inherited that only raises
    runc = DockerBackend(settings, {})
    assert checkpoints_of(runc) is runc
    assert "only gVisor" in (await runc.cannot_checkpoint() or "")
    runsc = load_settings({"state_dir": str(tmp_path), "docker_runtime": "runsc"}, environ={})
    gvisor = DockerBackend(runsc, {})
    assert isinstance(gvisor, Checkpoints)
    assert no_checkpoints(runsc, {"ExperimentalBuild": True}) is None
    assert "experimental" in (no_checkpoints(runsc, {}) or "")
