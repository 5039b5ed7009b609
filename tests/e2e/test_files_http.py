"""Files over plain HTTP (DESIGN §9), against the real HTTP server.

Downloads: the MCP client gets ``download_url``s in results; plain HTTP requests fetch
them, and every way of abusing a link (tampering, expiry, another session, a planted
symlink) gets a bare 403 or 404. Uploads: ``PUT`` streams a file into a session, within
the upload limit and the quota, leaving nothing behind when refused.

The server runs with a known ``SANDBOX_URL_SECRET`` so that the test can also sign links
the server never handed out (an expired one, one for a symlink) exactly as it would."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from mcp import Client

from mcp_code_sandbox.server.downloads import UrlSigner
from mcp_code_sandbox.settings import Settings

from ..conftest import each_runtime
from .conftest import http_server

SECRET = "test-secret-0123456789abcdef"
BLOB = bytes(range(256)) * 1000  # 256000 bytes, more than read_file's 64 KiB below


@pytest.fixture
def served(make_settings: Callable[..., Settings]) -> Iterator[str]:
    limits = {
        "SANDBOX_MAX_READ_BYTES": "65536",
        "SANDBOX_MAX_UPLOAD_BYTES": "300000",
        "SANDBOX_WORKSPACE_QUOTA_BYTES": "500000",
    }
    with http_server(make_settings(), SANDBOX_URL_SECRET=SECRET, **limits) as base:
        yield base


def signer(base: str, *, clock: Callable[[], float] = time.time) -> UrlSigner:
    return UrlSigner(SECRET.encode(), base, 3600, clock)


async def make_files(base: str, session: str) -> dict[str, Any]:
    code = (
        "open('blob.bin', 'wb').write(bytes(range(256)) * 1000)\n"
        "open('notes é.txt', 'w').write('hello')\n"
        "import os; os.symlink('/etc/passwd', 'link')"
    )
    async with Client(f"{base}/mcp", mode="legacy") as client:
        result = await client.call_tool("run_code", {"code": code, "session_id": session})
        assert not result.is_error, result.content
        data = result.structured_content
        assert data is not None and data["status"] == "ok", data
        read = await client.call_tool("read_file", {"session_id": session, "path": "blob.bin"})
        page = read.structured_content  # a first page of base64, with the link to all of it
        assert not read.is_error and page and page["next_offset"], read.content
        text = await client.call_tool("read_file", {"session_id": session, "path": "notes é.txt"})
        assert text.structured_content is not None
        return {
            "files": {f["path"]: f["download_url"] for f in data["files"]},
            "page": page,
            "read": text.structured_content["download_url"],
        }


async def test_results_carry_links_that_stream_the_file(served: str) -> None:
    links = await make_files(served, "dl-ok")
    url = links["files"]["blob.bin"]
    assert url.startswith(f"{served}/files/dl-ok/blob.bin?exp=")
    assert links["page"]["download_url"].startswith(f"{served}/files/dl-ok/blob.bin?")
    response = httpx.get(url)
    assert response.status_code == 200 and response.content == BLOB
    assert response.headers["content-disposition"].startswith('attachment; filename="blob.bin"')
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["accept-ranges"] == "bytes"
    part = httpx.get(url, headers={"Range": "bytes=1000-1009"})
    assert part.status_code == 206 and part.content == BLOB[1000:1010]
    assert part.headers["content-range"] == f"bytes 1000-1009/{len(BLOB)}"
    tail = httpx.get(url, headers={"Range": "bytes=-5"})
    assert tail.status_code == 206 and tail.content == BLOB[-5:]
    beyond = httpx.get(url, headers={"Range": f"bytes={len(BLOB)}-"})
    assert beyond.status_code == 416 and beyond.headers["content-range"] == f"bytes */{len(BLOB)}"
    # A name that needs quoting round-trips, and read_file's link works too.
    for link in (links["files"]["notes é.txt"], links["read"]):
        named = httpx.get(link)
        assert named.status_code == 200 and named.content == b"hello"
        assert "filename*=UTF-8''notes%20%C3%A9.txt" in named.headers["content-disposition"]


async def test_tampered_expired_and_foreign_links_reveal_nothing(served: str) -> None:
    links = await make_files(served, "dl-bad")
    url = links["files"]["blob.bin"]
    query = parse_qs(urlsplit(url).query)
    exp, sig = query["exp"][0], query["sig"][0]
    bad = {
        "signature": url.replace(sig, sig[:-2] + ("AA" if not sig.endswith("AA") else "BB")),
        "another file": url.replace("/blob.bin?", "/notes%20%C3%A9.txt?"),
        "another session": url.replace("/dl-bad/", "/dl-other/"),
        "later expiry": url.replace(f"exp={exp}", f"exp={int(exp) + 3600}"),
        "no signature": url.split("?")[0],
        "expired": signer(served, clock=lambda: time.time() - 7200).url(
            "local", "dl-bad", "blob.bin"
        ),
        "another owner": signer(served).url("mallory", "dl-bad", "blob.bin"),
    }
    for what, link in bad.items():
        response = httpx.get(link)
        assert response.status_code == 403, what
        assert response.text == "this link is not valid, or has expired\n", what
        assert "blob" not in response.text
    # Signed for real, but a symlink (to /etc/passwd), a missing file or a directory: 404.
    for path in ("link", "missing.txt", ".outputs", "../../etc/passwd"):
        response = httpx.get(signer(served).url("local", "dl-bad", path))
        assert response.status_code in (403, 404), path
        assert "root:" not in response.text and response.status_code != 200
    assert httpx.get(signer(served).url("local", "dl-bad", "link")).status_code == 404


async def test_links_die_with_the_session(served: str) -> None:
    links = await make_files(served, "dl-gone")
    url = links["files"]["blob.bin"]
    async with Client(f"{served}/mcp", mode="legacy") as client:
        await client.call_tool("close_session", {"session_id": "dl-gone"})
    assert httpx.get(url).status_code == 403


def put(base: str, session: str, path: str, body: Any, **params: str) -> httpx.Response:
    return httpx.put(f"{base}/files/{session}/{path}", content=body, params=params, timeout=60)


def chunks(total: int, size: int = 50_000) -> Iterator[bytes]:
    """A body without a Content-Length (chunked): the server must count it as it comes."""
    sent = 0
    while sent < total:
        n = min(size, total - sent)
        sent += n
        yield b"u" * n


async def test_put_uploads_a_file_the_tools_then_see(served: str) -> None:
    created = put(served, "up-1", "data/in.csv", b"a,b\n1,2\n")
    assert created.status_code == 201, created.text
    assert created.json() == {
        "session_id": "up-1",
        "path": "data/in.csv",
        "size_bytes": 8,
        "session_created": True,
    }
    big = put(served, "up-1", "big.bin", chunks(250_000))  # streamed, under the limit
    assert big.status_code == 200 and big.json()["size_bytes"] == 250_000
    async with Client(f"{served}/mcp", mode="legacy") as client:
        listed = await client.list_tools()
        upload = next(tool for tool in listed.tools if tool.name == "upload_file")
        assert f"HTTP PUT {served}/files/<session_id>/<path>" in (upload.description or "")
        code = (
            "import pandas as pd\n"
            "print(pd.read_csv('data/in.csv').b.sum(), len(open('big.bin', 'rb').read()))"
        )
        result = await client.call_tool("run_code", {"code": code, "session_id": "up-1"})
        assert result.structured_content and result.structured_content["stdout"] == "2 250000\n"
    exists = put(served, "up-1", "data/in.csv", b"x")
    assert exists.status_code == 409 and exists.json()["error"] == "file_exists"
    replaced = put(served, "up-1", "data/in.csv", b"x", overwrite="true")
    assert replaced.status_code == 200 and replaced.json()["size_bytes"] == 1


async def test_put_refuses_what_does_not_fit_and_leaves_nothing(served: str) -> None:
    assert put(served, "up-2", "seed.txt", b"seed").status_code == 201
    cases = {
        "declared too large": (put(served, "up-2", "a.bin", b"u" * 300_001), "upload_too_large"),
        "streamed too large": (put(served, "up-2", "b.bin", chunks(400_000)), "upload_too_large"),
        "traversal": (put(served, "up-2", "..%2F..%2Fescape.txt", b"x"), "invalid_filename"),
        "bad session": (put(served, "bad%20id", "c.txt", b"x"), "invalid_session_id"),
    }
    for what, (response, code) in cases.items():
        assert response.headers["content-type"] == "application/json", (what, response.text)
        assert response.json().get("error") == code, (what, response.text)
        assert response.status_code in (400, 413), what
    # Two uploads under the limit that together pass the 500 kB quota: the second is refused.
    assert put(served, "up-2", "one.bin", chunks(290_000)).status_code == 200
    over = put(served, "up-2", "two.bin", chunks(290_000))
    assert over.status_code == 413 and over.json()["error"] == "quota_exceeded"
    async with Client(f"{served}/mcp", mode="legacy") as client:
        listed = await client.call_tool("list_files", {"session_id": "up-2"})
        assert listed.structured_content is not None
        names = sorted(e["path"] for e in listed.structured_content["entries"])
    assert names == ["one.bin", "seed.txt"]  # no partial files, no temporary names


async def test_files_over_http_belong_to_the_token_owner(
    make_settings: Callable[..., Settings],
) -> None:
    from .test_auth import ALICE, BOB, TOKENS, client_as, structured

    with http_server(make_settings(), SANDBOX_API_TOKENS=TOKENS, SANDBOX_URL_SECRET=SECRET) as base:
        url = f"{base}/files/shared/in.txt"
        for headers in ({}, {"Authorization": f"Bearer {ALICE}x"}, {"Authorization": ALICE}):
            refused = httpx.put(url, content=b"x", headers=headers)
            assert refused.status_code == 401, headers
            assert refused.headers["www-authenticate"] == "Bearer"
            assert refused.json()["error"] == "unauthorized"
        alice = httpx.put(url, content=b"alice's", headers={"Authorization": f"Bearer {ALICE}"})
        assert alice.status_code == 201, alice.text
        # Bob naming the same session gets a session of his own, not Alice's file.
        bob = httpx.put(url, content=b"bob's", headers={"Authorization": f"Bearer {BOB}"})
        assert bob.status_code == 201 and bob.json()["session_created"] is True
        async with client_as(base, ALICE) as client:
            read = structured(
                await client.call_tool("read_file", {"session_id": "shared", "path": "in.txt"})
            )
            link = read["download_url"]
        assert httpx.get(link).content == b"alice's"
        # A link signed for Bob opens Bob's file; one claiming Alice's session for Bob,
        # or hers with his name, cannot be made without the secret (tested above).
        bobs = signer(base).url("bob", "shared", "in.txt")
        assert httpx.get(bobs).content == b"bob's"
        # The legacy SSE transport is behind the same bearer check as /mcp.
        assert httpx.get(f"{base}/sse", timeout=10).status_code == 401


#: About a second idle before a pause (the reaper looks every 0.5 s then).
PAUSE_AFTER_M = "0.02"
#: Generous: 2 cores, gVisor's checkpoint; never a speed claim.
PAUSE_WAIT_S = 120.0


async def _paused(client: Client, session_id: str) -> None:
    deadline = time.monotonic() + PAUSE_WAIT_S
    while True:
        listed = await client.call_tool("list_sessions", {})
        states = {s["session_id"]: s["state"] for s in listed.structured_content["sessions"]}
        if states.get(session_id) == "paused":
            return
        assert time.monotonic() < deadline, states
        await asyncio.sleep(0.2)


@each_runtime
async def test_no_upload_goes_into_a_paused_sessions_saved_state(
    make_settings: Callable[..., Settings],
) -> None:
    """``.session/`` is where a pause keeps a session's variables (bwrap, runc) or nothing
    (a gVisor checkpoint): an upload there is refused alike on every backend, by PUT or
    ``upload_file``, new file or not, and the session resumes as it was."""
    with http_server(make_settings(), SANDBOX_PAUSE_AFTER_M=PAUSE_AFTER_M) as base:
        async with Client(f"{base}/mcp", mode="legacy") as client:
            made = await client.call_tool("run_code", {"code": "x = 41", "session_id": "st"})
            assert not made.is_error, made.content
            await _paused(client, "st")
            for path in (".session/manifest.json", ".session/planted.pkl", ".session"):
                for overwrite in ("false", "true"):
                    refused = put(base, "st", path, b"planted", overwrite=overwrite)
                    answer = (refused.status_code, refused.json().get("error"))
                    assert answer == (400, "invalid_path"), (path, overwrite, refused.text)
                    assert ".session" in refused.json()["message"]
            tool = await client.call_tool(
                "upload_file",
                {
                    "session_id": "st",
                    "filename": ".session/x",
                    "content_text": "x",
                    "overwrite": True,
                },
            )
            assert tool.is_error and (tool.meta or {}).get("error_code") == "invalid_path"
            back = await client.call_tool("run_code", {"code": "print(x + 1)", "session_id": "st"})
            assert back.structured_content and back.structured_content["stdout"] == "42\n", back
