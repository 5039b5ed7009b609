"""Who is calling: named API tokens or OAuth access tokens, and the owner they stand for.

Modes (chosen by the settings, exclusive: one owner namespace per server):
- **none**: no token configured. Every caller is ``local``, as over stdio; allowed only on
  loopback unless ``SANDBOX_ALLOW_UNAUTHENTICATED`` (see ``transports.check_http_exposure``).
- **API tokens**: ``SANDBOX_API_TOKENS`` (``name:token,...``) and/or
  ``SANDBOX_API_TOKENS_FILE`` (one ``name:token`` a line, ``#`` comments; reread on
  SIGHUP). The owner is the token's name. ``name:token:admin`` marks an operator: the
  ``/ui`` pages show such a token every owner's sessions (a token never holds ``:``,
  so no entry that was valid before reads differently).
- **OAuth resource server**: ``SANDBOX_OAUTH_ISSUER``: JWT access tokens checked by
  :class:`~mcp_code_sandbox.server.oauth.JwtVerifier`. The owner is the token's ``sub``.

The SDK does the HTTP side: ``MCPServer(auth=AuthSettings, token_verifier=...)`` puts its
``BearerAuthBackend`` and ``RequireAuthMiddleware`` in front of ``/mcp`` (401 with
``WWW-Authenticate: Bearer``, 403 ``insufficient_scope``), binds each MCP session to the
principal that opened it, publishes the protected resource metadata in OAuth mode, and
makes the token visible to handlers through ``get_access_token()`` (a contextvar that
the SDK carries into every request's task): :func:`current_owner` reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import structlog
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser, BearerAuthBackend
from mcp.server.auth.provider import AccessToken, TokenVerifier
from mcp.server.auth.settings import AuthSettings
from starlette.requests import HTTPConnection

from mcp_code_sandbox.server.oauth import JwtVerifier
from mcp_code_sandbox.settings import ConfigError, Settings

__all__ = [
    "LOCAL_OWNER",
    "ServerAuth",
    "StaticTokens",
    "auth_configured",
    "auth_lifespan",
    "build_auth",
    "current_owner",
    "is_admin",
    "is_loopback",
    "owner_of_request",
    "parse_token_roles",
    "parse_tokens",
]

log = structlog.get_logger("mcp_code_sandbox.auth")

#: The owner of every call over stdio and over unauthenticated (loopback) HTTP.
LOCAL_OWNER = "local"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: RFC 6750 ``b64token``: what a client can put after ``Bearer `` at all.
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
MIN_TOKEN_CHARS = 16
#: The one role an API token entry may name after a second ``:``.
ADMIN_ROLE = "admin"


def current_owner() -> str:
    """The owner of the call being served: the authenticated principal, else ``local``."""
    token = get_access_token()
    return LOCAL_OWNER if token is None else owner_of_token(token)


def is_admin(auth: ServerAuth | None, owner: str) -> bool:
    """Whether ``owner`` may see every owner's sessions in ``/ui``: an API token marked
    ``admin``; without authentication, the one owner ``local`` (there is no other). OAuth
    subjects are never admins (no claim is trusted for it yet)."""
    if auth is None:
        return True
    return isinstance(auth.verifier, StaticTokens) and auth.verifier.is_admin(owner)


def owner_of_token(token: AccessToken) -> str:
    # API tokens: subject = client_id = the token's name; JWTs: the ``sub`` claim.
    return token.subject or token.client_id


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def auth_configured(settings: Settings) -> bool:
    """Whether HTTP callers must authenticate (even an empty token file counts: then
    nobody gets in until a SIGHUP brings tokens)."""
    return (
        bool(settings.api_tokens)
        or settings.api_tokens_file is not None
        or (settings.oauth_issuer is not None)
    )


# -- API tokens ------------------------------------------------------------------------


def parse_tokens(entries: list[tuple[str, str]]) -> dict[str, str]:
    """``(where, "name:token")`` pairs → ``{name: token}`` (see :func:`parse_token_roles`)."""
    return parse_token_roles(entries)[0]


def parse_token_roles(entries: list[tuple[str, str]]) -> tuple[dict[str, str], frozenset[str]]:
    """``(where, "name:token[:admin]")`` pairs → ``({name: token}, admin names)``; every bad
    entry is one line of the :class:`ConfigError` (where, what is wrong, never the token
    itself)."""
    tokens: dict[str, str] = {}
    owners: dict[str, str] = {}
    admins: set[str] = set()
    problems: list[str] = []
    for where, entry in entries:
        name, colon, token = entry.partition(":")
        token, role_colon, role = token.partition(":")
        name, token, role = name.strip(), token.strip(), role.strip()
        why = None
        if role_colon and role != ADMIN_ROLE:
            why = f"token {name!r}: the only role after a second ':' is {ADMIN_ROLE!r}"
        elif not colon:
            why = "expected name:token"
        elif not _NAME.fullmatch(name):
            why = f"token name {name!r} must be 1 to 64 letters, digits, '.', '_' or '-'"
        elif not token:
            why = f"token {name!r} is empty"
        elif not _TOKEN.fullmatch(token):
            why = f"token {name!r} has characters an HTTP bearer token cannot carry"
        elif len(token) < MIN_TOKEN_CHARS:
            why = (
                f"token {name!r} is shorter than {MIN_TOKEN_CHARS} characters; "
                "make one with `openssl rand -hex 32`"
            )
        elif name in tokens:
            why = f"token name {name!r} is given twice"
        elif token in owners:
            why = f"token {name!r} is the same as token {owners[token]!r}"
        if why is not None:
            problems.append(f"invalid configuration: {where}: {why}")
            continue
        tokens[name] = token
        owners[token] = name
        if role_colon:
            admins.add(name)
    if problems:
        raise ConfigError(problems)
    return tokens, frozenset(admins)


def load_tokens(settings: Settings) -> tuple[dict[str, str], frozenset[str]]:
    """The tokens of ``SANDBOX_API_TOKENS`` and ``SANDBOX_API_TOKENS_FILE`` (read now),
    and the names of those marked admin."""
    entries = [
        (f"SANDBOX_API_TOKENS entry {i}", part)
        for i, part in enumerate((settings.api_tokens or "").split(","), start=1)
        if part.strip()
    ]
    path = settings.api_tokens_file
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(
                [f"invalid configuration: SANDBOX_API_TOKENS_FILE: cannot read {path}: {reason}"]
            ) from None
        entries += [
            (f"{path} line {n}", line)
            for n, line in enumerate(text.splitlines(), start=1)
            if line.strip() and not line.lstrip().startswith("#")
        ]
    return parse_token_roles(entries)


class StaticTokens:
    """A :class:`TokenVerifier` for the named API tokens.

    A presented token is compared with every configured one, in constant time and without
    stopping at a match (SHA-256 digests, so neither the position nor the length of a
    token shows in the timing)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        tokens, self._admins = load_tokens(settings)
        self._digests = self._digest(tokens)

    @staticmethod
    def _digest(tokens: dict[str, str]) -> list[tuple[str, bytes]]:
        return [(name, hashlib.sha256(t.encode()).digest()) for name, t in tokens.items()]

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self._digests]

    def is_admin(self, name: str) -> bool:
        """Whether the token ``name`` is marked ``admin`` (as configured now)."""
        return name in self._admins

    def digest_of(self, name: str) -> bytes | None:
        """The SHA-256 of token ``name`` as configured now; ``None``: no such token (any
        more). The ``/ui`` login cookie carries a keyed hash of it, so a token removed or
        replaced (SIGHUP) ends the browser sessions made with it."""
        return next((digest for n, digest in self._digests if n == name), None)

    async def verify_token(self, token: str) -> AccessToken | None:
        presented = hashlib.sha256(token.encode()).digest()
        found = None
        for name, digest in self._digests:
            if hmac.compare_digest(presented, digest):
                found = name
        if found is None:
            return None
        return AccessToken(token=token, client_id=found, subject=found, scopes=[])

    def reload(self) -> None:
        """Reread the tokens; a bad file keeps the tokens in force and logs why."""
        try:
            tokens, admins = load_tokens(self._settings)
        except ConfigError as exc:
            log.error("API tokens NOT reloaded; the old ones stay in force", problems=exc.lines)
            return
        self._digests, self._admins = self._digest(tokens), admins
        log.info("API tokens reloaded", names=self.names, admins=sorted(admins))


