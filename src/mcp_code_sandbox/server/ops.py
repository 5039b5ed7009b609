"""The operator's endpoints: ``/healthz`` (alive), ``/readyz`` (the backend answers) and
``/metrics`` (Prometheus).

``/healthz`` and ``/readyz`` are open: orchestrators probe them without credentials, and
they say nothing a client could not learn by calling a tool. ``/metrics`` holds no
session id, owner or content (see :mod:`mcp_code_sandbox.metrics`), yet it tells how busy
the server is and what fails, so:

- ``SANDBOX_METRICS_TOKEN`` set: ``Authorization: Bearer <token>`` is required (compared
  in constant time), else 401 with ``WWW-Authenticate: Bearer``;
- not set, server bound to loopback: served to whoever reaches it there, with the same
  Host/Origin checks as ``/mcp`` (a rebinding web page must not read it);
- not set, server bound beyond loopback: 403, saying to set the token.
"""

from __future__ import annotations

import hmac

from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from mcp_code_sandbox.service import SandboxService

__all__ = ["ops_routes"]


def ops_routes(
    service: SandboxService, security: TransportSecuritySettings, *, loopback: bool
) -> list[Route]:
    """The three routes; ``loopback``: the server listens on a loopback address only."""
    token = service.settings.metrics_token
    host_check = TransportSecurityMiddleware(security)

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "sessions": service.session_count()})

    async def readyz(request: Request) -> JSONResponse:
        backend = service.backend.name
        reason = await service.not_ready()
        pool = service.pool_status()
        # Its own readiness only: another replica's state never makes this one unready.
        replica = {"replica": service.replica} if service.replica else {}
        if reason is not None:
            body = {"status": "not ready", "backend": backend, "reason": reason, "pool": pool}
            return JSONResponse(body | replica, status_code=503)
        return JSONResponse({"status": "ready", "backend": backend, "pool": pool} | replica)

    async def metrics(request: Request) -> Response:
        if token is not None:
            if not _bearer_matches(request, token):
                return PlainTextResponse(
                    "unauthorized: /metrics needs Authorization: Bearer <SANDBOX_METRICS_TOKEN>",
                    status_code=401,
                    headers={"WWW-Authenticate": 'Bearer realm="metrics"'},
                )
        elif not loopback:
            return PlainTextResponse(
                "forbidden: this server listens beyond loopback; set SANDBOX_METRICS_TOKEN "
                "and scrape /metrics with that bearer token",
                status_code=403,
            )
        elif (refused := await host_check.validate_request(request)) is not None:
            return refused
        body, content_type = service.metrics.render(request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    return [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


def _bearer_matches(request: Request, token: str) -> bool:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())
