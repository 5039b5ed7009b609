"""OAuth resource-server mode against the real server: JWTs from a test issuer on loopback
(its own RSA key pair, OpenID metadata and JWKS), checked over plain HTTP and with the
official MCP client."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from mcp_code_sandbox.settings import Settings

from ..oauth_issuer import Issuer, new_key
from .conftest import ERAS, http_server_process
from .test_auth import client_as, post_mcp, structured
from .test_errors import assert_error
from .ui_harness import sign_in_fields

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap]

AUDIENCE = "sandbox-test"


@pytest.fixture
def issuer() -> Iterator[Issuer]:
    with Issuer().serving() as running:
        yield running


@pytest.fixture
def oauth_server(
    make_settings: Callable[..., Settings], issuer: Issuer
) -> Iterator[tuple[str, Settings]]:
    settings = make_settings()
    extra = {
        "SANDBOX_OAUTH_ISSUER": issuer.url,
        "SANDBOX_OAUTH_AUDIENCE": AUDIENCE,
        "SANDBOX_OAUTH_REQUIRED_SCOPES": "sandbox",
    }
    with http_server_process(settings, **extra) as (base, _proc):
        yield base, settings


def challenge(response: httpx.Response) -> str:
    header = response.headers["www-authenticate"]
    assert header.startswith("Bearer ")
    return header


@pytest.mark.parametrize("mode", ERAS)
async def test_a_valid_token_works_and_its_subject_owns_the_session(
    oauth_server: tuple[str, Settings], issuer: Issuer, mode: str
) -> None:
    base, settings = oauth_server
    async with client_as(base, issuer.token("alice", scope="openid sandbox"), mode) as alice:
        up = {"session_id": "work", "filename": "a.txt", "content_text": "alice's"}
        assert structured(await alice.call_tool("upload_file", up))["session_created"]
        ran = structured(await alice.call_tool("run_code", {"session_id": "work", "code": "1+1"}))
        assert ran["result"] == "2"
    # Another token of the same subject (later, another client): the same owner.
    later = issuer.token("alice", client_id="other-client", jti="second")
    async with client_as(base, later, mode) as alice_again:
        listing = structured(await alice_again.call_tool("list_files", {"session_id": "work"}))
        assert [e["path"] for e in listing["entries"]] == ["a.txt"]
    # The same client for another subject: another owner.
    async with client_as(base, issuer.token("bob"), mode) as bob:
        assert_error(await bob.call_tool("list_files", {"session_id": "work"}), "session_not_found")
    assert "owner=alice" in (settings.state_dir / "server.log").read_text()


def test_bad_tokens_get_401_pointing_at_the_resource_metadata(
    oauth_server: tuple[str, Settings], issuer: Issuer
) -> None:
    base, _ = oauth_server
    metadata = f"{base}/.well-known/oauth-protected-resource/mcp"
    bad = {
        "none": None,
        "expired": issuer.token(lifetime_s=-3600),
        "wrong audience": issuer.token(audience="another-api"),
        "wrong issuer": issuer.token(iss="http://127.0.0.1:1/other"),
        "unknown key": issuer.token(key=new_key()),  # right kid, someone else's key
        "no subject": issuer.token(sub=""),
        "not a JWT": "x" * 40,
    }
    for why, token in bad.items():
        refused = post_mcp(base, None if token is None else f"Bearer {token}")
        assert refused.status_code == 401, why
        assert f'resource_metadata="{metadata}"' in challenge(refused), why
    assert post_mcp(base, f"Bearer {issuer.token()}").status_code == 200


def test_a_token_without_the_required_scope_gets_403(
    oauth_server: tuple[str, Settings], issuer: Issuer
) -> None:
    base, _ = oauth_server
    refused = post_mcp(base, f"Bearer {issuer.token(scope='openid profile')}")
    assert refused.status_code == 403
    assert 'error="insufficient_scope"' in challenge(refused)
    assert refused.json()["error"] == "insufficient_scope"
    as_list = issuer.token(scope=None, scp=["sandbox"])  # Azure-style scp list
    assert post_mcp(base, f"Bearer {as_list}").status_code == 200


def test_protected_resource_metadata(oauth_server: tuple[str, Settings], issuer: Issuer) -> None:
    base, _ = oauth_server
    got = httpx.get(f"{base}/.well-known/oauth-protected-resource/mcp")
    assert got.status_code == 200
    meta: dict[str, Any] = got.json()
    assert meta["resource"] == f"{base}/mcp"
    assert [s.rstrip("/") for s in meta["authorization_servers"]] == [issuer.url]
    assert meta["scopes_supported"] == ["sandbox"]
    assert issuer.requests.count("/jwks") <= 1  # nothing asked the issuer for this


def test_the_operator_view_takes_an_access_token(
    oauth_server: tuple[str, Settings], issuer: Issuer
) -> None:
    """``/ui`` with OAuth: the sign-in form takes an access token (required scopes
    checked), the subject is the viewer, never an admin, and the login cookie ends no
    later than the token."""
    base, _settings = oauth_server
    with httpx.Client(base_url=base, timeout=30) as browser:
        csrf = sign_in_fields(browser)  # the form's token, as a browser gets it
        unscoped = browser.post(
            "/ui/login", data={**csrf, "token": issuer.token("alice", scope="x")}
        )
        assert unscoped.status_code == 401
        token = issuer.token("alice", scope="sandbox", lifetime_s=120)
        signed_in = browser.post("/ui/login", data={**csrf, "token": token})
        assert signed_in.status_code == 303
        cookie = signed_in.headers["set-cookie"]
        max_age = int(cookie.split("Max-Age=")[1].split(";")[0])
        assert 0 < max_age <= 120 and token not in cookie
        page = browser.get("/ui")
        assert "signed in as <strong>alice</strong>" in page.text
        assert "admin: every owner" not in page.text
