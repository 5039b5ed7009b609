"""The sandbox's one way out: a bridge from ``127.0.0.1:EGRESS_PORT`` to the host's proxy.

A sandbox with network still has an empty network namespace (loopback only). The host
binds a directory into it at ``EGRESS_DIR`` holding the Unix socket of an egress proxy
(``mcp_code_sandbox.egress``), which decides per request which host may be reached. HTTP
clients only speak to proxies over TCP, so the agent, when that socket exists, listens on
``127.0.0.1:EGRESS_PORT`` and copies each connection to a new connection of the socket,
byte for byte: the bridge itself decides nothing, and code that connects to the socket
directly gets no more than through it. ``HTTP_PROXY`` and friends point here
(``mcp_code_sandbox.layout.egress_env``).

It runs in a daemon thread of the agent (one asyncio loop, so a thousand connections
cost no threads, which the sandbox's pids limit counts), started before any user code,
so the port is the agent's and not a program's that got there first. It lives as long
as the agent: a restarted interpreter keeps its network. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio

__all__ = ["EGRESS_DIR", "EGRESS_PORT", "EGRESS_SOCKET", "MAX_CONNECTIONS", "start_bridge"]

#: Where the host binds the proxy's directory (read-only) in a sandbox with network.
EGRESS_DIR = "/run/mcs-egress"
EGRESS_SOCKET = f"{EGRESS_DIR}/proxy.sock"
#: The port HTTP_PROXY names; the namespace is the sandbox's own, so a fixed one is safe.
EGRESS_PORT = 3128
#: Connections open at once; past it new ones wait in the listen backlog.
MAX_CONNECTIONS = 512
_CHUNK = 64 * 1024


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until EOF, then half-close ``writer`` (a client that
    shut down its sending side still gets its answer)."""
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        writer.close()


async def _relay(
    socket_path: str,
    slots: asyncio.Semaphore,
    client_r: asyncio.StreamReader,
    client_w: asyncio.StreamWriter,
) -> None:
    import asyncio  # see _run

    async with slots:
        try:
            proxy_r, proxy_w = await asyncio.open_unix_connection(socket_path)
        except OSError:
            client_w.close()  # no proxy: the client sees the connection closed
            return
        try:
            await asyncio.gather(_pump(client_r, proxy_w), _pump(proxy_r, client_w))
        finally:
            for writer in (proxy_w, client_w):
                writer.close()
                with contextlib.suppress(OSError, RuntimeError):
                    await writer.wait_closed()


async def _serve(socket_path: str, listener: socket.socket) -> None:
    import asyncio  # see _run

    slots = asyncio.Semaphore(MAX_CONNECTIONS)

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _relay(socket_path, slots, reader, writer)

    server = await asyncio.start_server(accepted, sock=listener)
    async with server:
        await server.serve_forever()


def _listen(port: int) -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    listener.setblocking(False)
    return listener


def _run(socket_path: str, listener: socket.socket) -> None:
    """The bridge thread's body. asyncio is imported here, in the thread, and only by a
    sandbox with network: importing it costs CPU, which every sandbox's start
    (its agent and kernel share one CPU) would otherwise pay before its first run."""
    import asyncio

    asyncio.run(_serve(socket_path, listener))


def start_bridge(socket_path: str = EGRESS_SOCKET, port: int = EGRESS_PORT) -> bool:
    """Listen on ``127.0.0.1:port`` and relay to ``socket_path`` in a daemon thread;
    ``False`` (nothing started) when there is no such socket: a sandbox without network.

    Called once by the agent's ``main`` before the supervisor serves. Raises ``OSError``
    when the port cannot be bound: the sandbox would have no network although it asked
    for it, and the agent fails its start instead."""
    if not os.path.exists(socket_path):
        return False
    listener = _listen(port)
    thread = threading.Thread(
        target=_run,
        args=(socket_path, listener),
        name="egress-bridge",
        daemon=True,
    )
    thread.start()
    return True
