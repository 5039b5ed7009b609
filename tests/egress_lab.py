"""Upstream servers and a client bridge for egress proxy tests, all on this host.

:class:`Upstream` is a small HTTP/1.1 server (plain, or TLS with a certificate from the
test's own CA) that answers every request with a JSON echo of what it received, or with
``n`` bytes for ``/bytes/<n>``. :func:`bridge` is what the sandbox side does: a TCP port
on 127.0.0.1 whose connections are piped to the proxy's Unix socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import textwrap
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import h11

from mcp_code_sandbox.egress.tls import EphemeralCA

#: Code for a sandbox with network: ``ask(data)`` sends raw bytes to its egress proxy and
#: returns the status line of the answer (the proxy's, or the upstream's relayed).
ASK_PROXY = textwrap.dedent(
    """
    import json, select, socket, time
    def ask(data):
        try:
            s = socket.create_connection(("127.0.0.1", 3128), timeout=15)
            s.sendall(data)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            return out.split(b"\\r\\n")[0].decode()
        except OSError as e:
            return f"error {e!r}"
    """
)


def flood_proxy(hold_s: float) -> str:
    """Code (after :data:`ASK_PROXY` and an ``out`` dict) that opens up to 400 connections
    to the sandbox's proxy socket until the proxy stops taking them, holds them for
    ``hold_s`` more, and puts how many it got in ``out["held"]``."""
    return textwrap.dedent(
        f"""
        held = []
        give_up = time.monotonic() + 20
        while len(held) < 400 and time.monotonic() < give_up:
            s = socket.socket(socket.AF_UNIX)
            s.setblocking(False)
            try:
                s.connect("/run/mcs-egress/proxy.sock")
            except BlockingIOError:  # the backlog is full: wait a little
                s.close()
                if select.select(held, [], [], 0.01)[0]:
                    break  # refusals began: the proxy took all it takes
                continue
            held.append(s)
        select.select(held, [], [], 20)
        time.sleep({hold_s})
        out["held"] = len(held)
        """
    )


class LabCA:
    """The test's own CA (not the proxy's): upstream certificates for test names."""

    def __init__(self, directory: Path) -> None:
        self.ca = EphemeralCA("tests upstream")
        self.path = directory / "upstream-ca.pem"
        self.path.write_bytes(self.ca.pem())

    def server_context(self, host: str) -> ssl.SSLContext:
        return self.ca.leaf_context(host)

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.path))


@dataclass
class Upstream:
    """A running echo server; ``requests`` holds every request's (target, headers)."""

    port: int
    server: asyncio.Server
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    connections: int = 0


async def _serve_one(
    up: Upstream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    up.connections += 1
    conn = h11.Connection(h11.SERVER)
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(65536)
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                target = event.target.decode()
                headers = {k.decode().lower(): v.decode() for k, v in event.headers}
                while not isinstance(ev := await _next(conn, reader), h11.EndOfMessage):
                    pass
                del ev
                up.requests.append((target, headers))
                if target.startswith("/bytes/"):
                    body = b"x" * int(target.rsplit("/", 1)[1])
                else:
                    body = json.dumps({"target": target, "headers": headers}).encode()
                writer.write(
                    conn.send(
                        h11.Response(
                            status_code=200, headers=[(b"content-length", str(len(body)).encode())]
                        )
                    )
                    or b""
                )
                view = memoryview(body)
                for start in range(0, len(view), 1 << 20):
                    writer.write(
                        conn.send(h11.Data(data=bytes(view[start : start + (1 << 20)]))) or b""
                    )
                    await writer.drain()
                writer.write(conn.send(h11.EndOfMessage()) or b"")
                await writer.drain()
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
                continue
            return
    except (OSError, h11.ProtocolError, ssl.SSLError):
        return
    finally:
        writer.close()


async def _next(conn: h11.Connection, reader: asyncio.StreamReader) -> h11.Event:
    while (event := conn.next_event()) is h11.NEED_DATA:
        conn.receive_data(await reader.read(65536))
    return event  # type: ignore[return-value]


@contextlib.asynccontextmanager
async def upstream(
    tls: ssl.SSLContext | None = None, host: str = "127.0.0.1"
) -> AsyncIterator[Upstream]:
    holder: list[Upstream] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _serve_one(holder[0], reader, writer)

    server = await asyncio.start_server(handle, host, 0, ssl=tls)
    up = Upstream(server.sockets[0].getsockname()[1], server)
    holder.append(up)
    try:
        yield up
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)


@contextlib.asynccontextmanager
async def bridge(socket_path: Path) -> AsyncIterator[int]:
    """A TCP port on 127.0.0.1 piped to the proxy's Unix socket (the sandbox's bridge)."""

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.write_eof()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(str(socket_path))
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        writer.close()
        up_writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


@dataclass
class Naive:
    """A running :func:`naive_upstream`: ``requests`` holds every request it ran, as
    (request line, headers by lower-case name: the first of each)."""

    port: int
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    stored: bytes = b""


async def _serve_naive(
    up: Naive, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            line, *rest = head.decode("latin-1").split("\r\n")
            headers: dict[str, str] = {}
            for item in rest:
                name, _, value = item.partition(":")
                headers.setdefault(name.strip().lower(), value.strip())
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            up.requests.append((line, headers))
            if line.startswith("POST /store "):
                up.stored = body
            answer = up.stored if line.startswith("GET /store ") else line.encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer))
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
        return
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def naive_upstream(tls: ssl.SSLContext | None = None) -> AsyncIterator[Naive]:
    """A keep-alive HTTP/1.1 server on 127.0.0.1 that frames requests by
    ``Content-Length`` only (it ignores ``Transfer-Encoding``), as many real servers and
    caches did: what request smuggling needs. ``POST /store`` keeps its body, ``GET
    /store`` answers it back; every other request is answered its request line."""
    holder: list[Naive] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _serve_naive(holder[0], reader, writer)

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls)
    holder.append(Naive(server.sockets[0].getsockname()[1]))
    try:
        yield holder[0]
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)
