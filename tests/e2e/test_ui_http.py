"""``/ui`` over plain HTTP against the real server: who gets in (bearer, login cookie, and
every way to be refused), what each owner sees, escaping of what clients and sandboxes
wrote, and the CSRF and Host/Origin guards of the close button."""

from __future__ import annotations

import html
import os
import re
import signal
import time
from collections.abc import Callable

import httpx
import pytest

from mcp_code_sandbox.settings import Settings

from .conftest import http_server_process
from .tenants import client_as, structured
from .ui_harness import (
    ALICE,
    BOB,
    ROOT,
    assert_secure_headers,
    close_form,
    forms,
    logged_in,
    session_ids,
    sign_in_fields,
    ui_server,
)

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap]


def test_without_a_valid_login_nothing_is_shown(make_settings: Callable[..., Settings]) -> None:
    with (
        ui_server(make_settings()) as (base, _proc),
        httpx.Client(base_url=base, timeout=30) as plain,
        logged_in(base, ALICE) as alice,
    ):
        first = plain.get("/ui")
        assert first.status_code == 303 and first.headers["location"] == "/ui/login"
        assert_secure_headers(first)
        form = plain.get("/ui/login")
        assert form.status_code == 200 and 'name="token"' in form.text
        assert_secure_headers(form)

        csrf = sign_in_fields(plain)
        wrong = plain.post("/ui/login", data={**csrf, "token": ALICE + "x"})
        assert wrong.status_code == 401 and "not valid" in wrong.text
        assert "mcs_ui=" not in wrong.headers.get("set-cookie", "")
        assert plain.post("/ui/login", data=csrf).status_code == 401
        too_big = plain.post("/ui/login", data={**csrf, "token": "a" * 20_000})
        assert too_big.status_code == 413

        for header in (f"Bearer {ALICE}x", "Bearer", f"Basic {ALICE}"):
            refused = plain.get("/ui", headers={"Authorization": header})
            assert refused.status_code == 401, header
            assert refused.headers["www-authenticate"].startswith("Bearer")
        ok = plain.get("/ui", headers={"Authorization": f"Bearer {ALICE}"})
        assert ok.status_code == 200 and "signed in as <strong>alice</strong>" in ok.text
        assert_secure_headers(ok)
        assert ALICE not in ok.text

        # A forged or tampered cookie is no login.
        cookie = alice.cookies["mcs_ui"]
        body, _, sig = cookie.partition(".")
        for forged in (f"{body}.{sig[:-2]}AA", f"{body}x.{sig}", "x" * 5000, "not-a-cookie"):
            tampered = httpx.get(f"{base}/ui", cookies={"mcs_ui": forged})
            assert tampered.status_code == 303, forged
        assert alice.get("/ui").status_code == 200

        # A POST without any login is refused, not redirected.
        assert plain.post("/ui/close", data={"owner": "alice"}).status_code == 401


def test_the_sign_in_form_carries_a_csrf_token(make_settings: Callable[..., Settings]) -> None:
    """Login CSRF: a page elsewhere posting its own token to the sign-in form would sign
    the victim's browser in as the attacker (whose sessions the victim then fills)."""
    with (
        ui_server(make_settings()) as (base, _proc),
        httpx.Client(base_url=base, timeout=30) as victim,
        httpx.Client(base_url=base, timeout=30) as attacker,
    ):
        fields = sign_in_fields(victim)
        assert fields.get("csrf") and "mcs_ui_pre" in victim.cookies
        # The attacker's own form page: a token valid for the attacker's pre-login cookie,
        # which the victim's browser does not hold.
        theirs = sign_in_fields(attacker)
        forged = [{}, {"csrf": ""}, {"csrf": fields["csrf"][:-2] + "xx"}, theirs]
        for extra in forged:
            refused = victim.post("/ui/login", data={"token": BOB, **extra})
            assert refused.status_code == 403 and "stale" in refused.text, extra
            assert "mcs_ui=" not in refused.headers.get("set-cookie", "")
        # Without the form's cookie (a cross-site post carries none), its token is nothing.
        with httpx.Client(base_url=base, timeout=30) as bare:
            alone = bare.post("/ui/login", data={"token": BOB, **fields})
            assert alone.status_code == 403
        signed_in = victim.post("/ui/login", data={"token": ALICE, **fields})
        assert signed_in.status_code == 303 and signed_in.headers["location"] == "/ui"
        assert "signed in as <strong>alice</strong>" in victim.get("/ui").text


