"""HTTP/1.1 for the egress proxy, parsed and framed by ``h11`` (no hand-written parser).

The proxy is an HTTP server to the sandbox (proxy requests, and requests inside an
intercepted TLS session) and an HTTP client to upstreams. :func:`next_event` reads one
bounded event; :func:`relay` forwards one request and its response between the two.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from http import HTTPStatus

import h11

from .streams import ByteStream

__all__ = [
    "HOP_BY_HOP",
    "MAX_HEAD",
    "Headers",
    "ReadTimeout",
    "UpstreamFailed",
    "header",
    "next_event",
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


class ReadTimeout(Exception):
    """No byte for the idle timeout."""


class UpstreamFailed(Exception):
    """The upstream broke the exchange before its response began (the client gets 502)."""


async def next_event(conn: h11.Connection, stream: ByteStream, idle_s: float) -> h11.Event:
    """The next event of ``conn``, reading ``stream`` as needed; EOF is given to h11
    (which turns it into ``ConnectionClosed`` or a protocol error). Raises
    :class:`ReadTimeout` after ``idle_s`` without a byte, and ``h11.ProtocolError``."""
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event  # type: ignore[return-value]
        try:
            data = await asyncio.wait_for(stream.read(), idle_s)
        except TimeoutError:
            raise ReadTimeout from None
        conn.receive_data(data)


def header(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower-case), or None."""
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def forwardable(headers: Sequence[tuple[bytes, bytes]]) -> Headers:
    """``headers`` without hop-by-hop ones, nor those the ``Connection`` header names."""
    named = {
        token.strip().lower()
        for key, value in headers
        if key.lower() == b"connection"
        for token in value.split(b",")
    }
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP | named]


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
    upstream as ``target`` with ``headers``, then the upstream's response back. Bodies
    stream through in chunks. Raises :class:`UpstreamFailed` when the upstream fails
    before the response began (the caller answers 502), other errors after."""
    if client_conn.they_are_waiting_for_100_continue:
        await client.write(
            client_conn.send(h11.InformationalResponse(status_code=100, headers=[])) or b""
        )
    try:
        await upstream.write(
            upstream_conn.send(
                h11.Request(method=request.method, target=target, headers=headers)
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
                headers=forwardable(event.headers),
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
