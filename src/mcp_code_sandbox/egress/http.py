"""HTTP/1.1 for the egress proxy, parsed and framed by ``h11`` (no hand-written parser).

The proxy is an HTTP server to the sandbox (proxy requests, and requests inside an
intercepted TLS session) and an HTTP client to upstreams. :func:`next_event` reads one
bounded event; :func:`relay` forwards one request and its response between the two.

Framing (RFC 9112 §6): what one side sent is never what the other side reads. Every head
is read by ``h11``, and before that checked whole by :func:`framing_problem`, because
``h11`` is lenient where a proxy must not be: it unfolds obs-fold lines, merges repeated
equal ``Content-Length`` headers and lets ``Transfer-Encoding`` win over
``Content-Length``, where an upstream behind the proxy may read the same bytes otherwise
(request smuggling). A head with any of those is refused (:class:`AmbiguousFraming`: a
400 to the sandbox, a 502 for an upstream's response). What is forwarded carries no
framing header of the sender: :func:`relay` states one length (``Content-Length``, or
chunked) of its own and ``h11`` writes the body by it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from http import HTTPStatus

import h11

from .streams import ByteStream

__all__ = [
    "HOP_BY_HOP",
    "MAX_HEAD",
    "AmbiguousFraming",
    "Headers",
    "ReadTimeout",
    "UpstreamFailed",
    "framing_problem",
    "header",
    "next_event",
    "next_request",
    "relay",
    "respond",
]

Headers = list[tuple[bytes, bytes]]
#: The most bytes of a request or response head (line and headers).
MAX_HEAD = 64 * 1024
#: Headers that belong to one connection, never forwarded (RFC 9110 §7.6.1), and the
#: proxy's own. ``Expect``: the proxy answers ``100-continue`` itself.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"upgrade",
        b"expect",
    }
)
#: Framing headers: never forwarded as received; :func:`relay` sets its own.
FRAMING = frozenset({b"content-length", b"transfer-encoding"})
#: Where a head ends (what ``h11`` looks for: a blank line, with or without CR).
_HEAD_END = re.compile(b"\n\r?\n")


class ReadTimeout(Exception):
    """No byte for the idle timeout."""


class UpstreamFailed(Exception):
    """The upstream broke the exchange before its response began (the client gets 502)."""


class AmbiguousFraming(h11.RemoteProtocolError):
    """A head that two HTTP parsers may frame differently (see the module docstring).
    A ``RemoteProtocolError``: every path that ends a connection on one ends it on this."""


def framing_problem(head: bytes, *, request: bool) -> str | None:
    """Why the complete head ``head`` (request or status line, headers, blank line) is
    ambiguous, or None: obs-fold, several ``Content-Length`` (as headers or as a list),
    ``Transfer-Encoding`` other than exactly one ``chunked``, both framing headers, or
    (requests) several ``Host`` headers (RFC 9112 §3.2)."""
    lines = head.split(b"\n")[1:]
    counts = {b"content-length": 0, b"transfer-encoding": 0, b"host": 0}
    for raw in lines:
        line = raw.rstrip(b"\r")
        if not line:
            break
        if line[:1] in (b" ", b"\t"):
            return "a header folded over lines (obs-fold)"
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name in counts:
            counts[name] += 1
        if name == b"content-length" and b"," in value:
            return "several Content-Length values"
        if name == b"transfer-encoding" and value.strip().lower() != b"chunked":
            return "a Transfer-Encoding other than chunked"
    if counts[b"content-length"] > 1:
        return "several Content-Length headers"
    if counts[b"transfer-encoding"] > 1:
        return "several Transfer-Encoding headers"
    if counts[b"content-length"] and counts[b"transfer-encoding"]:
        return "both Content-Length and Transfer-Encoding"
    if request and counts[b"host"] > 1:
        return "several Host headers"
    return None


def _check_head(conn: h11.Connection) -> None:
    """Before ``h11`` parses the peer's next head: refuse it if ambiguous. The head is
    still raw in ``h11``'s buffer (``trailing_data``) until ``next_event`` takes it."""
    expected = h11.IDLE if conn.our_role is h11.SERVER else h11.SEND_RESPONSE
    if conn.their_state is not expected:
        return
    buffered = conn.trailing_data[0]
    end = _HEAD_END.search(buffered)
    if end is None:
        return
    problem = framing_problem(buffered[: end.end()], request=conn.our_role is h11.SERVER)
    if problem is not None:
        raise AmbiguousFraming(f"ambiguous message framing: {problem}")


async def next_event(conn: h11.Connection, stream: ByteStream, idle_s: float) -> h11.Event:
    """The next event of ``conn``, reading ``stream`` as needed; EOF is given to h11
    (which turns it into ``ConnectionClosed`` or a protocol error). Raises
    :class:`ReadTimeout` after ``idle_s`` without a byte, and ``h11.ProtocolError``
    (:class:`AmbiguousFraming` for a head the proxy refuses to frame)."""
    _check_head(conn)  # a head already buffered (pipelined behind the last message)
    tail = b""
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event  # type: ignore[return-value]
        try:
            data = await asyncio.wait_for(stream.read(), idle_s)
        except TimeoutError:
            raise ReadTimeout from None
        conn.receive_data(data)
        # The buffer is looked at again only when a head may have ended in what came:
        # a head sent a byte at a time costs no more than one sent whole.
        window = tail + data
        if _HEAD_END.search(window):
            _check_head(conn)
        tail = window[-2:]


