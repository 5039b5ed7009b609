"""A session's files when they live in its sandbox: :class:`AgentFiles`, over the agent.

The :class:`~mcp_code_sandbox.workspace.seam.Files` of a backend whose workspaces the
server cannot open (``Backend.workspace_in_sandbox``: a Kubernetes pod's emptyDir). Every
call is one or a few ``fs`` requests to the session's agent (:mod:`..agent.files`), which
applies the workspace's rules inside the sandbox; here the client's path is checked
first (:func:`..workspace.parse_path`, the same checks as the directory's), and every
answer is checked again, because the agent runs beside the sandbox's code: numbers must
be numbers, data must be base64 of no more than was asked for, pages must end.

Types, text detection and results are made here from the file's first bytes, exactly as
the directory's are, so results are the same on every backend. The caller holds the
session's lock (the agent answers between runs only).
"""

from __future__ import annotations

import base64
import binascii
import functools
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, BinaryIO

import anyio.from_thread

from mcp_code_sandbox.agent.files import READ_PAGE_BYTES, WRITE_CHUNK_BYTES
from mcp_code_sandbox.agent.protocol import FsEvent
from mcp_code_sandbox.errors import (
    FileExists_,
    InternalError,
    InvalidArgument,
    InvalidPath,
    NotFound,
    QuotaExceeded,
    SandboxError,
    SandboxFailed,
)
from mcp_code_sandbox.sanitize import clean_text
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.workspace import (
    FileInfo,
    ListResult,
    ReadResult,
    Snapshot,
    Stamp,
    guess_mime,
    is_text_mime,
    join_parts,
    measure,
    parse_path,
)
from mcp_code_sandbox.workspace.core import HEAD_BYTES, HIDDEN_DIRS, upload_parts
from mcp_code_sandbox.workspace.entries import Entry, entry_of
from mcp_code_sandbox.workspace.fs import iso_utc
from mcp_code_sandbox.workspace.seam import Blocking

__all__ = ["CHUNK_BYTES", "AgentFiles"]

#: Bytes per write chunk and per read page: each is base64-coded and framed on the event
#: loop, so small enough to take about a millisecond, and well under the agent's caps.
CHUNK_BYTES = min(2 << 20, READ_PAGE_BYTES, WRITE_CHUNK_BYTES)
#: The longest refusal message kept from the agent (its words are the sandbox's).
_MESSAGE_CHARS = 2000
_REFUSALS: dict[str, type[SandboxError]] = {
    "not_found": NotFound,
    "invalid_path": InvalidPath,
    "file_exists": FileExists_,
    "invalid_argument": InvalidArgument,
}