# -- the server's authentication ---------------------------------------------------------


@dataclass(frozen=True)
class ServerAuth:
    """What ``build_server`` hands the SDK, and what file routes authenticate with."""

    verifier: TokenVerifier
    settings: AuthSettings


def build_auth(settings: Settings) -> ServerAuth | None:
    """The server's authentication, or None when callers need none (see the module doc).

    Raises :class:`ConfigError` for bad tokens or an issuer that is neither https nor on
    loopback (its keys would arrive unprotected)."""
    if not auth_configured(settings):
        return None
    base = _base_url(settings)
    if settings.oauth_issuer is None:
        tokens = StaticTokens(settings)
        # The SDK requires an issuer in AuthSettings; without an authorization-server
        # provider or a resource URL it is never used or published. These tokens are
        # this server's own, so it names itself.
        auth = AuthSettings.model_validate(
            {"issuer_url": base, "resource_server_url": None, "required_scopes": None}
        )
        return ServerAuth(tokens, auth)
    issuer = settings.oauth_issuer
    split = urlsplit(issuer)
    if split.scheme != "https" and not is_loopback(split.hostname or ""):
        raise ConfigError(
            [
                f"invalid configuration: SANDBOX_OAUTH_ISSUER: {issuer} must be https "
                "(plain http only on loopback, for testing)"
            ]
        )
    resource = f"{base}/mcp"
    auth = AuthSettings.model_validate(
        {
            "issuer_url": issuer,
            "resource_server_url": resource,
            "required_scopes": settings.oauth_required_scopes or None,
            # JwtVerifier checks the audience itself (SANDBOX_OAUTH_AUDIENCE).
            "validate_token_resource": False,
        }
    )
    verifier = JwtVerifier(issuer, settings.oauth_audience or resource)
    return ServerAuth(verifier, auth)


