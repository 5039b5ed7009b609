"""Workspace images mounted with the kernel's own calls (:mod:`.workspace.loopmount`): the
options a workspace must have, the loop device gone with the unmount or a failed mount,
and ``mount(8)`` where the calls cannot be made. Real mounts: root only."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from mcp_code_sandbox.errors import InternalError
from mcp_code_sandbox.workspace import loopmount, volume
from mcp_code_sandbox.workspace.volume import Volume, format_image, image_bytes, mounted, release

from .test_workspace_volumes import loops

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a workspace filesystem needs root"),
]


def mount_options(root: Path) -> set[str]:
    """The mount's own and the filesystem's options of ``root`` (/proc/self/mountinfo)."""
    with open("/proc/self/mountinfo") as info:
        for line in info:
            fields = line.split()
            if fields[4] == str(root):
                own = fields[5].split(",")
                extra = fields[fields.index("-") + 3].split(",")
                return {*own, *extra}
    raise AssertionError(f"{root} is not mounted")


def new_volume(tmp_path: Path, name: str = "w") -> tuple[Volume, Path]:
    """A workspace's volume not made yet (``create`` formats its image) and its root."""
    root = tmp_path / name
    root.mkdir()
    return Volume(tmp_path / f"{name}.img", image_bytes(8 << 20)), root


def test_a_workspace_is_mounted_without_mount8_with_its_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_tools(*args: str) -> None:
        if args[0] != "mkfs.ext4":
            raise AssertionError(f"{args[0]} was started: the kernel's calls were not used")
        real_run(*args)

    real_run = volume._run
    made, root = new_volume(tmp_path)
    monkeypatch.setattr(volume, "_run", no_tools)
    made.create(root)
    assert mounted(root)
    assert {"rw", "nosuid", "nodev", "noatime", "discard"} <= mount_options(root)
    assert not (root / "lost+found").exists()
    assert len(loops(made.image)) == 1
    (root / "f").write_bytes(b"x")

    monkeypatch.setattr(volume, "_run", real_run)  # a remount runs mount(8): see below
    made.unmount(root)  # a pause: the image stays, the device goes
    assert not mounted(root) and made.image.is_file()
    assert loops(made.image) == []
    made.create(root)  # the resume mounts it again, files there
    assert (root / "f").read_bytes() == b"x"

    release(root, made.image)
    assert not root.exists() and not made.image.exists()
    assert loops(made.image) == []


def test_a_busy_filesystem_is_detached_and_its_device_freed_with_its_last_user(
    tmp_path: Path,
) -> None:
    made, root = new_volume(tmp_path)
    made.create(root)
    held = os.open(root / "open-file", os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        with pytest.raises(InternalError, match="umount failed"):
            loopmount.unmount(root)  # busy
        release(root, made.image)  # lazily, then
        assert not root.exists()
        assert len(loops(made.image)) == 1  # still in use
    finally:
        os.close(held)
    for _ in range(200):  # the kernel lets go of it as the last file closes
        if not loops(made.image):
            break
        time.sleep(0.01)
    assert loops(made.image) == []


def test_an_image_that_is_no_filesystem_fails_and_leaves_no_device(tmp_path: Path) -> None:
    root = tmp_path / "w"
    root.mkdir()
    image = tmp_path / "w.img"
    image.write_bytes(b"\xff" * (1 << 20))
    with pytest.raises(InternalError, match="mount failed"):
        loopmount.loop_mount(image, root, "ext4", loopmount.MS_NOSUID, "")
    assert not mounted(root)
    assert loops(image) == []
    with pytest.raises(InternalError, match="umount failed"):
        loopmount.unmount(root)  # not a mount point: said, not ignored


def test_without_the_kernel_calls_mount8_mounts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a host without /dev/loop-control's node in this namespace (a copied /dev)
    # looks like to the fast path: it says it cannot, and mount(8) is run.
    monkeypatch.setattr(loopmount, "_LOOP_CONTROL", str(tmp_path / "no-loop-control"))
    made, root = new_volume(tmp_path)
    format_image(made.image, made.size_bytes)
    assert not loopmount.loop_mount(made.image, root, "ext4", 0, "")
    made.create(root)
    assert mounted(root)
    assert {"nosuid", "nodev", "noatime"} <= mount_options(root)
    release(root, made.image)
    assert loops(made.image) == []


def test_an_image_whose_filesystem_is_still_alive_is_mounted_as_that_filesystem(
    tmp_path: Path,
) -> None:
    # A paused session's image while its stopped sandbox's mount namespace still holds the
    # filesystem for a moment (here: a bind mount): mounting the image again must give
    # that same filesystem, not a second one over the same file (which corrupted both).
    made, root = new_volume(tmp_path)
    made.create(root)
    elsewhere = tmp_path / "namespace"
    elsewhere.mkdir()
    subprocess.run(["mount", "--bind", str(root), str(elsewhere)], check=True)
    try:
        made.unmount(root)
        assert not mounted(root) and len(loops(made.image)) == 1
        made.create(root)  # the resume
        assert len(loops(made.image)) == 1, "a second loop device over one image"
        (elsewhere / "written-there").write_text("x")
        assert (root / "written-there").read_text() == "x"
    finally:
        loopmount.unmount(elsewhere)
        release(root, made.image)
    assert loops(made.image) == []
