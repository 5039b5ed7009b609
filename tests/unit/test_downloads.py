"""Download link signatures, the secret's keeping, and Range arithmetic (pure parts)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from mcp_code_sandbox.server.downloads import UrlSigner, load_secret, parse_range
from mcp_code_sandbox.settings import load_settings


def test_a_link_opens_one_file_of_one_session_of_one_owner_until_it_expires() -> None:
    now = [1000.0]
    signer = UrlSigner(b"k" * 32, "https://sb.example/x", 60, lambda: now[0])
    url = signer.url("alice", "s1", "dir/a b.csv")
    assert url.startswith("https://sb.example/x/files/s1/dir/a%20b.csv?exp=1060&sig=")
    sig = url.rsplit("sig=", 1)[1]
    assert signer.valid("alice", "s1", "dir/a b.csv", "1060", sig)
    for owner, session, path, exp in [
        ("bob", "s1", "dir/a b.csv", "1060"),
        ("alice", "s2", "dir/a b.csv", "1060"),
        ("alice", "s1", "dir/other.csv", "1060"),
        ("alice", "s1", "dir/a b.csv", "1061"),
        ("alice", "s1", "dir/a b.csv", "-1"),
    ]:
        assert not signer.valid(owner, session, path, exp, sig)
    assert not UrlSigner(b"other" * 8, "", 60, lambda: now[0]).valid(
        "alice", "s1", "dir/a b.csv", "1060", sig
    )
    now[0] = 1061.0
    assert not signer.valid("alice", "s1", "dir/a b.csv", "1060", sig)


def test_oversized_or_odd_link_parts_are_refused_not_errors() -> None:
    signer = UrlSigner(b"k" * 32, "", 60, lambda: 1000.0)
    sig = signer.url("alice", "s1", "a.txt").rsplit("sig=", 1)[1]
    for session, path, exp, signature in [
        ("s1", "a.txt", "9" * 5000, sig),  # int() refuses over 4,300 digits
        ("s1", "a.txt", "1060\u00b2", sig),  # "²".isdigit(), but int() refuses it
        ("s1", "a.txt", "0" * 13 + "1060", sig),
        ("s1", "a.txt", "1060", sig * 1000),
        ("s1", "a.txt", "1060", "\u00e9" * 43),
        ("s1", "a" * 100_000, "1060", sig),
        ("s" * 100_000, "a.txt", "1060", sig),
    ]:
        assert not signer.valid("alice", session, path, exp, signature)


def test_the_secret_is_made_once_and_kept_private(tmp_path: Path) -> None:
    settings = load_settings({"state_dir": str(tmp_path)}, environ={})
    first = load_secret(settings)
    assert len(first) == 64 and load_secret(settings) == first
    assert stat.S_IMODE((tmp_path / "url-secret").stat().st_mode) == 0o600
    given = load_settings({"state_dir": str(tmp_path), "url_secret": "s" * 16}, environ={})
    assert load_secret(given) == b"s" * 16


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("bytes=0-9", (0, 10)),
        ("bytes=90-", (90, 100)),
        ("bytes=90-500", (90, 100)),
        ("bytes=-10", (90, 100)),
        ("bytes=-500", (0, 100)),
        ("bytes=100-", False),
        ("bytes=5-4", False),
        ("bytes=-0", False),
        ("bytes=0-1,5-6", None),
        ("items=0-1", None),
        ("bytes=a-b", None),
        ("bytes=1-x", None),
    ],
)
def test_parse_range(header: str | None, expected: object) -> None:
    assert parse_range(header, 100) == expected
