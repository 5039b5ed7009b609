"""Shape what ``read_file`` and the ``sandbox://`` resource return: bounded, never silently.

``read_file`` returns one page of a file: text as text, an image read whole as an image
(its preview), anything else as base64 in an embedded resource. Every page says how many
bytes it carries, whether the end was reached, and where the next page starts
(``next_offset``), so any file can be fetched whole by paging, over stdio too.

A base64 page is 4/3 the size of its bytes, so binary pages carry at most
:func:`blob_page_bytes` (about three quarters of ``max_read_bytes``): the whole page, JSON
and all, fits in ``max_read_bytes`` (the official client refuses a server-sent event over
1 MiB, the default).

A resource read has no paging: it returns the whole file or fails with
``artifact_too_large``, naming ``read_file`` (and the download link over HTTP). It never
returns the first part of a file as if it were all of it.
"""

from __future__ import annotations

import base64
import json

from mcp_types import CallToolResult, ContentBlock, ImageContent, TextContent

from mcp_code_sandbox.errors import ArtifactTooLarge
from mcp_code_sandbox.sanitize import escape_name
from mcp_code_sandbox.server import models
from mcp_code_sandbox.server.media import MAX_PIXELS
from mcp_code_sandbox.server.tool_results import embedded_blob, file_uri, structured_result
from mcp_code_sandbox.workspace import ReadResult

__all__ = ["Preview", "blob_page_bytes", "no_preview", "page_result", "whole_file"]

#: Room left in a page for everything but the base64: the structured result and its text
#: copy, with a path of up to 4 KiB (JSON-escaped), the URI and the download link.
_ENVELOPE = 64 * 1024
#: An image's preview (bytes, MIME type) made from a whole read; ``None``: none was made.
Preview = tuple[bytes, str]


def blob_page_bytes(max_read_bytes: int) -> int:
    """Most bytes in one binary page: its base64 and the page's JSON around it (path,
    link, the structured copy) fit in ``max_read_bytes``."""
    envelope = min(_ENVELOPE, max_read_bytes // 4)
    return max(3, (max_read_bytes - envelope) // 4 * 3)


def page_result(
    read: ReadResult,
    session_id: str,
    *,
    max_read_bytes: int,
    preview: Preview | None = None,
    notice: str | None = None,
    download_url: str | None = None,
) -> CallToolResult:
    """The ``read_file`` result for ``read`` (read from ``read.offset``, at most the
    page size the client asked for, itself at most ``max_read_bytes``)."""
    block: ContentBlock
    shown = escape_name(read.path)  # as listings show it, and as clients give it back
    if preview is not None:
        data = base64.b64encode(preview[0]).decode()
        block = ImageContent(type="image", data=data, mime_type=preview[1])
        encoding, returned = "image", len(read.data)
    elif read.is_text:
        room = max_read_bytes - min(_ENVELOPE, max_read_bytes // 4)
        text, returned = _text_page(read.data, read.eof, room)
        block = TextContent(type="text", text=text)
        encoding = "text"
    else:
        page = read.data[: blob_page_bytes(max_read_bytes)]
        block = embedded_blob(file_uri(session_id, shown), page, read.mime_type)
        encoding, returned = "resource", len(page)
    end = read.offset + returned
    # The file may have shrunk since it was opened: a short read that is all returned is
    # its end too (else a client would page at the same offset for ever).
    eof = end >= read.size_bytes or (read.eof and returned == len(read.data))
    meta = models.ReadFileResult(
        session_id=session_id,
        path=shown,
        mime_type=read.mime_type,
        size_bytes=read.size_bytes,
        offset=read.offset,
        returned_bytes=returned,
        eof=eof,
        next_offset=None if eof else end,
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


def whole_file(read: ReadResult, max_read_bytes: int, download_url: str | None) -> str | bytes:
    """A resource's contents: all of ``read`` (read from the start, at most
    ``max_read_bytes``), text as text when it decodes; ``ArtifactTooLarge`` when the file
    is more than one read carries."""
    if read.eof and read.is_text and len(read.data) <= max_read_bytes:
        try:
            return read.data.decode("utf-8")
        except UnicodeDecodeError:
            pass  # text at its start only: returned as bytes, unchanged, if they fit
    blob = blob_page_bytes(max_read_bytes)
    if read.eof and len(read.data) <= blob:
        return read.data
    limit = max_read_bytes if read.is_text else blob
    where = f", or download it from {download_url}" if download_url else ""
    details = {"download_url": download_url} if download_url else {}
    raise ArtifactTooLarge(
        f"'{read.path}' is {read.size_bytes} bytes, more than one resource read returns "
        f"({limit} bytes); read it with read_file page by page (offset=next_offset){where}",
        **details,
    )


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
    next page (so paging never garbles text). A page always advances: a page too small
    for its first character is decoded with U+FFFD instead of returning nothing."""
    if not eof:
        for cut in range(0, min(4, len(data))):
            try:
                end = len(data) - cut
                return data[:end].decode("utf-8"), end
            except UnicodeDecodeError:
                continue
    return data.decode("utf-8", "replace"), len(data)
