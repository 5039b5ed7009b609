"""OAuth resource-server mode: JWT access tokens checked against the issuer's keys.

Semantics:
- The issuer's keys are found through its metadata (RFC 8414
  ``/.well-known/oauth-authorization-server``, then OpenID Connect discovery), whose
  ``issuer`` must be the configured one, exactly; its ``jwks_uri`` is then fetched.
- Keys are cached: fetched again after ``KEYS_MAX_AGE_S``, or when a token names a key id
  the cache lacks (a rotation), but never more often than every ``REFRESH_MIN_S``, so
  tokens with made-up key ids cannot make this server hammer the issuer. A failed fetch
  keeps the keys there were.
- A token is valid when PyJWT verifies its signature with an asymmetric algorithm (never
  ``HS*`` or ``none``: a public key must not double as a shared secret) and its ``iss``,
  ``aud``, ``exp`` and ``sub``, with ``LEEWAY_S`` for clocks that disagree (``iat``,
  ``nbf``: the SDK's middleware refuses a token past its ``exp`` anyway). Scopes come
  from ``scope`` (space-separated) or ``scp``; the SDK's middleware enforces the
  required ones (403 ``insufficient_scope``).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import jwt
import structlog
from mcp.server.auth.provider import AccessToken

__all__ = ["ALGORITHMS", "IssuerKeys", "JwtVerifier", "metadata_urls"]

log = structlog.get_logger("mcp_code_sandbox.oauth")

ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
LEEWAY_S = 60
KEYS_MAX_AGE_S = 600.0
REFRESH_MIN_S = 30.0
_FETCH_TIMEOUT_S = 10.0
_MAX_DOCUMENT_BYTES = 1024 * 1024


def metadata_urls(issuer: str) -> list[str]:
    """Where the issuer's metadata may be, in the order the MCP authorization spec tries:
    RFC 8414 with the issuer's path after the well-known part, then OpenID Connect."""
    parts = urlsplit(issuer)
    origin = f"{parts.scheme}://{parts.netloc}"
    path = parts.path.rstrip("/")
    if not path:
        return [
            f"{origin}/.well-known/oauth-authorization-server",
            f"{origin}/.well-known/openid-configuration",
        ]
    return [
        f"{origin}/.well-known/oauth-authorization-server{path}",
        f"{origin}/.well-known/openid-configuration{path}",
        f"{origin}{path}/.well-known/openid-configuration",
    ]


