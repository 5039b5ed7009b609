"""Reading what a sandbox writes to the host outside its channel: bounded, escaped.

Everything out of a sandbox is hostile (DESIGN.md §10). A stream such as bwrap's stderr
is written by the agent, and by anything in the sandbox that gets hold of that fd: it may
hold one endless line, terminal escape sequences, carriage returns that rewrite what an
operator sees, or newlines followed by text made up to look like the server's own log.
So it is read in fixed-size chunks (never ``readline()``, whose buffer limit ends the
reader with an exception), cut into lines here, each line capped, and every control
character shown as a visible escape (``\\x1b``) before it reaches a log or a message.

Semantics: a line cut at the cap is yielded once, marked ``cut``; the rest of it, up to
the next newline, is read and dropped. Memory held per stream: one chunk and one line.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

__all__ = ["CHUNK_BYTES", "LineSplitter", "escape_control", "escape_line", "read_lines"]

#: How much is read from a stream at once.
CHUNK_BYTES = 4096

# C0 controls, DEL and C1 controls, the Unicode line and paragraph separators (a log
# viewer may break lines there) and the bidirectional overrides (which reorder what an
# operator reads on screen): each becomes its escape.
_ESCAPES: dict[int, str] = {
    code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0))
} | {
    code: f"\\u{code:04x}"
    for code in (0x2028, 0x2029, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
}
_ESCAPES |= {ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"}


def escape_control(text: str) -> str:
    """``text`` with every control character as a visible escape (``\\x1b``, ``\\n``)."""
    return text.translate(_ESCAPES)


class LineSplitter:
    """Cuts a byte stream into lines of at most ``max_bytes`` (without the newline)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._line = bytearray()
        #: Inside a line already yielded as cut: drop bytes until its newline.
        self._skipping = False

    def feed(self, chunk: bytes) -> Iterator[tuple[bytes, bool]]:
        """The lines ``chunk`` completes, as ``(line, cut)``."""
        *complete, rest = chunk.split(b"\n")
        for piece in complete:
            if not self._skipping:
                yield from self._take(piece)
                if not self._skipping:
                    yield bytes(self._line), False
            self._line.clear()
            self._skipping = False
        if not self._skipping:
            yield from self._take(rest)

    def flush(self) -> Iterator[tuple[bytes, bool]]:
        """At EOF: the last line, if it had no newline."""
        if self._line and not self._skipping:
            yield bytes(self._line), False
        self._line.clear()
        self._skipping = False

    def _take(self, piece: bytes) -> Iterator[tuple[bytes, bool]]:
        room = self.max_bytes - len(self._line)
        if len(piece) <= room:
            self._line += piece
            return
        self._line += piece[:room]
        yield bytes(self._line), True
        self._line.clear()
        self._skipping = True


def escape_line(line: bytes) -> str:
    """A line as read from a sandbox, as text fit for a log or a message."""
    return escape_control(line.decode("utf-8", "replace"))


async def read_lines(
    stream: asyncio.StreamReader, max_bytes: int, on_line: Callable[[bytes, bool], None]
) -> None:
    """Read ``stream`` to EOF in chunks, calling ``on_line(raw line, cut)`` per line.

    The line is raw: escape it (:func:`escape_line`) only when it is used, since a flood
    is mostly dropped and escaping every line would cost the event loop. Never raises for
    what the stream holds (an ``OSError`` reading it ends the stream); ``on_line`` is
    called synchronously, so it must be cheap."""
    splitter = LineSplitter(max_bytes)
    while True:
        try:
            chunk = await stream.read(CHUNK_BYTES)
        except OSError:
            chunk = b""
        lines = splitter.feed(chunk) if chunk else splitter.flush()
        for line, cut in lines:
            on_line(line, cut)
        if not chunk:
            return
