"""Byte streams the proxy reads and writes: a socket's (asyncio streams) or a TLS session
run over one (``tls.TlsStream``). Both count their bytes for the audit line and bound
every read: nothing the sandbox or an upstream sends is buffered beyond :data:`CHUNK`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

__all__ = ["CHUNK", "ByteStream", "Counter", "SocketStream"]

#: The most bytes one read returns.
CHUNK = 64 * 1024


class Counter:
    """Bytes one way on one proxied connection (several streams may add to one)."""

    def __init__(self) -> None:
        self.bytes = 0


class ByteStream(Protocol):
    async def read(self) -> bytes:
        """Up to :data:`CHUNK` bytes; ``b""`` at the end of the stream."""

    async def write(self, data: bytes) -> None:
        """All of ``data`` (waits while the peer's buffers are full)."""

    async def close(self) -> None:
        """Close without raising; bounded."""


class SocketStream:
    """An asyncio connection. ``received``/``sent`` count what crossed it."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        received: Counter | None = None,
        sent: Counter | None = None,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.received = received or Counter()
        self.sent = sent or Counter()

    async def read(self) -> bytes:
        data = await self.reader.read(CHUNK)
        self.received.bytes += len(data)
        return data

    async def write(self, data: bytes) -> None:
        if data:
            self.writer.write(data)
            self.sent.bytes += len(data)
            await self.writer.drain()

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 5)
