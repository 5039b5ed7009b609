"""``--listen ADDR:PORT --ca PATH``: the host channel on Kubernetes, where the server dials in.

A pod cannot be handed a socket: the agent listens on TCP and a server (any replica)
connects to the pod's address. Other pods may reach that port too (a NetworkPolicy should
stop them; nothing here relies on it), so every connection proves it comes from a server
before the agent reads or sends a single frame on it.

Why TLS with reversed roles: the agent must hold no secret. Code in the pod runs as the
agent's uid, and whatever key the agent held, that code could find a way to read (a file,
an environment variable): with it, it could drive the agent of *another* pod, whose CA
trusts the same key. So the agent is the TLS *client* (``ssl`` lets the side that accepted
the TCP connection be the one that sends the ClientHello) and the connecting server is the
TLS *server*, with a certificate for :data:`SERVER_NAME` signed by the CA the servers
share. The agent checks that chain against the CA certificate (public: a ConfigMap),
the name, the validity dates, TLS 1.2 or later. Nothing in the pod is secret, and nothing
a pod learns lets it act as a server. The agent does not authenticate itself in TLS: the
server reached it at the pod address the cluster gave, and checks that the agent's
``ready`` names that address (``listen`` in :class:`.protocol.ReadyEvent`; the frame
travels inside the tunnel), so a pod that relays a server's connection to another pod's
agent is caught. What the agent says is hostile to the server anyway.

Refused, and closed before any frame: plain TCP (whatever it sends is not a TLS
ServerHello), a peer that speaks TLS as a client, a certificate from another CA, expired
or not yet valid, or for another name. A handshake has :data:`HANDSHAKE_TIMEOUT_S`, and at
most :data:`MAX_PENDING` are under way: a new connection beyond that pushes out the oldest
one, so a flood of connections that never finish cannot keep a server out for long (a
server's handshake takes milliseconds; a flooder's stays open until pushed out or timed
out).

Everything runs on the supervisor's one thread and ``selectors`` loop: sockets are
non-blocking, handshakes are stepped as their sockets become ready. Which authenticated
connection becomes the host link is the supervisor's business (the newest, once idle).
Imported only with ``--listen``: ``ssl`` costs an agent's start time.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import select
import selectors
import socket
import ssl
import time
from collections.abc import Callable

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "MAX_PENDING",
    "SERVER_NAME",
    "Listener",
    "TlsConnection",
    "client_context",
    "listen_address",
    "parse_address",
]

#: The name in the servers' certificate (``mcp-code-sandbox kubernetes certs``) that the
#: agent expects: one fixed name, since a server is reached by no name at all.
SERVER_NAME = "mcp-code-sandbox-server"
#: From accept to a verified certificate. A server in the same cluster needs a few round
#: trips (milliseconds); this is room for a loaded node, not for a slow peer.
HANDSHAKE_TIMEOUT_S = 5.0
#: Handshakes under way at once. More than the replicas that could dial one agent at the
#: same moment; few enough that a flood holds only this many sockets.
MAX_PENDING = 16
#: The kernel's queue of connections not yet accepted: the loop accepts all at each turn.
_BACKLOG = 64
#: Accepted at most per turn of the loop, so that a flood cannot starve a run's output.
_ACCEPT_BATCH = 64
#: Read per turn of the loop at most (then more when the socket is readable again).
_READ_BYTES = 1 << 20
#: A host that takes not one byte of a frame for this long is gone (a node that vanished
#: without a FIN): the link is dropped, and the next server to connect takes over.
_WRITE_STALL_S = 30.0


def parse_address(text: str) -> tuple[str, int]:
    """``ADDR:PORT`` as ``(address, port)``; ``ValueError`` if not. An IPv6 address may
    come in brackets or not (``$(POD_IP):7070``): the port is after the last colon."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"--listen wants ADDR:PORT, got {text!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"--listen: port {port} out of range")
    return str(ipaddress.ip_address(host)), port


def listen_address(host: str, port: int) -> str:
    """The canonical ``ADDR:PORT`` of a listening address, as ``ready`` says it and as a
    server compares it with the address it dialled."""
    with contextlib.suppress(ValueError):
        parsed = ipaddress.ip_address(host)
        host = f"[{parsed}]" if parsed.version == 6 else str(parsed)
    return f"{host}:{port}"


