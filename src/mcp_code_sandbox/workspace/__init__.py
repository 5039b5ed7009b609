"""A session's files on the host: safe paths, uploads, reads, listing, artifact diff, quota.

A workspace is a host directory that the sandbox sees as ``/mnt/data``. Two parties are
hostile: the code in the sandbox, which can plant symlinks (to ``/etc/passwd``, to ``/``, to
another session), hard links, FIFOs, millions of files and deep trees, and change all of
it while the server looks; and the client, which sends paths. So:

- Client paths are validated as strings first (:func:`parse_path`): no absolute paths but
  ``/mnt/data/...``, no ``..``, NUL, control characters or backslashes, POSIX length limits.
- Then every component is opened with ``O_DIRECTORY|O_NOFOLLOW`` relative to the fd of the
  directory before it (``dir_fd=``), never by a host path string. A symlink anywhere in the
  path is refused (``InvalidPath``), not resolved: resolving it in user space and then
  opening the result (``realpath`` + check + ``open``) is racy, because the sandbox can swap
  a directory for a link between the check and the open. With dir fds there is no window.
- Files are read only when regular and with one hard link: a hard link planted in the
  workspace may be the only name of a host file the server can read and the sandbox can't.
  Opens use ``O_NONBLOCK``, so a FIFO fails the check instead of hanging the server.
- Uploads are written to a temporary name in the target directory and renamed (or, without
  ``overwrite``, hard-linked, which fails if the name appeared meanwhile) into place, so a
  failed write leaves nothing and a reader never sees half a file.
- Walks (listing, snapshots, usage) read a bounded number of entries and descend a bounded
  depth, and report ``truncated`` instead of running out of time, memory or fds.

Semantics:
- ``parse_path`` returns ``()`` for the workspace root (``'.'``, ``'/mnt/data'``), which
  only reading-side calls accept; uploads need a file name.
- Paths in results are relative to ``/mnt/data``, '/'-separated, canonical (``'a/b.csv'``,
  ``'.'`` for the root). Names that are not UTF-8 show with U+FFFD in them.
- ``owner`` ``None`` means "the server's own uid": nothing is chowned. A tuple means every
  directory and file the server creates is given to that uid/gid (the sandbox's user).
- ``ReadResult.data`` empty with ``eof`` true means the end was reached; ``max_bytes=0``
  is a valid way to get a file's size and type without its content.
- ``Snapshot.files`` holds regular files only; ``diff`` reports created and modified files,
  never deletions. ``truncated`` (in snapshots and listings) means "partial", not "error".
- ``guess_mime(name, None)`` looks at the extension only; with a ``head`` it also knows
  PNG, JPEG, GIF, WebP, PDF, ZIP, gzip and Parquet by their magic bytes.
"""

from mcp_code_sandbox.workspace.core import HEAD_BYTES, OUTPUTS_DIR, Workspace, measure
from mcp_code_sandbox.workspace.entries import (
    Change,
    Entry,
    FileInfo,
    ListResult,
    ReadResult,
    Snapshot,
    Stamp,
    diff,
)
from mcp_code_sandbox.workspace.fs import remove_tree
from mcp_code_sandbox.workspace.mime import (
    OCTET_STREAM,
    guess_mime,
    is_text,
    is_text_mime,
    looks_like_text,
)
from mcp_code_sandbox.workspace.paths import join_parts, parse_path

__all__ = [
    "HEAD_BYTES",
    "OCTET_STREAM",
    "OUTPUTS_DIR",
    "Change",
    "Entry",
    "FileInfo",
    "ListResult",
    "ReadResult",
    "Snapshot",
    "Stamp",
    "Workspace",
    "diff",
    "guess_mime",
    "is_text",
    "is_text_mime",
    "join_parts",
    "looks_like_text",
    "measure",
    "parse_path",
    "remove_tree",
]
