"""HTTP inside a TLS session the proxy terminated, for a host that secrets go to.

The sandbox's requests arrive in plaintext here (:class:`Intercepted`); each is judged
as the first was (the proxy's policy of the moment must still allow the host: a later
call that names fewer hosts applies to it), must be for the CONNECT host in
origin form, gets the secrets for that host added (:func:`with_secrets`) and goes to the
upstream over the proxy's own TLS connection, verified by the proxy and kept alive
across requests while both ends allow. Only bytes the proxy framed reach that upstream
(``http.relay``), and a response followed by bytes nobody asked for ends the kept
connection: a request that carries a secret never meets a response (or a request) that
another exchange left behind.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

import h11

from . import http
from .policy import Decision, normalize_host
from .secrets import Secret
from .streams import IDLE_S, ByteStream, SocketStream

__all__ = ["MAX_REQUESTS", "Intercepted", "with_secrets"]

#: Requests on one intercepted connection.
MAX_REQUESTS = 1000


def with_secrets(headers: http.Headers, secrets: Sequence[Secret], used: set[str]) -> http.Headers:
    """``headers`` with each secret's header set from its template where the request
    lacks that header or carries the placeholder in it; a header the code set to anything
    else is left alone (its own credential). The names of the secrets added go to ``used``."""
    out = list(headers)
    for secret in secrets:
        name = secret.header_name.lower().encode()
        present = [i for i, (key, _) in enumerate(out) if key.lower() == name]
        if present and not any(secret.placeholder.encode() in out[i][1] for i in present):
            continue
        out = [pair for i, pair in enumerate(out) if i not in present]
        out.append((secret.header_name.encode(), secret.header_value().encode()))
        used.add(secret.name)
    return out


class Intercepted:
    """One intercepted connection. ``dial`` opens a verified connection to the host, or
    raises :class:`http.UpstreamFailed`; ``judge`` is the policy's verdict on the host
    now, asked before every request; ``refused`` answers a refusal (the proxy's 403,
    which it counts); ``used`` collects the secret names added."""

    def __init__(
        self,
        tls: ByteStream,
        host: str,
        secrets: Sequence[Secret],
        dial: Callable[[], Awaitable[SocketStream]],
        judge: Callable[[], Decision],
        refused: Callable[[h11.Connection, ByteStream, Decision], Awaitable[None]],
    ) -> None:
        self.tls = tls
        self.host = host
        self.secrets = tuple(secrets)
        self._judge = judge
        self._refused = refused
        self.used: set[str] = set()
        self._dial = dial
        self._upstream: SocketStream | None = None
        self._upstream_conn = h11.Connection(h11.CLIENT)

    async def serve(self) -> None:
        """Serve requests until the client ends, errs or reaches :data:`MAX_REQUESTS`.
        Called by the proxy after the handshake; closes the upstream side at the end."""
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=http.MAX_HEAD)
        try:
            for _ in range(MAX_REQUESTS):
                event = await http.next_request(conn, self.tls, IDLE_S)
                if not isinstance(event, h11.Request):
                    return
                if not self._for_host(event):
                    await http.respond(
                        conn, self.tls, 403,
                        f"requests in this tunnel must be for {self.host}, in origin form",
                        close=True,
                    )  # fmt: skip
                    return
                if not (decision := self._judge()).allowed:
                    await self._refused(conn, self.tls, decision)
                    return
                headers = with_secrets(http.forwardable(event.headers), self.secrets, self.used)
                if not await self._relay(conn, event, headers):
                    return
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        finally:
            await self._drop()

    def _for_host(self, request: h11.Request) -> bool:
        """The Host header names the CONNECT host and the target is a path (no second
        host behind an allowed one, by ``Host`` or by an absolute URL an upstream would
        prefer to it)."""
        if request.method == b"CONNECT" or not request.target.startswith(b"/"):
            return False
        stated = (http.header(request.headers, b"host") or b"").decode("latin-1")
        try:
            return normalize_host(urlsplit("//" + stated).hostname or "") == self.host
        except ValueError:
            return False

    async def _relay(
        self, conn: h11.Connection, request: h11.Request, headers: http.Headers
    ) -> bool:
        """One exchange; False after answering 502 (the connection then ends)."""
        try:
            if self._upstream is None or self._upstream.reader.at_eof():
                await self._drop()  # the upstream closed the kept connection: a new one
                self._upstream = await self._dial()
                self._upstream_conn = h11.Connection(h11.CLIENT)
            up = self._upstream_conn
            await http.relay(
                conn, self.tls, request, request.target, headers, up, self._upstream, IDLE_S
            )
        except http.UpstreamFailed as exc:
            await self._drop()
            await http.respond(
                conn, self.tls, 502, f"upstream {self.host} failed: {exc}", close=True
            )
            return False
        except BaseException:
            await self._drop()
            raise
        if up.our_state is h11.DONE and up.their_state is h11.DONE and not up.trailing_data[0]:
            up.start_next_cycle()
        else:
            await self._drop()
        return True

    async def _drop(self) -> None:
        if self._upstream is not None:
            upstream, self._upstream = self._upstream, None
            await upstream.close()
