"""Authentication's own parts: parsing API tokens, checking them, the settings that choose
a mode, the exposure guard, and the OAuth key cache against a real loopback issuer."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from mcp_code_sandbox.server import oauth
from mcp_code_sandbox.server.auth import (
    LOCAL_OWNER,
    ServerAuth,
    StaticTokens,
    build_auth,
    load_tokens,
    owner_of_request,
    parse_tokens,
)
from mcp_code_sandbox.server.oauth import IssuerKeys, JwtVerifier, metadata_urls
from mcp_code_sandbox.server.transports import check_http_exposure
from mcp_code_sandbox.settings import ConfigError, Settings, load_settings

from ..oauth_issuer import Issuer, new_key

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789ab"


def settings(**values: object) -> Settings:
    return load_settings(dict(values), environ={})


# -- API tokens -------------------------------------------------------------------------


def test_tokens_parse() -> None:
    entries = [("e1", f"alice:{ALICE}"), ("e2", f" bob : {BOB} ")]
    assert parse_tokens(entries) == {"alice": ALICE, "bob": BOB}


def test_every_bad_token_entry_is_one_line_that_never_shows_the_token() -> None:
    entries = [
        ("e1", "no-colon-here-0123456789"),
        ("e2", f"bad name:{ALICE}"),
        ("e3", "empty:"),
        ("e4", "short:abc123"),
        ("e5", "spaces:has spaces in it 0123"),
        ("e6", f"alice:{ALICE}"),
        ("e7", "alice:another-token-0123456789"),
        ("e8", f"carol:{ALICE}"),
    ]
    with pytest.raises(ConfigError) as info:
        parse_tokens(entries)
    lines = info.value.lines
    assert [line.split(":")[1].strip() for line in lines] == [
        "e1", "e2", "e3", "e4", "e5", "e7", "e8",
    ]  # fmt: skip
    assert "expected name:token" in lines[0]
    assert "token name 'bad name'" in lines[1]
    assert "'empty' is empty" in lines[2]
    assert "shorter than 16" in lines[3]
    assert "cannot carry" in lines[4]
    assert "given twice" in lines[5]
    assert "same as token 'alice'" in lines[6]
    text = "\n".join(lines)
    for secret in (ALICE, "another-token", "abc123", "has spaces"):
        assert secret not in text


def test_tokens_from_env_and_file(tmp_path: Path) -> None:
    file = tmp_path / "tokens"
    file.write_text(f"# team tokens\n\nbob:{BOB}\n  # indented comment\n")
    s = settings(api_tokens=f"alice:{ALICE},", api_tokens_file=str(file))
    assert load_tokens(s) == ({"alice": ALICE, "bob": BOB}, frozenset())

    file.write_text(f"bob:{BOB}\nalice:{BOB[::-1]}\nbroken\n")
    with pytest.raises(ConfigError) as info:
        load_tokens(s)
    assert info.value.lines == [
        f"invalid configuration: {file} line 2: token name 'alice' is given twice",
        f"invalid configuration: {file} line 3: expected name:token",
    ]
    file.unlink()
    with pytest.raises(ConfigError, match=r"cannot read .*No such file"):
        load_tokens(s)


async def test_static_tokens_verify_by_name_and_reload_keeps_old_on_error(
    tmp_path: Path,
) -> None:
    file = tmp_path / "tokens"
    file.write_text(f"alice:{ALICE}\n")
    tokens = StaticTokens(settings(api_tokens_file=str(file)))
    found = await tokens.verify_token(ALICE)
    assert found is not None and (found.client_id, found.subject) == ("alice", "alice")
    for wrong in (BOB, ALICE[:-1], ALICE + "x", "", "é" * 20):
        assert await tokens.verify_token(wrong) is None

    file.write_text(f"bob:{BOB}\n")
    tokens.reload()
    assert await tokens.verify_token(ALICE) is None
    assert (await tokens.verify_token(BOB)) is not None

    file.write_text("bob:short\n")
    tokens.reload()  # refused: bob's token stays
    assert (await tokens.verify_token(BOB)) is not None
    assert tokens.names == ["bob"]


async def test_owner_of_request_reads_the_bearer_header() -> None:
    auth = build_auth(settings(api_tokens=f"alice:{ALICE}"))
    assert isinstance(auth, ServerAuth)

    async def who(request: Request) -> PlainTextResponse:
        return PlainTextResponse(str(await owner_of_request(auth, request)))

    async def open_who(request: Request) -> PlainTextResponse:
        return PlainTextResponse(str(await owner_of_request(None, request)))

    app = Starlette(routes=[Route("/who", who), Route("/open", open_who)])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        assert (await client.get("/who", headers={"Authorization": f"Bearer {ALICE}"})).text == (
            "alice"
        )
        assert (await client.get("/who", headers={"Authorization": f"Bearer {BOB}"})).text == (
            "None"
        )
        assert (await client.get("/who")).text == "None"
        assert (await client.get("/open")).text == LOCAL_OWNER


# -- settings and the exposure guard ------------------------------------------------------


def test_modes_and_their_settings() -> None:
    with pytest.raises(ConfigError, match="exclude each other"):
        settings(api_tokens=f"a:{ALICE}", oauth_issuer="https://idp.example.com")
    with pytest.raises(ConfigError, match="need SANDBOX_OAUTH_ISSUER"):
        settings(oauth_audience="x")
    with pytest.raises(ConfigError, match=r"SANDBOX_OAUTH_ISSUER.*http"):
        settings(oauth_issuer="idp.example.com")
    with pytest.raises(ConfigError, match="SANDBOX_MAX_SESSIONS_PER_OWNER"):
        settings(max_sessions_per_owner=0)
    s = settings(
        oauth_issuer="https://idp.example.com/realms/x",
        oauth_required_scopes="sandbox, files",
        max_sessions_per_owner="3",
    )
    assert s.oauth_required_scopes == ["sandbox", "files"]
    assert s.max_sessions_per_owner == 3
    assert settings().max_sessions_per_owner is None


def test_oauth_mode_is_a_resource_server_of_this_url() -> None:
    auth = build_auth(settings(oauth_issuer="https://idp.example.com", http_port=9000))
    assert auth is not None and isinstance(auth.verifier, JwtVerifier)
    assert str(auth.settings.resource_server_url) == "http://127.0.0.1:9000/mcp"
    assert auth.verifier.audience == "http://127.0.0.1:9000/mcp"  # the default audience
    public = build_auth(
        settings(
            oauth_issuer="https://idp.example.com",
            oauth_audience="api://sandbox",
            http_host="0.0.0.0",
            public_base_url="https://sandbox.example.com/",
        )
    )
    assert public is not None and isinstance(public.verifier, JwtVerifier)
    assert str(public.settings.resource_server_url) == "https://sandbox.example.com/mcp"
    assert public.verifier.audience == "api://sandbox"
    with pytest.raises(ConfigError, match="SANDBOX_PUBLIC_BASE_URL"):
        build_auth(settings(oauth_issuer="https://idp.example.com", http_host="0.0.0.0"))
    with pytest.raises(ConfigError, match="must be https"):
        build_auth(settings(oauth_issuer="http://idp.example.com"))
    assert build_auth(settings(oauth_issuer="http://127.0.0.1:8999")) is not None
    assert build_auth(settings()) is None


def test_open_bind_needs_tokens_or_an_explicit_yes() -> None:
    assert check_http_exposure(settings()) is None  # loopback
    assert check_http_exposure(settings(http_host="::1")) is None
    with pytest.raises(ConfigError, match="SANDBOX_ALLOW_UNAUTHENTICATED"):
        check_http_exposure(settings(http_host="0.0.0.0"))
    assert check_http_exposure(settings(http_host="0.0.0.0", api_tokens=f"a:{ALICE}")) is None
    issuer = {"oauth_issuer": "https://idp.example.com", "public_base_url": "https://x.example"}
    assert check_http_exposure(settings(http_host="0.0.0.0", **issuer)) is None
    warning = check_http_exposure(settings(http_host="0.0.0.0", allow_unauthenticated=True))
    assert warning is not None and "WITHOUT AUTHENTICATION" in warning


# -- OAuth: discovery and the key cache ----------------------------------------------------


def test_metadata_urls() -> None:
    assert metadata_urls("https://idp.example.com") == [
        "https://idp.example.com/.well-known/oauth-authorization-server",
        "https://idp.example.com/.well-known/openid-configuration",
    ]
    assert metadata_urls("https://idp.example.com/realms/x/") == [
        "https://idp.example.com/.well-known/oauth-authorization-server/realms/x",
        "https://idp.example.com/.well-known/openid-configuration/realms/x",
        "https://idp.example.com/realms/x/.well-known/openid-configuration",
    ]


async def test_keys_are_cached_and_refetched_for_a_new_kid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with Issuer().serving() as issuer:
        keys = IssuerKeys(issuer.url)
        assert await keys.key("key-1", "RS256") is not None
        assert await keys.key("key-1", "RS256") is not None
        assert await keys.key("key-1", "ES256") is None  # an RSA key is not an EC key
        fetched = issuer.requests.count("/jwks")
        assert fetched == 1  # cached
        assert issuer.requests[0] == "/.well-known/oauth-authorization-server"  # 404, then OIDC

        issuer.keys["key-2"] = new_key()
        assert await keys.key("key-2", "RS256") is None  # a refetch was done moments ago
        monkeypatch.setattr(oauth, "REFRESH_MIN_S", 0.0)
        assert await keys.key("key-2", "RS256") is not None  # rotated in
        assert issuer.requests.count("/jwks") == fetched + 1

        verifier = JwtVerifier(issuer.url, "sandbox-test")
        good = await verifier.verify_token(issuer.token("carol", kid="key-2", scope="a b"))
        assert good is not None
        assert (good.subject, good.client_id, good.scopes) == ("carol", "test-client", ["a", "b"])
        assert await verifier.verify_token("not-a-jwt") is None


async def test_an_unreachable_issuer_refuses_tokens() -> None:
    issuer = Issuer()
    with issuer.serving():
        token = issuer.token()
    verifier = JwtVerifier(issuer.url, "sandbox-test")  # nobody answers there any more
    assert await verifier.verify_token(token) is None
