"""The workspace as MCP resources: ``sandbox://{session_id}/{path}``.

Three requests, served here rather than by the SDK's resource template, whose reads all
carry the one MIME type given when it was registered (a PNG, a CSV and an XLSX alike
said ``text/plain``, and clients that render or attach by type mishandled them):

- ``resources/templates/list``: the one template.
- ``resources/read``: a whole workspace file with its detected MIME type (the type
  ``list_files`` and ``read_file`` report), text as text and anything else as a blob;
  a file larger than one read is ``artifact_too_large``, naming ``read_file``.
- ``resources/list``: the caller's workspace files, every session of theirs, sorted by
  session and path, in pages of at most :data:`PAGE` (``nextCursor``). The hidden
  directories (saved outputs, installed packages, saved state) are left out, as in
  ``list_files``; a session busy with a run for more than :data:`BUSY_WAIT_S` is
  skipped (its files are listed once it is free), and a listing counts as activity.

Errors are protocol errors whose ``data`` carries our code (``error_code``), as
``_meta`` does for tools. URIs are checked by the SDK's own template parser and path
policy (no ``..``, no absolute path, no NUL) before the workspace checks them again.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
from typing import Any

from mcp import MCPError
from mcp.server import MCPServer
from mcp.server.mcpserver.resources.templates import DEFAULT_RESOURCE_SECURITY
from mcp.shared.uri_template import UriTemplate
from mcp_types import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    BlobResourceContents,
    ListResourcesResult,
    ListResourceTemplatesResult,
    PaginatedRequestParams,
    ReadResourceRequestParams,
    ReadResourceResult,
    Resource,
    ResourceTemplate,
    TextResourceContents,
)

from mcp_code_sandbox.errors import SandboxError, SessionBusy, SessionNotFound
from mcp_code_sandbox.sanitize import escape_name
from mcp_code_sandbox.server.auth import current_owner
from mcp_code_sandbox.server.downloads import UrlSigner
from mcp_code_sandbox.service import SandboxService

__all__ = ["PAGE", "TEMPLATE", "WorkspaceResources"]

TEMPLATE = "sandbox://{session_id}/{+path}"
#: Resources one ``resources/list`` page holds: a client lists them all page by page; a
#: page of 500 short entries stays far below any result budget.
PAGE = 500
#: Directory entries one session's walk reads for a page (as ``list_files`` does); a
#: larger workspace is listed up to here (``list_files`` with a path reaches the rest).
WALK = 50_000
#: How long a listing waits for a session busy with a run: a listing is no reason to
#: wait out someone's minute-long cell; that session's files are listed once it is free.
BUSY_WAIT_S = 1.0


class WorkspaceResources:
    """The ``sandbox://`` resources of ``service``, installed on an ``MCPServer``."""

    def __init__(self, service: SandboxService, signer: UrlSigner | None) -> None:
        self.service = service
        self.signer = signer
        self._template = UriTemplate.parse(TEMPLATE)

    def install(self, mcp: MCPServer[Any]) -> None:
        # The SDK's low-level server replaces a method's handler when one is added; it
        # offers no public way to reach it from MCPServer yet.
        lowlevel = mcp._lowlevel_server
        lowlevel.add_request_handler(
            "resources/templates/list", PaginatedRequestParams, self.templates
        )
        lowlevel.add_request_handler("resources/list", PaginatedRequestParams, self.list)
        lowlevel.add_request_handler("resources/read", ReadResourceRequestParams, self.read)

    async def templates(
        self, ctx: Any, params: PaginatedRequestParams
    ) -> ListResourceTemplatesResult:
        template = ResourceTemplate(
            uri_template=TEMPLATE,
            name="workspace_file",
            description="A file in a session's /mnt/data, with its detected MIME type "
            "(whole; larger files: read_file pages)",
        )
        return ListResourceTemplatesResult(resource_templates=[template])

    async def read(self, ctx: Any, params: ReadResourceRequestParams) -> ReadResourceResult:
        uri = str(params.uri)
        matched = self._template.match(uri)
        if matched is None or DEFAULT_RESOURCE_SECURITY.validate(matched) is not None:
            raise MCPError(INVALID_PARAMS, f"Unknown resource: {uri}", {"uri": uri})
        session_id, path = str(matched["session_id"]), str(matched["path"])
        owner = current_owner()
        link = functools.partial(self.signer.url, owner, session_id) if self.signer else None
        try:
            content, mime_type = await self.service.read_resource(owner, session_id, path, link)
        except SandboxError as exc:
            raise _protocol_error(self.service.public_error(exc), uri) from None
        contents: TextResourceContents | BlobResourceContents
        if isinstance(content, str):
            contents = TextResourceContents(uri=uri, text=content, mime_type=mime_type)
        else:
            blob = base64.b64encode(content).decode()
            contents = BlobResourceContents(uri=uri, blob=blob, mime_type=mime_type)
        return ReadResourceResult(contents=[contents])

    async def list(self, ctx: Any, params: PaginatedRequestParams) -> ListResourcesResult:
        owner = current_owner()
        session_id, offset = _parse_cursor(params.cursor)
        sessions = sorted(s.id for s in self.service.sessions.listed(owner))
        listed: list[Resource] = []
        for sid in (s for s in sessions if s >= session_id):
            skip = offset if sid == session_id else 0
            try:
                listing = await self.service.list_files(
                    owner, sid, ".", recursive=True, limit=WALK, wait_s=BUSY_WAIT_S
                )
            except (SessionNotFound, SessionBusy):  # closed since, or running a long cell
                continue
            files = [e for e in listing.entries if e.type == "file"][skip:]
            room = PAGE - len(listed)
            listed += [_resource(sid, e.path, e.mime_type, e.size_bytes) for e in files[:room]]
            if len(files) > room:
                return ListResourcesResult(resources=listed, next_cursor=_cursor(sid, skip + room))
        return ListResourcesResult(resources=listed)


def _resource(session_id: str, path: str, mime_type: str, size: int) -> Resource:
    name = escape_name(path)  # as listings show it, and as clients give it back
    return Resource(
        uri=f"sandbox://{session_id}/{name}",
        name=name,
        title=f"{name} (session {session_id})",
        mime_type=mime_type,
        size=size,
    )


def _cursor(session_id: str, offset: int) -> str:
    raw = json.dumps([session_id, offset], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _parse_cursor(cursor: str | None) -> tuple[str, int]:
    """(session id, files of it to skip) from a ``nextCursor`` this module made; the
    start for none. Anything else is the client's error."""
    if cursor is None:
        return "", 0
    try:
        session_id, offset = json.loads(base64.urlsafe_b64decode(cursor.encode()))
    except (binascii.Error, ValueError, TypeError, UnicodeError):
        session_id, offset = None, None
    if not isinstance(session_id, str) or not isinstance(offset, int) or offset < 0:
        raise MCPError(INVALID_PARAMS, "invalid cursor: pass a nextCursor of resources/list")
    return session_id, offset


def _protocol_error(error: SandboxError, uri: str) -> MCPError:
    details = {k: v for k, v in error.details.items() if isinstance(v, str | int)}
    data = {"uri": uri, "error_code": error.code, **details}
    return MCPError(INTERNAL_ERROR, str(error), data)
