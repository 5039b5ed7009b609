"""The value types the workspace hands back, and the snapshot diff."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

from mcp_code_sandbox.workspace.fs import EntryType, entry_type, iso_utc
from mcp_code_sandbox.workspace.mime import OCTET_STREAM, guess_mime

__all__ = [
    "Change",
    "Entry",
    "FileInfo",
    "ListResult",
    "ReadResult",
    "Snapshot",
    "Stamp",
    "diff",
    "entry_of",
    "make_entry",
]


@dataclass(frozen=True)
class FileInfo:
    path: str
    size_bytes: int
    mime_type: str
    modified: str


@dataclass(frozen=True)
class ReadResult:
    path: str
    #: At most ``max_bytes`` bytes starting at ``offset``.
    data: bytes
    offset: int
    #: Where the next page starts: ``offset + len(data)``.
    next_offset: int
    #: Size when the file was opened (the sandbox may change it meanwhile).
    size_bytes: int
    #: True when nothing is left after ``data``.
    eof: bool
    mime_type: str
    #: True when the file's first bytes are UTF-8 without NULs and its type is text or unknown.
    is_text: bool
    modified: str


@dataclass(frozen=True)
class Entry:
    path: str
    type: EntryType
    #: 0 for anything but a regular file (a symlink's target is never looked at).
    size_bytes: int
    modified: str
    mime_type: str


@dataclass(frozen=True)
class ListResult:
    #: The listed directory, canonical and relative: ``'.'`` for the root.
    path: str
    entries: tuple[Entry, ...]
    #: True when the limit (entries or depth) cut the listing short.
    truncated: bool


class Stamp(NamedTuple):
    """What tells one version of a file from the next. ``ctime_ns`` and ``ino`` catch a
    rewrite that keeps size and mtime (``shutil.copy2``, ``os.utime``)."""

    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int


@dataclass(frozen=True)
class Snapshot:
    #: Relative path -> stamp, for regular files only, ``.outputs/``, ``.packages/`` and
    #: ``.session/`` left out.
    files: Mapping[str, Stamp]
    #: True when the entry limit or depth cut the walk short: ``files`` is then partial.
    truncated: bool
    #: Bytes of the regular files in the directories ``files`` leaves out (0 unless the
    #: snapshot was taken with ``count_hidden``).
    hidden_bytes: int = 0

    @property
    def used_bytes(self) -> int:
        """What the workspace holds, towards its quota."""
        return self.hidden_bytes + sum(stamp.size for stamp in self.files.values())


@dataclass(frozen=True)
class Change:
    path: str
    size_bytes: int
    mime_type: str
    change: Literal["created", "modified"]


def diff(before: Snapshot, after: Snapshot) -> list[Change]:
    """Files created or modified between two snapshots, sorted by path; deletions are not
    reported. A file missing from a truncated ``before`` is reported as created."""
    changes: list[Change] = []
    for path in sorted(after.files):
        now = after.files[path]
        old = before.files.get(path)
        if old == now:
            continue
        kind: Literal["created", "modified"] = "created" if old is None else "modified"
        changes.append(Change(path, now.size, guess_mime(path), kind))
    return changes


def make_entry(path: str, st: os.stat_result) -> Entry:
    return entry_of(path, st.st_mode, st.st_size, st.st_mtime_ns)


def entry_of(path: str, mode: int, size: int, mtime_ns: int) -> Entry:
    """The entry of ``path`` from its ``lstat``'s mode, size and mtime."""
    kind = entry_type(mode)
    return Entry(
        path, kind, size if kind == "file" else 0, iso_utc(mtime_ns), _entry_mime(path, mode)
    )


def _entry_mime(path: str, mode: int) -> str:
    if stat.S_ISREG(mode):
        return guess_mime(path)
    # The freedesktop.org names for what is not a file, so clients need no special case.
    kinds = (
        (stat.S_ISDIR, "inode/directory"),
        (stat.S_ISLNK, "inode/symlink"),
        (stat.S_ISFIFO, "inode/fifo"),
        (stat.S_ISSOCK, "inode/socket"),
        (stat.S_ISCHR, "inode/chardevice"),
        (stat.S_ISBLK, "inode/blockdevice"),
    )
    return next((mime for test, mime in kinds if test(mode)), OCTET_STREAM)