class IssuerKeys:
    """The issuer's signing keys (JWKS), discovered, cached and refreshed as above."""

    def __init__(self, issuer: str) -> None:
        self.issuer = issuer
        self._jwks_uri: str | None = None
        self._keys: list[dict[str, Any]] = []
        self._built: dict[tuple[str | None, str], jwt.PyJWK] = {}
        self._fetched = -math.inf
        self._attempted = -math.inf
        self._lock = asyncio.Lock()

    async def key(self, kid: str | None, alg: str) -> jwt.PyJWK | None:
        """The key for a token's ``kid`` and ``alg``; None if the issuer has none."""
        now = time.monotonic()
        if now - self._fetched > KEYS_MAX_AGE_S:
            await self._refresh()
        found = self._find(kid, alg)
        if found is None:
            await self._refresh()  # a rotation, maybe (rate-limited)
            found = self._find(kid, alg)
        return found

    def _find(self, kid: str | None, alg: str) -> jwt.PyJWK | None:
        if (kid, alg) in self._built:
            return self._built[(kid, alg)]
        candidates = [
            k
            for k in self._keys
            if (kid is None or k.get("kid") == kid)
            and k.get("use", "sig") == "sig"
            and k.get("alg", alg) == alg
        ]
        if len(candidates) != 1:  # none, or no kid to tell several apart
            return None
        try:
            built = jwt.PyJWK(candidates[0], algorithm=alg)
        except jwt.PyJWTError:  # e.g. an RSA key for ES256
            return None
        self._built[(kid, alg)] = built
        return built

    async def _refresh(self) -> None:
        async with self._lock:
            if time.monotonic() - self._attempted < REFRESH_MIN_S:
                return  # just done (maybe by a call that held the lock before us)
            self._attempted = time.monotonic()
            try:
                async with httpx.AsyncClient(
                    timeout=_FETCH_TIMEOUT_S, follow_redirects=True
                ) as client:
                    if self._jwks_uri is None:
                        self._jwks_uri = await self._discover(client)
                    jwks = await _get_json(client, self._jwks_uri)
                keys = jwks.get("keys")
                if not isinstance(keys, list):
                    raise ValueError(f"{self._jwks_uri} has no 'keys' list")
            except (httpx.HTTPError, ValueError) as exc:
                log.error(
                    "cannot fetch the OAuth issuer's signing keys; tokens it signed with "
                    "keys not seen before are refused until this works",
                    issuer=self.issuer,
                    error=str(exc),
                )
                return
            self._keys = [k for k in keys if isinstance(k, dict)]
            self._built = {}
            self._fetched = time.monotonic()
            log.info("OAuth signing keys fetched", jwks_uri=self._jwks_uri, keys=len(self._keys))

    async def _discover(self, client: httpx.AsyncClient) -> str:
        problems = []
        for url in metadata_urls(self.issuer):
            try:
                meta = await _get_json(client, url)
            except (httpx.HTTPError, ValueError) as exc:
                problems.append(f"{url}: {exc}")
                continue
            if meta.get("issuer") != self.issuer:
                problems.append(f"{url} names issuer {meta.get('issuer')!r}")
                continue
            uri = meta.get("jwks_uri")
            if not isinstance(uri, str) or not uri.startswith(("https://", "http://")):
                problems.append(f"{url} has no jwks_uri")
                continue
            if uri.startswith("http://") and not self.issuer.startswith("http://"):
                problems.append(f"{url}: jwks_uri {uri} is not https")
                continue
            return uri
        raise ValueError("no usable issuer metadata: " + "; ".join(problems))


async def _get_json(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    response = await client.get(url, headers={"Accept": "application/json"})
    response.raise_for_status()
    if len(response.content) > _MAX_DOCUMENT_BYTES:
        raise ValueError(f"{url} is larger than {_MAX_DOCUMENT_BYTES} bytes")
    data = response.json()
    if not isinstance(data, dict):
        raise ValueError(f"{url} is not a JSON object")
    return data


class JwtVerifier:
    """A :class:`~mcp.server.auth.provider.TokenVerifier` for the issuer's JWTs."""

    def __init__(self, issuer: str, audience: str) -> None:
        self.issuer = issuer
        self.audience = audience
        self.keys = IssuerKeys(issuer)

    async def verify_token(self, token: str) -> AccessToken | None:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            return None  # not a JWT at all
        alg, kid = header.get("alg"), header.get("kid")
        if alg not in ALGORITHMS or not isinstance(kid, str | None):
            log.info("bearer token refused", reason=f"algorithm {alg!r} is not accepted")
            return None
        key = await self.keys.key(kid, alg)
        if key is None:
            log.info("bearer token refused", reason=f"the issuer has no key {kid!r} for {alg}")
            return None
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=[alg],
                audience=self.audience,
                issuer=self.issuer,
                leeway=LEEWAY_S,
                options={"require": ["exp", "iss", "aud", "sub"]},
            )
        except jwt.PyJWTError as exc:
            log.info("bearer token refused", reason=str(exc))
            return None
        subject = claims["sub"]
        if not subject:
            log.info("bearer token refused", reason="empty subject")
            return None
        return AccessToken(
            token=token,
            client_id=str(claims.get("client_id") or claims.get("azp") or subject),
            scopes=_scopes(claims),
            expires_at=int(claims["exp"]),
            resource=self.audience,
            subject=subject,
            claims={"iss": claims["iss"]},
        )


def _scopes(claims: dict[str, Any]) -> list[str]:
    raw = claims.get("scope")
    if raw is None:
        raw = claims.get("scp")
    if isinstance(raw, str):
        return raw.split()
    if isinstance(raw, list):
        return [s for s in raw if isinstance(s, str)]
    return []
