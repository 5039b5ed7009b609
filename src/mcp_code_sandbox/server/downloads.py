"""Signed download links to workspace files (DESIGN §9), and the HTTP range arithmetic
for serving them. Pure: no I/O but reading or creating the secret.

A link is ``<base>/files/<session_id>/<path>?exp=<unix time>&sig=<signature>``. The
signature is HMAC-SHA256, keyed with the server's secret, over the owner, the session id,
the path and the expiry, so a link opens exactly one file of one session of one owner
until it expires, and changing any part of it (another path, another session, a later
expiry) makes it invalid. The owner is not in the link: the server tries the owners that
have a session of that id (a handful at most) and serves only on a match.

The secret is ``SANDBOX_URL_SECRET`` when set, else 32 random bytes made once and kept in
``<state_dir>/url-secret`` (mode 0600), so links survive a restart of the server.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from mcp_code_sandbox.errors import BackendUnavailable
from mcp_code_sandbox.settings import Settings

__all__ = ["UrlSigner", "load_secret", "parse_range"]

SECRET_FILE = "url-secret"  # noqa: S105 - a file name
#: Bounds on what a link may carry, checked before any arithmetic or hashing: a link is
#: anyone's to forge, and a 5,000-digit ``exp`` must be a refusal, not an error (``int``
#: refuses strings over 4,300 digits). 12 digits reach the year 33658; a signature is
#: always 43 characters (unpadded base64 of 32 bytes).
MAX_EXP_DIGITS = 12
SIGNATURE_CHARS = 43
MAX_PATH_CHARS = 4096


@dataclass(frozen=True)
class UrlSigner:
    secret: bytes = field(repr=False)
    #: Scheme, host and any path prefix, without a trailing slash.
    base_url: str
    ttl_s: int
    clock: Callable[[], float] = time.time

    def url(self, owner: str, session_id: str, path: str) -> str:
        expires = int(self.clock()) + self.ttl_s
        signature = self._sign(owner, session_id, path, expires)
        return (
            f"{self.base_url}/files/{quote(session_id, safe='')}/{quote(path)}"
            f"?exp={expires}&sig={signature}"
        )

    def valid(self, owner: str, session_id: str, path: str, expires: str, signature: str) -> bool:
        """Whether ``signature`` is this server's for these and ``expires`` is to come."""
        if not (
            0 < len(expires) <= MAX_EXP_DIGITS
            and expires.isascii()
            and expires.isdigit()  # not "²": str.isdigit takes more than int() does
            and len(signature) == SIGNATURE_CHARS
            and len(path) <= MAX_PATH_CHARS
            and len(session_id) <= MAX_PATH_CHARS
        ):
            return False
        if int(expires) < self.clock():
            return False
        expected = self._sign(owner, session_id, path, int(expires))
        return hmac.compare_digest(expected.encode(), signature.encode())

    def _sign(self, owner: str, session_id: str, path: str, expires: int) -> str:
        message = "\0".join((owner, session_id, path, str(expires))).encode()
        digest = hmac.new(self.secret, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def load_secret(settings: Settings) -> bytes:
    """The signing key: ``SANDBOX_URL_SECRET``, or the one kept in the state dir (made on
    first use). Raises ``BackendUnavailable`` when the state dir cannot keep it."""
    if settings.url_secret:
        return settings.url_secret.encode()
    path = settings.state_dir / SECRET_FILE
    try:
        return path.read_bytes().strip() or _make_secret(path)
    except FileNotFoundError:
        return _make_secret(path)
    except OSError as exc:
        raise BackendUnavailable(f"cannot read the URL secret {path}: {exc}") from None


def _make_secret(path: Path) -> bytes:
    secret = secrets.token_hex(32).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret + b"\n")
    except OSError as exc:
        raise BackendUnavailable(f"cannot keep the URL secret in {path}: {exc}") from None
    return secret


def parse_range(header: str | None, size: int) -> tuple[int, int] | bool | None:
    """The byte range ``[start, end)`` a ``Range`` header asks of a ``size``-byte file.

    ``None``: serve the whole file (no header, or one this server does not do: another
    unit, several ranges). ``False``: unsatisfiable (answer 416).
    """
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    first, dash, last = header[len("bytes=") :].strip().partition("-")
    if not dash or not (first.isdigit() or last.isdigit()):
        return None
    if not first:  # bytes=-N: the last N bytes
        count = int(last)
        return (max(0, size - count), size) if count and size else False
    start = int(first)
    end = min(size, int(last) + 1) if last.isdigit() else size
    if last and not last.isdigit():
        return None
    if start >= size or end <= start:
        return False
    return start, end
