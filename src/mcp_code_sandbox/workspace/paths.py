"""Validation of client-supplied workspace paths: pure string checks, no filesystem access.

A valid path names something inside ``/mnt/data`` relative to it: ``data.csv``,
``reports/q1.csv``. The absolute sandbox form ``/mnt/data/reports/q1.csv`` is accepted too,
because models often copy the path their code printed. Everything else that could escape the
workspace or confuse a later consumer is refused here, before any file is touched; links
planted by the sandbox are refused later, while walking (see :mod:`.core`).
"""

from __future__ import annotations

from mcp_code_sandbox.errors import InvalidFilename, InvalidPath
from mcp_code_sandbox.sanitize import unescape_name

__all__ = ["MAX_NAME_BYTES", "MAX_PATH_BYTES", "SANDBOX_ROOT", "join_parts", "parse_path"]

#: The workspace as the sandbox sees it; a leading ``/mnt/data/`` is stripped.
SANDBOX_ROOT = "/mnt/data"
#: NAME_MAX and PATH_MAX of Linux: longer names would fail in the kernel with a worse message.
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4096

_HINT = (
    "a valid path is relative to /mnt/data, like 'data.csv' or 'reports/q1.csv' "
    "('/mnt/data/reports/q1.csv' is accepted too); '..', backslashes, control characters "
    f"and names over {MAX_NAME_BYTES} bytes are not allowed"
)


def parse_path(rel: str, *, for_upload: bool) -> tuple[str, ...]:
    """Validate ``rel`` and return its components; ``()`` is the workspace root.

    ``for_upload`` names a file to create: the root (``.``, ``/mnt/data``) and a trailing
    ``/`` are refused, and errors are ``InvalidFilename`` instead of ``InvalidPath``.
    Otherwise the path names an existing file as results and listings show it: a name
    with control characters in the escaped form of :func:`.sanitize.escape_name`
    (``a\\x1bb.txt``), which is the only use of a backslash there is.
    """
    error = InvalidFilename if for_upload else InvalidPath
    problem = _problem(rel, escaped=not for_upload)
    if problem is None and for_upload and rel.endswith("/"):
        problem = "it ends with '/', which names a directory, not a file"
    if problem is None and not for_upload and "\\" in rel:
        try:
            rel = unescape_name(rel)
        except ValueError:
            problem = "it contains a backslash that is not '\\\\' or '\\xNN' as listings write them"
    if problem is not None:
        raise error(f"invalid path {rel!r}: {problem}; {_HINT}")
    parts = _split(rel)
    if isinstance(parts, str):
        raise error(f"invalid path {rel!r}: {parts}; {_HINT}")
    if for_upload and not parts:
        raise error(f"invalid path {rel!r}: it names the workspace itself, not a file; {_HINT}")
    return parts


def join_parts(parts: tuple[str, ...]) -> str:
    """The canonical relative form of parsed components: ``'a/b.txt'``, ``'.'`` for the root."""
    return "/".join(parts) if parts else "."


def _problem(rel: str, *, escaped: bool = False) -> str | None:
    """What is wrong with ``rel`` as a whole string, or ``None``; ``escaped``: its
    backslashes are escapes (checked by the caller)."""
    if not isinstance(rel, str) or not rel:
        return "it is empty"
    try:
        size = len(rel.encode("utf-8"))
    except UnicodeEncodeError:  # lone surrogates: not a name any file system can hold
        return "it is not valid Unicode"
    if size > MAX_PATH_BYTES:
        return f"it is {size} bytes long, over {MAX_PATH_BYTES}"
    if "\x00" in rel:
        return "it contains a NUL byte"
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in rel):
        return "it contains a control character"
    if "\\" in rel and not escaped:
        return "it contains a backslash; use '/' between directories"
    return None


def _split(rel: str) -> tuple[str, ...] | str:
    """Components of an already screened ``rel``, or a description of what is wrong."""
    if rel == SANDBOX_ROOT or rel.startswith(SANDBOX_ROOT + "/"):
        rel = rel[len(SANDBOX_ROOT) :]
        rel = rel.lstrip("/")
    elif rel.startswith("/"):
        return "it is absolute and outside /mnt/data"
    parts: list[str] = []
    for part in rel.split("/"):
        if part in ("", "."):  # 'a//b', './a', 'a/' mean what a shell would make of them
            continue
        if part == "..":
            return "it contains '..'"
        if len(part.encode("utf-8")) > MAX_NAME_BYTES:
            return f"the name {part[:40]!r}... is over {MAX_NAME_BYTES} bytes"
        parts.append(part)
    return tuple(parts)
