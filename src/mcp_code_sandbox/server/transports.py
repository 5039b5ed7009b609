"""Serve the MCP server over stdio or HTTP, and clean up on every way out.

stdio: the server ends at stdin EOF, SIGTERM or SIGINT; all sandboxes and workspaces are
removed before exit. HTTP: the SDK's streamable HTTP app (``/mcp``) and its legacy
HTTP+SSE app (``/sse`` + ``/messages/``, for clients that only speak the 2024-11-05
transport) in Starlette beside the operator's endpoints (:mod:`.ops`), served by uvicorn,
whose own SIGTERM/SIGINT handling runs the lifespan's cleanup. Both MCP apps check Host
and Origin (:mod:`.hosts`) and authenticate as ``auth.build_auth`` says; SIGHUP rereads
the API tokens. ``/files`` (:mod:`.files_http`) serves signed downloads and takes
uploads with the same bearer check. ``/ui`` (:mod:`.ui`) is the operator's view.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator
from typing import Any

import anyio
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mcp_code_sandbox.server.app import build_server
from mcp_code_sandbox.server.auth import (
    auth_configured,
    auth_lifespan,
    build_auth,
    is_loopback,
    owner_of_request,
)
from mcp_code_sandbox.server.downloads import UrlSigner, load_secret
from mcp_code_sandbox.server.files_http import file_routes
from mcp_code_sandbox.server.hosts import public_base_url, transport_security
from mcp_code_sandbox.server.ops import ops_routes
from mcp_code_sandbox.server.ui import ui_routes
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.settings import ConfigError, Settings

__all__ = [
    "bind_http",
    "build_http_app",
    "check_http_exposure",
    "serve_http",
    "serve_stdio",
]

log = structlog.get_logger("mcp_code_sandbox.transports")


async def serve_stdio(service: SandboxService) -> None:
    mcp = build_server(service)
    await service.start()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_exit_on_signal, service)
            await mcp.run_stdio_async()  # returns at stdin EOF
            tg.cancel_scope.cancel()
    finally:
        # A client's shutdown is stdin closed, then SIGTERM, then SIGKILL: from here to
        # the process's exit, a SIGTERM must not cut this cleanup short (what a SIGKILL
        # leaves is the janitor's, see sessions.janitor).
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        with anyio.CancelScope(shield=True):
            await service.aclose()


async def _exit_on_signal(service: SandboxService) -> None:
    """SIGTERM/SIGINT: remove every sandbox, then exit at once.

    The SDK reads stdin in a worker thread that no cancellation can interrupt, so an
    orderly unwind would wait for the client to send another line; exiting directly after
    our own cleanup is the bounded way out."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            with anyio.CancelScope(shield=True):
                await service.aclose()
            logging.shutdown()
            os._exit(0)


def check_http_exposure(settings: Settings) -> str | None:
    """Refuse to serve beyond loopback with nobody authenticated (DESIGN §9), unless
    ``SANDBOX_ALLOW_UNAUTHENTICATED`` says it is on purpose: then the warning to log."""
    if is_loopback(settings.http_host) or auth_configured(settings):
        return None
    if settings.allow_unauthenticated:
        return (
            f"SERVING WITHOUT AUTHENTICATION on {settings.http_host}:{settings.http_port} "
            "(SANDBOX_ALLOW_UNAUTHENTICATED=true): anyone who can reach this port can run "
            "code here and read every session's files. Only do this behind a proxy that "
            "authenticates"
        )
    raise ConfigError(
        [
            f"refusing to listen on {settings.http_host}: that is reachable from other machines "
            "and no API token is configured. Set SANDBOX_API_TOKENS (or SANDBOX_API_TOKENS_FILE, "
            "or SANDBOX_OAUTH_ISSUER), or bind to 127.0.0.1 and put an authenticating proxy in "
            "front (SANDBOX_ALLOW_UNAUTHENTICATED=true to serve beyond loopback without auth)"
        ]
    )


