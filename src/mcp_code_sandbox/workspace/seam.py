"""The one way callers reach a session's files, wherever they live: :class:`Files`.

Two implement it. :class:`DirectoryFiles`: the workspace is a host directory (bwrap,
docker), the :class:`.core.Workspace` that the sandbox sees as /mnt/data, its blocking
calls run in worker threads. :class:`mcp_code_sandbox.sessions.agent_files.AgentFiles`:
the workspace lives in the sandbox (a Kubernetes pod's emptyDir) and the agent does the
same with the same rules (:mod:`mcp_code_sandbox.agent.files`), over its channel. Every
method is async and never blocks the event loop; results, errors and rules are the same
on both (``tests/unit/test_workspace.py`` runs on each).

The caller holds the session's lock around every call, as for a run: an agent answers
file requests between runs only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import BinaryIO, ParamSpec, Protocol, TypeVar

from mcp_code_sandbox.workspace.core import Workspace
from mcp_code_sandbox.workspace.entries import FileInfo, ListResult, ReadResult, Snapshot

__all__ = ["INLINE_SNAPSHOT_ENTRIES", "Blocking", "DirectoryFiles", "Files"]

#: A directory with at most this many entries is snapshotted on the event loop (see
#: :meth:`DirectoryFiles.snapshot`): a trip to a worker thread costs more than that walk.
INLINE_SNAPSHOT_ENTRIES = 64

_P = ParamSpec("_P")
_T = TypeVar("_T")


class Blocking(Protocol):
    """Runs a blocking call off the event loop (the session manager's per-owner worker
    threads, ``sessions.workers``): ``await blocking(fn, *args, **kwargs)``."""

    def __call__(
        self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs
    ) -> Awaitable[_T]: ...


class Files(Protocol):
    """A session's files (see the module doc). Paths are the client's, checked here
    (:func:`.paths.parse_path`); errors are the workspace's (``InvalidPath``,
    ``NotFound``, ``FileExists_``, ``QuotaExceeded``...)."""

    @property
    def quota_bytes(self) -> int: ...

    async def write_file(self, rel: str, data: bytes | BinaryIO, *, overwrite: bool) -> FileInfo:
        """:meth:`.core.Workspace.write_file`: atomic, quota checked first."""
        ...

    async def read_file(self, rel: str, *, offset: int = 0, max_bytes: int) -> ReadResult:
        """:meth:`.core.Workspace.read_file`: regular files with one link only."""
        ...

    async def open_file(self, rel: str) -> tuple[BinaryIO, FileInfo]:
        """A file to stream after the call (a download), with ``read_file``'s checks; the
        caller closes it. Blocking to read: read it in a worker thread."""
        ...

    async def list_files(
        self, rel: str = ".", *, recursive: bool = True, limit: int = 10000
    ) -> ListResult:
        """:meth:`.core.Workspace.list_files`: bounded, links shown, never followed."""
        ...

    async def snapshot(self, limit: int = 20000, *, count_hidden: bool = False) -> Snapshot:
        """:meth:`.core.Workspace.snapshot`: the stamps a run's ``files[]`` are diffed from."""
        ...

    async def usage_bytes(self, limit: int = 200_000) -> int:
        """:meth:`.core.Workspace.usage_bytes`: what counts towards the quota."""
        ...

    def reader(self) -> Callable[[str, int], ReadResult]:
        """``read(rel, max_bytes)`` for code already in a worker thread (a notebook's
        export embeds images one at a time): ``read_file`` from offset 0."""
        ...


class DirectoryFiles:
    """:class:`Files` of a host directory: ``workspace``'s calls in ``blocking``."""

    def __init__(self, workspace: Workspace, blocking: Blocking) -> None:
        self.workspace = workspace
        self._blocking = blocking

    @property
    def quota_bytes(self) -> int:
        return self.workspace.quota_bytes

    async def write_file(self, rel: str, data: bytes | BinaryIO, *, overwrite: bool) -> FileInfo:
        return await self._blocking(self.workspace.write_file, rel, data, overwrite=overwrite)

    async def read_file(self, rel: str, *, offset: int = 0, max_bytes: int) -> ReadResult:
        read = self.workspace.read_file
        return await self._blocking(read, rel, offset=offset, max_bytes=max_bytes)

    async def open_file(self, rel: str) -> tuple[BinaryIO, FileInfo]:
        return await self._blocking(self.workspace.open_file, rel)

    async def list_files(
        self, rel: str = ".", *, recursive: bool = True, limit: int = 10000
    ) -> ListResult:
        listing = self.workspace.list_files
        return await self._blocking(listing, rel, recursive=recursive, limit=limit)

    async def snapshot(self, limit: int = 20000, *, count_hidden: bool = False) -> Snapshot:
        """Taken here, on the event loop, when the workspace has at most
        ``INLINE_SNAPSHOT_ENTRIES`` entries (most; the walk reads no more than that many,
        so it stays well under a millisecond), else in a worker thread. The same snapshot
        either way: a walk that did not run out of entries saw them all."""
        if not count_hidden and limit >= INLINE_SNAPSHOT_ENTRIES:
            small = self.workspace.snapshot(INLINE_SNAPSHOT_ENTRIES)
            if not small.truncated:
                return small
        return await self._blocking(self.workspace.snapshot, limit, count_hidden=count_hidden)

    async def usage_bytes(self, limit: int = 200_000) -> int:
        return await self._blocking(self.workspace.usage_bytes, limit)

    def reader(self) -> Callable[[str, int], ReadResult]:
        def read(rel: str, max_bytes: int) -> ReadResult:
            return self.workspace.read_file(rel, max_bytes=max_bytes)

        return read