def client_context(cafile: str) -> ssl.SSLContext:
    """The agent's TLS context: a server certificate for :data:`SERVER_NAME`, chained to
    the CA in ``cafile`` (and only that one), TLS 1.2 or later. Raises ``OSError`` or
    ``ssl.SSLError`` for a CA file that is missing or not a certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, check_hostname
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cafile=cafile)
    return context


class TlsConnection:
    """An authenticated connection, non-blocking, as the supervisor's host link uses it."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> bytes | None:
        """What the host sent: ``b""`` at EOF (or a broken record), ``None`` when no whole
        record came yet. Reads until the socket is empty or a bound is reached, and never
        leaves decrypted bytes behind (the selector could not see them)."""
        chunks: list[bytes] = []
        size = 0
        while size < _READ_BYTES or self.sock.pending():
            try:
                data = self.sock.recv(_READ_BYTES)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            except (ssl.SSLError, OSError):
                data = b""
            if not data:  # EOF: what came before it first; the EOF is seen again
                return b"".join(chunks) if chunks else b""
            chunks.append(data)
            size += len(data)
        return b"".join(chunks) if chunks else None

    def send(self, data: bytes) -> None:
        """All of ``data``; ``OSError`` when the host stops taking it for ``_WRITE_STALL_S``."""
        view = memoryview(data)
        while view:
            try:
                view = view[self.sock.send(view) :]
                continue
            except ssl.SSLWantReadError:
                wanted = select.POLLIN
            except ssl.SSLWantWriteError:
                wanted = select.POLLOUT
            poll = select.poll()
            poll.register(self.sock, wanted)
            if not poll.poll(_WRITE_STALL_S * 1000):
                raise TimeoutError(f"the host took nothing for {_WRITE_STALL_S:g} s")

    def close(self) -> None:
        self.sock.close()


class _Handshake:
    def __init__(self, sock: ssl.SSLSocket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline


class Listener:
    """The listening socket and the handshakes under way, in the supervisor's selector.

    ``on_authenticated`` gets each connection whose server proved itself; the listener
    forgets it then. Sockets that fail are closed here and never reported."""

    def __init__(self, address: tuple[str, int], cafile: str) -> None:
        self.address = address
        self._context = client_context(cafile)
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._sock = socket.create_server(address, family=family, backlog=_BACKLOG)
        self._sock.setblocking(False)
        #: Oldest first: the one pushed out when a new connection finds no room.
        self._pending: collections.OrderedDict[int, _Handshake] = collections.OrderedDict()
        self._sel: selectors.BaseSelector | None = None
        self._on_authenticated: Callable[[TlsConnection], None] = lambda conn: conn.close()

    @property
    def name(self) -> str:
        """This listener's ``ADDR:PORT`` (see :func:`listen_address`)."""
        return listen_address(*self.address)

    def attach(
        self, sel: selectors.BaseSelector, on_authenticated: Callable[[TlsConnection], None]
    ) -> None:
        """Start accepting: register with ``sel``, whose loop calls back zero-arg ``data``."""
        self._sel = sel
        self._on_authenticated = on_authenticated
        sel.register(self._sock, selectors.EVENT_READ, self._accept)

    def due_in(self) -> float | None:
        """Seconds until the oldest handshake times out; ``None`` with none under way."""
        if not self._pending:
            return None
        oldest = next(iter(self._pending.values()))
        return max(0.0, oldest.deadline - time.monotonic())

    def expire(self) -> None:
        """Close every handshake past its deadline."""
        now = time.monotonic()
        for fd, handshake in list(self._pending.items()):
            if handshake.deadline > now:
                break  # oldest first, and every one has the same timeout
            self._drop(fd)

    def close(self) -> None:
        for fd in list(self._pending):
            self._drop(fd)
        if self._sel is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(self._sock)
        self._sock.close()

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                raw, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of fds, a connection reset before accept: try later
                return
            self._begin(raw)

    def _begin(self, raw: socket.socket) -> None:
        while len(self._pending) >= MAX_PENDING:
            self._drop(next(iter(self._pending)))
        try:
            raw.setblocking(False)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # frames are small
            sock = self._context.wrap_socket(
                raw, server_side=False, server_hostname=SERVER_NAME, do_handshake_on_connect=False
            )
        except (ssl.SSLError, OSError):
            raw.close()
            return
        fd = sock.fileno()
        self._pending[fd] = _Handshake(sock, time.monotonic() + HANDSHAKE_TIMEOUT_S)
        assert self._sel is not None
        self._sel.register(fd, selectors.EVENT_WRITE, lambda: self._step(fd))
        self._step(fd)

    def _step(self, fd: int) -> None:
        handshake = self._pending.get(fd)
        if handshake is None:
            return
        assert self._sel is not None
        try:
            handshake.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._sel.modify(fd, selectors.EVENT_READ, lambda: self._step(fd))
            return
        except ssl.SSLWantWriteError:
            self._sel.modify(fd, selectors.EVENT_WRITE, lambda: self._step(fd))
            return
        except (ssl.SSLError, OSError, ValueError):  # refused: wrong CA, name, dates; EOF
            self._drop(fd)
            return
        self._sel.unregister(fd)
        del self._pending[fd]
        self._on_authenticated(TlsConnection(handshake.sock))

    def _drop(self, fd: int) -> None:
        handshake = self._pending.pop(fd)
        if self._sel is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(fd)
        handshake.sock.close()
