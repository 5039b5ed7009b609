"""The server's end of the agent channel on Kubernetes: TLS over TCP to the pod.

The agent listens on its pod's address (``--listen``) and a server dials in. In the TLS
handshake the server is the TLS *server* although it opened the connection: it presents
the certificate every replica shares (``certs``), the agent checks it against the CA and
holds no secret itself (:mod:`mcp_code_sandbox.agent.listener` says why). The server does
not check a certificate of the agent (it has none). Instead the agent's ``ready`` names
the address the agent listens on, inside the tunnel, and :func:`open_channel` requires it
to be the address it dialled: a pod that took a connection meant for its own agent and
relayed it to another pod's agent is caught there.

:func:`open_channel` returns once the agent has said ``ready`` on the connection, which
a busy agent does only after the run in flight on its previous connection has finished;
the ``ready`` is then the channel's first message, for ``backends.base.wait_ready``.
Every failure (refused, reset, timed out, the handshake, a wrong ``ready``) is
:class:`~mcp_code_sandbox.errors.SandboxFailed`.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path
from typing import Any

from mcp_code_sandbox.agent.listener import listen_address
from mcp_code_sandbox.agent.protocol import ProtocolError
from mcp_code_sandbox.backends.base import Channel
from mcp_code_sandbox.errors import SandboxFailed

__all__ = ["open_channel", "server_context"]


def server_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """The TLS context a server dials agents with: its certificate and key (``server.crt``
    and ``server.key`` of ``mcp-code-sandbox kubernetes certs``), TLS 1.2 or later, no
    client certificate asked for. Nothing else: the CA is the agent's to check against.
    Raises ``OSError`` or ``ssl.SSLError`` for files that are missing or do not match."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certfile=cert_file, keyfile=key_file)
    return context


async def open_channel(host: str, port: int, tls: ssl.SSLContext, timeout_s: float) -> Channel:
    """A channel to the agent listening at ``host`` (the pod's IP address, as the agent
    was told it in ``--listen``) and ``port``, within ``timeout_s`` in all: connect, TLS,
    and the agent's ``ready``."""
    where = listen_address(host, port)
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await _connect(host, port, tls)
            channel = _ReadyChannel(reader, writer)
            try:
                ready = await channel.receive()
            except BaseException:
                channel.close()
                raise
    except TimeoutError:
        raise SandboxFailed(f"agent at {where}: no ready within {timeout_s:g} s") from None
    except ssl.SSLError as exc:
        raise SandboxFailed(f"agent at {where}: TLS failed: {exc.reason or exc}") from None
    except (OSError, ProtocolError) as exc:
        raise SandboxFailed(f"agent at {where}: {exc}") from None
    problem = _ready_problem(ready, where)
    if problem is not None:
        channel.close()
        raise SandboxFailed(f"agent at {where}: {problem}")
    assert ready is not None
    channel.first = ready
    return channel


def _ready_problem(ready: dict[str, Any] | None, where: str) -> str | None:
    if ready is None:
        return "closed the connection before ready"
    if ready.get("ev") != "ready":
        return "its first message is not ready"
    if ready.get("listen") != where:
        # Text from the sandbox: not repeated in the message.
        return "its ready names another address (a connection relayed to another pod?)"
    return None


async def _connect(
    host: str, port: int, tls: ssl.SSLContext
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """TCP to ``host:port``, then TLS with this side as the TLS server (streams cannot
    do that for a connection they opened, so the protocol is wired here)."""
    loop = asyncio.get_running_loop()
    raw, _ = await loop.create_connection(asyncio.Protocol, host, port)
    _keep_alive(raw.get_extra_info("socket"))
    reader = asyncio.StreamReader()
    protocol = asyncio.StreamReaderProtocol(reader)
    try:
        transport = await loop.start_tls(raw, protocol, tls, server_side=True)
    except BaseException:
        raw.abort()
        raise
    assert transport is not None
    # start_tls does not call connection_made (the TCP connection was made before): the
    # reader learns its transport here, which its flow control (pause at its limit) needs.
    protocol.connection_made(transport)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


#: TCP keepalive on the channel: a pod whose node vanished sends no FIN, and a channel
#: waiting on it would wait until the run's deadline. Probes after a minute idle, every
#: ten seconds, three lost: a dead peer is noticed within about ninety seconds.
_KEEPALIVE_IDLE_S = 60
_KEEPALIVE_INTERVAL_S = 10
_KEEPALIVE_PROBES = 3


def _keep_alive(sock: socket.socket | None) -> None:
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, _KEEPALIVE_IDLE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, _KEEPALIVE_INTERVAL_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, _KEEPALIVE_PROBES)


class _ReadyChannel(Channel):
    """A channel whose first ``receive`` gives back the ``ready`` already read."""

    first: dict[str, Any] | None = None

    async def receive(self) -> dict[str, Any] | None:
        if self.first is not None:
            message, self.first = self.first, None
            return message
        return await super().receive()

    def close(self) -> None:
        # At once, with no TLS close_notify exchange: a graceful TLS close waits for the
        # agent's answer (up to half a minute), and the framing says where messages end.
        self._writer.transport.abort()