class AgentFiles:
    """:class:`~mcp_code_sandbox.workspace.seam.Files` through a session's agent.

    ``agent`` returns the agent client to ask (the session's, started if need be);
    ``blocking`` runs the host's own blocking work (reading an upload's file, a
    download's spool) off the event loop."""

    def __init__(
        self,
        agent: Callable[[], Awaitable[AgentClient]],
        *,
        quota_bytes: int,
        blocking: Blocking,
    ) -> None:
        if quota_bytes <= 0:
            raise InvalidArgument(f"quota_bytes must be positive, not {quota_bytes}")
        self._agent = agent
        self._quota_bytes = quota_bytes
        self._blocking = blocking

    @property
    def quota_bytes(self) -> int:
        return self._quota_bytes

    # -- files -----------------------------------------------------------------------------

    async def write_file(self, rel: str, data: bytes | BinaryIO, *, overwrite: bool) -> FileInfo:
        parts = upload_parts(rel)
        shown = join_parts(parts)
        size, head = (
            measure(data) if isinstance(data, bytes) else await self._blocking(measure, data)
        )
        agent = await self._agent()
        offset = 0
        while True:
            if isinstance(data, bytes):
                chunk = data[offset : offset + CHUNK_BYTES]
            else:
                chunk = await self._blocking(data.read, min(CHUNK_BYTES, size - offset))
            end = offset + len(chunk) >= size
            if not chunk and not end:
                await agent.fs({"action": "abort"})
                raise InternalError(f"the upload of '{shown}' ended before its size")
            answer = await agent.fs({
                "action": "write", "path": list(parts), "data": _b64(chunk), "offset": offset,
                "size": size, "overwrite": overwrite, "quota": self._quota_bytes, "end": end,
            })  # fmt: skip
            _check(answer)
            offset += len(chunk)
            if end:
                break
        return FileInfo(
            shown,
            _number(answer.get("size")),
            guess_mime(shown, head),
            iso_utc(_number(answer.get("mtime_ns"), signed=True)),
        )

    async def read_file(self, rel: str, *, offset: int = 0, max_bytes: int) -> ReadResult:
        if offset < 0 or max_bytes < 0:
            raise InvalidArgument(
                f"offset ({offset}) and max_bytes ({max_bytes}) must be 0 or more"
            )
        shown, first, pages, _ = await self._read(rel, offset, max_bytes)
        data = b"".join(pages)
        size, head = _number(first.get("size")), _data(first.get("head"), HEAD_BYTES)
        mime = guess_mime(shown, head)
        end = offset + len(data)
        return ReadResult(
            path=shown,
            data=data,
            offset=offset,
            next_offset=end,
            size_bytes=size,
            eof=len(data) < max_bytes or end >= size,
            mime_type=mime,
            is_text=is_text_mime(mime, head),
            modified=iso_utc(_number(first.get("mtime_ns"), signed=True)),
        )

    async def open_file(self, rel: str) -> tuple[BinaryIO, FileInfo]:
        """The whole file, copied into a host spool now (the agent answers under the
        session's lock only; the download streams after it), with its info at open."""
        shown, first, _, _ = await self._read(rel, 0, 0)
        size = _number(first.get("size"))
        head = _data(first.get("head"), HEAD_BYTES)
        spool: BinaryIO = await self._blocking(tempfile.TemporaryFile, prefix="mcs-download-")
        try:
            # At most the size at open: code an earlier cell left running may still write.
            _, _, _, got = await self._read(rel, 0, size, into=spool)
            await self._blocking(spool.seek, 0)
        except BaseException:
            spool.close()
            raise
        modified = iso_utc(_number(first.get("mtime_ns"), signed=True))
        return spool, FileInfo(shown, got, guess_mime(shown, head), modified)

    async def _read(
        self, rel: str, offset: int, max_bytes: int, *, into: BinaryIO | None = None
    ) -> tuple[str, FsEvent, list[bytes], int]:
        """Pages of ``rel`` from ``offset``, up to ``max_bytes`` (one request at least, for
        the file's size and head): the path shown, the first answer, the pages (or none,
        written to ``into`` instead), and how many bytes they hold."""
        parts = parse_path(rel, for_upload=False)
        shown = join_parts(parts)
        agent = await self._agent()
        pages: list[bytes] = []
        first: FsEvent | None = None
        want = max_bytes
        got = 0
        while True:
            ask = min(want, CHUNK_BYTES)
            answer = await agent.fs(
                {"action": "read", "path": list(parts), "offset": offset, "max_bytes": ask}
            )
            _check(answer)
            first = first or answer
            page = _data(answer.get("data"), ask)
            if into is None:
                pages.append(page)
            else:
                await self._blocking(into.write, page)
            got += len(page)
            offset += len(page)
            want -= len(page)
            if len(page) < ask or want <= 0:
                return shown, first, pages, got

    # -- listing, snapshots, usage -----------------------------------------------------------

    async def list_files(
        self, rel: str = ".", *, recursive: bool = True, limit: int = 10000
    ) -> ListResult:
        if limit < 1:
            raise InvalidArgument(f"limit must be 1 or more, not {limit}")
        parts = parse_path(rel, for_upload=False)
        # Saved outputs, packages and variables are not the session's files (``HIDDEN_DIRS``):
        # listed only when asked for by path.
        skip = sorted(HIDDEN_DIRS) if not parts else []
        request = {"action": "list", "path": list(parts), "recursive": recursive,
                   "limit": limit, "skip": skip}  # fmt: skip
        found: list[Entry] = []
        truncated = False
        for answer in await self._pages(request, limit):
            truncated = truncated or answer.get("truncated") is True
            for item in _items(answer.get("entries"), 4):
                path, mode, size, mtime_ns = item
                found.append(
                    entry_of(
                        _path(path), _number(mode), _number(size), _number(mtime_ns, signed=True)
                    )
                )
        if len(found) > limit:
            found, truncated = found[:limit], True
        return ListResult(join_parts(parts), tuple(found), truncated)

    async def snapshot(self, limit: int = 20000, *, count_hidden: bool = False) -> Snapshot:
        request = {"action": "snapshot", "limit": limit, "skip": sorted(HIDDEN_DIRS),
                   "count_hidden": count_hidden}  # fmt: skip
        files: dict[str, Stamp] = {}
        truncated = False
        extra = 0
        for answer in await self._pages(request, limit):
            truncated = truncated or answer.get("truncated") is True
            extra = _number(answer.get("extra_bytes", 0))
            for item in _items(answer.get("files"), 5):
                path, size, mtime_ns, ctime_ns, ino = item
                files[_path(path)] = Stamp(
                    _number(size), _number(mtime_ns, signed=True), _number(ctime_ns, signed=True),
                    _number(ino),
                )  # fmt: skip
        if len(files) > limit:
            files, truncated = dict(list(files.items())[:limit]), True
        return Snapshot(files, truncated, extra if count_hidden else 0)

    async def usage_bytes(self, limit: int = 200_000) -> int:
        agent = await self._agent()
        answer = await agent.fs({"action": "usage", "limit": limit})
        _check(answer)
        return _number(answer.get("bytes"))

    def reader(self) -> Callable[[str, int], ReadResult]:
        """Reads by the event loop's agent requests, from a worker thread of anyio's
        (``sessions.workers``): no thread more is taken, which the caller's may hold."""

        def read(rel: str, max_bytes: int) -> ReadResult:
            return anyio.from_thread.run(
                functools.partial(self.read_file, rel, max_bytes=max_bytes)
            )

        return read

    async def _pages(self, request: dict[str, Any], limit: int) -> list[FsEvent]:
        """Every page of a walk: asked from ``start`` 0 until ``next`` is null. A page
        holds one entry at least, so there are at most ``limit`` + 1 of them."""
        agent = await self._agent()
        answers: list[FsEvent] = []
        start = 0
        for _ in range(limit + 1):
            answer = await agent.fs({**request, "start": start})
            _check(answer)
            answers.append(answer)
            following = answer.get("next")
            if following is None:
                return answers
            if _number(following) <= start:
                raise _malformed("a page that does not move on")
            start = _number(following)
        raise _malformed("more pages than entries")


