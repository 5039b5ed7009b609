"""Shared by the ``/ui`` tests: three tokens (two owners and an admin), a server with them,
and plain-HTTP helpers for the pages (login, forms, CSRF tokens)."""

from __future__ import annotations

import contextlib
import re
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser

import httpx

from mcp_code_sandbox.settings import Settings

from .conftest import http_server_process

ALICE = "alice-0123456789abcdef"
BOB = "bob-0123456789abcdef00"
ROOT = "root-0123456789abcdef00"
#: ``root`` is marked admin: the only one who sees every owner's sessions.
TOKENS = f"alice:{ALICE},bob:{BOB},root:{ROOT}:admin"
SECURITY = {
    "content-security-policy": "default-src 'self'",
    "x-frame-options": "DENY",
    "cache-control": "no-store",
}


@contextlib.contextmanager
def ui_server(settings: Settings, **extra: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    env = {"SANDBOX_API_TOKENS": TOKENS, **extra}
    with http_server_process(settings, **env) as served:
        yield served


def assert_secure_headers(response: httpx.Response) -> None:
    for name, value in SECURITY.items():
        assert value in response.headers.get(name, ""), (name, response.headers)


def sign_in_fields(client: httpx.Client) -> dict[str, str]:
    """The sign-in form's hidden fields (its CSRF token), as a browser gets them with the
    form's page (and its pre-login cookie, now in ``client``)."""
    page = client.get("/ui/login")
    assert page.status_code == 200, page.text
    (form,) = [f for f in forms(page.text) if f["_action"].endswith("/ui/login")]
    return {k: v for k, v in form.items() if k != "_action"}


@contextlib.contextmanager
def logged_in(base: str, token: str) -> Iterator[httpx.Client]:
    """A client holding the login cookie ``token`` gets from the sign-in form."""
    with httpx.Client(base_url=base, timeout=30) as client:
        answer = client.post("/ui/login", data={**sign_in_fields(client), "token": token})
        assert answer.status_code == 303, answer.text
        assert answer.headers["location"] == "/ui"
        cookie = answer.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
        assert token not in cookie
        yield client


class _Forms(HTMLParser):
    """Every ``<form>``'s action and hidden inputs, as the browser would post them."""

    def __init__(self) -> None:
        super().__init__()
        self.forms: list[dict[str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k: v or "" for k, v in attrs}
        if tag == "form":
            self.forms.append({"_action": values.get("action", "")})
        elif tag == "input" and self.forms and values.get("type") == "hidden":
            self.forms[-1][values.get("name", "")] = values.get("value", "")


def forms(html: str) -> list[dict[str, str]]:
    parser = _Forms()
    parser.feed(html)
    return parser.forms


def close_form(html: str, owner: str, session_id: str) -> dict[str, str]:
    """The hidden fields of the page's Close button for that session."""
    for form in forms(html):
        if form.get("owner") == owner and form.get("session_id") == session_id:
            return {k: v for k, v in form.items() if k != "_action"}
    raise AssertionError(f"no close button for {owner}/{session_id}")


def session_ids(html: str) -> set[str]:
    """The session ids in the Sessions table."""
    table = html.split('id="runs"')[0]
    return set(re.findall(r'<td class="sid"><code>([^<]*)</code>', table))
