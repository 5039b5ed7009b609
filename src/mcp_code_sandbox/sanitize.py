"""Text from a sandbox, made safe to show: no terminal control sequences, no control
characters. Pure functions.

What a sandbox prints and what it names its files is its tenant's to choose, and clients
show both, often in a terminal: there an OSC 52 sequence writes the user's clipboard,
others clear the screen, set the window title, or move the cursor so that later text
hides earlier text; a NUL or a newline in a file name fakes a line of a listing.

- :func:`clean_text`, for output (stdout, stderr, the last expression, errors, displays,
  progress messages): escape sequences (ECMA-48 CSI, OSC/DCS/SOS/PM/APC strings, the
  two-character ``ESC x`` ones, and their 8-bit C1 forms) are removed whole, and so is
  every other control character except ``\\n`` and ``\\t``; ``\\r\\n`` and a lone ``\\r``
  become ``\\n`` (a lone ``\\r`` lets later text overwrite earlier text on a terminal, and
  a progress bar's states then read one a line). Lossy by design: what goes is
  instructions to a terminal, not text, and never more bytes than came; the full output
  the workspace keeps (``.outputs/<run>.txt``) has the raw bytes.
- :func:`escape_name` / :func:`unescape_name`, for file names: a name identifies a file,
  so nothing is dropped: a control character becomes a visible ``\\xNN`` and a backslash
  ``\\\\``. A path a client gives may never contain a backslash (the workspace refuses
  it), so the escaped form cannot mean anything else: it is how a client names such a
  file back (``read_file``, ``list_files``, ``sandbox://`` resources, download links),
  and every name without a control character or backslash reads exactly as before.
"""

from __future__ import annotations

import re

__all__ = ["clean_text", "escape_name", "unescape_name"]

# A string command (OSC, DCS, SOS, PM, APC) up to its terminator (BEL, ST, 8-bit ST).
# Unterminated, only its introducer goes (by the last pattern): the rest stays as text,
# rather than everything after it.
_STRING = r"(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)"
_CSI = r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"
_ESC = r"\x1b[ -/]*[0-~]"  # ESC c (reset), ESC 7, ESC ( B, ESC # 8, ...
_SEQUENCE = re.compile(f"{_STRING}|{_CSI}|{_ESC}")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_NAME_ESCAPES = re.compile(r"[\x00-\x1f\x7f-\x9f\\]")
_NAME_UNESCAPES = re.compile(r"\\(\\|x(0[1-9a-f]|1[0-9a-f]|7f|8[0-9a-f]|9[0-9a-f]))?")


def clean_text(text: str) -> str:
    """``text`` without terminal control sequences or control characters (``\\n``,
    ``\\t`` kept; ``\\r`` made ``\\n``). Never longer than ``text``."""
    if _CONTROL.search(text) is None:  # the common case: nothing to do
        return text
    text = text.replace("\r\n", "\n")
    text = _SEQUENCE.sub("", text)
    return _CONTROL.sub("", text.replace("\r", "\n"))


def escape_name(name: str) -> str:
    """``name`` with each control character as ``\\xNN`` and each backslash as ``\\\\``."""
    return _NAME_ESCAPES.sub(_escape_one, name)


def _escape_one(match: re.Match[str]) -> str:
    char = match.group()
    return "\\\\" if char == "\\" else f"\\x{ord(char):02x}"


def unescape_name(name: str) -> str:
    """The name :func:`escape_name` made ``name`` from. Raises ``ValueError`` for a
    backslash that starts no such escape (``\\x00`` neither: no file name holds a NUL)."""

    def one(match: re.Match[str]) -> str:
        if match.group(1) is None:
            raise ValueError("a backslash that is not an escape this server writes")
        return "\\" if match.group(1) == "\\" else chr(int(match.group(2), 16))

    return _NAME_UNESCAPES.sub(one, name)