# -- checking what the agent sent ---------------------------------------------------------


def _check(answer: FsEvent) -> None:
    """Raise the refusal an answer carries (in the server's own error types)."""
    if answer.get("ok") is True:
        return
    code = answer.get("code")
    message = clean_text(str(answer.get("message", "")))[:_MESSAGE_CHARS] or "refused"
    if code == "quota_exceeded":
        details = answer.get("details")
        numbers = details if isinstance(details, dict) else {}
        used, quota = numbers.get("used_bytes"), numbers.get("quota_bytes")
        if isinstance(used, int) and isinstance(quota, int):
            raise QuotaExceeded(message, used_bytes=used, quota_bytes=quota)
        raise QuotaExceeded(message)
    error = _REFUSALS.get(str(code))
    if error is None:
        raise InternalError(f"the sandbox could not do a file operation: {message}")
    raise error(message)


def _number(value: Any, *, signed: bool = False) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or (value < 0 and not signed):
        raise _malformed(f"{value!r:.50} where a number belongs")
    return value


def _data(value: Any, most: int) -> bytes:
    if not isinstance(value, str) or len(value) > (most // 3 + 1) * 4:
        raise _malformed("data that is not what was asked for")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise _malformed("data that is not base64") from None
    if len(data) > most:
        raise _malformed("more data than was asked for")
    return data


def _path(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _malformed("an entry without a path")
    return value


def _items(value: Any, width: int) -> Iterator[list[Any]]:
    if not isinstance(value, list):
        raise _malformed("a page that is not a list")
    for item in value:
        if not isinstance(item, list) or len(item) != width:
            raise _malformed("an entry of the wrong shape")
        yield item


def _malformed(what: str) -> SandboxFailed:
    return SandboxFailed(f"the sandbox's agent sent {what} in a file answer")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
