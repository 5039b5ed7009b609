"""Copying a workspace's files into a fresh one: a paused session resumed into a warm
sandbox moves its files into that sandbox's workspace (:mod:`.sessions.moving`), and a
fork copies its source's (:mod:`.sessions.forking`).

The source was written by a sandbox, so it is hostile like any workspace (see the
package docstring). Its session is locked while we copy, but its sandbox may still run
(a fork's source) and change it meanwhile: every entry is opened relative to its
directory's fd with ``O_NOFOLLOW`` and checked to be the inode that was listed, and a
file is copied up to the size it was listed with, never further (one that grows while
it is copied cannot get past ``max_bytes``).

What is copied: directories, regular files (content, permission bits without set-id,
modification time) and symlinks (as links: their targets are strings, never followed).
FIFOs, sockets and devices are left out and counted (none of them holds data). Every
entry is given to ``owner`` (the new sandbox's uid).

The copy is all or nothing for the caller: past ``max_bytes`` (files count at the size
they claim: a sparse file is copied whole) or ``max_entries``, deeper than
:data:`.fs.MAX_DEPTH`, or at a file with more than one hard link (its other name may be
a file the sandbox could not read, and the copy would be given to it), it raises
:class:`CopyRefused`; the target then holds a partial copy the caller discards. With
``hard_links="skip"`` such a file is left out and named instead (the one way a fork can
still copy a workspace in which user code linked two names of one file).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mcp_code_sandbox.workspace.fs import DIR_FLAGS, FILE_FLAGS, MAX_DEPTH, closing_fd

__all__ = ["NAMED_LEFT_OUT", "Copied", "CopyRefused", "CopyTooLarge", "copy_tree"]

_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 24
#: Paths of entries left out that :class:`Copied` names (the rest are counted only).
NAMED_LEFT_OUT = 20


class CopyRefused(Exception):
    """The tree is not copied whole (too large, too deep, a hard link): use another way."""


class CopyTooLarge(CopyRefused):
    """The tree's files claim more than ``max_bytes``."""


@dataclass
class Copied:
    """What :func:`copy_tree` copied, and what it left out."""

    files: int = 0
    bytes: int = 0
    dirs: int = 0
    links: int = 0
    #: FIFOs, sockets and device nodes (and files with hard links, when skipped): not
    #: copied.
    skipped: int = 0
    #: The first :data:`NAMED_LEFT_OUT` of those, by path relative to the source, as the
    #: sandbox named them (hostile text: clean it before showing it).
    left_out: list[str] = field(default_factory=list)

    def leave_out(self, path: str) -> None:
        self.skipped += 1
        if len(self.left_out) < NAMED_LEFT_OUT:
            self.left_out.append(path)


@dataclass
class _Limits:
    max_bytes: int
    max_entries: int
    owner: tuple[int, int] | None
    skip_hard_links: bool


def copy_tree(
    source: Path,
    target: Path,
    *,
    owner: tuple[int, int] | None,
    max_bytes: int,
    max_entries: int,
    hard_links: Literal["refuse", "skip"] = "refuse",
) -> Copied:
    """Copy everything under the directory ``source`` into the existing, empty directory
    ``target``, giving each entry to ``owner`` (``None``: left ours). Blocking: call it
    in a worker thread. Raises :class:`CopyRefused` (see the module docstring), or
    ``OSError`` (a full target, say)."""
    copied = Copied()
    limits = _Limits(max_bytes, max_entries, owner, hard_links == "skip")
    with (
        closing_fd(os.open(source, DIR_FLAGS)) as src,
        closing_fd(os.open(target, DIR_FLAGS)) as dst,
    ):
        _copy_dir(src, dst, limits, copied, depth=0, prefix="")
    return copied


def _copy_dir(src: int, dst: int, limits: _Limits, copied: Copied, depth: int, prefix: str) -> None:
    done = copied.files + copied.dirs + copied.links + copied.skipped
    names: list[str] = []
    with os.scandir(src) as it:  # bounded while listing: a directory may hold millions
        for entry in it:
            if done + len(names) >= limits.max_entries:
                raise CopyRefused(f"more than {limits.max_entries} entries")
            names.append(entry.name)
    for name in names:
        if copied.files + copied.dirs + copied.links + copied.skipped >= limits.max_entries:
            raise CopyRefused(f"more than {limits.max_entries} entries")
        st = os.stat(name, dir_fd=src, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            if depth + 1 >= MAX_DEPTH:
                raise CopyRefused(f"directories nested deeper than {MAX_DEPTH}")
            _copy_subdir(src, dst, name, st, limits, copied, depth, prefix + name + "/")
        elif stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and limits.skip_hard_links:
            copied.leave_out(prefix + name)
        elif stat.S_ISREG(st.st_mode):
            _copy_file(src, dst, name, st, limits, copied)
        elif stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(name, dir_fd=src), name, dir_fd=dst)
            if limits.owner is not None:
                os.chown(name, *limits.owner, dir_fd=dst, follow_symlinks=False)
            os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dst, follow_symlinks=False)
            copied.links += 1
        else:
            copied.leave_out(prefix + name)


def _copy_subdir(
    src: int,
    dst: int,
    name: str,
    st: os.stat_result,
    limits: _Limits,
    copied: Copied,
    depth: int,
    prefix: str,
) -> None:
    with closing_fd(os.open(name, DIR_FLAGS, dir_fd=src)) as child:
        _same_inode(child, st, name)
        os.mkdir(name, 0o700, dir_fd=dst)
        with closing_fd(os.open(name, DIR_FLAGS, dir_fd=dst)) as made:
            _copy_dir(child, made, limits, copied, depth + 1, prefix)
            _finish(made, st, limits)
    copied.dirs += 1


def _copy_file(
    src: int, dst: int, name: str, st: os.stat_result, limits: _Limits, copied: Copied
) -> None:
    if st.st_nlink > 1:
        raise CopyRefused(f"a file with {st.st_nlink} hard links")
    if copied.bytes + st.st_size > limits.max_bytes:
        raise CopyTooLarge(f"more than {limits.max_bytes} bytes")
    with closing_fd(os.open(name, FILE_FLAGS, dir_fd=src)) as inp:
        _same_inode(inp, st, name)
        with closing_fd(os.open(name, _NEW_FILE, 0o600, dir_fd=dst)) as out:
            left = st.st_size  # as listed: a file growing meanwhile is cut there
            while left > 0:
                sent = os.sendfile(out, inp, None, min(left, _CHUNK))
                if sent == 0:  # shrank meanwhile
                    break
                left -= sent
            _finish(out, st, limits)
    copied.files += 1
    copied.bytes += st.st_size


def _same_inode(fd: int, st: os.stat_result, name: str) -> None:
    now = os.fstat(fd)
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        raise CopyRefused(f"{name!r} changed while it was copied")


def _finish(fd: int, st: os.stat_result, limits: _Limits) -> None:
    """Owner, then mode (a chown may clear set-id bits; we copy none anyway), then times."""
    if limits.owner is not None:
        os.fchown(fd, *limits.owner)
    os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o1777)
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
