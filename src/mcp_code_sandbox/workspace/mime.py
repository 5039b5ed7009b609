"""MIME types of workspace files: by extension first, then by magic bytes, then a fallback.

The table is fixed (Python's built-in map plus our overrides), never the host's
``/etc/mime.types``, so a file gets the same type on every server. ``guess_mime`` does not
read files: callers that have the first bytes pass them as ``head``.
"""

from __future__ import annotations

import codecs
import mimetypes
import posixpath

__all__ = [
    "IMAGE_MIME_TYPES",
    "OCTET_STREAM",
    "guess_mime",
    "is_text",
    "is_text_mime",
    "looks_like_text",
]

OCTET_STREAM = "application/octet-stream"
#: Images that come back as image blocks (what LLM APIs accept): a run's image files, and
#: ``read_file`` of an image from its start.
IMAGE_MIME_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})

# Only the default table: ``MimeTypes()`` starts from Python's own map, not the host's files.
_DEFAULTS = mimetypes.MimeTypes()

# Where Python's map is missing a type or says something unhelpful (``.ts`` is MPEG-TS there).
_OVERRIDES = {
    ".csv": "text/csv",
    ".tsv": "text/tab-separated-values",
    ".md": "text/markdown",
    ".markdown": "text/markdown",
    ".txt": "text/plain",
    ".log": "text/plain",
    ".py": "text/x-python",
    ".ipynb": "application/x-ipynb+json",
    ".json": "application/json",
    ".jsonl": "application/x-ndjson",
    ".ndjson": "application/x-ndjson",
    ".geojson": "application/geo+json",
    ".yaml": "application/yaml",
    ".yml": "application/yaml",
    ".toml": "application/toml",
    ".js": "text/javascript",
    ".mjs": "text/javascript",
    ".cjs": "text/javascript",
    ".ts": "text/x-typescript",
    ".tsx": "text/x-typescript",
    ".sh": "application/x-sh",
    ".sql": "application/sql",
    ".r": "text/x-r",
    ".parquet": "application/vnd.apache.parquet",
    ".arrow": "application/vnd.apache.arrow.file",
    ".feather": "application/vnd.apache.arrow.file",
    ".xlsx": "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
    ".docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
    ".pptx": "application/vnd.openxmlformats-officedocument.presentationml.presentation",
    ".svg": "image/svg+xml",
    ".webp": "image/webp",
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".gif": "image/gif",
    ".pdf": "application/pdf",
    ".zip": "application/zip",
    ".gz": "application/gzip",
    ".tgz": "application/gzip",
    ".bz2": "application/x-bzip2",
    ".xz": "application/x-xz",
    ".zst": "application/zstd",
    ".pkl": OCTET_STREAM,
    ".pickle": OCTET_STREAM,
    ".npy": OCTET_STREAM,
}

# (prefix, offset, type); checked only when the extension says nothing.
_MAGIC: tuple[tuple[bytes, int, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", 0, "image/png"),
    (b"\xff\xd8\xff", 0, "image/jpeg"),
    (b"GIF87a", 0, "image/gif"),
    (b"GIF89a", 0, "image/gif"),
    (b"WEBP", 8, "image/webp"),  # after b"RIFF" and a 4-byte size, checked below
    (b"%PDF-", 0, "application/pdf"),
    (b"PK\x03\x04", 0, "application/zip"),
    (b"PK\x05\x06", 0, "application/zip"),  # an empty archive
    (b"\x1f\x8b", 0, "application/gzip"),
    (b"PAR1", 0, "application/vnd.apache.parquet"),
)

_TEXT_APPLICATION = frozenset(
    {
        "application/json",
        "application/x-ndjson",
        "application/xml",
        "application/javascript",
        "application/x-sh",
        "application/sql",
        "application/toml",
        "application/yaml",
        "application/x-yaml",
    }
)


def guess_mime(name: str, head: bytes | None = None) -> str:
    """The MIME type of a file called ``name`` (a path is fine) whose first bytes are ``head``.

    ``head`` ``None`` means "not read": only the extension counts. Unknown is
    ``application/octet-stream``; text without a telling extension is that too (ask
    :func:`looks_like_text`).
    """
    ext = posixpath.splitext(posixpath.basename(name))[1].lower()
    by_ext = _OVERRIDES.get(ext) or _DEFAULTS.types_map[True].get(ext)
    if by_ext is None:
        by_ext = _DEFAULTS.types_map[False].get(ext)
    if by_ext is not None:
        return by_ext
    return _by_magic(head) if head else OCTET_STREAM


def is_text(mime: str) -> bool:
    """Whether files of type ``mime`` are text a client can read as UTF-8 (SVG included)."""
    base = mime.split(";", 1)[0].strip().lower()
    return base.startswith("text/") or base in _TEXT_APPLICATION or base.endswith(("+json", "+xml"))


def is_text_mime(mime: str, data: bytes) -> bool:
    """Whether content of type ``mime`` whose bytes are (or start with) ``data`` is text.

    A text type is trusted (a ``.csv`` with a stray bad byte is still a table); an unknown
    type (``application/octet-stream``) is text when ``data`` looks like UTF-8. Pass a
    file's head (as ``ReadResult.is_text`` does) for an answer that is the same on every page.
    """
    if is_text(mime):
        return True
    return mime == OCTET_STREAM and looks_like_text(data)


def looks_like_text(head: bytes) -> bool:
    """Whether ``head`` (bytes of a file, possibly cut mid-character) is UTF-8 text.

    A NUL byte means binary. A multi-byte character cut at either end is fine (a page may
    start inside one); an invalid sequence anywhere else is not.
    """
    if b"\x00" in head:
        return False
    skip = 0
    while skip < 3 and skip < len(head) and 0x80 <= head[skip] <= 0xBF:
        skip += 1  # continuation bytes of a character that began before ``head``
    head = head[skip:]
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


def _by_magic(head: bytes) -> str:
    for prefix, offset, mime in _MAGIC:
        if head[offset : offset + len(prefix)] != prefix:
            continue
        if mime == "image/webp" and not head.startswith(b"RIFF"):
            continue
        return mime
    return OCTET_STREAM
