"""Bounded capture of a run's stdout and stderr.

The agent sends everything a run prints; the host keeps, per stream, the head and the tail
within the output budget and marks the cut. Once a run's output passes the budget, all of
it from then on (both streams, interleaved as they arrived) is also spooled to a file, so
the full text can be saved in the workspace and its path reported. Memory stays bounded by
the budget whatever the run prints; the spool is capped too (a run printing forever must
not fill the disk).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

__all__ = ["MAX_SPOOL_BYTES", "OutputCapture", "StreamText"]

#: The full-output file stops growing here; what follows is counted, not kept.
MAX_SPOOL_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class StreamText:
    text: str
    truncated: bool
    total_bytes: int


class _Stream:
    """Head and tail of one stream, each at most half the budget (in UTF-8 bytes)."""

    def __init__(self, budget: int) -> None:
        self.half = max(budget // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > self.half:
                del self.tail[: len(self.tail) - self.half]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + len(self.tail)

    def render(self, where: str | None) -> StreamText:
        if not self.truncated:
            text = (bytes(self.head) + bytes(self.tail)).decode("utf-8", "replace")
            return StreamText(text, False, self.total)
        cut = self.total - len(self.head) - len(self.tail)
        saved = f"; full output in {where}" if where else ""
        marker = f"\n[... {cut} bytes cut{saved} ...]\n"
        # errors="replace" heals a UTF-8 sequence split by the cut.
        head = bytes(self.head).decode("utf-8", "replace")
        tail = bytes(self.tail).decode("utf-8", "replace")
        return StreamText(head + marker + tail, True, self.total)


class OutputCapture:
    """Collects one run's streams; spools everything once the budget is passed.

    ``open_spool`` is called at most once, when the output first passes the budget; it
    returns the writable file for the full output, or ``None`` to keep none. ``spool`` is
    that file, or ``None`` while the output still fits (or when none could be opened).
    """

    def __init__(self, budget: int, open_spool: Callable[[], BinaryIO | None]) -> None:
        self.budget = budget
        self._open = open_spool
        self._streams = {"stdout": _Stream(budget), "stderr": _Stream(budget)}
        self._early = io.BytesIO()  # everything, in arrival order, until the spool opens
        self.spool: BinaryIO | None = None
        self._spool_tried = False
        self._spooled = 0
        self.spool_cut = False
        self._last = b""

    def add(self, name: str, text: str) -> None:
        data = text.encode("utf-8")
        stream = self._streams["stderr" if name == "stderr" else "stdout"]
        stream.add(data)
        self._last = (self._last + data)[-2048:]
        if self.spool is not None:
            self._write_spool(data)
        elif not self._spool_tried:
            self._early.write(data)
            if any(s.truncated for s in self._streams.values()):
                self._open_spool()

    def _open_spool(self) -> None:
        self._spool_tried = True
        spool = self._open()
        if spool is None:
            self._early = io.BytesIO()
            return
        self.spool = spool
        self._write_spool(self._early.getvalue())
        self._early = io.BytesIO()

    def _write_spool(self, data: bytes) -> None:
        assert self.spool is not None
        room = MAX_SPOOL_BYTES - self._spooled
        if room <= 0:
            self.spool_cut = True
            return
        self.spool.write(data[:room])
        self._spooled += min(len(data), room)
        if len(data) > room:
            self.spool_cut = True

    def finish(self) -> bytes | None:
        """Close the spool and return the full output, or ``None`` when none was spooled.

        The spool must have been opened readable (``w+b``)."""
        if self.spool is None:
            return None
        try:
            if self.spool_cut:
                self.spool.write(f"\n[output cut at {MAX_SPOOL_BYTES} bytes]\n".encode())
            self.spool.seek(0)
            return self.spool.read()
        finally:
            self.spool.close()

    def tail(self, limit: int = 400) -> str:
        """The last few hundred characters printed, for progress messages."""
        return self._last.decode("utf-8", "replace")[-limit:]

    def render(self, name: str, where: str | None) -> StreamText:
        return self._streams[name].render(where)

    @property
    def total_bytes(self) -> int:
        return sum(s.total for s in self._streams.values())
