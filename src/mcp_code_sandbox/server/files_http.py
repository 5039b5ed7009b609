"""``/files/{session_id}/{path}``: workspace files over plain HTTP (DESIGN §9).

``GET`` serves a file to whoever holds a signed link (:mod:`mcp_code_sandbox.downloads`),
streamed, with single ``Range`` requests, as an attachment the browser must not sniff. A
link that is tampered with, expired, or for a session that is gone gets the same 403;
a valid link to a file that is gone (or is a link, a directory, a hard link: the
workspace refuses those as it does for ``read_file``) gets 404. Neither says more.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from mcp_code_sandbox.downloads import UrlSigner, parse_range
from mcp_code_sandbox.errors import SandboxError
from mcp_code_sandbox.service import SandboxService

__all__ = ["file_routes"]

CHUNK = 64 * 1024
_SAFE_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "private, no-store",
    "Content-Security-Policy": "default-src 'none'; sandbox",
}


def file_routes(service: SandboxService, signer: UrlSigner) -> list[Route]:
    async def download(request: Request) -> Response:
        session_id = request.path_params["session_id"]
        path = request.path_params["path"]
        expires = request.query_params.get("exp", "")
        signature = request.query_params.get("sig", "")
        matches = [
            session
            for session in service.sessions.with_id(session_id)
            if signer.valid(session.owner, session_id, path, expires, signature)
        ]
        if not matches:
            return _plain(403, "this link is not valid, or has expired")
        try:
            source, info = matches[0].workspace.open_file(path)
        except SandboxError:
            return _plain(404, "no such file")
        return _stream(source, info.size_bytes, info.mime_type, path, request)

    return [Route("/files/{session_id}/{path:path}", download, methods=["GET", "HEAD"])]


def _stream(source: BinaryIO, size: int, mime_type: str, path: str, request: Request) -> Response:
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
        _chunks(source, start, end), status_code=status, headers=headers, media_type=mime_type
    )


def _chunks(source: BinaryIO, start: int, end: int) -> Iterator[bytes]:
    """The bytes ``[start, end)`` of the open file; a file that shrank ends early."""
    with source:
        source.seek(start)
        left = end - start
        while left > 0 and (chunk := source.read(min(CHUNK, left))):
            left -= len(chunk)
            yield chunk


def _attachment(name: str) -> str:
    fallback = "".join(
        c if c.isascii() and c.isprintable() and c not in '"\\' else "_" for c in name
    )
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(name)}"


def _plain(status: int, text: str) -> Response:
    return PlainTextResponse(text + "\n", status_code=status, headers=_SAFE_HEADERS)
