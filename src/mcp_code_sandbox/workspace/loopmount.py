"""Loop-mount a workspace image with the kernel's own calls, as ``mount -o loop`` does,
without starting ``mount(8)``.

Why: a new session's workspace is mounted on its cold path, and ``mount`` (a process to
start, libmount's look at every mount table, a loop device found and set up) took several
times what the calls themselves take, and ``umount`` likewise on a close or a pause.

What it does is what util-linux does for ``mount -o loop``: ask ``/dev/loop-control`` for
a free device, bind the image to it in one ``LOOP_CONFIGURE`` with ``LO_FLAGS_AUTOCLEAR``
(the device lets go of the image at the filesystem's last unmount), retrying when another
process took the device first, then ``mount(2)`` it. A mount that fails frees the device
(the flag again, once the only fd is closed).

Only for an image no loop device has: a new one. What util-linux does besides, and this
does not, is look for a device that has the image already and mount that one (the kernel
then gives the filesystem that is still alive, not a second one over the same file):
:meth:`.volume.Volume.create` runs ``mount`` for an image that was mounted before.

Where this cannot be done, :func:`loop_mount` says so and the caller runs ``mount``: a
kernel older than 5.8 (no ``LOOP_CONFIGURE``), or a ``/dev`` without the node of the
device the kernel gave (a container whose ``/dev`` is a copy, where ``mount`` has its own
ways).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import struct
from pathlib import Path

from mcp_code_sandbox.errors import InternalError

__all__ = ["MS_NOATIME", "MS_NODEV", "MS_NOSUID", "loop_mount", "unmount"]

MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOATIME = 0x400
_MNT_DETACH = 0x2

_LOOP_CONTROL = "/dev/loop-control"
_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LO_FLAGS_AUTOCLEAR = 4
#: ``struct loop_info64``: five u64, four u32 (``lo_flags`` the last), then the name.
_INFO_BYTES = 232
_FLAGS_AT = 52
_NAME_AT = 56
_NAME_BYTES = 64
#: ``struct loop_config``: fd, block size, the info, eight reserved u64.
_RESERVED_BYTES = 64
#: Devices another process took between our ask and our configure: tries, then give up.
_TRIES = 16

_libc = ctypes.CDLL(None, use_errno=True)
_mount = _libc.mount
_mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_mount.restype = ctypes.c_int
_umount2 = _libc.umount2
_umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_umount2.restype = ctypes.c_int
_syncfs = _libc.syncfs
_syncfs.argtypes = [ctypes.c_int]
_syncfs.restype = ctypes.c_int


def loop_mount(image: Path, root: Path, fstype: str, flags: int, data: str) -> bool:
    """Mount ``image`` (a filesystem of ``fstype``) at ``root`` through a loop device, with
    ``flags`` (``MS_*``) and ``data`` (the filesystem's options). ``False``: this kernel
    or ``/dev`` cannot, nothing was done (run ``mount`` instead). Raises
    ``InternalError`` when the mount failed, having freed its loop device."""
    device = _attach(image)
    if device is None:
        return False
    with contextlib.closing(device):
        if _mount(
            os.fsencode(device.path), os.fsencode(root), fstype.encode(), flags, data.encode()
        ):
            code = ctypes.get_errno()
            # Names, not the host's paths: the message may reach the client.
            raise InternalError(f"mount failed: {image.name}: {os.strerror(code)}")
    return True


def unmount(root: Path, *, lazy: bool = False) -> None:
    """Unmount ``root`` (``lazy``: out of the tree now, the kernel frees the filesystem
    when its last user is gone). Raises ``InternalError`` (busy, not mounted...)."""
    if _umount2(os.fsencode(root), _MNT_DETACH if lazy else 0):
        code = ctypes.get_errno()
        raise InternalError(f"umount failed: {root.name}: {os.strerror(code)}")


def sync_filesystem(root: Path) -> None:
    """Write the filesystem mounted at ``root`` through to its image (``syncfs(2)``), so
    that the image's blocks are what the files hold: a filesystem still alive in the
    mount namespace of a stopped sandbox outlives the unmount here, with its dirty pages
    unwritten. Raises ``InternalError``."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise InternalError(f"syncfs failed: {root.name}: {exc.strerror}") from None
    try:
        if _syncfs(fd):
            code = ctypes.get_errno()
            raise InternalError(f"syncfs failed: {root.name}: {os.strerror(code)}")
    finally:
        os.close(fd)


class _Device:
    """A loop device bound to an image, open; closing it lets the kernel free the device
    once nothing is mounted from it (``LO_FLAGS_AUTOCLEAR``)."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd

    def close(self) -> None:
        os.close(self.fd)


def _attach(image: Path) -> _Device | None:
    try:
        control = os.open(_LOOP_CONTROL, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        backing = os.open(image, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        os.close(control)
        raise InternalError(f"mount failed: {image.name}: {exc.strerror}") from None
    try:
        config = _config(backing, image)
        for _ in range(_TRIES):
            number = fcntl.ioctl(control, _LOOP_CTL_GET_FREE)
            path = f"/dev/loop{number}"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                return None  # a /dev that is a copy: mount(8) knows what to do there
            try:
                fcntl.ioctl(fd, _LOOP_CONFIGURE, config)
            except OSError as exc:
                os.close(fd)
                if exc.errno == errno.EBUSY:
                    continue  # taken by another process since we asked: ask again
                if exc.errno in (errno.EINVAL, errno.ENOTTY):
                    return None  # before Linux 5.8: no LOOP_CONFIGURE
                raise InternalError(f"mount failed: {path}: {exc.strerror}") from None
            return _Device(path, fd)
        raise InternalError(f"mount failed: no free loop device after {_TRIES} tries")
    except OSError as exc:  # loop-control's own refusal (no free device, no permission)
        raise InternalError(f"mount failed: {_LOOP_CONTROL}: {exc.strerror}") from None
    finally:
        os.close(backing)  # the device holds the image now
        os.close(control)


def _config(backing: int, image: Path) -> bytes:
    info = bytearray(_INFO_BYTES)
    struct.pack_into("=I", info, _FLAGS_AT, _LO_FLAGS_AUTOCLEAR)
    name = os.fsencode(image)[-(_NAME_BYTES - 1) :]  # what losetup shows; the kernel's is whole
    info[_NAME_AT : _NAME_AT + len(name)] = name
    return struct.pack("=II", backing, 0) + bytes(info) + bytes(_RESERVED_BYTES)
