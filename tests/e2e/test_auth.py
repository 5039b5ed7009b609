"""API tokens over HTTP, against the real server: 401s, owners kept apart in every tool and
in resource reads, the per-owner limit, and SIGHUP rereading the tokens file. Driven with
plain HTTP requests (status and headers) and the official MCP client (both eras)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import httpx
import pytest
from mcp import MCPError

from mcp_code_sandbox.settings import Settings

from .conftest import ERAS, http_server, http_server_process, initialize_request
from .tenants import client_as, structured
from .test_errors import assert_error

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap]

ALICE = "alice-0123456789abcdef"
BOB = "bob-0123456789abcdef00"
TOKENS = f"alice:{ALICE},bob:{BOB}"
INITIALIZE = initialize_request()


def post_mcp(base: str, authorization: str | None) -> httpx.Response:
    """An MCP ``initialize`` as plain HTTP, with this Authorization header (if any)."""
    headers = {"Accept": "application/json, text/event-stream"}
    if authorization is not None:
        headers["Authorization"] = authorization
    return httpx.post(f"{base}/mcp", json=INITIALIZE, headers=headers, timeout=30)


def test_missing_or_wrong_token_gets_401(make_settings: Callable[..., Settings]) -> None:
    with http_server(make_settings(), SANDBOX_API_TOKENS=TOKENS) as base:
        for authorization in (None, f"Bearer {ALICE}x", "Bearer", f"Basic {ALICE}", ALICE):
            refused = post_mcp(base, authorization)
            assert refused.status_code == 401, authorization
            assert refused.headers["www-authenticate"].startswith("Bearer "), authorization
            assert 'error="invalid_token"' in refused.headers["www-authenticate"]
            assert refused.json()["error"] == "invalid_token"
        assert post_mcp(base, f"Bearer {ALICE}").status_code == 200
        assert post_mcp(base, f"bearer {BOB}").status_code == 200  # the scheme is case-blind
        assert httpx.get(f"{base}/healthz").status_code == 200  # health needs no token


@pytest.mark.parametrize("mode", ERAS)
async def test_the_client_needs_the_right_token(
    make_settings: Callable[..., Settings], mode: str
) -> None:
    with http_server(make_settings(), SANDBOX_API_TOKENS=TOKENS) as base:
        async with client_as(base, ALICE, mode) as alice:
            assert structured(await alice.call_tool("list_runtimes", {}))["runtimes"]
        with pytest.raises(ExceptionGroup) as refused:
            async with client_as(base, BOB + "x", mode) as intruder:
                await intruder.call_tool("list_runtimes", {})
        assert refused.group_contains(MCPError)


@pytest.mark.parametrize("mode", ERAS)
async def test_owners_never_see_each_other(
    make_settings: Callable[..., Settings], mode: str
) -> None:
    settings = make_settings()
    with http_server_process(settings, SANDBOX_API_TOKENS=TOKENS) as (base, _proc):
        async with client_as(base, ALICE, mode) as alice, client_as(base, BOB, mode) as bob:
            up = structured(
                await alice.call_tool(
                    "upload_file",
                    {"session_id": "team", "filename": "secret.txt", "content_text": "A's"},
                )
            )
            assert up["session_created"] is True
            ran = await alice.call_tool("run_code", {"session_id": "team", "code": "x = 42"})
            assert structured(ran)["status"] == "ok"

            # Every tool that names an existing session: as if it did not exist.
            for tool, args in (
                ("read_file", {"session_id": "team", "path": "secret.txt"}),
                ("list_files", {"session_id": "team"}),
                ("close_session", {"session_id": "team"}),
            ):
                assert_error(await bob.call_tool(tool, args), "session_not_found")
            with pytest.raises(MCPError, match="session_not_found"):
                await bob.read_resource("sandbox://team/secret.txt")

            # run_code with an unknown name makes the caller's own session of that name.
            probe = "import os\nprint(os.path.exists('secret.txt'), 'x' in globals())"
            probed = await bob.call_tool("run_code", {"session_id": "team", "code": probe})
            mine = structured(probed)
            assert mine["session_created"] is True
            assert mine["stdout"] == "False False\n"
            bob_up = {"session_id": "team", "filename": "secret.txt", "content_text": "B's"}
            bob_upload = structured(await bob.call_tool("upload_file", bob_up))
            assert bob_upload["session_created"] is False

            # Alice's session is untouched by all of that.
            read = await alice.read_resource("sandbox://team/secret.txt")
            assert read.contents[0].text == "A's"  # type: ignore[union-attr]
            again = await alice.call_tool("run_code", {"session_id": "team", "code": "x"})
            assert structured(again)["result"] == "42"
            structured(await alice.call_tool("close_session", {"session_id": "team"}))
            assert structured(await bob.call_tool("list_files", {"session_id": "team"}))["entries"]
    log = (settings.state_dir / "server.log").read_text()
    assert "owner=alice" in log and "owner=bob" in log  # the audit lines name the owner


async def test_max_sessions_per_owner(make_settings: Callable[..., Settings]) -> None:
    # Pausing off: past her share a new session is refused (with pausing on, her own
    # idlest would be paused to make room: tests/e2e/test_hostile_small.py).
    extra = {
        "SANDBOX_API_TOKENS": TOKENS,
        "SANDBOX_MAX_SESSIONS_PER_OWNER": "2",
        "SANDBOX_PAUSE_AFTER_M": "0",
    }
    with http_server(make_settings(), **extra) as base:
        async with client_as(base, ALICE) as alice, client_as(base, BOB) as bob:
            for sid in ("one", "two"):
                args = {"session_id": sid, "filename": "f", "content_text": "x"}
                structured(await alice.call_tool("upload_file", args))
            third = {"session_id": "three", "filename": "f", "content_text": "x"}
            assert_error(await alice.call_tool("upload_file", third), "max_sessions")
            assert_error(
                await alice.call_tool("run_code", {"session_id": "three", "code": "1"}),
                "max_sessions",
            )
            structured(await bob.call_tool("upload_file", third))  # bob has his own two


def wait_for_status(base: str, authorization: str, status: int) -> None:
    deadline = time.monotonic() + 15
    while (got := post_mcp(base, authorization).status_code) != status:
        assert time.monotonic() < deadline, f"still {got}, not {status}"
        time.sleep(0.1)


async def test_sighup_rereads_the_tokens_file(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings()
    tokens = settings.state_dir / "tokens"
    tokens.write_text(f"# who may call\nalice:{ALICE}\n")
    with http_server_process(settings, SANDBOX_API_TOKENS_FILE=str(tokens)) as (base, proc):
        assert post_mcp(base, f"Bearer {ALICE}").status_code == 200
        assert post_mcp(base, f"Bearer {BOB}").status_code == 401

        tokens.write_text(f"bob:{BOB}\n")
        proc.send_signal(signal.SIGHUP)
        wait_for_status(base, f"Bearer {BOB}", 200)
        assert post_mcp(base, f"Bearer {ALICE}").status_code == 401  # removed: out at once
        async with client_as(base, BOB) as bob:
            structured(await bob.call_tool("run_code", {"code": "1 + 1"}))

        tokens.write_text("bob:short\ncarol\n")  # a broken file keeps the tokens in force
        proc.send_signal(signal.SIGHUP)
        log = settings.state_dir / "server.log"
        deadline = time.monotonic() + 15
        while "NOT reloaded" not in log.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert post_mcp(base, f"Bearer {BOB}").status_code == 200
        assert proc.poll() is None
    text = log.read_text()
    assert "line 2: expected name:token" in text
    assert ALICE not in text and BOB not in text  # tokens are never logged
