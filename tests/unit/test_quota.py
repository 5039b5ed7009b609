"""The workspace quota's modes, sizes and the watch over runs in checked mode.

The watch is tested on a real workspace in a temporary directory with a coroutine that
writes files as code in a sandbox would; the filesystem mode's mounts are tested for real
in ``tests/integration/test_workspace_volumes.py`` and ``tests/e2e/test_hostile_quota.py``.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.backends.bwrap.backend import BwrapBackend
from mcp_code_sandbox.backends.docker.backend import DockerBackend
from mcp_code_sandbox.errors import BackendUnavailable
from mcp_code_sandbox.sessions import quota
from mcp_code_sandbox.settings import Settings, load_settings
from mcp_code_sandbox.workspace import Workspace
from mcp_code_sandbox.workspace.fs import counted_bytes
from mcp_code_sandbox.workspace.volume import MIN_IMAGE_BYTES, image_bytes, mkfs_args

MIB = 1 << 20


def settings(tmp_path: Path, **values: Any) -> Settings:
    return load_settings({"state_dir": str(tmp_path), **values}, environ={})


@pytest.mark.parametrize("quota_bytes", [1, 10_000, MIB, 64 * MIB, 1 << 30, 10 << 30])
def test_the_image_holds_the_quota_and_its_metadata(quota_bytes: int) -> None:
    size = image_bytes(quota_bytes)
    assert size % 65536 == 0 and size >= MIN_IMAGE_BYTES
    assert quota_bytes < size <= max(MIN_IMAGE_BYTES, quota_bytes * 108 // 100 + MIB)


def test_mkfs_makes_a_plain_file_system_without_reserved_blocks() -> None:
    args = mkfs_args(Path("/x.img"))
    assert args[-1] == "/x.img" and args[2:4] == ["-m", "0"]
    assert "^has_journal,^resize_inode" in args


def test_counted_bytes_sees_preallocated_blocks(tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.write_bytes(b"x" * 60)
    assert counted_bytes(small.stat()) == 60  # block rounding does not count
    sparse = tmp_path / "sparse"
    with open(sparse, "wb") as out:
        out.truncate(8 * MIB)
    assert counted_bytes(sparse.stat()) == 8 * MIB  # its size, though it holds no blocks
    kept = tmp_path / "kept"
    fd = os.open(kept, os.O_CREAT | os.O_WRONLY, 0o600)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    try:
        if libc.fallocate(fd, 1, 0, 4 * MIB) != 0:  # FALLOC_FL_KEEP_SIZE
            pytest.skip(f"fallocate: {os.strerror(ctypes.get_errno())} on this file system")
    finally:
        os.close(fd)
    assert kept.stat().st_size == 0 and counted_bytes(kept.stat()) >= 4 * MIB - 4096


def test_checked_when_asked(tmp_path: Path) -> None:
    s = settings(tmp_path, workspace_quota_mode="checked", backend="bwrap")
    mode = quota.choose(s, BwrapBackend(s))
    assert not mode.filesystem and "SANDBOX_WORKSPACE_QUOTA_MODE=checked" in mode.describe()
    assert "overshoot" in mode.describe()


def test_a_server_in_a_container_cannot_mount_for_the_engine(tmp_path: Path) -> None:
    s = settings(tmp_path, backend="docker", docker_host_state_dir="/srv/state")
    mode = quota.choose(s, DockerBackend(s, {}))
    assert not mode.filesystem and "runs in a container" in (mode.why or "")
    remote = DockerBackend(settings(tmp_path), {"DOCKER_HOST": "tcp://10.0.0.1:2376"})
    assert "another host" in (remote.workspace_mounts_unseen or "")
    assert DockerBackend(settings(tmp_path), {}).workspace_mounts_unseen is None
    forced = settings(
        tmp_path, backend="docker", docker_host_state_dir="/srv/state",
        workspace_quota_mode="filesystem",
    )  # fmt: skip
    with pytest.raises(BackendUnavailable, match="SANDBOX_WORKSPACE_QUOTA_MODE=filesystem"):
        quota.choose(forced, DockerBackend(forced, {}))


def test_over_quota_message_says_how_much_to_delete() -> None:
    text = quota.over_quota_message(150, 100)
    assert "holds 150 bytes" in text and "delete at least 50 bytes" in text


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    workspace = Workspace(tmp_path / "ws", quota_bytes=MIB)
    workspace.create()
    return workspace


async def write_files(root: Path, count: int, size: int = 64 << 10) -> str:
    for i in range(count):
        (root / f"f{i}.bin").write_bytes(b"x" * size)
        await asyncio.sleep(0.01)
    return "finished"


async def test_the_watch_stops_a_run_that_writes_past_the_quota(ws: Workspace) -> None:
    done, why = await quota.guarded(ws, lambda: write_files(ws.root, 1000))
    assert done is None and why is not None and "stopped" in why
    assert len(list(ws.root.iterdir())) < 1000
    # The call goes on: the cancellation that stopped the run was taken back.
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0.3)


async def test_a_run_within_the_quota_is_left_alone(ws: Workspace) -> None:
    assert await quota.guarded(ws, lambda: write_files(ws.root, 4)) == ("finished", None)


async def test_over_its_quota_a_run_may_delete_but_not_grow(ws: Workspace) -> None:
    (ws.root / "big").write_bytes(b"x" * 2 * MIB)

    async def delete() -> str:
        (ws.root / "big").unlink()
        await asyncio.sleep(0.5)
        return "deleted"

    assert await quota.guarded(ws, delete) == ("deleted", None)
    (ws.root / "big").write_bytes(b"x" * 2 * MIB)
    done, why = await quota.guarded(ws, lambda: write_files(ws.root, 1000))
    assert done is None and why is not None


async def test_the_callers_cancellation_goes_through(ws: Workspace) -> None:
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.sleep(3600)

    task = asyncio.create_task(quota.guarded(ws, forever))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
