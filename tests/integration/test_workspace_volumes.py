"""Workspace filesystems (``workspace_quota_mode`` filesystem, a root server) leave nothing
behind: no mount, no loop device, no image, after a close, an expiry, a shutdown, or a
server killed with SIGKILL (the next start releases what it does not re-attach; a docker
session it re-attaches keeps its filesystem and files).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from mcp_code_sandbox.errors import InternalError
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.settings import Settings
from mcp_code_sandbox.workspace import Workspace
from mcp_code_sandbox.workspace.spares import SPARES_DIR
from mcp_code_sandbox.workspace.volume import image_bytes, mounted

from ..conftest import MakeService, each_backend
from ..e2e.conftest import http_server_process

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a workspace filesystem needs root"),
]


def mounts(state_dir: Path) -> list[str]:
    """Mount points under ``state_dir`` (mountinfo escapes spaces; ours have none)."""
    with open("/proc/self/mountinfo") as info:
        points = [line.split()[4] for line in info]
    return [p for p in points if p.startswith(str(state_dir))]


def loops(state_dir: Path) -> list[str]:
    """Loop devices backed by a file under ``state_dir`` (deleted ones too)."""
    listed = subprocess.run(
        ["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [line for line in listed.splitlines() if str(state_dir) in line]


def spares_dir(settings: Settings) -> Path:
    return settings.volumes_dir / SPARES_DIR


def images(settings: Settings) -> list[Path]:
    return sorted(settings.volumes_dir.glob("*.img")) if settings.volumes_dir.is_dir() else []


def nothing_left(settings: Settings) -> None:
    assert mounts(settings.state_dir) == []
    assert loops(settings.state_dir) == []
    assert images(settings) == []
    assert not any(settings.workspaces_dir.iterdir())


async def new_session(svc: Any, session_id: str) -> Path:
    await svc.upload_file("local", "a.txt", b"hi", session_id=session_id, overwrite=False)
    [session] = svc.sessions.with_id(session_id)
    root: Path = session.workspace.root
    # No sandbox yet: the upload's mount ends with the call, the image stays.
    assert not mounts(svc.settings.state_dir) and len(images(svc.settings)) == 1
    await svc.run_code("local", RunRequest("1"), session_id)  # its sandbox mounts it
    assert str(root) in mounts(svc.settings.state_dir)
    assert len(loops(svc.settings.state_dir)) == 1
    return root


@pytest.mark.bwrap
async def test_close_expiry_and_shutdown_release_the_filesystem(
    make_service: MakeService,
) -> None:
    async with make_service(workspace_quota_bytes=8 << 20, session_ttl_m=0.01) as svc:
        settings = svc.settings
        assert svc.sessions.quota.filesystem
        await new_session(svc, "closed")
        await svc.close_session("local", "closed")
        nothing_left(settings)
        await new_session(svc, "expired")
        await asyncio.sleep(1.0)  # past the TTL of 0.6 s
        await svc.sessions.reap()
        nothing_left(settings)
        await new_session(svc, "left-at-shutdown")
    nothing_left(settings)
    assert not spares_dir(settings).exists(), "spare images are deleted at shutdown"


@each_backend
async def test_a_killed_servers_filesystems_are_released_or_kept(
    make_settings: Callable[..., Settings], backend: str
) -> None:
    """SIGKILL leaves the mount; the next server releases it (bwrap), or re-attaches
    the session with its filesystem and files (docker), and ends it cleanly later."""
    settings = make_settings(workspace_quota_bytes=8 << 20)
    with http_server_process(settings) as (base, proc):
        async with Client(f"{base}/mcp", mode="legacy") as client:
            ran = await client.call_tool(
                "run_code", {"session_id": "s", "code": "open('kept.txt', 'w').write('hi')"}
            )
            assert not ran.is_error, ran
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(mounts(settings.state_dir)) == 1 and len(images(settings)) == 1
    stale = spares_dir(settings) / "stale.img"  # a spare the killed server left
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"")
    with http_server_process(settings) as (base, proc):
        assert not stale.exists(), "the next server's recovery deletes a dead one's spares"
        if backend == "bwrap":
            nothing_left(settings)  # its sandbox died with the server: nothing to keep
        else:
            assert len(mounts(settings.state_dir)) == 1  # the container still uses it
            async with Client(f"{base}/mcp", mode="legacy") as client:
                again = await client.call_tool(
                    "run_code", {"session_id": "s", "code": "print(open('kept.txt').read())"}
                )
            assert not again.is_error and again.structured_content["stdout"] == "hi\n", again
    nothing_left(settings)
    assert not spares_dir(settings).exists()


@each_backend
async def test_a_new_sessions_first_run_sees_its_own_filesystem(
    make_service: MakeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workspace of a new session is mounted while its sandbox starts (docker: during
    the container's create): its first run already sees the filesystem, not the directory
    under it; a mount that fails fails the call, leaves no sandbox, and the next call
    mounts it."""
    async with make_service(workspace_quota_bytes=8 << 20) as svc:
        code = (
            "import os; s = os.statvfs('/mnt/data'); print(s.f_blocks * s.f_frsize)\n"
            "open('f.txt', 'w').write('x')"
        )
        first = await svc.run_code("local", RunRequest(code), "fresh")
        assert first.status == "ok", first
        assert int(first.stdout) <= image_bytes(8 << 20)  # its own, not the host's
        [session] = svc.sessions.with_id("fresh")
        assert mounted(session.workspace.root)
        assert (session.workspace.root / "f.txt").read_text() == "x"

        create = Workspace.create

        def failing(self: Workspace) -> None:
            raise InternalError("mount failed: the test's")

        monkeypatch.setattr(Workspace, "create", failing)
        with pytest.raises(InternalError, match="the test's"):
            await svc.run_code("local", RunRequest("print(1)"), "unlucky")
        [unlucky] = svc.sessions.with_id("unlucky")
        assert unlucky.sandbox is None and not unlucky.workspace_made
        assert not mounted(unlucky.workspace.root)
        monkeypatch.setattr(Workspace, "create", create)
        again = await svc.run_code("local", RunRequest(code), "unlucky")
        assert again.status == "ok" and int(again.stdout) <= image_bytes(8 << 20), again
    nothing_left(svc.settings)