def build_http_app(service: SandboxService) -> Starlette:
    settings = service.settings
    secret = load_secret(settings)
    signer = UrlSigner(secret, public_base_url(settings), settings.download_url_ttl_s)
    auth = build_auth(settings)
    mcp = build_server(service, auth, signer)
    body_limit = settings.max_upload_bytes * 4 // 3 + settings.max_code_bytes + 1024 * 1024
    security = transport_security(settings)
    mcp_app = mcp.streamable_http_app(transport_security=security, max_request_body_size=body_limit)
    # The legacy transport: GET /sse holds the stream, POST /messages/?session_id= carries
    # the client's messages. Routed whole (its own auth middleware, if any, included).
    sse_app = mcp.sse_app(transport_security=security, max_request_body_size=body_limit)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await service.start()
        try:
            with auth_lifespan(auth):
                async with mcp.session_manager.run():
                    yield
        finally:
            with anyio.CancelScope(shield=True):
                await service.aclose()

    # Both transports behind one app: whatever guards MCP must guard the legacy one too.
    mcp_endpoints = Starlette(
        routes=[
            Route("/sse", _FirstResponseOnly(sse_app), methods=["GET"]),
            Route("/messages/", sse_app, methods=["POST"]),
            Mount("/", app=mcp_app),
        ]
    )
    return Starlette(
        routes=[
            *ops_routes(service, security, loopback=is_loopback(settings.http_host)),
            *file_routes(service, signer, functools.partial(owner_of_request, auth)),
            *ui_routes(service, auth, security, secret),
            Mount("/", app=mcp_endpoints),
        ],
        lifespan=lifespan,
    )


class _FirstResponseOnly:
    """Drop a second response an ASGI app sends after its first one.

    The SDK's ``sse_app`` answers ``GET /sse`` with the event stream and then, once that
    ended, with an empty ``Response()`` too (python-sdk issue #883): uvicorn logs an
    "Exception in ASGI application" for every stream open at shutdown. A class, not a
    function: Starlette's ``Route`` treats a plain function as a request handler."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = second = False

        async def first_only(message: Message) -> None:
            nonlocal started, second
            if message["type"] == "http.response.start":
                second, started = started, True
            if not second:
                await send(message)

        await self.app(scope, receive, first_only)


def bind_http(settings: Settings) -> socket.socket:
    """The listening socket for ``SANDBOX_HTTP_HOST``:``SANDBOX_HTTP_PORT``, bound before
    anything else starts, so that a port in use (or an address not of this host) is one
    clear line and a non-zero exit (``ConfigError``), not uvicorn's line after the
    server's startup messages. Called by the CLI's ``serve`` first."""
    host, port = settings.http_host, settings.http_port
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError([f"error: cannot listen on {where}: {exc.strerror or exc}"]) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(2048)  # uvicorn's own backlog
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                [
                    f"error: cannot listen on {where}: the port is in use (another server?); "
                    "stop it or choose another port with --http-port or SANDBOX_HTTP_PORT"
                ]
            ) from None
        raise ConfigError([f"error: cannot listen on {where}: {exc.strerror or exc}"]) from None
    sock.set_inheritable(False)
    return sock


async def serve_http(
    service: SandboxService, sock: socket.socket | None = None, **uvicorn_options: Any
) -> None:
    """Serve HTTP on ``sock`` (from :func:`bind_http`; bound here when not given)."""
    settings = service.settings
    warning = check_http_exposure(settings)
    if warning:
        log.warning(warning)
    sock = sock or bind_http(settings)
    config = uvicorn.Config(
        build_http_app(service),
        host=settings.http_host,
        port=settings.http_port,
        log_config=None,
        access_log=False,
        lifespan="on",
        **uvicorn_options,
    )
    with sock:
        await uvicorn.Server(config).serve(sockets=[sock])
