"""Which ``Host`` and ``Origin`` headers the HTTP server accepts (DNS-rebinding defence).

A web page the user visits can make the browser send requests to ``127.0.0.1:8080`` (or,
by rebinding its own DNS name to that address, read the answers). The SDK's transport
security refuses a request whose ``Host`` is not in ``allowed_hosts`` (421) or whose
``Origin``, when there is one, is not in ``allowed_origins`` (403). It is always on here,
whatever the bind address (the SDK only turns it on by itself for a loopback bind).

Semantics: what is accepted is the union of
- the loopback names with any port (``127.0.0.1:*``, ``localhost:*``, ``[::1]:*``): a
  rebinding page sends its own name, never a loopback one, and a server in a container is
  reached through a published port that is not its own), and the bind address with the
  port when it is a specific address (not ``0.0.0.0`` / ``::``);
- ``PUBLIC_BASE_URL``'s host (``sandbox.example.com`` or ``name:port``, as a reverse
  proxy that keeps the Host header passes it on) and its origin;
- ``SANDBOX_ALLOWED_HOSTS`` / ``SANDBOX_ALLOWED_ORIGINS``, as given.
Origins also accept loopback pages on any port (``http://localhost:*``): a local tool such
as the MCP Inspector is no rebinding attacker.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from mcp.server.transport_security import TransportSecuritySettings

from mcp_code_sandbox.settings import Settings

__all__ = ["allowed_hosts", "allowed_origins", "public_base_url", "transport_security"]

_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
_WILDCARD_BINDS = ("0.0.0.0", "::", "")  # noqa: S104 - compared against, not bound


def _host_name(host: str) -> str:
    """``::1`` → ``[::1]``: how an IPv6 address appears in a Host header."""
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host


def allowed_hosts(settings: Settings) -> list[str]:
    port = str(settings.http_port) if settings.http_port else "*"
    hosts = [f"{name}:*" for name in _LOOPBACK_NAMES]
    bind = _host_name(settings.http_host)
    if settings.http_host not in (*_WILDCARD_BINDS, *_LOOPBACK_NAMES, "::1"):
        hosts.append(f"{bind}:{port}")
    if settings.public_base_url:
        netloc = urlsplit(settings.public_base_url).netloc
        hosts.append(netloc)
    hosts.extend(settings.allowed_hosts)
    return list(dict.fromkeys(hosts))


def allowed_origins(settings: Settings) -> list[str]:
    origins = [f"http://{name}:*" for name in _LOOPBACK_NAMES]
    if settings.public_base_url:
        parts = urlsplit(settings.public_base_url)
        origins.append(f"{parts.scheme}://{parts.netloc}")
    origins.extend(settings.allowed_origins)
    return list(dict.fromkeys(origins))


def transport_security(settings: Settings) -> TransportSecuritySettings:
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=allowed_hosts(settings),
        allowed_origins=allowed_origins(settings),
    )


def public_base_url(settings: Settings) -> str:
    """Where clients reach this server (download links, the PUT address):
    ``PUBLIC_BASE_URL``, else the bind address (loopback for a wildcard bind)."""
    if settings.public_base_url:
        return settings.public_base_url.rstrip("/")
    bind = (
        "127.0.0.1" if settings.http_host in (*_WILDCARD_BINDS, "localhost") else settings.http_host
    )
    return f"http://{_host_name(bind)}:{settings.http_port}"
