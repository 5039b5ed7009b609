"""``/files/{session_id}/{path}``: workspace files over plain HTTP (DESIGN §9).

``GET`` serves a file to whoever holds a signed link (:mod:`mcp_code_sandbox.server.downloads`),
opened through the service under the session lock (``SandboxService.open_download``) and
streamed, with single ``Range`` requests, as an attachment the browser must not sniff. A
link that is tampered with, expired, or for a session that is gone gets the same 403;
a valid link to a file that is gone (or is a link, a directory, a hard link: the
workspace refuses those as it does for ``read_file``) gets 404. Neither says more.

``PUT`` uploads a file too big for a tool argument, with the bearer token of the session's
owner (the same check as ``/mcp``), exactly as ``upload_file`` would (a new session when
the id is unknown to this owner; ``?overwrite=true`` to replace). The body is spooled to
an unnamed temporary file as it arrives, never held in memory, and cut off with 413 at the
upload limit; then the workspace checks the quota and writes it atomically, so a refused
upload leaves nothing in the workspace. Errors are JSON ``{"error": code, "message": ...}``
with the HTTP status of the code (``SandboxError.http_status``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, BinaryIO
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from mcp_code_sandbox.errors import SandboxError, Unauthorized, UploadTooLarge
from mcp_code_sandbox.server.downloads import UrlSigner, parse_range
from mcp_code_sandbox.service import SandboxService

__all__ = ["Authenticate", "file_routes"]

CHUNK = 64 * 1024
_SAFE_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "private, no-store",
    "Content-Security-Policy": "default-src 'none'; sandbox",
}


#: The owner a request's bearer token names; ``None``: missing or wrong.
Authenticate = Callable[[Request], Awaitable[str | None]]
#: ``await run(fn, *args)``: ``fn`` in the worker threads of the file's owner.
InThread = Callable[..., Awaitable[Any]]


def file_routes(
    service: SandboxService, signer: UrlSigner, authenticate: Authenticate
) -> list[Route]:
    async def download(request: Request) -> Response:
        session_id = request.path_params["session_id"]
        path = request.path_params["path"]
        expires = request.query_params.get("exp", "")
        signature = request.query_params.get("sig", "")

        def signed_for(owner: str) -> bool:
            return signer.valid(owner, session_id, path, expires, signature)

        try:
            opened = await service.open_download(session_id, path, signed_for)
        except SandboxError:
            return _plain(404, "no such file")
        if opened is None:
            return _plain(403, "this link is not valid, or has expired")
        owner = opened.owner

        async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
            return await service.threads.run(owner, fn, *args)

        info = opened.info
        return _stream(opened.source, info.size_bytes, info.mime_type, path, request, in_thread)

    async def upload(request: Request) -> Response:
        owner = await authenticate(request)
        if owner is None:
            return _error(
                Unauthorized("a bearer token is required (Authorization: Bearer <token>)"),
                {"WWW-Authenticate": "Bearer"},
            )
        limit = service.settings.max_upload_bytes
        too_large = UploadTooLarge(f"the file is larger than the limit of {limit} bytes")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return _error(too_large)
        overwrite = request.query_params.get("overwrite", "false").lower() in ("1", "true")
        with tempfile.TemporaryFile(prefix="mcs-put-") as spool:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    return _error(too_large)
                await service.threads.run(owner, spool.write, chunk)
            spool.seek(0)
            try:
                done = await service.upload_file(
                    owner,
                    request.path_params["path"],
                    spool,
                    session_id=request.path_params["session_id"],
                    overwrite=overwrite,
                )
            except SandboxError as exc:
                return _error(service.public_error(exc))
        body = {
            "session_id": done.session_id,
            "path": done.path,
            "size_bytes": done.size_bytes,
            "session_created": done.session_created,
        }
        return JSONResponse(body, status_code=201 if done.session_created else 200)

    route = "/files/{session_id}/{path:path}"
    return [
        Route(route, download, methods=["GET", "HEAD"]),
        Route(route, upload, methods=["PUT"]),
    ]


def _stream(
    source: BinaryIO, size: int, mime_type: str, path: str, request: Request, run: InThread
) -> Response:
    wanted = parse_range(request.headers.get("range"), size)
    headers = {
        **_SAFE_HEADERS,
        "Accept-Ranges": "bytes",
        "Content-Disposition": _attachment(path.rsplit("/", 1)[-1]),
    }
    if wanted is False:
        source.close()
        return Response(status_code=416, headers={**headers, "Content-Range": f"bytes */{size}"})
    start, end = wanted if isinstance(wanted, tuple) else (0, size)
    headers["Content-Length"] = str(end - start)
    status = 200
    if isinstance(wanted, tuple):
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    if request.method == "HEAD":
        source.close()
        return Response(status_code=status, headers=headers, media_type=mime_type)
    return StreamingResponse(
        _chunks(source, start, end, run), status_code=status, headers=headers, media_type=mime_type
    )


async def _chunks(source: BinaryIO, start: int, end: int, run: InThread) -> AsyncIterator[bytes]:
    """The bytes ``[start, end)`` of the open file, each chunk read in the owner's worker
    threads (a slot per chunk, so a slow download holds none); a file that shrank ends
    early."""
    try:
        offset = start
        while offset < end:
            chunk = await run(os.pread, source.fileno(), min(CHUNK, end - offset), offset)
            if not chunk:
                break
            offset += len(chunk)
            yield chunk
    finally:
        source.close()


def _attachment(name: str) -> str:
    fallback = "".join(
        c if c.isascii() and c.isprintable() and c not in '"\\' else "_" for c in name
    )
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(name)}"


def _error(error: SandboxError, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(
        {"error": error.code, "message": error.message},
        status_code=error.http_status,
        headers={**_SAFE_HEADERS, **(headers or {})},
    )


def _plain(status: int, text: str) -> Response:
    return PlainTextResponse(text + "\n", status_code=status, headers=_SAFE_HEADERS)
