"""Byte streams the proxy reads and writes: a socket's (asyncio streams) or a TLS session
run over one (``tls.TlsStream``). Both count their bytes for the audit line and bound
every read: nothing the sandbox or an upstream sends is buffered beyond :data:`CHUNK`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol

__all__ = ["CHUNK", "IDLE_S", "ByteStream", "Counter", "SocketStream", "pipe"]

#: The most bytes one read returns.
CHUNK = 64 * 1024
#: Seconds a proxied connection may stay silent (both ways) before the proxy ends it.
IDLE_S = 300.0


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


async def pipe(one: ByteStream, other: ByteStream, idle_s: float) -> None:
    """Copy both ways until either side ends (or fails), or neither sends for ``idle_s``
    (one direction may be quiet for long while the other streams: a download)."""
    last = [time.monotonic()]

    async def copy(source: ByteStream, sink: ByteStream) -> None:
        while True:
            try:
                data = await asyncio.wait_for(source.read(), idle_s)
            except TimeoutError:
                if time.monotonic() - last[0] >= idle_s:
                    return
                continue
            if not data:
                return
            last[0] = time.monotonic()
            await sink.write(data)

    tasks = [asyncio.create_task(copy(one, other)), asyncio.create_task(copy(other, one))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
