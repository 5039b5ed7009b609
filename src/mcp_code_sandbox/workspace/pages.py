"""Decide what ``read_file`` and the ``sandbox://`` resource return: bounded, never silently.

``read_file`` returns one page of a file: text as text, an image read whole as an image
(its preview), anything else as base64 in an embedded resource. Every page says how many
bytes it carries, whether the end was reached, and where the next page starts
(``next_offset``), so any file can be fetched whole by paging, over stdio too.
:func:`page_of` decides the page (the service calls it); the tool layer only turns it into
MCP content, and fits an image candidate into its image budget.

A base64 page is 4/3 the size of its bytes, so binary pages carry at most
:func:`blob_page_bytes` (about three quarters of ``max_read_bytes``): the whole page, JSON
and all, fits in ``max_read_bytes`` (the official client refuses a server-sent event over
1 MiB, the default).

A resource read has no paging: it returns the whole file or fails with
``artifact_too_large``, naming ``read_file`` (and the download link over HTTP). It never
returns the first part of a file as if it were all of it.

Semantics:
- ``Page.wants_preview``: the page is of an image, from its start. ``Page.image`` is then
  the whole file when it was read whole, else ``None`` (it is larger than one read).
  It is only a candidate: when no preview fits the tool's image budget the page
  goes as ``encoding`` (its ``text`` or ``data``), with a notice saying why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from mcp_code_sandbox.errors import ArtifactTooLarge
from mcp_code_sandbox.workspace.entries import ReadResult
from mcp_code_sandbox.workspace.mime import IMAGE_MIME_TYPES

__all__ = ["Page", "blob_page_bytes", "page_of", "whole_file"]

#: Room left in a page for everything but the base64: the structured result and its text
#: copy, with a path of up to 4 KiB (JSON-escaped), the URI and the download link.
_ENVELOPE = 64 * 1024


@dataclass(frozen=True)
class Page:
    """One ``read_file`` page, decided: what it carries and where the next one starts."""

    #: What was read (at most the page size the client asked for, from ``read.offset``).
    read: ReadResult
    #: How the page goes when it is not an image preview.
    encoding: Literal["text", "resource"]
    #: The page as text (``encoding == "text"``), else ``None``.
    text: str | None
    #: The page's bytes (for ``"text"``: the bytes ``text`` was decoded from).
    data: bytes
    #: Where the next page starts; ``None``: this page reaches the end.
    next_offset: int | None
    #: Most bytes the page's whole result may take (JSON, text copy and all).
    budget: int
    #: An image from its start, and the whole file as a preview candidate (see "Semantics").
    wants_preview: bool
    image: bytes | None

    @property
    def eof(self) -> bool:
        return self.next_offset is None


def blob_page_bytes(max_read_bytes: int) -> int:
    """Most bytes in one binary page: its base64 and the page's JSON around it (path,
    link, the structured copy) fit in ``max_read_bytes``."""
    envelope = min(_ENVELOPE, max_read_bytes // 4)
    return max(3, (max_read_bytes - envelope) // 4 * 3)


def page_of(read: ReadResult, max_read_bytes: int, max_text_bytes: int | None = None) -> Page:
    """The ``read_file`` page for ``read`` (read from ``read.offset``, at most the page
    size the client asked for, itself at most ``max_read_bytes``); a text page also at
    most ``max_text_bytes`` as JSON (what the client reads as tokens), when given."""
    wants_preview = read.mime_type in IMAGE_MIME_TYPES and read.offset == 0
    text: str | None = None
    if read.is_text:
        room = max_read_bytes - min(_ENVELOPE, max_read_bytes // 4)
        if max_text_bytes is not None:
            room = min(room, max_text_bytes)
        text, returned = _text_page(read.data, read.eof, room)
        data = read.data[:returned]
    else:
        data = read.data[: blob_page_bytes(max_read_bytes)]
        returned = len(data)
    end = read.offset + returned
    # The file may have shrunk since it was opened: a short read that is all returned is
    # its end too (else a client would page at the same offset for ever).
    eof = end >= read.size_bytes or (read.eof and returned == len(read.data))
    return Page(
        read=read,
        budget=max_read_bytes,
        encoding="text" if read.is_text else "resource",
        text=text,
        data=data,
        next_offset=None if eof else end,
        wants_preview=wants_preview,
        image=read.data if wants_preview and read.eof else None,
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
