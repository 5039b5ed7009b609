"""Low-level file system helpers that work on directory fds and never follow a link.

The walk and its flags are the agent's (:mod:`mcp_code_sandbox.agent.dirfd`), re-exported
here: the agent walks ``/mnt/data`` with the same code when the host cannot see it.
Everything here takes an open directory fd plus a single name (``openat``-style), so a
symlink or a renamed directory planted by the sandbox between two calls can at worst point
at another place *inside* the workspace, never outside it. Walks are bounded in entries and
in depth, because the sandbox can make both as large as it likes.
"""

from __future__ import annotations

import os
import secrets
import stat
from contextlib import suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from mcp_code_sandbox.agent.dirfd import (
    DIR_FLAGS,
    FILE_FLAGS,
    MAX_DEPTH,
    Budget,
    closing_fd,
    counted_bytes,
    describe,
    walk,
)

__all__ = [
    "DIR_FLAGS",
    "FILE_FLAGS",
    "MAX_DEPTH",
    "Budget",
    "EntryType",
    "closing_fd",
    "counted_bytes",
    "describe",
    "entry_type",
    "iso_utc",
    "remove_tree",
    "walk",
]

EntryType = Literal["file", "directory", "symlink", "other"]

#: Deepest level removal descends into before moving a subtree up (see ``remove_tree``).
_REMOVE_DEPTH = 32
_REMOVE_BATCH = 4096


def entry_type(mode: int) -> EntryType:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def iso_utc(mtime_ns: int) -> str:
    """ISO 8601 UTC with a ``Z``; the sandbox can set any mtime, so out-of-range clamps."""
    try:
        moment = datetime.fromtimestamp(mtime_ns / 1e9, tz=UTC)
    except (OverflowError, OSError, ValueError):
        moment = (
            datetime.max.replace(tzinfo=UTC) if mtime_ns > 0 else datetime.min.replace(tzinfo=UTC)
        )
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


# --- removal -------------------------------------------------------------------------------


def remove_tree(path: Path) -> None:
    """Remove ``path`` (trusted: ours) and everything under it, following no link.

    Tolerates what the sandbox may have done: directories without permissions (their
    mode is restored first), nesting deeper than any fd budget (deep subtrees are moved
    up to the top and removed in later passes), entries vanishing meanwhile.
    """
    parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    with closing_fd(parent):
        try:
            st = os.stat(path.name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path.name, dir_fd=parent)
            return
        with closing_fd(_open_for_removal(parent, path.name)) as top:
            _empty(top, top, depth=0)
        os.rmdir(path.name, dir_fd=parent)


def _empty(dir_fd: int, top_fd: int, depth: int) -> None:
    # Re-scan in batches until nothing is left: bounded memory for huge directories, and
    # at the top this also picks up the subtrees that deeper levels moved here.
    while names := _first_names(dir_fd):
        for name in names:
            _remove_entry(dir_fd, name, top_fd, depth)


def _first_names(dir_fd: int) -> list[str]:
    names: list[str] = []
    with os.scandir(dir_fd) as it:
        for entry in it:
            names.append(entry.name)
            if len(names) >= _REMOVE_BATCH:
                break
    return names


def _remove_entry(dir_fd: int, name: str, top_fd: int, depth: int) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dir_fd)
        elif depth >= _REMOVE_DEPTH:
            # Too deep to hold one more fd per level: hoist the subtree to the top.
            os.rename(name, f".mcs-rm-{secrets.token_hex(8)}", src_dir_fd=dir_fd, dst_dir_fd=top_fd)
        else:
            with closing_fd(_open_for_removal(dir_fd, name)) as fd:
                _empty(fd, top_fd, depth + 1)
            os.rmdir(name, dir_fd=dir_fd)
    except FileNotFoundError:  # already gone: that is what we wanted
        pass


def _open_for_removal(dir_fd: int, name: str) -> int:
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:  # e.g. chmod 000 by the sandbox; root would not get here
        _chmod_dir_nofollow(dir_fd, name, 0o700)
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if mode & 0o700 != 0o700:  # we need to list (r), reach (x) and unlink in (w) it
        with suppress(PermissionError):  # not ours: the unlinks below will say so
            os.fchmod(fd, mode | 0o700)
    return fd


def _chmod_dir_nofollow(dir_fd: int, name: str, mode: int) -> None:
    # An O_PATH fd needs no permission on the directory itself, and chmod through its
    # /proc magic link changes exactly that inode: no window for a swapped-in symlink,
    # which fchmodat(AT_SYMLINK_NOFOLLOW) cannot promise on Linux.
    fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    with closing_fd(fd):
        os.chmod(f"/proc/self/fd/{fd}", mode)
