"""``read_file`` pages and resource reads: every bound says what it cut and where the rest
is. Real files in a real workspace; the pages as the tool returns them."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest
from mcp_types import CallToolResult, EmbeddedResource, ImageContent, TextContent

from mcp_code_sandbox.errors import ArtifactTooLarge
from mcp_code_sandbox.server.reads import no_preview, page_result, read_result
from mcp_code_sandbox.settings import load_settings
from mcp_code_sandbox.workspace import ReadResult, Workspace
from mcp_code_sandbox.workspace.pages import blob_page_bytes, page_of, whole_file

PAGE = 65536  # max_read_bytes in these tests
BLOB = os.urandom(200_000)


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    workspace = Workspace(tmp_path / "ws", quota_bytes=10**8)
    workspace.create()
    workspace.write_file("blob.bin", BLOB, overwrite=False)
    workspace.write_file("notes.txt", ("é" * 50_000).encode(), overwrite=False)  # 100,000 bytes
    return workspace


def page(ws: Workspace, path: str, offset: int, max_bytes: int = PAGE) -> CallToolResult:
    read = ws.read_file(path, offset=offset, max_bytes=max_bytes)
    return page_result(page_of(read, PAGE), "s1")


def meta(result: CallToolResult) -> dict[str, Any]:
    assert isinstance(result.structured_content, dict)
    return result.structured_content


def blob(result: CallToolResult) -> bytes:
    block = result.content[1]
    assert isinstance(block, EmbeddedResource)
    return base64.b64decode(block.resource.blob)  # type: ignore[union-attr]


def wire_size(result: CallToolResult) -> int:
    return len(json.dumps(result.model_dump(mode="json", by_alias=True, exclude_none=True)))


def test_a_binary_file_comes_whole_page_by_page(ws: Workspace) -> None:
    got, offset, pages = b"", 0, 0
    while True:
        result = page(ws, "blob.bin", offset)
        data, info = blob(result), meta(result)
        assert info["encoding"] == "resource" and info["returned_bytes"] == len(data)
        assert info["offset"] == offset and info["size_bytes"] == len(BLOB)
        assert len(data) <= blob_page_bytes(PAGE)
        assert wire_size(result) <= PAGE  # base64, JSON and its text copy: one page's budget
        got += data
        pages += 1
        if info["eof"]:
            assert info["next_offset"] is None
            break
        assert info["next_offset"] == offset + len(data)
        offset = info["next_offset"]
    assert got == BLOB
    assert pages == -(-len(BLOB) // blob_page_bytes(PAGE))


@pytest.mark.parametrize("past", [0, 1, 10**9])
def test_offset_at_or_past_the_end_is_an_empty_last_page(ws: Workspace, past: int) -> None:
    for path, size in (("blob.bin", len(BLOB)), ("notes.txt", 100_000)):
        info = meta(page(ws, path, size + past))
        assert info["returned_bytes"] == 0 and info["eof"] is True, path
        assert info["next_offset"] is None and info["size_bytes"] == size


def test_the_last_page_is_exact(ws: Workspace) -> None:
    result = page(ws, "blob.bin", len(BLOB) - 10)
    assert blob(result) == BLOB[-10:]
    assert meta(result)["eof"] is True and meta(result)["next_offset"] is None
    # A page that ends exactly at the end of the file is the last one too.
    exact = page(ws, "blob.bin", len(BLOB) - 100, max_bytes=100)
    assert blob(exact) == BLOB[-100:] and meta(exact)["eof"] is True


def test_max_bytes_bounds_a_page(ws: Workspace) -> None:
    small = page(ws, "blob.bin", 5, max_bytes=7)
    assert blob(small) == BLOB[5:12] and meta(small)["next_offset"] == 12
    # Asking for a full read of binary gets a page whose base64 fits: fewer bytes, said so.
    full = page(ws, "blob.bin", 0, max_bytes=PAGE)
    assert meta(full)["returned_bytes"] == blob_page_bytes(PAGE) < PAGE
    assert meta(full)["next_offset"] == blob_page_bytes(PAGE)


def test_text_pages_never_split_a_character(ws: Workspace) -> None:
    text, offset = "", 0
    while True:
        result = page(ws, "notes.txt", offset, max_bytes=999)  # odd: 'é' is 2 bytes
        block = result.content[1]
        assert isinstance(block, TextContent)
        text += block.text
        info = meta(result)
        assert info["encoding"] == "text"
        if info["eof"]:
            break
        offset = info["next_offset"]
    assert text == "é" * 50_000


def test_a_page_too_small_for_a_character_still_moves_on(ws: Workspace) -> None:
    info = meta(page(ws, "notes.txt", 0, max_bytes=1))
    assert info["returned_bytes"] == 1 and info["next_offset"] == 1


def test_a_file_that_shrank_ends_the_paging() -> None:
    # Opened at 1,000 bytes, only 300 left when read: the short page is the last.
    read = ReadResult("a.bin", b"\1" * 300, 0, 300, 1000, True, "application/octet-stream",
                      False, "2026-01-01T00:00:00Z")  # fmt: skip
    info = meta(page_result(page_of(read, PAGE), "s1"))
    assert info["eof"] is True and info["next_offset"] is None


def test_image_without_preview_says_why(ws: Workspace) -> None:
    read = ws.read_file("blob.bin", offset=0, max_bytes=PAGE)
    assert "larger than one read" in no_preview(read, 1000)
    whole = ws.read_file("blob.bin", offset=0, max_bytes=10**6)
    assert "not decoded" in no_preview(whole, 1000)


def test_resources_are_whole_or_refused(ws: Workspace, tmp_path: Path) -> None:
    ws.write_file("small.txt", b"hello\n", overwrite=False)
    ws.write_file("small.bin", BLOB[:1000], overwrite=False)
    mixed = b"a,b\n" * 200 + b"\xff" * 10  # text by its first 512 bytes, not UTF-8 later
    ws.write_file("mixed.csv", mixed, overwrite=False)
    read = ws.read_file
    assert whole_file(read("small.txt", max_bytes=PAGE), PAGE, None) == "hello\n"
    assert whole_file(read("small.bin", max_bytes=PAGE), PAGE, None) == BLOB[:1000]
    assert read("mixed.csv", max_bytes=PAGE).is_text
    assert whole_file(read("mixed.csv", max_bytes=PAGE), PAGE, None) == mixed  # never U+FFFD
    for path in ("blob.bin", "notes.txt"):
        with pytest.raises(ArtifactTooLarge) as refused:
            whole_file(read(path, max_bytes=PAGE), PAGE, "https://x/files/s1/" + path)
        assert "read_file page by page" in refused.value.message
        assert refused.value.details["download_url"] == "https://x/files/s1/" + path
    with pytest.raises(ArtifactTooLarge) as no_link:
        whole_file(read("blob.bin", max_bytes=PAGE), PAGE, None)
    assert "download" not in no_link.value.message and no_link.value.details == {}


def png(side: int) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.frombytes("RGB", (side, side), os.urandom(side * side * 3)).save(out, format="PNG")
    return out.getvalue()


def test_an_image_read_whole_is_a_preview_within_the_one_image_budget(ws: Workspace) -> None:
    # The same shaper as run_code's images (tool_results.image_blocks) decides the size.
    ws.write_file("plot.png", png(100), overwrite=False)  # about 30 KB
    settings = load_settings({"max_image_bytes": 10_000}, environ={})
    page = page_of(ws.read_file("plot.png", max_bytes=PAGE), PAGE)
    assert page.wants_preview and page.image is not None
    result = read_result(page, "s1", settings, None)
    block = result.content[1]
    assert isinstance(block, ImageContent) and len(base64.b64decode(block.data)) <= 10_000
    assert meta(result)["encoding"] == "image" and meta(result)["eof"] is True
    # Too small a budget for any preview: the page goes as bytes, and says why.
    tiny = load_settings({"max_image_bytes": 10}, environ={})
    refused = read_result(page, "s1", tiny, lambda p: f"https://x/{p}")
    assert meta(refused)["encoding"] == "resource" and "at most 10 bytes" in meta(refused)["notice"]
    assert meta(refused)["download_url"] == "https://x/plot.png"
    # Not from its start: no preview is tried, and no notice either.
    later = read_result(page_of(ws.read_file("plot.png", offset=1, max_bytes=PAGE), PAGE),
                        "s1", settings, None)  # fmt: skip
    assert meta(later)["encoding"] == "resource" and meta(later)["notice"] is None
