"""The ``/ui`` login cookie and CSRF tokens (``server.ui.cookies``), the admin mark of API
tokens (``server.auth``), the recent-runs ring (``run.recent``) and the page's value
filters: pure parts, without a server."""

from __future__ import annotations

import hashlib

import pytest

from mcp_code_sandbox.run.recent import (
    MAX_ERROR_CHARS,
    MAX_ID_CHARS,
    RecentRuns,
    RunEntry,
    error_label,
)
from mcp_code_sandbox.server.auth import StaticTokens, is_admin, parse_token_roles
from mcp_code_sandbox.server.ui.cookies import (
    LOGIN_TTL_S,
    MAX_LOGINS_PER_OWNER,
    CookieSigner,
    LiveLogins,
)
from mcp_code_sandbox.server.ui.views import duration, ended_note, size
from mcp_code_sandbox.settings import ConfigError, load_settings

ALICE = "alice-0123456789abcdef"
ROOT = "root-0123456789abcdef00"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_login_round_trips_and_expires() -> None:
    clock = Clock()
    signer = CookieSigner(b"k" * 32, clock)
    digest = hashlib.sha256(ALICE.encode()).digest()
    login = signer.login("alice", digest, None)
    value = signer.encode(login)
    assert ALICE not in value and digest.hex() not in value
    assert signer.decode(value) == login
    assert login.expires == int(clock.now) + LOGIN_TTL_S
    assert signer.login("alice", None, clock.now + 60).expires == int(clock.now) + 60  # OAuth
    clock.now += LOGIN_TTL_S + 1
    assert signer.decode(value) is None


_B64URL = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


def _same_bytes(last: str) -> str:
    """Another last character of a 43-character (32-byte) base64 text that decodes to the
    same bytes: its lowest bit is one of the 2 spare bits."""
    return _B64URL[_B64URL.index(last) ^ 1]


def _other_last(text: str) -> str:
    """``text`` with another last character (one that may differ only in spare bits)."""
    return text[:-1] + ("B" if text[-1] != "B" else "C")


@pytest.mark.parametrize(
    "forge",
    [
        _other_last,  # the signature's last character
        lambda v: v[:-1] + _same_bytes(v[-1]),  # only its spare bits: the same bytes
        lambda v: _other_last(v.split(".")[0]) + "." + v.split(".")[1],  # the payload's
        lambda v: "e" + v,  # payload changed
        lambda v: v.replace(".", ""),
        lambda v: v + ".x",
        lambda v: "",
        lambda v: "x" * 2000,
        lambda v: "!!!.???",
    ],
)
def test_a_forged_cookie_is_no_login(forge: object) -> None:
    signer = CookieSigner(b"k" * 32)
    value = signer.encode(signer.login("alice", None, None))
    assert callable(forge)
    assert signer.decode(forge(value)) is None
    # Another server's (another secret's) cookie neither.
    assert CookieSigner(b"j" * 32).decode(value) is None


def test_csrf_tokens_are_per_login() -> None:
    signer = CookieSigner(b"k" * 32)
    one, two = signer.login("alice", None, None), signer.login("alice", None, None)
    assert signer.csrf_ok(one, signer.csrf(one))
    assert not signer.csrf_ok(one, signer.csrf(two))
    assert not signer.csrf_ok(one, "")
    assert not signer.csrf_ok(one, "é" * 43)


def test_tokens_marked_admin() -> None:
    tokens, admins = parse_token_roles(
        [("e1", f"alice:{ALICE}"), ("e2", f" root : {ROOT} : admin ")]
    )
    assert tokens == {"alice": ALICE, "root": ROOT} and admins == {"root"}
    with pytest.raises(ConfigError) as info:
        parse_token_roles([("entry 1", f"root:{ROOT}:owner")])
    assert info.value.lines == [
        "invalid configuration: entry 1: token 'root': the only role after a second ':' is 'admin'"
    ]
    assert ROOT not in str(info.value)


def test_static_tokens_know_their_admins() -> None:
    settings = load_settings({"api_tokens": f"alice:{ALICE},root:{ROOT}:admin"}, environ={})
    tokens = StaticTokens(settings)
    assert tokens.is_admin("root") and not tokens.is_admin("alice")
    assert tokens.digest_of("alice") == hashlib.sha256(ALICE.encode()).digest()
    assert tokens.digest_of("nobody") is None
    assert is_admin(None, "local")  # no authentication: the one owner


def test_recent_runs_are_bounded_newest_first_and_per_owner() -> None:
    ring = RecentRuns(size=3)
    for i in range(5):
        ring.add("alice" if i % 2 else "bob", f"s{i}", "python", "ok", i, None)
    assert [e.session_id for e in ring.listed()] == ["s4", "s3", "s2"]
    assert [e.session_id for e in ring.listed("alice")] == ["s3"]
    ring.add("bob", "x" * 10_000, "y" * 1000, "failed", 1, "E" * 10_000)
    newest = ring.listed()[0]
    assert newest.session_id is not None and len(newest.session_id) == MAX_ID_CHARS
    assert newest.error is not None and len(newest.error) == MAX_ERROR_CHARS
    assert len(newest.language) < 100


