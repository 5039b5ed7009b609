"""Serve the MCP server over stdio or streamable HTTP, and clean up on every way out.

stdio: the server ends at stdin EOF, SIGTERM or SIGINT; all sandboxes and workspaces are
removed before exit. HTTP: the SDK's app mounted in Starlette beside ``/healthz``, served
by uvicorn, whose own SIGTERM/SIGINT handling runs the lifespan's cleanup; ``/mcp``
authenticates as ``auth.build_auth`` says, and SIGHUP rereads the API tokens.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import anyio
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from mcp_code_sandbox.server.app import build_server
from mcp_code_sandbox.server.auth import auth_configured, auth_lifespan, build_auth, is_loopback
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.settings import ConfigError, Settings

__all__ = ["build_http_app", "check_http_exposure", "serve_http", "serve_stdio"]

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
    auth = build_auth(settings)
    mcp = build_server(service, auth)
    body_limit = settings.max_upload_bytes * 4 // 3 + settings.max_code_bytes + 1024 * 1024
    mcp_app = mcp.streamable_http_app(host=settings.http_host, max_request_body_size=body_limit)

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "sessions": service.sessions.count()})

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

    return Starlette(
        routes=[Route("/healthz", healthz), Mount("/", app=mcp_app)], lifespan=lifespan
    )


async def serve_http(service: SandboxService, **uvicorn_options: Any) -> None:
    settings = service.settings
    warning = check_http_exposure(settings)
    if warning:
        log.warning(warning)
    config = uvicorn.Config(
        build_http_app(service),
        host=settings.http_host,
        port=settings.http_port,
        log_config=None,
        access_log=False,
        lifespan="on",
        **uvicorn_options,
    )
    await uvicorn.Server(config).serve()
