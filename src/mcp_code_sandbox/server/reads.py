"""Turn a decided ``read_file`` page (:mod:`mcp_code_sandbox.workspace.pages`) into MCP content.

The page is decided on the service side; here it becomes a text block, an image (its
preview, made within the image budget by :func:`.tool_results.image_blocks`, the same
shaper ``run_code`` uses) or an embedded resource, beside its structured meta.
"""

from __future__ import annotations

from collections.abc import Callable

from mcp_types import CallToolResult, ContentBlock, ImageContent, TextContent

from mcp_code_sandbox.sanitize import escape_name
from mcp_code_sandbox.server import models
from mcp_code_sandbox.server.media import MAX_PIXELS
from mcp_code_sandbox.server.tool_results import (
    embedded_blob,
    file_uri,
    image_blocks,
    structured_result,
)
from mcp_code_sandbox.settings import Settings
from mcp_code_sandbox.workspace import ReadResult
from mcp_code_sandbox.workspace.pages import Page

__all__ = ["READ_META_BYTES", "no_preview", "page_result", "read_result"]

#: Room in a read_file result for everything but the page itself.
READ_META_BYTES = 8 * 1024


def read_result(
    page: Page, session_id: str, settings: Settings, link: Callable[[str], str] | None
) -> CallToolResult:
    """The ``read_file`` result for ``page``: an image candidate as its preview when one
    fits, else the page as decided, with a notice saying why; ``link`` makes the
    ``download_url`` (none when ``None``).

    Blocking (it decodes and re-encodes images): call it in a worker thread."""
    read = page.read
    preview, notice = None, None
    if page.wants_preview:
        room = page.budget - READ_META_BYTES
        candidates = [(page.image, read.mime_type)] if page.image is not None else []
        shown = image_blocks(candidates, 1, settings.max_image_bytes, room * 3 // 4)
        if shown.blocks:
            preview = shown.blocks[0]
        else:
            notice = no_preview(read, shown.per_image)
    # Names as listings show them, and as clients give them back (sanitize).
    url = link(escape_name(read.path)) if link else None
    return page_result(page, session_id, preview=preview, notice=notice, download_url=url)


def page_result(
    page: Page,
    session_id: str,
    *,
    preview: ImageContent | None = None,
    notice: str | None = None,
    download_url: str | None = None,
) -> CallToolResult:
    """``page`` as MCP content: ``preview`` when given (the whole file, as an image),
    else its text or its bytes in an embedded resource."""
    read = page.read
    block: ContentBlock
    shown = escape_name(read.path)  # as listings show it, and as clients give it back
    if preview is not None:
        block, encoding, returned, next_offset = preview, "image", len(read.data), None
    elif page.text is not None:
        block = TextContent(type="text", text=page.text)
        encoding, returned, next_offset = "text", len(page.data), page.next_offset
    else:
        block = embedded_blob(file_uri(session_id, shown), page.data, read.mime_type)
        encoding, returned, next_offset = "resource", len(page.data), page.next_offset
    meta = models.ReadFileResult(
        session_id=session_id,
        path=shown,
        mime_type=read.mime_type,
        size_bytes=read.size_bytes,
        offset=read.offset,
        returned_bytes=returned,
        eof=next_offset is None,
        next_offset=next_offset,
        encoding=encoding,  # type: ignore[arg-type]
        download_url=download_url,
        notice=notice,
    )
    return structured_result(meta, [block])


def no_preview(read: ReadResult, max_image_bytes: int) -> str:
    """Why an image read from its start comes back as bytes, not as an image."""
    if not read.eof:
        why = f"it is larger than one read ({len(read.data)} bytes)"
    else:
        why = (
            f"it cannot be made into a preview of at most {max_image_bytes} bytes (images "
            f"over {MAX_PIXELS} pixels are not decoded)"
        )
    return (
        f"no preview of this image: {why}; its bytes come as base64, page by page "
        "(offset=next_offset); or look at it with run_code"
    )