def _base_url(settings: Settings) -> str:
    """Where clients reach this server: ``PUBLIC_BASE_URL``, else the bind address."""
    if settings.public_base_url:
        return settings.public_base_url.rstrip("/")
    if settings.oauth_issuer is not None and not is_loopback(settings.http_host):
        raise ConfigError(
            [
                "invalid configuration: SANDBOX_PUBLIC_BASE_URL: OAuth mode beyond loopback "
                "needs the URL clients use to reach this server (e.g. "
                "https://sandbox.example.com): it is the tokens' audience and is published "
                "in the protected resource metadata"
            ]
        )
    host = settings.http_host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6
    return f"http://{host}:{settings.http_port}"


async def owner_of_request(auth: ServerAuth | None, conn: HTTPConnection) -> str | None:
    """The owner an HTTP request's ``Authorization: Bearer`` stands for, as ``/mcp`` would
    decide it (required scopes included); None when it does not authenticate. Without
    authentication configured every request is ``local``'s."""
    if auth is None:
        return LOCAL_OWNER
    found = await BearerAuthBackend(auth.verifier).authenticate(conn)
    if found is None:
        return None
    credentials, user = found
    if not isinstance(user, AuthenticatedUser):
        return None
    if any(scope not in credentials.scopes for scope in auth.settings.required_scopes or []):
        return None
    return owner_of_token(user.access_token)


@contextlib.contextmanager
def auth_lifespan(auth: ServerAuth | None) -> Iterator[None]:
    """While the HTTP server runs: say how it authenticates, and reread the API tokens on
    SIGHUP (a handler on the running loop)."""
    if auth is None:
        log.info("HTTP callers are not authenticated; every session's owner is 'local'")
        yield
        return
    if not isinstance(auth.verifier, StaticTokens):
        issuer = str(auth.settings.issuer_url)
        log.info("HTTP callers authenticate with OAuth access tokens", issuer=issuer)
        yield
        return
    if auth.verifier.names:
        admins = [name for name in auth.verifier.names if auth.verifier.is_admin(name)]
        log.info(
            "HTTP callers authenticate with API tokens", names=auth.verifier.names, admins=admins
        )
    else:
        log.warning("no API token is configured yet: every request gets 401 until SIGHUP")
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, auth.verifier.reload)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