def test_page_values() -> None:
    assert size(None) == "unknown" and size(512) == "512 B" and size(5000) == "4.9 KiB"
    assert duration(5) == "5 s" and duration(600) == "10 min" and duration(36000) == "10.0 h"


def test_a_login_is_good_only_while_the_server_holds_it() -> None:
    clock = Clock()
    signer = CookieSigner(b"k" * 32, clock)
    live = LiveLogins(clock)
    first, second = signer.login("alice", None, None), signer.login("alice", None, None)
    assert not live.holds(first)  # never given out here (another server's, a restart)
    live.add(first)
    live.add(second)
    live.end(first)
    assert not live.holds(first) and live.holds(second)
    live.end(first)  # twice: nothing
    clock.now += LOGIN_TTL_S + 1
    assert not live.holds(second)


def test_one_owner_cannot_make_the_server_hold_logins_without_bound() -> None:
    clock = Clock()
    signer = CookieSigner(b"k" * 32, clock)
    live = LiveLogins(clock)
    bob = signer.login("bob", None, None)
    live.add(bob)
    alices = [signer.login("alice", None, None) for _ in range(MAX_LOGINS_PER_OWNER + 5)]
    for login in alices:
        live.add(login)
    assert [live.holds(a) for a in alices] == [False] * 5 + [True] * MAX_LOGINS_PER_OWNER
    assert live.holds(bob)


def test_a_pre_login_cookie_is_never_a_login() -> None:
    signer = CookieSigner(b"k" * 32, Clock())
    pre = signer.pre_login()
    assert signer.decode_pre(signer.encode_pre(pre)) == pre
    assert signer.decode(signer.encode_pre(pre)) is None
    login = signer.login("alice", None, None)
    assert signer.decode_pre(signer.encode(login)) is None


NODE_TYPE_ERROR = """file:///tmp/mcs-code-x/main.mjs:1
null.x
     ^

TypeError: Cannot read properties of null (reading 'x')
    at file:///tmp/mcs-code-x/main.mjs:1:6
    at ModuleJob.run (node:internal/modules/esm/module_job:561:25)

Node.js v24.21.0
"""
NODE_SUBCLASS = """file:///tmp/mcs-code-x/main.mjs:1
label: for (;;) { class MyErr extends Error {}; throw new MyErr('m') }
                                                   ^

MyErr [Error]: m
    at file:///tmp/mcs-code-x/main.mjs:1:36
"""
BUN_SUBCLASS = """1 | class MyErr extends Error{}; throw new MyErr('m')
                                       ^
error: m
      at /tmp/mcs-code-x/main.ts:1:36

Bun v1.4.5 (Linux x64)
"""
NODE_THROWN_STRING = """node:internal/modules/run_main:107
    triggerUncaughtException(
    ^
str
(Use `node --trace-uncaught ...` to show where the exception was thrown)
"""


@pytest.mark.parametrize(
    ("status", "error", "exit_code", "stderr", "label"),
    [
        ("error", {"name": "ZeroDivisionError"}, None, "", "ZeroDivisionError"),
        ("error", None, 1, NODE_TYPE_ERROR, "TypeError"),
        ("error", None, 1, NODE_SUBCLASS, "MyErr"),
        ("error", None, 1, BUN_SUBCLASS, "Error"),
        ("error", None, 1, NODE_THROWN_STRING, "exit code 1"),
        ("error", None, 3, "", "exit code 3"),
        ("error", None, 1, "x" * 100_000 + "\n" + NODE_TYPE_ERROR, "exit code 1"),
        ("ok", None, 0, NODE_TYPE_ERROR, None),
        ("timeout", None, None, "", None),
    ],
)
def test_a_failed_run_is_labelled_by_its_error(
    status: str, error: dict[str, str] | None, exit_code: int | None, stderr: str, label: str
) -> None:
    assert error_label(status, error, exit_code, stderr) == label


def test_a_run_of_an_ended_session_says_why() -> None:
    def run(sid: str | None, at: float = 100.0, status: str = "ok") -> RunEntry:
        return RunEntry(at, "alice", sid, "python", status, 5, None)

    live = {("alice", "open"): 50.0, ("alice", "again"): 150.0}
    ended = {("alice", "gone"): "session gone was closed", ("bob", "open"): "expired"}
    assert ended_note(run("open"), live, ended) is None
    assert ended_note(run("gone"), live, ended) == "session gone was closed"
    assert ended_note(run("again"), live, ended) == "this session has ended"  # an earlier one
    assert ended_note(run("again", at=200.0), live, ended) is None
    assert ended_note(run("forgotten"), live, ended) == "this session has ended"
    assert ended_note(run("bad id", status="failed"), live, ended) is None  # never was one
    assert ended_note(run(None, status="failed"), live, ended) is None
