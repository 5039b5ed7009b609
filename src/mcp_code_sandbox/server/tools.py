"""The six tools of DESIGN §6. Each validates its arguments, calls the service, shapes.

Owners: the authenticated principal over HTTP (a token's name, a JWT's subject), ``local``
over stdio and over unauthenticated loopback HTTP (``auth.current_owner``).
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, ParamSpec

import structlog
from mcp.server.mcpserver import Context
from mcp_types import CallToolResult, ContentBlock, ImageContent, TextContent
from pydantic import Field

from mcp_code_sandbox.errors import (
    ArtifactTooLarge,
    InternalError,
    InvalidArgument,
    InvalidContent,
    SandboxError,
    UploadTooLarge,
)
from mcp_code_sandbox.images import fit_image
from mcp_code_sandbox.runs import IMAGE_MIME_TYPES, RunRequest
from mcp_code_sandbox.runtimes import RUNTIMES
from mcp_code_sandbox.sanitize import clean_text, escape_name
from mcp_code_sandbox.server import models
from mcp_code_sandbox.server.auth import current_owner
from mcp_code_sandbox.server.fit import fit_count
from mcp_code_sandbox.server.results import (
    embedded_blob,
    error_result,
    file_uri,
    run_result,
    structured_result,
)
from mcp_code_sandbox.service import SandboxService

__all__ = ["ToolSet"]

log = structlog.get_logger("mcp_code_sandbox.tools")
P = ParamSpec("P")
LANGUAGES = sorted(RUNTIMES)
#: Room in a read_file result for everything but the page itself.
READ_META_BYTES = 8 * 1024
#: Directory entries one list_files walk reads (beyond: ``truncated``, narrow the path),
#: and the most one page can hold before the result budget cuts it further.
LIST_WALK = 50_000
LIST_PAGE = 10_000

SessionArg = Annotated[
    str | None,
    Field(
        description="Session to use. Omit to start a new one (its id is in the result); "
        "pass your own id (letters, digits, . _ -) to create or reuse a named session."
    ),
]
RequiredSession = Annotated[str, Field(description="The session_id a previous result returned")]


def tool_errors(
    fn: Callable[P, Awaitable[CallToolResult]],
) -> Callable[P, Awaitable[CallToolResult]]:
    """Turn our errors into ``isError`` results; anything else is ``internal_error``."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> CallToolResult:
        try:
            return await fn(*args, **kwargs)
        except SandboxError as exc:
            return error_result(exc)
        except Exception:
            log.exception("tool failed unexpectedly", tool=fn.__name__)
            return error_result(
                InternalError(
                    "the server failed unexpectedly; the error is in its log. Try again, or "
                    "start a new session if it persists"
                )
            )

    return wrapper


