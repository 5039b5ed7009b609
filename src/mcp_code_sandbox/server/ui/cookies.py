"""The ``/ui`` browser login: a server-signed cookie, never the token, and CSRF tokens.

A browser cannot be made to send ``Authorization: Bearer`` to a page, so ``/ui`` has a
login form: the token is posted once, checked exactly as ``/mcp`` checks it, and the
answer is a cookie holding a signed :class:`Login` (owner, a random nonce, an expiry and
a fingerprint of the token), ``HttpOnly``, ``SameSite=Strict``, ``Secure`` over TLS,
``Path=/ui``. The token itself is never in the cookie, the page or a log.

The fingerprint is an HMAC of the token's SHA-256 (``StaticTokens.digest_of``): every
request compares it with the token configured *now*, so a token removed or replaced
(SIGHUP) logs out its browsers at once. OAuth logins have none; their cookie expires
with the access token that made it.

A cookie is good only while the server holds its login (:class:`LiveLogins`): signing
out ends it there, so a copy of the cookie (taken from a shared machine, a proxy's log, a
backup) is dead at once, not when it expires. A restart forgets every login: browsers
sign in again.

CSRF: every form that changes something carries :meth:`CookieSigner.csrf` of the
login's nonce (an HMAC no other origin can compute or read), checked in constant time;
``SameSite=Strict`` and the Host/Origin checks come on top. The sign-in form too: before
any login, the form's page sets a short-lived pre-login cookie (:data:`PRE_COOKIE_NAME`,
its own signature label, so it is never a login) whose nonce the form's token is made of;
a sign-in posted from anywhere else (to sign a victim's browser in as the attacker) is
refused.

The signing key is derived from the server's URL secret (``downloads.load_secret``)
with a label of its own, so a download signature is never a valid cookie or the reverse.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "COOKIE_NAME",
    "LOGIN_TTL_S",
    "MAX_LOGINS_PER_OWNER",
    "PRE_COOKIE_NAME",
    "PRE_LOGIN_TTL_S",
    "CookieSigner",
    "LiveLogins",
    "Login",
]

COOKIE_NAME = "mcs_ui"
PRE_COOKIE_NAME = "mcs_ui_pre"
#: How long a browser login lasts (then the token is asked for again).
LOGIN_TTL_S = 8 * 3600
#: How long a sign-in form stays good to post (then it is reloaded: a token is pasted
#: within minutes of opening the form).
PRE_LOGIN_TTL_S = 3600
#: Logins one owner holds at once; a new one past it ends that owner's oldest. Bounds
#: what a token's holder (or, without tokens, any loopback client, who gets a ``local``
#: login per cookie-less visit) can make the server remember, never touching another
#: owner's logins; a few dozen browsers is more than one person uses.
MAX_LOGINS_PER_OWNER = 32
#: Signature labels: a pre-login cookie is never a login, and the reverse.
_LOGIN = b"cookie"
_PRE_LOGIN = b"pre-login"
#: A cookie longer than this is refused before any decoding (a cookie is anyone's to forge).
MAX_COOKIE_CHARS = 1024


@dataclass(frozen=True)
class Login:
    owner: str
    nonce: str
    expires: int
    #: Keyed hash of the token's digest (API tokens); empty for OAuth and no-auth logins.
    fingerprint: str


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class CookieSigner:
    """Signs and reads login cookies and makes CSRF tokens; ``secret``: the server's."""

    secret: bytes = field(repr=False)
    clock: Callable[[], float] = time.time

    @property
    def _key(self) -> bytes:
        return hmac.new(self.secret, b"mcp-code-sandbox /ui login", hashlib.sha256).digest()

    def _mac(self, label: bytes, data: bytes) -> bytes:
        return hmac.new(self._key, label + b"\0" + data, hashlib.sha256).digest()

    def fingerprint(self, token_digest: bytes | None) -> str:
        return "" if token_digest is None else _b64(self._mac(b"token", token_digest))[:32]

    def login(self, owner: str, token_digest: bytes | None, expires: float | None) -> Login:
        """A new login for ``owner`` until ``expires`` (at most :data:`LOGIN_TTL_S`)."""
        until = int(self.clock()) + LOGIN_TTL_S
        if expires is not None:
            until = min(until, int(expires))
        nonce = secrets.token_urlsafe(16)
        return Login(owner, nonce, until, self.fingerprint(token_digest))

    def pre_login(self) -> Login:
        """A sign-in form's pre-login (no owner): its nonce makes the form's CSRF token."""
        until = int(self.clock()) + PRE_LOGIN_TTL_S
        return Login("", secrets.token_urlsafe(16), until, "")

    def encode(self, login: Login, label: bytes = _LOGIN) -> str:
        payload = json.dumps(
            {"o": login.owner, "n": login.nonce, "e": login.expires, "f": login.fingerprint},
            separators=(",", ":"),
        ).encode()
        return f"{_b64(payload)}.{_b64(self._mac(label, payload))}"

    def encode_pre(self, pre: Login) -> str:
        return self.encode(pre, _PRE_LOGIN)

    def decode_pre(self, value: str | None) -> Login | None:
        return self.decode(value, _PRE_LOGIN)

    def decode(self, value: str | None, label: bytes = _LOGIN) -> Login | None:
        """The login a cookie holds; ``None`` when it is missing, forged, tampered with,
        malformed or expired. Whether the server still holds it is :class:`LiveLogins`'
        to say."""
        if not value or len(value) > MAX_COOKIE_CHARS or value.count(".") != 1:
            return None
        body, signature = value.split(".")
        try:
            payload = _unb64(body)
        except (binascii.Error, ValueError):
            return None
        # Compared as text, in the one encoding we write: base64's last character has
        # spare bits, and another spelling of the same bytes is not our cookie.
        expected = _b64(self._mac(label, payload))
        if not hmac.compare_digest(expected.encode(), signature.encode("utf-8", "replace")):
            return None
        if _b64(payload) != body:
            return None
        try:
            data = json.loads(payload)
            login = Login(str(data["o"]), str(data["n"]), int(data["e"]), str(data["f"]))
        except (ValueError, KeyError, TypeError):
            return None
        return login if login.expires > self.clock() else None

    def csrf(self, login: Login) -> str:
        """The CSRF token of ``login``'s forms."""
        return _b64(self._mac(b"csrf", login.nonce.encode()))

    def csrf_ok(self, login: Login, given: str) -> bool:
        return hmac.compare_digest(self.csrf(login).encode(), given.encode())


class LiveLogins:
    """The logins the server gave out and that have not ended: a cookie is a login only
    while its own is here. Sign-out ends it (:meth:`end`); a server restart forgets all.

    Per owner, at most :data:`MAX_LOGINS_PER_OWNER` (the oldest ends first) and none past
    its expiry (dropped whenever that owner signs in). Called on the event loop only."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        #: owner -> nonce -> expiry, oldest first.
        self._held: dict[str, OrderedDict[str, int]] = {}

    def add(self, login: Login) -> None:
        held = self._held.setdefault(login.owner, OrderedDict())
        now = self.clock()
        for nonce in [n for n, expires in held.items() if expires <= now]:
            del held[nonce]
        held[login.nonce] = login.expires
        while len(held) > MAX_LOGINS_PER_OWNER:
            held.popitem(last=False)

    def holds(self, login: Login) -> bool:
        held = self._held.get(login.owner)
        expires = None if held is None else held.get(login.nonce)
        return expires is not None and expires > self.clock()

    def end(self, login: Login) -> None:
        held = self._held.get(login.owner)
        if held is None:
            return
        held.pop(login.nonce, None)
        if not held:
            del self._held[login.owner]
