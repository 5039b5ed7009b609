"""The supervisor's outgoing output: chunks read from pipes, batched before they are sent.

A program (bash, node, ...) or C code in the kernel writes to its pipes as often as it
likes; each read of a pipe used to become its own ``stream`` message to the host, and the
cost of a message (a frame, a host read, a JSON decode, the output budget's bookkeeping)
is per message, not per byte. :class:`Pending` keeps what was read, in the order it was
read across both streams, and hands it out as few messages as that order allows: when it
holds ``FLUSH_BYTES``, when its oldest text is ``FLUSH_S`` old (the supervisor's select
wakes for it), and whenever something else must go to the host first (a ``display``, a
batch from the kernel, ``done``).

Semantics: ``due`` is ``None`` while nothing is pending, else the monotonic time by which
it must be sent. ``take`` merges neighbours of one stream and splits text into messages of
at most ``FLUSH_BYTES`` characters (the protocol's chunk bound).
"""

from __future__ import annotations

import time

__all__ = ["FLUSH_BYTES", "FLUSH_S", "Pending"]

#: Pending output sent at once; also the longest text of one message.
FLUSH_BYTES = 64 * 1024
#: Longest output read from a pipe waits before it is sent.
FLUSH_S = 0.05


class Pending:
    def __init__(self) -> None:
        #: ``(name, pieces)`` in order; pieces joined only when taken (no quadratic copy).
        self._chunks: list[tuple[str, list[str]]] = []
        self.size = 0
        self.due: float | None = None

    def add(self, name: str, text: str) -> bool:
        """Keep ``text`` of stream ``name``; True when the batch is full (send it now)."""
        if not text:
            return False
        if self._chunks and self._chunks[-1][0] == name:
            self._chunks[-1][1].append(text)
        else:
            self._chunks.append((name, [text]))
        self.size += len(text)
        if self.due is None:
            self.due = time.monotonic() + FLUSH_S
        return self.size >= FLUSH_BYTES

    def take(self) -> list[tuple[str, str]]:
        """Everything pending, as ``(name, text)`` messages in order; empties the batch."""
        chunks, self._chunks, self.size, self.due = self._chunks, [], 0, None
        return [
            (name, text[start : start + FLUSH_BYTES])
            for name, pieces in chunks
            for text in ("".join(pieces),)
            for start in range(0, len(text), FLUSH_BYTES)
        ]
