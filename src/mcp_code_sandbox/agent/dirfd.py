"""Walking a directory by fds without ever following a link: shared by both sides.

The host's workspace (:mod:`mcp_code_sandbox.workspace.fs`) uses these on the directory it
keeps for a session; the agent (:mod:`.files`) uses the same ones on ``/mnt/data`` when the
host cannot see it (a pod's emptyDir). One definition, so that a listing, a snapshot and a
quota walk mean the same on every backend. Standard library only.

Everything here takes an open directory fd plus a single name (``openat``-style), so a
symlink or a renamed directory planted by the sandbox between two calls can at worst point
at another place *inside* the workspace, never outside it. Walks are bounded in entries and
in depth, because the sandbox can make both as large as it likes.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = [
    "DIR_FLAGS",
    "FILE_FLAGS",
    "MAX_DEPTH",
    "Budget",
    "closing_fd",
    "counted_bytes",
    "describe",
    "display_name",
    "pread_all",
    "walk",
    "write_all",
]

#: A directory component: refuse symlinks (ENOTDIR/ELOOP) instead of following them.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: A file to read: no link following, and O_NONBLOCK so opening a FIFO cannot block us.
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
#: Deepest directory a walk descends into; every level holds one fd open.
MAX_DEPTH = 64


@contextmanager
def closing_fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def describe(dir_fd: int, name: str) -> str:
    """What ``name`` is, for an error message: 'a symbolic link', 'a FIFO', ..."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        return "missing or inaccessible"
    kinds = (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((what for test, what in kinds if test(mode)), "a special file")


def counted_bytes(st: os.stat_result) -> int:
    """What a regular file counts towards the quota: its size, or the blocks it holds
    when those are more (``fallocate`` with ``FALLOC_FL_KEEP_SIZE`` allocates disk
    without growing the size). Less one block of slack, so that rounding a small file up
    to a whole block does not count: a file of 60 bytes counts 60."""
    allocated = st.st_blocks * 512 - st.st_blksize
    return max(st.st_size, allocated)


@dataclass
class Budget:
    """How many more directory entries a walk may read; ``truncated`` once it ran out."""

    remaining: int
    truncated: bool = False

    def take(self) -> bool:
        if self.remaining <= 0:
            self.truncated = True
            return False
        self.remaining -= 1
        return True


def walk(
    dir_fd: int,
    prefix: str,
    *,
    recursive: bool,
    budget: Budget,
    skip: frozenset[str] = frozenset(),
    depth: int = 0,
) -> Iterator[tuple[str, os.stat_result]]:
    """Yield ``(path, lstat)`` under ``dir_fd``: a parent before its children, names sorted.

    ``prefix`` is the relative path of ``dir_fd`` (``""`` for the root); ``skip`` names
    entries of the top level to leave out entirely. Entries that vanish or cannot be
    stat'ed while we look (the sandbox may be running) are left out; directories that
    cannot be opened are reported but not descended into.
    """
    for name in _read_names(dir_fd, budget):
        if depth == 0 and name in skip:
            continue
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        path = f"{prefix}/{display_name(name)}" if prefix else display_name(name)
        yield path, st
        if recursive and stat.S_ISDIR(st.st_mode):
            yield from _descend(dir_fd, name, st, path, budget, depth + 1)


def _descend(
    dir_fd: int, name: str, st: os.stat_result, path: str, budget: Budget, depth: int
) -> Iterator[tuple[str, os.stat_result]]:
    if depth >= MAX_DEPTH:
        budget.truncated = True
        return
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError:  # replaced by a link or made unreadable since the stat: skip it
        return
    with closing_fd(fd):
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return
        yield from walk(fd, path, recursive=True, budget=budget, depth=depth)


def _read_names(dir_fd: int, budget: Budget) -> list[str]:
    names: list[str] = []
    with os.scandir(dir_fd) as it:
        for entry in it:
            if not budget.take():
                break
            names.append(entry.name)
    names.sort()
    return names


def display_name(name: str) -> str:
    """A name as clients see it: bytes that are not UTF-8 become U+FFFD."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def pread_all(fd: int, offset: int, max_bytes: int) -> bytes:
    """Up to ``max_bytes`` of ``fd`` from ``offset`` (fewer only at its end), read in
    pieces of at most 1 MiB."""
    chunks: list[bytes] = []
    want = max_bytes
    while want > 0:
        chunk = os.pread(fd, min(want, 1 << 20), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        want -= len(chunk)
    return b"".join(chunks)


def write_all(fd: int, data: bytes) -> None:
    """All of ``data`` to ``fd``, however short each write."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
