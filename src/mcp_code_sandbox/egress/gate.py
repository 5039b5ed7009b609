"""One TCP port for the egress proxies of sandboxes that reach the server over a network.

A sandbox that cannot see a Unix socket of the server (a Kubernetes pod) reaches its
proxy at the server's address instead, on one port for all of them. What makes a
connection a sandbox's is a credential of its own proxy: ``Proxy-Authorization: Basic``
with a user (the proxy's name, not secret) and a random token, which
:meth:`ProxyGate.admit` makes and the session side hands to that sandbox alone, in
the proxy URL of its run's environment (HTTP clients send it from the URL). The first
request's head of each connection is read, the token compared in constant time, and the
connection handed to that proxy (:meth:`.proxy.EgressProxy.serve_handed`), which judges
every request by its own policy as if it had accepted it; one without a valid
credential is answered 407 and closed, so another pod that reaches the port gets
nothing through it. A proxy forgotten (its sandbox stopped) takes no new connection.

Bounds: :data:`MAX_PENDING` connections being authenticated at once (more are closed at
once), :data:`HEAD_WAIT_S` for a head of at most ``http.MAX_HEAD`` bytes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import secrets
from dataclasses import dataclass

import structlog

from . import http
from .proxy import EgressProxy

__all__ = ["Credential", "ProxyGate"]

log = structlog.get_logger("mcp_code_sandbox.egress")

#: Connections read for their credential at once: a client sends its head at once, so
#: more than a handful waiting is a flood, not the sandboxes' traffic.
MAX_PENDING = 256
#: How long a connection may take to send its first request's head.
HEAD_WAIT_S = 10.0
#: The realm a 407 names (clients show it, none needs it).
REALM = "mcp-code-sandbox egress"


@dataclass(frozen=True)
class Credential:
    """What a sandbox uses its proxy with: ``http://user:token@host:port``."""

    user: str
    token: str

    def url(self, host: str, port: int) -> str:
        where = f"[{host}]" if ":" in host else host
        return f"http://{self.user}:{self.token}@{where}:{port}"


class ProxyGate:
    """The listener on ``host:port`` (``port`` 0: any free one, :attr:`port` says which)."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._proxies: dict[str, tuple[bytes, EgressProxy]] = {}
        self._pending = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Listen; raises ``OSError`` when the address cannot be bound."""
        self._server = await asyncio.start_server(
            self._accepted, self.host, self.port, limit=http.MAX_HEAD
        )
        self.port = self._server.sockets[0].getsockname()[1]

    def admit(self, proxy: EgressProxy) -> Credential:
        """A new credential for ``proxy``: connections that present it are its."""
        credential = Credential(secrets.token_hex(8), secrets.token_urlsafe(32))
        self._proxies[credential.user] = (credential.token.encode(), proxy)
        return credential

    def forget(self, credential: Credential) -> None:
        """``credential`` opens nothing from now on (its proxy closes its connections)."""
        self._proxies.pop(credential.user, None)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._pending >= MAX_PENDING:
            writer.close()
            return
        self._pending += 1
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_WAIT_S)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            writer.close()
            return
        finally:
            self._pending -= 1
        proxy = self._proxy_of(head)
        if proxy is None:
            body = b"this proxy needs the sandbox's own credential\n"
            with contextlib.suppress(OSError):
                writer.write(
                    b"HTTP/1.1 407 Proxy Authentication Required\r\n"
                    + f'proxy-authenticate: Basic realm="{REALM}"\r\n'.encode()
                    + b"content-type: text/plain; charset=utf-8\r\n"
                    + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
            writer.close()
            return
        # Awaited (not returned): the server ends the connection when its callback ends.
        await asyncio.wait([proxy.serve_handed(reader, writer, head)])

    def _proxy_of(self, head: bytes) -> EgressProxy | None:
        """The proxy whose credential ``head`` presents, else None."""
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() != b"proxy-authorization":
                continue
            scheme, _, encoded = value.strip().partition(b" ")
            if scheme.lower() != b"basic":
                return None
            try:
                user, _, token = base64.b64decode(encoded.strip(), validate=True).partition(b":")
            except (binascii.Error, ValueError):
                return None
            known = self._proxies.get(user.decode("latin-1"))
            if known is None:
                hmac.compare_digest(token, token)  # the same work as a wrong token
                return None
            expected, proxy = known
            return proxy if hmac.compare_digest(token, expected) else None
        return None