class ToolSet:
    """The tools bound to one service; ``app.build_server`` registers them."""

    def __init__(self, service: SandboxService) -> None:
        self.service = service
        self.settings = service.settings

    @tool_errors
    async def run_code(
        self,
        code: Annotated[str, Field(description="The program or cell to run")],
        ctx: Context[Any, Any],
        language: Annotated[
            str,
            # The enum is set by app.build_server and follows the runner images found.
            Field(
                description="Language of the code (see list_runtimes)",
                json_schema_extra={"enum": LANGUAGES},
            ),
        ] = "python",
        session_id: SessionArg = None,
        timeout_s: Annotated[float | None, Field(description="Wall-time limit in seconds")] = None,
        network: Annotated[
            bool,
            Field(
                description=(
                    "Outbound network for this call, where the server allows it (else "
                    "network_not_allowed). Changing it within a session restarts the "
                    "sandbox: files kept, variables lost"
                )
            ),
        ] = False,
        env: Annotated[
            dict[str, str] | None, Field(description="Extra environment for this call")
        ] = None,
    ) -> Annotated[CallToolResult, models.RunResult]:
        request = RunRequest(code, language, timeout_s, network, env)
        owner = current_owner()
        report = await self.service.run_code(
            owner, request, session_id, on_progress=_progress_sink(ctx)
        )
        return run_result(report, self.settings, self._links(owner, report.session_id))

    @tool_errors
    async def upload_file(
        self,
        filename: Annotated[
            str, Field(description="Path relative to /mnt/data, e.g. data/sales.csv")
        ],
        content_base64: Annotated[str | None, Field(description="File content, base64")] = None,
        content_text: Annotated[str | None, Field(description="File content as UTF-8 text")] = None,
        session_id: SessionArg = None,
        overwrite: Annotated[bool, Field(description="Replace an existing file")] = False,
    ) -> Annotated[CallToolResult, models.UploadResult]:
        data = self._decode_content(content_base64, content_text)
        up = await self.service.upload_file(
            current_owner(), filename, data, session_id=session_id, overwrite=overwrite
        )
        return structured_result(
            models.UploadResult(
                session_id=up.session_id,
                path=up.path,
                size_bytes=up.size_bytes,
                session_created=up.session_created,
                notice=up.notice,
            )
        )

    def _decode_content(self, b64: str | None, text: str | None) -> bytes:
        if (b64 is None) == (text is None):
            raise InvalidArgument("give exactly one of content_base64 and content_text")
        if text is not None:
            return text.encode("utf-8")
        assert b64 is not None
        limit = self.settings.max_upload_bytes
        if len(b64) > (limit + 2) // 3 * 4 + 4:
            raise UploadTooLarge(f"the file is larger than the upload limit of {limit} bytes")
        try:
            return base64.b64decode("".join(b64.split()), validate=True)
        except (binascii.Error, ValueError):
            raise InvalidContent(
                "content_base64 is not valid base64; send standard base64 (RFC 4648) or "
                "use content_text for text"
            ) from None

    @tool_errors
    async def read_file(
        self,
        session_id: RequiredSession,
        path: Annotated[str, Field(description="Path relative to /mnt/data")],
        offset: Annotated[int, Field(description="Byte offset to start at (text paging)")] = 0,
        max_bytes: Annotated[int | None, Field(description="Most bytes to return")] = None,
    ) -> Annotated[CallToolResult, models.ReadFileResult]:
        owner = current_owner()
        read = await self.service.read_file(
            owner, session_id, path, offset=offset, max_bytes=max_bytes
        )
        shown = escape_name(read.path)  # how listings show it, and how it is given back
        uri = file_uri(session_id, shown)
        link = self._links(owner, session_id)
        url = link(shown) if link else None
        whole = offset == 0 and read.eof
        block: ContentBlock
        room = self.settings.max_result_bytes - READ_META_BYTES  # the page and its meta
        if read.mime_type in IMAGE_MIME_TYPES and whole:
            cap = min(self.settings.max_image_bytes, room * 3 // 4)  # base64: 4/3
            fitted = fit_image(read.data, read.mime_type, cap)
            if fitted is None:
                return self._too_large(shown, read.size_bytes, url)
            block = ImageContent(
                type="image", data=base64.b64encode(fitted[0]).decode(), mime_type=fitted[1]
            )
            encoding, returned = "image", len(read.data)
        elif read.is_text:
            text, returned = _text_page(read.data, read.eof, room)
            block = TextContent(type="text", text=text)
            encoding = "text"
        elif whole and len(read.data) <= self._blob_bytes():
            block = embedded_blob(uri, read.data, read.mime_type)
            encoding, returned = "resource", len(read.data)
        else:
            return self._too_large(shown, read.size_bytes, url)
        end = offset + returned
        eof = end >= read.size_bytes
        meta = models.ReadFileResult(
            session_id=session_id,
            path=shown,
            mime_type=read.mime_type,
            size_bytes=read.size_bytes,
            offset=offset,
            returned_bytes=returned,
            eof=eof,
            next_offset=None if eof else end,
            encoding=encoding,  # type: ignore[arg-type]
            download_url=url,
        )
        return structured_result(meta, [block])

    def _too_large(self, path: str, size: int, url: str | None) -> CallToolResult:
        where = f"download it from {url}" if url else "download it over HTTP"
        details = {"download_url": url} if url else {}
        return error_result(
            ArtifactTooLarge(
                f"{path} is {size} bytes of binary data, more than one result can carry "
                f"({self._blob_bytes()} bytes); process it with run_code, or "
                f"{where}",
                **details,
            )
        )

    def _blob_bytes(self) -> int:
        """The largest binary file read_file embeds whole (base64 in the result budget)."""
        room = self.settings.max_result_bytes - READ_META_BYTES
        return min(self.settings.max_read_bytes, room * 3 // 4)

    def _links(self, owner: str, session_id: str) -> Callable[[str], str] | None:
        """Download links to ``session_id``'s files, when the HTTP server serves them."""
        signer = self.service.downloads
        if signer is None:
            return None
        return functools.partial(signer.url, owner, session_id)

    @tool_errors
    async def list_files(
        self,
        session_id: RequiredSession,
        path: Annotated[str, Field(description="Directory relative to /mnt/data")] = ".",
        recursive: Annotated[bool, Field(description="Include subdirectories")] = True,
        offset: Annotated[
            int, Field(ge=0, description="Skip this many entries (a previous next_offset)")
        ] = 0,
    ) -> Annotated[CallToolResult, models.ListFilesResult]:
        # The same bounded walk every time (sorted, so the same entries in the same
        # order while the files stay put), paged by offset within the result budget.
        listing = await self.service.list_files(
            current_owner(), session_id, path, recursive=recursive, limit=LIST_WALK
        )
        rest = listing.entries[offset:]
        entries = [
            models.FileEntryOut(**{**vars(e), "path": escape_name(e.path)})
            for e in rest[:LIST_PAGE]
        ]

        def page(count: int) -> CallToolResult:
            more = count < len(rest)
            return structured_result(
                models.ListFilesResult(
                    session_id=session_id,
                    path=path,
                    entries=entries[:count],
                    truncated=more or listing.truncated,
                    next_offset=offset + count if more and count else None,
                )
            )

        return fit_count(page, len(entries), self.settings.max_result_bytes)

    @tool_errors
    async def close_session(
        self, session_id: RequiredSession
    ) -> Annotated[CallToolResult, models.CloseResult]:
        await self.service.close_session(current_owner(), session_id)
        return structured_result(models.CloseResult(session_id=session_id, status="closed"))

    @tool_errors
    async def list_runtimes(self) -> Annotated[CallToolResult, models.RuntimesResult]:
        runtimes = [models.RuntimeOut(**r) for r in await self.service.runtimes()]
        return structured_result(models.RuntimesResult(runtimes=runtimes))


def _progress_sink(ctx: Context[Any, Any]) -> Callable[[float, str], Awaitable[None]] | None:
    meta = ctx.request_context.meta or {}
    if meta.get("progress_token") is None:
        return None

    async def report(elapsed: float, message: str) -> None:
        await ctx.report_progress(elapsed, None, clean_text(message))

    return report


def _text_page(data: bytes, eof: bool, room: int) -> tuple[str, int]:
    """A page of text whose JSON form fits in ``room`` bytes (escapes can make it up to
    six times the text): shorter pages until it does; ``next_offset`` says where to go on."""
    page = data[:room]
    while True:
        text, returned = _utf8_prefix(page, eof and len(page) == len(data))
        if len(page) <= 4096 or len(json.dumps(text, ensure_ascii=False).encode()) <= room:
            return text, returned
        page = page[: len(page) // 2]


def _utf8_prefix(data: bytes, eof: bool) -> tuple[str, int]:
    """Decode a page of text, leaving a multi-byte character cut by the page end for the
    next page (so paging never garbles text)."""
    if not eof:
        for cut in range(0, 4):
            try:
                end = len(data) - cut
                return data[:end].decode("utf-8"), end
            except UnicodeDecodeError:
                continue
    return data.decode("utf-8", "replace"), len(data)
