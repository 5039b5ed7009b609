"""A size-limited filesystem per workspace: a sparse ext4 image loop-mounted at its root.

Why: the quota must bind the sandbox, not only the server's own writes. A workspace that
is a mount of its own filesystem cannot hold more than that filesystem's size, whatever
the code in it does (``fallocate``, many files, package installs), and every backend gets
that for free: bwrap binds the workspace directory, Docker (runc and runsc) bind-mounts it
at ``/mnt/data``, and both see the mounted filesystem.

Layout and life cycle. The image is ``<state_dir>/volumes/<slot>.img``, next to the
workspace (never inside it: the sandbox must not reach its own image). :meth:`Volume.create`
makes it (sparse: the host pays only for what is written), formats it (``mkfs.ext4``: no
journal, no blocks reserved for root, inode tables not zeroed: a new sparse file reads as
zeros anyway, and ``noinit_itable`` keeps the kernel from writing them out later) and
mounts it ``nosuid,nodev`` (not ``noexec``: users run scripts from their workspace) with
``discard``, so that deleting files in the sandbox gives the host its disk back. Formatting
is the slow part (done ahead, :mod:`.spares`); the mount is made with the kernel's
own calls (:mod:`.loopmount`; ``mount(8)`` where they cannot be), on a loop device set to
clear itself on the last unmount, so unmounting frees the device too.
:func:`release` unmounts (lazily when something still holds it), deletes the image, then
the directory: in that order, so that a server killed half-way leaves a workspace
directory, which the next start finds and releases again (see :mod:`sessions.recovery`).

Semantics: the image is a little larger than the quota (:func:`image_bytes`), so that the
files the quota allows fit next to the filesystem's own metadata; the server still checks
the quota by the bytes in files after every run and before every upload. ``lost+found``
is removed (nothing ever runs ``fsck`` on a workspace: it is deleted with its session).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from mcp_code_sandbox.errors import InternalError
from mcp_code_sandbox.workspace.fs import remove_tree
from mcp_code_sandbox.workspace.loopmount import (
    MS_NOATIME,
    MS_NODEV,
    MS_NOSUID,
    loop_mount,
    sync_filesystem,
    unmount,
)

__all__ = [
    "IMAGE_SUFFIX",
    "PROBE_PREFIX",
    "Spares",
    "Volume",
    "format_image",
    "image_bytes",
    "mounted",
    "probe",
    "release",
]

IMAGE_SUFFIX = ".img"
#: Names of :func:`probe`'s mount points (its image: the same name plus the suffix).
PROBE_PREFIX = ".mcs-probe-"
#: The smallest image ``mkfs.ext4`` makes a usable filesystem of (it fails below ~256 KiB).
MIN_IMAGE_BYTES = 1 << 20
#: Bytes of file data per inode (``mkfs -i``): enough inodes for package trees of small
#: files, while the inode tables (256 bytes each) cost ~3 % of the image.
BYTES_PER_INODE = 8192
_TIMEOUT_S = 60.0
_SBIN = "/usr/sbin:/sbin:/usr/bin:/bin"
_MOUNT_FLAGS = MS_NOSUID | MS_NODEV | MS_NOATIME
_MOUNT_DATA = "discard,noinit_itable"
#: The same for ``mount(8)``, where the kernel's calls cannot be made (see :mod:`.loopmount`).
_MOUNT_OPTIONS = f"loop,nosuid,nodev,noatime,{_MOUNT_DATA}"


class Spares(Protocol):
    """Formatted images to take one from (:class:`.spares.SpareImages`)."""

    def take(self, image: Path, size_bytes: int) -> bool:
        """Move a formatted image of ``size_bytes`` to ``image``; ``False``: none."""
        ...


def image_bytes(quota_bytes: int) -> int:
    """Size of the image for ``quota_bytes`` of files: the quota plus the metadata that
    ``mkfs.ext4`` takes from it (inode tables, bitmaps, the root directory), so that the
    quota's worth of data fits; rounded up to whole 64 KiB."""
    metadata = quota_bytes * 256 // BYTES_PER_INODE + quota_bytes // 32 + (512 << 10)
    size = max(MIN_IMAGE_BYTES, quota_bytes + metadata)
    return -(-size // 65536) * 65536


@dataclass(frozen=True)
class Volume:
    """The filesystem of one workspace: ``image`` (a file), mounted at the workspace root.

    ``spares``: formatted images to take one from instead of formatting (:mod:`.spares`);
    ``None``: always format."""

    image: Path
    size_bytes: int
    spares: Spares | None = field(default=None, compare=False)

    def create(self, root: Path) -> None:
        """Make, format and mount the image at ``root`` (an existing empty directory).

        A ``root`` that is already a mount point is kept as it is: a restarted server
        re-attaching a session whose filesystem outlived the old server. An image that
        exists already is mounted as it is: a paused session's (see :meth:`unmount`)."""
        if mounted(root):
            return
        if self.image.is_file() and not self.image.is_symlink():
            _mount(self.image, root, new=False)
            return
        self.image.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            if self.spares is None or not self.spares.take(self.image, self.size_bytes):
                format_image(self.image, self.size_bytes)
            _mount(self.image, root, new=True)
            (root / "lost+found").rmdir()
        except BaseException:
            release(root, self.image, keep_root=True)
            raise

    def unmount(self, root: Path) -> bool:
        """Unmount ``root``, keeping the image (and everything in it) for :meth:`create`:
        a paused session holds no mount, no loop device and no page cache of its own.
        A busy filesystem (a download still reading a file) stays mounted: unmounted
        lazily, it could be mounted a second time by the next call before it is gone.
        Whether ``root`` is unmounted now. The filesystem is written through to the image
        first, so that :meth:`disk_bytes` is what the files hold."""
        if mounted(root):
            with contextlib.suppress(InternalError):
                sync_filesystem(root)
                unmount(root)
        return not mounted(root)

    def disk_bytes(self) -> int:
        """Bytes the image takes on the host's disk: its allocated blocks (it is sparse,
        and ``discard`` gives back what is deleted in it), whatever the sizes its files
        claim; 0 when it is gone."""
        try:
            st = self.image.lstat()
        except FileNotFoundError:
            return 0
        return st.st_blocks * 512 if stat.S_ISREG(st.st_mode) else 0


def format_image(image: Path, size_bytes: int, *, background: bool = False) -> None:
    """Make ``image`` a sparse file of ``size_bytes`` holding an empty workspace
    filesystem (not mounted). ``background``: at a lower CPU priority (``nice``), for
    work nobody waits for (:mod:`.spares`). Raises ``InternalError`` when mkfs fails."""
    with open(image, "wb") as out:
        out.truncate(size_bytes)
    args = mkfs_args(image)
    if background and _which("nice") is not None:
        _run("nice", "-n", "10", _which("mkfs.ext4") or "mkfs.ext4", *args)
    else:
        _run("mkfs.ext4", *args)


def mkfs_args(image: Path) -> list[str]:
    """``mkfs.ext4`` arguments for a workspace image: quiet, forced (a file, not a
    device), no journal (a crash loses the session anyway), nothing reserved for root,
    inode tables left for the kernel to zero when first used."""
    return [
        "-q",
        "-F",
        "-m",
        "0",
        "-i",
        str(BYTES_PER_INODE),
        "-O",
        "^has_journal,^resize_inode",
        "-E",
        "lazy_itable_init=1,nodiscard",
        str(image),
    ]


def release(root: Path, image: Path | None, *, keep_root: bool = False) -> None:
    """Unmount ``root`` if it is a mount point, delete ``image``, then ``root`` with what
    is in it (unless ``keep_root``). No-op for what is gone; never follows links."""
    if mounted(root):
        try:
            unmount(root)
        except InternalError:
            # Busy (a process still has a file open in it): out of the tree now, the kernel
            # frees the filesystem and its loop device when the last user is gone.
            unmount(root, lazy=True)
    if image is not None:
        image.unlink(missing_ok=True)
    if not keep_root:
        remove_tree(root)


def mounted(path: Path) -> bool:
    """Is ``path`` (a directory, not a link) a mount point?"""
    try:
        return not path.is_symlink() and os.path.ismount(path)
    except OSError:
        return False


def probe(directory: Path) -> str | None:
    """Why per-workspace filesystems cannot be made here, or ``None`` when they can.

    Real, not guessed: makes, mounts and releases a small image in ``directory``,
    since root without ``CAP_SYS_ADMIN`` (a container) or without loop devices fails
    only at the mount."""
    if os.geteuid() != 0:
        return "the server is not root (mounting a filesystem needs CAP_SYS_ADMIN)"
    for tool in ("mkfs.ext4", "mount"):
        if _which(tool) is None:
            return f"{tool} is not installed (apt-get install e2fsprogs mount)"
    if not Path("/dev/loop-control").exists():
        return "the host has no loop devices (/dev/loop-control)"
    directory.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=PROBE_PREFIX, dir=directory))
    volume = Volume(root.with_name(root.name + IMAGE_SUFFIX), MIN_IMAGE_BYTES)
    try:
        volume.create(root)
    except InternalError as exc:
        return exc.message
    finally:
        release(root, volume.image)
    return None


def _mount(image: Path, root: Path, *, new: bool) -> None:
    """Mount ``image`` at ``root``: with the kernel's calls when it is ``new`` (no loop
    device can have it yet), else with mount(8). The filesystem of an image mounted before
    (a paused session's) may still be alive elsewhere (the mount namespace of its stopped
    sandbox, for a moment), and mount(8) mounts the loop device that still has the image;
    a second device would make a second filesystem of one image."""
    if new and loop_mount(image, root, "ext4", _MOUNT_FLAGS, _MOUNT_DATA):
        return
    _run("mount", "-t", "ext4", "-o", _MOUNT_OPTIONS, str(image), str(root))


def _which(tool: str) -> str | None:
    # A service's PATH often lacks the sbin directories, where these tools live.
    return shutil.which(tool) or shutil.which(tool, path=_SBIN)


def _run(tool: str, *args: str) -> None:
    argv = [_which(tool) or tool, *args]
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise InternalError(f"{tool} failed: {exc}") from None
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip()[-300:] or f"exit {done.returncode}"
        raise InternalError(f"{tool} failed: {detail}")
