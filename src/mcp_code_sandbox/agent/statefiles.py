"""The saved-state directory of the workspace, ``.session/``: where it is, how a state is
committed, and how its files are opened without trusting what user code left there.

Kernel-side only (a save or load runs in the kernel, as the user). The directory lives in
the workspace (:data:`STATE_DIR`, next to ``.packages``), so it is counted in the quota
and kept with the session's files; the host leaves it out of listings and artifacts.

Layout::

    .session/manifest.json     the committed state: names ``data`` and what it holds
    .session/data-<hex>/       one committed state's files (``v<N>.pkl``, history.json)

Commit protocol: a save writes a complete new ``data-<hex>/`` beside the old one, each
file flushed to disk, then the new manifest under a temporary name, then renames it over
``manifest.json`` (atomic), and only then removes the old directory and any leftovers.
A kill at any moment leaves the previous manifest and its directory, or the new ones,
never a mix; leftovers of a killed save are removed by the next save and ignored by loads.

Everything in ``.session`` is the user's to tamper with (a cell may plant a symlink, a
fifo, a truncated file): every open is relative to a directory fd, with ``O_NOFOLLOW``
(and ``O_NONBLOCK``, so a fifo cannot block a read), and checked to be a regular file or
a directory. A save replaces a ``.session`` that is not a directory; a load reports it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from collections.abc import Iterator
from typing import BinaryIO

__all__ = [
    "DATA_NAME",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "STATE_DIR",
    "StateDirError",
    "commit",
    "new_data_dir",
    "open_file",
    "open_state_dir",
    "read_manifest_bytes",
]

#: Relative to the workspace. The host's workspace code names it too (``HIDDEN_DIRS``).
STATE_DIR = ".session"
MANIFEST = "manifest.json"
#: What a committed data directory may be called (anything else in .session is junk).
DATA_NAME = re.compile(r"data-[0-9a-f]{16}")
#: The manifest holds names and sizes only (history is a file of its own).
MAX_MANIFEST_BYTES = 16 * 1024 * 1024

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class StateDirError(Exception):
    """``.session`` (or a file in it) is not what a saved state is made of."""


@contextlib.contextmanager
def open_state_dir(workdir: str, *, create: bool) -> Iterator[int]:
    """An fd of ``<workdir>/.session``. ``create``: make it, replacing whatever else
    (a symlink, a file, a fifo) has the name. Without: raise ``FileNotFoundError`` when
    there is none and ``StateDirError`` when it is not a directory."""
    root = os.open(workdir, _DIR_FLAGS)
    try:
        fd = _open_dir(root, create=create)
        try:
            yield fd
        finally:
            os.close(fd)
    finally:
        os.close(root)


def _open_dir(root: int, *, create: bool) -> int:
    try:
        return os.open(STATE_DIR, _DIR_FLAGS, dir_fd=root)
    except FileNotFoundError:
        if not create:
            raise
    except OSError as exc:  # ELOOP: a symlink; ENOTDIR: a file, a fifo, a socket
        if not create:
            raise StateDirError(f"{STATE_DIR} is not a directory ({exc.strerror})") from None
        os.unlink(STATE_DIR, dir_fd=root)  # the name only: a symlink is never followed
    os.mkdir(STATE_DIR, 0o700, dir_fd=root)
    return os.open(STATE_DIR, _DIR_FLAGS, dir_fd=root)


def _token() -> str:
    # What ``secrets.token_hex(8)`` is, without ``secrets`` and the ``hmac`` it imports.
    return os.urandom(8).hex()


def new_data_dir(state: int) -> tuple[str, int]:
    """A fresh, empty ``data-<hex>`` directory in ``state``: its name and an fd."""
    name = f"data-{_token()}"
    os.mkdir(name, 0o700, dir_fd=state)
    return name, os.open(name, _DIR_FLAGS, dir_fd=state)


def open_data_dir(state: int, name: str) -> int:
    if DATA_NAME.fullmatch(name) is None:
        raise StateDirError(f"the manifest names {name[:80]!r}, not a data directory")
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=state)
    except OSError as exc:
        raise StateDirError(f"{name}: {exc.strerror}") from None


def create_file(directory: int, name: str) -> BinaryIO:
    """A new file ``name`` in ``directory``, opened for writing (never an existing one)."""
    fd = os.open(name, _WRITE_FLAGS, 0o600, dir_fd=directory)
    return os.fdopen(fd, "wb", buffering=1 << 20)


def open_file(directory: int, name: str, max_bytes: int | None = None) -> tuple[BinaryIO, int]:
    """``name`` in ``directory`` for reading, and its size: a regular file, not a link
    nor a fifo, of at most ``max_bytes``. Raises ``StateDirError`` saying what is wrong."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=directory)
    except OSError as exc:
        raise StateDirError(f"{name}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StateDirError(f"{name} is not a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise StateDirError(f"{name} holds {st.st_size} bytes, over {max_bytes}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=1 << 20), st.st_size
    except BaseException:
        os.close(fd)
        raise


def read_manifest_bytes(state: int) -> bytes:
    """The committed manifest's bytes. Raises ``FileNotFoundError`` when there is none."""
    try:
        os.stat(MANIFEST, dir_fd=state, follow_symlinks=False)
    except FileNotFoundError:
        raise
    handle, _ = open_file(state, MANIFEST, MAX_MANIFEST_BYTES)
    with handle:
        return handle.read(MAX_MANIFEST_BYTES + 1)


def sync_file(handle: BinaryIO) -> None:
    """Flush ``handle`` to the disk: a state is committed only once its files are there."""
    handle.flush()
    os.fsync(handle.fileno())


def commit(state: int, data_name: str, manifest: bytes) -> None:
    """Make ``data_name`` (complete, synced) the saved state: write ``manifest`` under a
    temporary name, rename it over ``manifest.json``, then remove everything else."""
    tmp = f".manifest-{_token()}.tmp"
    with create_file(state, tmp) as handle:
        handle.write(manifest)
        sync_file(handle)
    try:
        _replace(state, tmp, MANIFEST)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=state)
        raise
    os.fsync(state)
    remove_except(state, {MANIFEST, data_name})


def _replace(state: int, src: str, dst: str) -> None:
    try:
        os.rename(src, dst, src_dir_fd=state, dst_dir_fd=state)
    except IsADirectoryError:  # a directory planted as manifest.json
        shutil.rmtree(dst, dir_fd=state)
        os.rename(src, dst, src_dir_fd=state, dst_dir_fd=state)


def remove_except(state: int, keep: set[str]) -> None:
    """Remove every entry of ``state`` but ``keep``: old states, leftovers of a killed
    save, and whatever user code put there. Links are removed, never followed."""
    for name in os.listdir(state):
        if name in keep:
            continue
        with contextlib.suppress(OSError):
            remove(state, name)


def remove(directory: int, name: str) -> None:
    st = os.stat(name, dir_fd=directory, follow_symlinks=False)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=directory)  # fd-based: follows no link inside either
    else:
        os.unlink(name, dir_fd=directory)
