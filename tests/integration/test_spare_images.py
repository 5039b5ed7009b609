"""Spare workspace images (:mod:`mcp_code_sandbox.workspace.spares`): formatted ahead for
real (``mkfs.ext4``), taken by a new workspace (which only mounts it and gets a usable,
empty filesystem), refilled, and deleted at close; a size that differs is never taken."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.workspace import Workspace
from mcp_code_sandbox.workspace import spares as spares_module
from mcp_code_sandbox.workspace.spares import SPARES_DIR, SpareImages
from mcp_code_sandbox.workspace.volume import MIN_IMAGE_BYTES, Volume, mounted

from ..conftest import MakeService, each_backend

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a workspace filesystem needs root"),
]

SIZE = 4 * MIN_IMAGE_BYTES


def wait_for(check: Callable[[], bool], what: str, limit_s: float = 30.0) -> None:
    """A bounded wait for the background thread (not a timing assertion)."""
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def test_a_spare_is_taken_mounted_and_refilled_and_close_deletes_them(tmp_path: Path) -> None:
    spares = SpareImages(tmp_path / SPARES_DIR, SIZE, keep=2)
    spares.start()
    try:
        wait_for(lambda: spares.ready() == 2, "two spares")
        assert len(list((tmp_path / SPARES_DIR).iterdir())) == 2
        assert not spares.take(tmp_path / "other.img", SIZE + 65536), "another size is not taken"
        assert spares.ready() == 2
        root = tmp_path / "ws"
        workspace = Workspace(
            root, quota_bytes=MIN_IMAGE_BYTES, volume=Volume(tmp_path / "ws.img", SIZE, spares)
        )
        workspace.create()
        try:
            assert mounted(root) and (tmp_path / "ws.img").exists()
            assert os.listdir(root) == [], "a taken spare is an empty filesystem"
            workspace.write_file("a.txt", b"hi", overwrite=False)
            assert (root / "a.txt").read_bytes() == b"hi"
        finally:
            workspace.destroy()
        assert not mounted(root) and not (tmp_path / "ws.img").exists()
        wait_for(lambda: spares.ready() == 2, "refilled")
    finally:
        spares.close()
    assert not (tmp_path / SPARES_DIR).exists()
    assert not spares.take(tmp_path / "late.img", SIZE)


def test_a_refill_waits_while_a_spare_is_left_and_not_once_none_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spares = SpareImages(tmp_path / SPARES_DIR, SIZE, keep=2)
    spares.start()
    try:
        wait_for(lambda: spares.ready() == 2, "two spares")
        monkeypatch.setattr(spares_module, "REFILL_AFTER_S", 3600.0)
        assert spares.take(tmp_path / "a.img", SIZE)
        time.sleep(0.5)  # a format takes ~20 ms: it would be back by now
        assert spares.ready() == 1, "refilled beside the start of the session that took one"
        assert spares.take(tmp_path / "b.img", SIZE)
        wait_for(lambda: spares.ready() >= 1, "a refill once none is left")
    finally:
        started = time.monotonic()
        spares.close()  # not held up by the wait
    assert time.monotonic() - started < 30


def test_no_spares_means_the_workspace_formats_its_own(tmp_path: Path) -> None:
    spares = SpareImages(tmp_path / SPARES_DIR, SIZE, keep=0)
    spares.start()
    assert not (tmp_path / SPARES_DIR).exists() and spares.ready() == 0
    root = tmp_path / "ws"
    workspace = Workspace(
        root, quota_bytes=MIN_IMAGE_BYTES, volume=Volume(tmp_path / "ws.img", SIZE, spares)
    )
    workspace.create()
    try:
        assert mounted(root) and os.listdir(root) == []
    finally:
        workspace.destroy()
        spares.close()


@each_backend
async def test_the_session_manager_keeps_spares_and_a_new_session_takes_one(
    make_service: MakeService, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spares_module, "KEEP", 1)
    async with make_service(workspace_quota_bytes=8 << 20) as svc:
        spares = svc.sessions.making.spares
        assert spares is not None and svc.sessions.quota.filesystem
        wait_for(lambda: spares.ready() == 1, "a spare")
        [before] = list(spares.directory.iterdir())
        ran = await svc.run_code("local", RunRequest("import os\nprint(len(os.listdir('.')))"))
        assert ran.stdout == "0\n", ran
        assert not before.exists(), "the session's workspace is the spare"
        wait_for(lambda: spares.ready() == 1, "refilled")
        directory = spares.directory
    assert not directory.exists()