async def next_request(
    conn: h11.Connection, stream: ByteStream, idle_s: float, what: str = "bad request"
) -> h11.Event | None:
    """The next event of the sandbox's side ``conn`` (a server), as :func:`next_event`;
    a head it cannot or must not frame is answered 400 (``what`` and why) and gives
    None: the connection then ends, since nothing after that head can be framed safely."""
    try:
        return await next_event(conn, stream, idle_s)
    except h11.RemoteProtocolError as exc:
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            await respond(conn, stream, 400, f"{what}: {exc}", close=True)
        return None


def header(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower-case), or None."""
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def forwardable(headers: Sequence[tuple[bytes, bytes]]) -> Headers:
    """``headers`` without hop-by-hop ones, nor those the ``Connection`` header names,
    nor framing ones (:func:`relay` frames what it forwards)."""
    named = {
        token.strip().lower()
        for key, value in headers
        if key.lower() == b"connection"
        for token in value.split(b",")
    }
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP | FRAMING | named]


def _framing(message: h11.Request | h11.Response, *, request: bool) -> Headers:
    """The one framing header to forward ``message`` with: its length when it stated one
    (checked single by :func:`framing_problem`, and by ``h11``), else for a request
    ``chunked`` when its body was; for a response nothing (``h11`` then chooses chunked,
    or close-delimited for an HTTP/1.0 client)."""
    length = header(message.headers, b"content-length")
    if length is not None:
        return [(b"content-length", length)]
    if request and header(message.headers, b"transfer-encoding") is not None:
        return [(b"transfer-encoding", b"chunked")]
    return []


async def respond(
    conn: h11.Connection, stream: ByteStream, status: int, text: str, *, close: bool = False
) -> None:
    """A short plain-text answer of the proxy itself (403, 400, 502, ...)."""
    body = text.encode() + b"\n"
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    reason = HTTPStatus(status).phrase.encode()
    await stream.write(
        conn.send(h11.Response(status_code=status, headers=headers, reason=reason)) or b""
    )
    await stream.write(conn.send(h11.Data(data=body)) or b"")
    await stream.write(conn.send(h11.EndOfMessage()) or b"")


async def relay(
    client_conn: h11.Connection,
    client: ByteStream,
    request: h11.Request,
    target: bytes,
    headers: Headers,
    upstream_conn: h11.Connection,
    upstream: ByteStream,
    idle_s: float,
    on_response: Callable[[int], None] | None = None,
) -> None:
    """Forward ``request`` (already read from ``client_conn``; its body not yet) to the
    upstream as ``target`` with ``headers`` (framing headers are the proxy's: any in
    ``headers`` are dropped), then the upstream's response back. Bodies stream through
    in chunks, framed anew each way. Raises :class:`UpstreamFailed` when the upstream
    fails before the response began (the caller answers 502), other errors after."""
    if client_conn.they_are_waiting_for_100_continue:
        await client.write(
            client_conn.send(h11.InformationalResponse(status_code=100, headers=[])) or b""
        )
    try:
        await upstream.write(
            upstream_conn.send(
                h11.Request(
                    method=request.method,
                    target=target,
                    headers=[
                        *(pair for pair in headers if pair[0].lower() not in FRAMING),
                        *_framing(request, request=True),
                    ],
                )
            ) or b""
        )  # fmt: skip
        await _copy_body(client_conn, client, upstream_conn, upstream, idle_s, "a request")
        while True:
            event = await next_event(upstream_conn, upstream, idle_s)
            if isinstance(event, h11.InformationalResponse):
                continue  # the proxy answered any 100-continue itself
            if isinstance(event, h11.Response):
                break
            raise UpstreamFailed(f"unexpected {type(event).__name__} instead of a response")
    except (OSError, h11.ProtocolError, ReadTimeout) as exc:
        if client_conn.our_state is h11.SEND_RESPONSE:
            raise UpstreamFailed(str(exc) or type(exc).__name__) from None
        raise
    if on_response is not None:
        on_response(event.status_code)
    await client.write(
        client_conn.send(
            h11.Response(
                status_code=event.status_code,
                headers=[*forwardable(event.headers), *_framing(event, request=False)],
                reason=event.reason,
            )
        ) or b""
    )  # fmt: skip
    await _copy_body(upstream_conn, upstream, client_conn, client, idle_s, "a response")


async def _copy_body(
    src_conn: h11.Connection,
    src: ByteStream,
    dst_conn: h11.Connection,
    dst: ByteStream,
    idle_s: float,
    what: str,
) -> None:
    """Stream a message body from ``src`` to ``dst`` chunk by chunk, through its end."""
    while True:
        event = await next_event(src_conn, src, idle_s)
        if isinstance(event, h11.Data):
            await dst.write(dst_conn.send(h11.Data(data=event.data)) or b"")
        elif isinstance(event, h11.EndOfMessage):
            await dst.write(dst_conn.send(h11.EndOfMessage()) or b"")
            return
        else:
            raise h11.RemoteProtocolError(f"unexpected {type(event).__name__} in {what} body")
