"""One sandbox's egress proxy: an HTTP proxy on a Unix socket, its only way out.

The sandbox side (``backends``) binds the socket into the sandbox and bridges it to
``127.0.0.1:<port>`` there, with ``HTTP(S)_PROXY`` pointing at it. A proxy opened
without a socket serves the connections :mod:`.gate` hands it instead (a sandbox that
reaches the server over a network: its TCP port, a credential per proxy). Per connection:

- ``CONNECT host:port`` (HTTPS): the policy decides by the CONNECT host, then by every
  address it resolves to; a refusal is the CONNECT's answer, a 403 whose body says
  ``blocked by sandbox network policy: <host> is not in the allowlist``. After ``200``
  the ClientHello's SNI must equal the host (``tls.accept_tls``). Hosts with secrets are
  intercepted (:mod:`.secrets`); all others are tunnelled, bytes untouched.
- ``GET http://host/...`` (plain HTTP, absolute form): decided by the host, which the
  request line and the ``Host`` header must agree on; forwarded with ``h11``.
- Plain HTTP inside a CONNECT tunnel (Node's fetch, undici, tunnels ``http://`` URLs
  too): the first byte after ``200`` is not a TLS handshake record, so the tunnel's
  requests are read with ``h11`` and each is served like a plain proxy request for the
  CONNECT host, whose name its ``Host`` header must carry (a 403 with the policy's
  message otherwise: no second host behind an allowed one). Like all plain HTTP, no
  secret is ever added to them.

Bounds: :data:`MAX_CONNECTIONS` at once, fewer when the owner's sandboxes hold their
share of the server's connections (``limits.ConnectionBudget``; more are answered 503,
a few at a time, and past those wait in the socket's backlog), refusals at the pace of
``limits.RefusalPace``, heads of
``http.MAX_HEAD`` bytes, :data:`IDLE_S` without a byte either way, ten seconds for DNS, the
upstream's connect and the TLS handshake. Every connection ends in one audit line (logger
``mcp_code_sandbox.egress``) and one metrics count. A failure inside one connection ends
that connection only, and one sandbox's proxy shares nothing with another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

import h11
import structlog

from mcp_code_sandbox.errors import SandboxFailed
from mcp_code_sandbox.metrics import Metrics

from . import http
from .audit import Audit
from .dns import ResolveFailed, Resolver, system_resolver, vetted_addresses
from .intercept import Intercepted
from .limits import ConnectionBudget, RefusalPace
from .policy import Decision, IPAddress, Policy, normalize_host
from .secrets import Secret, secrets_for
from .streams import IDLE_S, ByteStream, SocketStream, pipe
from .tls import (
    EphemeralCA,
    Handshaken,
    NotTls,
    SniRefused,
    Tunnel,
    accept_tls,
    prepare_tls,
)

__all__ = ["EgressProxy", "blocked_message", "open_proxy"]

log = structlog.get_logger("mcp_code_sandbox.egress")

#: Connections one sandbox's proxy serves at once (the README documents it).
MAX_CONNECTIONS = 64
#: Connections past a limit being answered 503 at once; more wait in the backlog.
REFUSING = 8
#: The listening socket's backlog: connections the kernel holds (on the sandbox's
#: account) while every slot is taken.
BACKLOG = 64
#: How long a connection past a limit may take to send its request before its 503.
REFUSE_READ_S = 2.0
#: After a failed accept (the process out of descriptors): a pause, not a busy loop.
ACCEPT_RETRY_S = 0.1
CONNECT_TIMEOUT_S = 10.0
HANDSHAKE_TIMEOUT_S = 10.0
#: Hosts kept for :meth:`EgressProxy.take_blocked` between two calls.
MAX_BLOCKED = 32
#: Certificates kept per proxy (one per intercepted host name).
MAX_LEAVES = 64
#: The first byte of a TLS handshake record (RFC 8446 §5.1): what a tunnel for HTTPS
#: starts with. Anything else after a CONNECT is taken for plain HTTP.
TLS_HANDSHAKE = 0x16


def blocked_message(host: str) -> str:
    """The body of a refusal: what the model reads and can act on."""
    return f"blocked by sandbox network policy: {host} is not in the allowlist"


class EgressProxy:
    """A running proxy. Built by :func:`open_proxy`; the sandbox's owner (the session's
    sandbox wiring) reads :meth:`ca_bundle` once, :meth:`take_blocked` after each run,
    and calls :meth:`aclose` when the sandbox goes."""

    def __init__(
        self,
        socket_path: Path | None,
        policy: Policy,
        secrets: Sequence[Secret],
        *,
        owner: str,
        session: str,
        metrics: Metrics | None,
        resolver: Resolver,
        ca: EphemeralCA | None,
        bundle: bytes | None,
        upstream_tls: ssl.SSLContext | None,
        budget: ConnectionBudget | None = None,
    ) -> None:
        self._socket_path = socket_path
        self.policy = policy
        self.secrets = tuple(secrets)
        self.owner = owner
        self.session = session
        self._metrics = metrics
        self._resolver = resolver
        self._ca = ca
        self._bundle = bundle
        self._upstream_tls = upstream_tls
        self._leaves: dict[str, ssl.SSLContext] = {}
        self._blocked: dict[str, None] = {}
        self._budget = budget
        self._pace = RefusalPace(session, owner, metrics)
        #: Connections accepted and not yet ended: those served and those being refused.
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS + REFUSING)
        self._serving = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None

    # -- the API --------------------------------------------------------------------

    @property
    def socket_path(self) -> Path:
        """The Unix socket it listens on (``ValueError`` for one that serves a gate's)."""
        if self._socket_path is None:
            raise ValueError("this proxy has no socket: it serves the gate's connections")
        return self._socket_path

    def use_policy(self, policy: Policy) -> None:
        """Judge new connections by ``policy`` from now on (a call's narrowed policy, the
        server's, or ``Policy()`` to refuse everything while a call has no network).
        Requests on connections already open are judged by it too (plain HTTP, and
        intercepted TLS); a tunnel the proxy does not intercept keeps its verdict."""
        self.policy = policy

    def ca_bundle(self) -> bytes | None:
        """PEM to trust inside the sandbox (``SSL_CERT_FILE``, ``REQUESTS_CA_BUNDLE``,
        ``NODE_EXTRA_CA_CERTS``, ``PIP_CERT``): this proxy's CA, the system roots and
        the extra upstream CA. None when there are no secrets and no extra CA: the
        sandbox then needs nothing but its own roots (the proxy intercepts nothing)."""
        return self._bundle

    def take_blocked(self) -> list[str]:
        """Hosts refused since the last call (each once, at most :data:`MAX_BLOCKED`),
        for the run result; the list is emptied."""
        hosts, self._blocked = list(self._blocked), {}
        return hosts

    async def aclose(self) -> None:
        """Stop listening, end every open connection, remove the socket. Bounded."""
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.wait([self._accepting], timeout=5)
        if self._listener is not None:
            self._listener.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        self._pace.summarise()
        if self._socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._socket_path.unlink()

    # -- serving --------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on :attr:`socket_path`; its mode lets any uid connect (the sandbox's
        uid differs from the server's): the directory it lies in is the gate."""
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.socket_path))
            os.chmod(self.socket_path, 0o666)  # noqa: S103 - the directory guards it
            listener.listen(BACKLOG)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._accepting = asyncio.create_task(self._accept_loop(listener))

    async def _accept_loop(self, listener: socket.socket) -> None:
        """Accept only while a slot is free: past :data:`MAX_CONNECTIONS` served and
        :data:`REFUSING` being refused, connections wait in the kernel's backlog (the
        sandbox's, not the server's descriptors). Each accepted one is served, or (past
        this proxy's cap, its owner's share or the server's budget) answered 503."""
        loop = asyncio.get_running_loop()
        while True:
            await self._slots.acquire()
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # EMFILE and friends: the reserve is the server's
                self._slots.release()
                log.warning("egress proxy cannot accept", session=self.session, error=str(exc))
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            except BaseException:
                self._slots.release()
                raise
            task = asyncio.create_task(self._connection(sock))
            self._tasks.add(task)

    def _grant(self) -> tuple[str, str] | None:
        """A slot to serve one more connection, or (the metrics' reason, the message)."""
        if self._serving >= MAX_CONNECTIONS:
            return "sandbox_limit", f"too many connections (at most {MAX_CONNECTIONS})"
        if self._budget is not None and (refused := self._budget.take(self.owner)) is not None:
            return refused
        self._serving += 1
        return None

    def serve_handed(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes
    ) -> asyncio.Task[None]:
        """Serve a connection another listener accepted and authenticated (:mod:`.gate`),
        ``head``: the bytes it read already (the first request's head), as if this proxy
        had read them. The task ends with the connection; :meth:`aclose` ends it too."""
        task = asyncio.create_task(self._connection(None, (reader, writer), head))
        self._tasks.add(task)
        return task

    async def _connection(
        self,
        sock: socket.socket | None,
        handed: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None,
        head: bytes = b"",
    ) -> None:
        """One connection: ``sock`` accepted on this proxy's socket (a slot taken), or
        ``handed`` over with its first bytes ``head`` (no slot: the gate bounds those)."""
        task = asyncio.current_task()
        assert task is not None
        refusal = self._grant()
        audit = [Audit("http")]  # the current request's (plain HTTP: one per request)
        client: SocketStream | None = None
        try:
            if handed is not None:
                reader, writer = handed
            else:
                reader, writer = await asyncio.open_unix_connection(sock=sock, limit=http.MAX_HEAD)
            client = SocketStream(reader, writer, received=audit[0].up, sent=audit[0].down)
            conn = h11.Connection(h11.SERVER, max_incomplete_event_size=http.MAX_HEAD)
            if head:  # (empty bytes would tell h11 the peer closed)
                conn.receive_data(head)
            if refusal is None:
                await self._serve(client, audit, conn)
            else:
                await self._overloaded(client, *refusal, conn)
        except (OSError, h11.ProtocolError, http.ReadTimeout, ssl.SSLError, TimeoutError):
            pass  # the peer went away or spoke nonsense: the connection ends, the audit says so
        except asyncio.CancelledError:
            pass  # aclose() ends open connections; nobody awaits this task
        except Exception:  # one connection's bug never stops the proxy
            log.exception("egress connection failed", session=self.session)
        finally:
            if refusal is None:
                self._serving -= 1
                if self._budget is not None:
                    self._budget.give(self.owner)
            if client is not None:
                await client.close()
            elif sock is not None:
                sock.close()
            elif handed is not None:
                handed[1].close()
            if handed is None:
                self._slots.release()
            self._tasks.discard(task)
            if audit[0].host:
                audit[0].emit(self.session, self.owner, self._metrics)

    async def _overloaded(
        self, client: SocketStream, reason: str, message: str, conn: h11.Connection
    ) -> None:
        """A connection past a limit: its request (read for at most a moment) is answered
        503, at the pace of refusals."""
        if self._metrics is not None:
            self._metrics.egress_refused(reason)
        with contextlib.suppress(h11.ProtocolError, http.ReadTimeout):
            await http.next_event(conn, client, REFUSE_READ_S)
        if await self._pace.wait():
            log.info("egress connection refused", session=self.session, owner=self.owner,
                     reason=reason)  # fmt: skip
        await http.respond(conn, client, 503, message, close=True)

    async def _serve(
        self,
        client: SocketStream,
        audit: list[Audit],
        conn: h11.Connection | None = None,
        tunnel: tuple[str, int] | None = None,
    ) -> None:
        """Requests on one connection: a CONNECT ends the loop (the connection becomes
        the tunnel); plain requests may follow each other (keep-alive), each with its
        own audit line. ``tunnel``: the connection is a CONNECT tunnel to that host and
        port carrying plain HTTP (``conn`` has its first bytes), called by
        :meth:`_plain_tunnel`."""
        if conn is None:
            conn = h11.Connection(h11.SERVER, max_incomplete_event_size=http.MAX_HEAD)
        while True:
            what = "bad request" if tunnel is None else "a tunnel carries TLS or HTTP/1.1"
            event = await http.next_request(conn, client, IDLE_S, what)
            if not isinstance(event, h11.Request):
                return
            if event.method == b"CONNECT" and tunnel is None:
                audit[0].kind = "connect"
                await self._connect(conn, client, event, audit)
                return
            if tunnel is None:
                going_on = await self._plain(conn, client, event, audit[0])
            else:
                going_on = await self._in_tunnel(conn, client, event, audit[0], *tunnel)
            if not going_on:
                return
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            audit[0].emit(self.session, self.owner, self._metrics)
            audit[0] = Audit("http")
            client.received, client.sent = audit[0].up, audit[0].down
            conn.start_next_cycle()

    async def _refuse(
        self, conn: h11.Connection, client: ByteStream, audit: Audit, decision: Decision
    ) -> None:
        audit.allowed, audit.rule = False, decision.rule
        self._note_blocked(audit.host)
        audit.quiet = not await self._pace.wait()
        await http.respond(conn, client, 403, blocked_message(audit.host))

    def _note_blocked(self, host: str) -> None:
        if host not in self._blocked and len(self._blocked) < MAX_BLOCKED:
            self._blocked[host] = None

    async def _judge(
        self, conn: h11.Connection, client: ByteStream, audit: Audit
    ) -> list[IPAddress] | None:
        """The addresses to connect to, or None after answering the client (403/502)."""
        decision = self.policy.decide(audit.host, audit.port)
        audit.rule = decision.rule
        if not decision.allowed:
            await self._refuse(conn, client, audit, decision)
            return None
        try:
            addresses, verdict = await vetted_addresses(
                self.policy, self._resolver, audit.host, audit.port
            )
        except ResolveFailed:
            audit.rule = "dns-failed"
            await http.respond(conn, client, 502, f"{audit.host} did not resolve")
            return None
        if not verdict.allowed:
            await self._refuse(conn, client, audit, verdict)
            return None
        return addresses

    async def _dial(
        self, addresses: Sequence[IPAddress], port: int, tls: ssl.SSLContext | None, host: str
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect to the first address that answers (bounded per address)."""
        failure: Exception = OSError("no address")
        for address in addresses:
            try:
                return await asyncio.wait_for(
                    asyncio.open_connection(
                        str(address), port, ssl=tls, server_hostname=host if tls else None,
                        limit=http.MAX_HEAD,
                    ),
                    CONNECT_TIMEOUT_S,
                )  # fmt: skip
            except (OSError, TimeoutError) as exc:
                failure = exc
        raise failure

    # -- plain HTTP -----------------------------------------------------------------

    async def _plain(
        self, conn: h11.Connection, client: SocketStream, request: h11.Request, audit: Audit
    ) -> bool:
        """One absolute-form request. Returns whether the connection may go on."""
        url = urlsplit(request.target.decode("latin-1"))
        if url.scheme != "http" or not url.hostname:
            await http.respond(
                conn, client, 400,
                "this proxy takes absolute http:// URLs; use CONNECT for https",
                close=True,
            )  # fmt: skip
            return False
        try:
            host, port = normalize_host(url.hostname), url.port or 80
            stated = urlsplit("//" + (http.header(request.headers, b"host") or b"").decode())
            agrees = normalize_host(stated.hostname or "") == host and (stated.port or 80) == port
        except ValueError:
            agrees = False
        if not agrees:
            await http.respond(
                conn, client, 400, "the Host header must name the request's host", close=True
            )
            return False
        path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        return await self._forward(conn, client, request, audit, (host, port), path)

    async def _in_tunnel(
        self,
        conn: h11.Connection,
        client: SocketStream,
        request: h11.Request,
        audit: Audit,
        host: str,
        port: int,
    ) -> bool:
        """One origin-form request inside a plain-HTTP CONNECT tunnel to ``host:port``.
        Its ``Host`` header must name ``host`` (and ``port``, when it names one): a
        client must not reach a second host through a tunnel the policy let it open.
        Returns whether the connection may go on."""
        target = request.target.decode("latin-1")
        if request.method == b"CONNECT" or not target.startswith("/"):
            await http.respond(
                conn, client, 400, "requests in a tunnel take a path (origin form)", close=True
            )
            return False
        try:
            stated = urlsplit("//" + (http.header(request.headers, b"host") or b"").decode())
            named = normalize_host(stated.hostname or "")
            agrees = named == host and stated.port in (None, port)
        except ValueError:
            named, agrees = "", False
        if not agrees:
            audit.host, audit.port = named or "(none)", port
            audit.allowed, audit.rule = False, f"tunnel-host:{host}"
            self._note_blocked(audit.host)
            await http.respond(conn, client, 403, blocked_message(audit.host), close=True)
            return False
        return await self._forward(conn, client, request, audit, (host, port), target)

    async def _forward(
        self,
        conn: h11.Connection,
        client: SocketStream,
        request: h11.Request,
        audit: Audit,
        where: tuple[str, int],
        path: str,
    ) -> bool:
        """Judge, dial and relay one plain-HTTP request to ``where`` as ``path``: the
        one way plain HTTP goes out, from a proxy request or a tunnel. No secret is
        added (secrets go over TLS only). Returns whether the connection may go on."""
        host, port = where
        audit.host, audit.port = host, port
        addresses = await self._judge(conn, client, audit)
        if addresses is None:
            return True
        try:
            reader, writer = await self._dial(addresses, port, None, host)
        except (OSError, TimeoutError) as exc:
            audit.rule += " (connect failed)"
            await http.respond(conn, client, 502, f"could not connect to {host}:{port}: {exc}")
            return True
        audit.allowed = True
        upstream = SocketStream(reader, writer)
        headers = [*http.forwardable(request.headers), (b"connection", b"close")]
        try:
            await http.relay(
                conn, client, request, path.encode("latin-1"), headers,
                h11.Connection(h11.CLIENT), upstream, IDLE_S,
            )  # fmt: skip
        except http.UpstreamFailed as exc:
            await http.respond(conn, client, 502, f"upstream {host} failed: {exc}", close=True)
            return False
        finally:
            await upstream.close()
        return True

    # -- CONNECT --------------------------------------------------------------------

    async def _connect(
        self,
        conn: h11.Connection,
        client: SocketStream,
        request: h11.Request,
        audits: list[Audit],
    ) -> None:
        audit = audits[0]
        target = request.target.decode("latin-1")
        try:
            url = urlsplit("//" + target)
            host, port = normalize_host(url.hostname or ""), url.port
        except ValueError:
            host, port = "", None
        if not host or port is None:
            await http.respond(conn, client, 400, "CONNECT needs host:port", close=True)
            return
        audit.host, audit.port = host, port
        addresses = await self._judge(conn, client, audit)
        if addresses is None:
            return
        mine = secrets_for(self.secrets, host)
        leaf = await self._leaf(host) if mine else None
        try:
            reader, writer = await self._dial(addresses, port, None, host)
        except (OSError, TimeoutError) as exc:
            audit.rule += " (connect failed)"
            await http.respond(conn, client, 502, f"could not connect to {host}:{port}: {exc}")
            return
        upstream = SocketStream(reader, writer)
        try:
            await client.write(
                conn.send(
                    h11.Response(status_code=200, headers=[], reason=b"Connection established")
                )
                or b""
            )
            first = conn.trailing_data[0] or await asyncio.wait_for(
                client.read(), HANDSHAKE_TIMEOUT_S
            )
            if first and first[0] != TLS_HANDSHAKE:
                await upstream.close()  # each request dials its own, as plain HTTP does
                await self._plain_tunnel(client, first, (host, port), audits)
                return
            outcome = await asyncio.wait_for(
                accept_tls(client, first, host, leaf), HANDSHAKE_TIMEOUT_S
            )
            await self._after_hello(outcome, client, upstream, audit, mine)
        finally:
            await upstream.close()

    async def _plain_tunnel(
        self, client: SocketStream, first: bytes, where: tuple[str, int], audits: list[Audit]
    ) -> None:
        """Serve a CONNECT tunnel that carries plain HTTP (``first``: its first bytes)
        as plain proxy requests for ``where``: one audit line per request, as for plain
        HTTP. Bytes that are neither TLS nor HTTP get a 400 and end the connection."""
        audits[0].kind, audits[0].rule = "http", "not-tls-or-http"
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=http.MAX_HEAD)
        conn.receive_data(first)
        try:
            await self._serve(client, audits, conn, where)
        except h11.RemoteProtocolError:
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                await http.respond(
                    conn, client, 400, "a tunnel carries TLS or HTTP/1.1", close=True
                )

    async def _after_hello(
        self,
        outcome: Tunnel | SniRefused | NotTls | Handshaken,
        client: SocketStream,
        upstream: SocketStream,
        audit: Audit,
        mine: Sequence[Secret],
    ) -> None:
        if isinstance(outcome, SniRefused):
            audit.allowed, audit.rule = False, f"sni-mismatch:{outcome.sni or '(none)'}"
            self._note_blocked(outcome.sni or audit.host)
        elif isinstance(outcome, NotTls):
            audit.allowed, audit.rule = False, f"not-tls ({outcome.reason})"
        elif isinstance(outcome, Tunnel):
            audit.allowed = True
            await upstream.write(outcome.hello)
            await pipe(client, upstream, IDLE_S)
        else:
            audit.allowed, audit.intercepted = True, True
            await upstream.close()  # reopened with TLS, verified by the proxy
            session = Intercepted(
                outcome.stream, audit.host, mine,
                lambda: self._dial_tls(audit.host, audit.port),
                lambda: self.policy.decide(audit.host, audit.port),
                lambda conn, stream, decision: self._refuse(conn, stream, audit, decision),
            )  # fmt: skip
            try:
                await session.serve()
            finally:
                audit.secrets.update(session.used)

    async def _leaf(self, host: str) -> ssl.SSLContext:
        """This proxy's certificate for ``host``, made once (in a thread) and kept; at
        most :data:`MAX_LEAVES` are kept (a secret for ``*.x`` allows many names)."""
        assert self._ca is not None
        if host not in self._leaves:
            if len(self._leaves) >= MAX_LEAVES:
                del self._leaves[next(iter(self._leaves))]
            self._leaves[host] = await asyncio.to_thread(self._ca.leaf_context, host)
        return self._leaves[host]

    async def _dial_tls(self, host: str, port: int) -> SocketStream:
        """A new connection to an intercepted host, its certificate verified by the proxy
        (the system roots and ``upstream_ca``), its addresses checked again."""
        try:
            addresses, verdict = await vetted_addresses(self.policy, self._resolver, host, port)
            if not verdict.allowed:
                raise OSError(f"address refused ({verdict.rule})")
            reader, writer = await self._dial(addresses, port, self._upstream_tls, host)
        except (OSError, TimeoutError, ResolveFailed, ssl.SSLError) as exc:
            raise http.UpstreamFailed(f"could not reach {host}: {exc}") from None
        return SocketStream(reader, writer)


async def open_proxy(
    socket_path: Path | None,
    policy: Policy,
    secrets: Sequence[Secret],
    *,
    owner: str,
    session: str,
    metrics: Metrics | None,
    upstream_ca: Path | None = None,
    resolver: Resolver | None = None,
    budget: ConnectionBudget | None = None,
) -> EgressProxy:
    """Start a sandbox's proxy listening on ``socket_path`` (created; replaced if stale);
    ``None``: listening nowhere, for connections handed to :meth:`EgressProxy.serve_handed`.

    ``secrets``: all the server's secrets (the proxy picks those whose hosts a CONNECT
    names). ``upstream_ca``: extra roots for upstreams (``SANDBOX_NETWORK_UPSTREAM_CA``).
    ``resolver``: how names resolve (default: the host's resolver;
    ``dns.resolver_from_settings`` adds ``SANDBOX_NETWORK_RESOLVE``). ``budget``: the
    server's connections, shared by all its proxies (None: this proxy's cap only). The
    blocking set-up (a CA key, reading the roots) runs in a worker thread. Raises
    :class:`~mcp_code_sandbox.errors.SandboxFailed` when the socket cannot be made.
    """
    ca: EphemeralCA | None = None
    bundle: bytes | None = None
    upstream_tls: ssl.SSLContext | None = None
    if secrets or upstream_ca is not None:
        ca, bundle, upstream_tls = await asyncio.to_thread(
            prepare_tls, session, bool(secrets), upstream_ca
        )
    proxy = EgressProxy(
        socket_path, policy, secrets, owner=owner, session=session, metrics=metrics,
        resolver=resolver or system_resolver, ca=ca, bundle=bundle, upstream_tls=upstream_tls,
        budget=budget,
    )  # fmt: skip
    if socket_path is None:
        return proxy
    try:
        await proxy.start()
    except OSError as exc:
        raise SandboxFailed(
            f"could not start the sandbox's egress proxy on {socket_path}: {exc.strerror or exc}"
        ) from None
    return proxy