def test_a_signed_out_cookie_is_no_login(make_settings: Callable[..., Settings]) -> None:
    """A copy of the login cookie (a shared machine, a proxy's log) replayed after sign-out
    gets nothing: the server ended that login, it did not only ask the browser to forget
    it."""
    with (
        ui_server(make_settings()) as (base, _proc),
        logged_in(base, ALICE) as alice,
        logged_in(base, ALICE) as other_browser,
    ):
        copied = alice.cookies["mcs_ui"]
        page = alice.get("/ui").text
        (logout,) = [f for f in forms(page) if f["_action"].endswith("/ui/logout")]
        assert alice.post("/ui/logout", data={"csrf": logout["csrf"]}).status_code == 303
        with httpx.Client(base_url=base, timeout=30, cookies={"mcs_ui": copied}) as replay:
            assert replay.get("/ui").status_code == 303  # to the sign-in form
            closing = replay.post("/ui/close", data={**logout, "owner": "alice"})
            assert closing.status_code == 401
            again = replay.post("/ui/logout", data={"csrf": logout["csrf"]})
            assert again.status_code == 401
        # Only that login ended: alice's other browser is still signed in.
        assert other_browser.get("/ui").status_code == 200


def test_a_removed_token_ends_its_browser_logins(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    tokens = settings.state_dir / "tokens"
    tokens.write_text(f"alice:{ALICE}\nroot:{ROOT}:admin\n")
    with (
        http_server_process(settings, SANDBOX_API_TOKENS_FILE=str(tokens)) as (base, proc),
        logged_in(base, ALICE) as alice,
        logged_in(base, ROOT) as root,
    ):
        assert "admin: every owner" in root.get("/ui").text
        tokens.write_text(f"alice:{BOB}\nroot:{ROOT}\n")  # alice's replaced, root not admin
        os.kill(proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 20
        while alice.get("/ui").status_code != 303:
            assert time.monotonic() < deadline, "the old token's login still works"
            time.sleep(0.2)
        page = root.get("/ui")
        assert page.status_code == 200 and "admin: every owner" not in page.text


async def test_owners_see_their_own_and_the_admin_sees_all(
    make_settings: Callable[..., Settings],
) -> None:
    with ui_server(make_settings()) as (base, _proc):
        async with client_as(base, ALICE) as a, client_as(base, BOB) as b:
            ran = structured(await a.call_tool("run_code", {"session_id": "a1", "code": "1+1"}))
            assert ran["status"] == "ok"
            await b.call_tool("run_code", {"session_id": "b1", "code": "1/0"})
        with logged_in(base, ALICE) as alice:
            alice_page = alice.get("/ui").text
        assert session_ids(alice_page) == {"a1"}
        assert "ZeroDivisionError" not in alice_page  # bob's run
        assert 'class="status status-ok">ok<' in alice_page
        with logged_in(base, ROOT) as root:
            root_page = root.get("/ui").text
        assert session_ids(root_page) == {"a1", "b1"}
        assert "ZeroDivisionError" in root_page
        for section in ('id="pool"', 'id="paused"', "Not enabled"):
            assert section in root_page


async def test_a_failed_program_shows_its_error(make_settings: Callable[..., Settings]) -> None:
    """node and bun print an uncaught error on stderr, with no structured error: the page
    names it as it names a Python exception; another program's failure is its exit code."""
    failing = {
        "javascript": "null.x",
        "typescript": "throw new RangeError('out of range')",
        "bash": "exit 3",
    }
    with ui_server(make_settings()) as (base, _proc):
        async with client_as(base, ALICE) as a:
            for language, code in failing.items():
                args = {"session_id": "a1", "language": language, "code": code}
                assert structured(await a.call_tool("run_code", args))["status"] == "error"
        with logged_in(base, ALICE) as alice:
            page = alice.get("/ui").text
    shown = re.findall(r'<td class="error">([^<]*)</td>', page)
    assert shown == ["exit code 3", "RangeError", "TypeError"]  # newest first


async def test_paused_sessions_show_their_real_figures(
    make_settings: Callable[..., Settings],
) -> None:
    """Pausing is on by default: the card says how many sessions are paused and what they
    hold on disk (an owner's own; the admin's: all), and the rules that bound them."""
    settings = make_settings()
    keep = {"SANDBOX_KEEP_SESSIONS_ON_SHUTDOWN": ""}  # the HTTP default: a stop pauses all
    with ui_server(settings, **keep) as (base, _proc):
        async with client_as(base, ALICE) as a, client_as(base, BOB) as b:
            for owner, sid in ((a, "a1"), (a, "a2"), (b, "b1")):
                code = "v = 'x' * 1000; open('f.txt', 'w').write(v)"
                ran = structured(
                    await owner.call_tool("run_code", {"session_id": sid, "code": code})
                )
                assert ran["status"] == "ok"
    with (
        ui_server(settings, **keep) as (base, _proc),
        logged_in(base, ALICE) as alice,
        logged_in(base, ROOT) as root,
    ):
        mine, every = alice.get("/ui").text, root.get("/ui").text
    assert "Not enabled on this server" not in mine
    assert re.search(r'Paused \(yours\)</dt><dd id="paused-count">2<', mine), mine
    assert re.search(r'<dd id="paused-count">3<', every)
    held = re.search(r'<dd id="paused-bytes">([^<]*)<', mine)
    assert held and held.group(1) not in {"0 B", "unknown"}
    assert "idle for 10 min is paused" in mine and "10.0 GiB" in mine


async def test_runs_of_an_ended_session_say_so(make_settings: Callable[..., Settings]) -> None:
    with ui_server(make_settings()) as (base, _proc):
        async with client_as(base, ALICE) as a:
            for sid in ("gone", "open", "again"):
                await a.call_tool("run_code", {"session_id": sid, "code": "1"})
            for sid in ("gone", "again"):
                assert not (await a.call_tool("close_session", {"session_id": sid})).is_error
            await a.call_tool("run_code", {"session_id": "again", "code": "2"})  # a new one
        with logged_in(base, ALICE) as alice:
            page = alice.get("/ui").text
    rows = re.findall(r'<td class="sid"><code>([^<]*)</code>(?:<br><span[^>]*>([^<]*)<)?', page)
    runs = rows[len(session_ids(page)) :]  # after the Sessions table's
    assert runs == [
        ("again", ""),
        ("again", "this session has ended"),
        ("open", ""),
        ("gone", "session gone was closed; files and variables from before are gone"),
    ]


async def test_what_clients_and_sandboxes_wrote_is_escaped(
    make_settings: Callable[..., Settings],
) -> None:
    hostile_id = '"><script>alert(1)</script>'
    hostile_class = "<img src=x onerror=alert(2)>"
    code = f"raise type({hostile_class!r}, (Exception,), {{}})('x')"
    with ui_server(make_settings()) as (base, _proc):
        async with client_as(base, ALICE) as a:
            refused = await a.call_tool("run_code", {"session_id": hostile_id, "code": "1"})
            assert refused.is_error
            failed = structured(await a.call_tool("run_code", {"session_id": "s1", "code": code}))
            assert failed["error"]["name"] == hostile_class
        with logged_in(base, ALICE) as alice:
            page = alice.get("/ui").text
        for raw in (hostile_id, hostile_class, "<script>", "<img"):
            assert raw not in page
        assert html.escape(hostile_class) in page
        assert html.escape(hostile_id.removeprefix('"')) in page  # (jinja writes " as &#34;)
        assert "invalid_session_id" in page


async def test_close_needs_the_csrf_token_and_an_entitled_viewer(
    make_settings: Callable[..., Settings],
) -> None:
    with ui_server(make_settings()) as (base, _proc):
        async with client_as(base, ALICE) as a, client_as(base, BOB) as b:
            await a.call_tool("run_code", {"session_id": "a1", "code": "x = 1"})
            await b.call_tool("run_code", {"session_id": "b1", "code": "y = 2"})
        with (
            logged_in(base, ALICE) as alice,
            logged_in(base, BOB) as bob,
            logged_in(base, ROOT) as root,
        ):
            await _close_checks(base, alice, bob, root)


async def _close_checks(
    base: str, alice: httpx.Client, bob: httpx.Client, root: httpx.Client
) -> None:
    """Alice's session a1 and bob's b1 are open; each client is logged in as its name."""
    fields = close_form(alice.get("/ui").text, "alice", "a1")
    bob_fields = close_form(bob.get("/ui").text, "bob", "b1")

    refusals = [
        {k: v for k, v in fields.items() if k != "csrf"},  # no token
        {**fields, "csrf": fields["csrf"][:-2] + "xx"},  # a wrong one
        {**fields, "csrf": bob_fields["csrf"]},  # another login's
    ]
    for form in refusals:
        answer = alice.post("/ui/close", data=form)
        assert answer.status_code == 403 and "stale" in answer.text
    # A page of another origin posting with the cookie: refused before anything.
    evil = alice.post("/ui/close", data=fields, headers={"Origin": "https://evil.example"})
    assert evil.status_code == 403
    assert "a1" in session_ids(root.get("/ui").text)

    # bob, not admin, cannot close alice's session, even with his own valid token.
    other = bob.post("/ui/close", data={**bob_fields, "owner": "alice", "session_id": "a1"})
    assert other.status_code == 303 and other.headers["location"] == "/ui?notice=not_found"
    assert "a1" in session_ids(root.get("/ui").text)

    done = alice.post("/ui/close", data=fields)
    assert done.status_code == 303 and done.headers["location"] == "/ui?notice=closed"
    assert "was closed" in alice.get("/ui?notice=closed").text
    # The admin closes bob's.
    root_fields = close_form(root.get("/ui").text, "bob", "b1")
    assert root.post("/ui/close", data=root_fields).headers["location"].endswith("closed")
    assert session_ids(root.get("/ui").text) == set()
    async with client_as(base, BOB) as b:
        gone = await b.call_tool("list_files", {"session_id": "b1"})
        assert gone.is_error and "session_not_found" in str(gone.content)

    # A bearer request needs no CSRF token (no browser sends that header by itself).
    async with client_as(base, ALICE) as a:
        await a.call_tool("run_code", {"session_id": "a2", "code": "1"})
    bearer = httpx.post(
        f"{base}/ui/close",
        data={"owner": "alice", "session_id": "a2"},
        headers={"Authorization": f"Bearer {ALICE}"},
    )
    assert bearer.headers["location"] == "/ui?notice=closed"

    # Signing out needs the token too, and ends the login.
    logout = alice.post("/ui/logout", data={"csrf": fields["csrf"]})
    assert logout.status_code == 303
    assert alice.get("/ui").status_code == 303


def test_without_tokens_local_gets_in_on_loopback(make_settings: Callable[..., Settings]) -> None:
    with (
        http_server_process(make_settings(), SANDBOX_PAUSE_AFTER_M="0") as (base, _proc),
        httpx.Client(base_url=base, timeout=30) as client,
    ):
        page = client.get("/ui")
        assert page.status_code == 200 and "signed in as <strong>local</strong>" in page.text
        assert "Idle sessions are not paused on this server" in page.text
        assert "mcs_ui" in client.cookies
        rebound = client.get("/ui", headers={"Host": "evil.example"})
        assert rebound.status_code == 421


def test_malformed_forms_are_refused(make_settings: Callable[..., Settings]) -> None:
    with ui_server(make_settings()) as (base, _proc), logged_in(base, ALICE) as alice:
        many = "&".join(f"f{i}=1" for i in range(40))
        headers = {"Content-Type": "application/x-www-form-urlencoded"}
        assert alice.post("/ui/close", content=many, headers=headers).status_code == 400
        assert alice.post("/ui/close", content=b"\xff\xfe=\x00").status_code == 403  # no csrf
