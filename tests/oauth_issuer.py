"""A test OAuth issuer on loopback: an RSA key pair, its OpenID metadata and JWKS served by
a real HTTP server in a thread, and access tokens signed with it (PyJWT)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa


def new_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


class Issuer:
    """Serves ``/.well-known/openid-configuration`` (only: the RFC 8414 URL gets 404, so
    discovery has to fall back) and ``/jwks`` with the public halves of ``keys``."""

    def __init__(self) -> None:
        self.keys: dict[str, rsa.RSAPrivateKey] = {"key-1": new_key()}
        self.requests: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                issuer.requests.append(self.path)
                if self.path == "/.well-known/openid-configuration":
                    body: dict[str, Any] = {
                        "issuer": issuer.url,
                        "jwks_uri": f"{issuer.url}/jwks",
                        "authorization_endpoint": f"{issuer.url}/authorize",
                        "token_endpoint": f"{issuer.url}/token",
                    }
                elif self.path == "/jwks":
                    body = {"keys": [issuer.public_jwk(kid) for kid in issuer.keys]}
                else:
                    self.send_error(404)
                    return
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler

    def public_jwk(self, kid: str) -> dict[str, Any]:
        jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.keys[kid].public_key()))
        return {**jwk, "kid": kid, "use": "sig", "alg": "RS256"}

    def token(
        self,
        sub: str = "alice",
        *,
        audience: str = "sandbox-test",
        scope: str | None = "sandbox",
        lifetime_s: float = 300,
        kid: str = "key-1",
        key: rsa.RSAPrivateKey | None = None,
        **claims: Any,
    ) -> str:
        now = int(time.time())
        payload = {
            "iss": self.url,
            "sub": sub,
            "aud": audience,
            "iat": now,
            "exp": now + int(lifetime_s),
            "scope": scope,
            "client_id": "test-client",
            **claims,
        }
        signing = key if key is not None else self.keys[kid]
        present = {name: value for name, value in payload.items() if value is not None}
        return jwt.encode(present, signing, algorithm="RS256", headers={"kid": kid})

    @contextlib.contextmanager
    def serving(self) -> Iterator[Issuer]:
        thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()
            thread.join(timeout=5)
