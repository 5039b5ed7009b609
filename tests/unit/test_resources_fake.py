"""The workspace as MCP resources (``server/resources.py``), through the SDK's in-memory
client against ``build_server`` on the fake backend: types, listing, paging, links."""

from __future__ import annotations

import base64
import io
import zipfile
from pathlib import Path

import anyio
import pytest
from mcp import MCPError
from mcp_types import BlobResourceContents, ResourceLink, TextResourceContents
from PIL import Image

from mcp_code_sandbox.server import resources
from tests.unit.test_tools_fake import connected, data

XLSX = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"


def png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 4), "red").save(out, format="PNG")
    return out.getvalue()


def xlsx() -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("[Content_Types].xml", "<Types/>")
    return out.getvalue()


async def test_every_read_says_the_files_type(state_dir: Path) -> None:
    async with connected(state_dir) as (client, _):
        files = {"chart.png": png(), "sales.csv": b"a,b\n1,2\n", "book.xlsx": xlsx()}
        sid = "typed"
        for name, content in files.items():
            b64 = base64.b64encode(content).decode()
            args = {"filename": name, "content_base64": b64, "session_id": sid}
            data(await client.call_tool("upload_file", args))
        read = {n: (await client.read_resource(f"sandbox://{sid}/{n}")).contents[0] for n in files}
        assert isinstance(read["sales.csv"], TextResourceContents)
        assert (read["sales.csv"].mime_type, read["sales.csv"].text) == ("text/csv", "a,b\n1,2\n")
        assert isinstance(read["chart.png"], BlobResourceContents)
        assert read["chart.png"].mime_type == "image/png"
        assert base64.b64decode(read["chart.png"].blob) == files["chart.png"]
        assert isinstance(read["book.xlsx"], BlobResourceContents)
        assert read["book.xlsx"].mime_type == XLSX
        templates = (await client.list_resource_templates()).resource_templates
        assert [t.uri_template for t in templates] == ["sandbox://{session_id}/{+path}"]


async def test_unknown_and_hostile_uris_are_refused(state_dir: Path) -> None:
    async with connected(state_dir) as (client, _):
        up = data(await client.call_tool("upload_file", {"filename": "a.txt", "content_text": "a"}))
        sid = up["session_id"]
        with pytest.raises(MCPError, match="session_not_found"):
            await client.read_resource("sandbox://nobody/a.txt")
        with pytest.raises(MCPError, match="not_found"):
            await client.read_resource(f"sandbox://{sid}/b.txt")
        for uri in (f"sandbox://{sid}/../x", f"sandbox://{sid}//etc/passwd", "file:///etc/passwd"):
            with pytest.raises(MCPError, match="Unknown resource"):
                await client.read_resource(uri)


async def test_resources_list_the_callers_files_page_by_page(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resources, "PAGE", 3)
    async with connected(state_dir) as (client, _):
        assert (await client.list_resources()).resources == []
        made = {("one", "a.txt"), ("one", "d/b.csv"), ("two", "c.txt"), ("two", "e.txt")}
        for sid, name in made:
            args = {"filename": name, "content_text": "x,y", "session_id": sid}
            data(await client.call_tool("upload_file", args))
        # Saved outputs and the like are not the user's files: left out, as list_files does.
        data(await client.call_tool("run_code", {"code": "print('x' * 10)", "session_id": "two"}))
        seen, cursor, pages = [], None, 0
        while True:
            page = await client.list_resources(cursor=cursor)
            pages += 1
            assert len(page.resources) <= 3
            seen += page.resources
            cursor = page.next_cursor
            if cursor is None:
                break
        assert pages == 2
        assert [str(r.uri) for r in seen] == [
            "sandbox://one/a.txt",
            "sandbox://one/d/b.csv",
            "sandbox://two/c.txt",
            "sandbox://two/e.txt",
        ]
        assert {r.mime_type for r in seen} == {"text/plain", "text/csv"}
        assert all(r.size == 3 for r in seen)
        with pytest.raises(MCPError, match="invalid cursor"):
            await client.list_resources(cursor="not a cursor")


async def test_an_upload_links_to_what_it_wrote(state_dir: Path) -> None:
    async with connected(state_dir) as (client, _):
        args = {"filename": "in/data.csv", "content_text": "a,b\n1,2\n", "session_id": "up"}
        result = await client.call_tool("upload_file", args)
        data(result)
        links = [b for b in result.content if isinstance(b, ResourceLink)]
        assert [(str(b.uri), b.mime_type, b.size) for b in links] == [
            ("sandbox://up/in/data.csv", "text/csv", 8)
        ]
        read = await client.read_resource(str(links[0].uri))
        assert read.contents[0].text == "a,b\n1,2\n"  # type: ignore[union-attr]


async def test_a_session_busy_with_a_long_run_does_not_stall_the_listing(
    state_dir: Path,
) -> None:
    async with connected(state_dir, exec_timeout_s=120) as (client, svc):
        for sid in ("busy", "idle"):
            args = {"filename": "f.txt", "content_text": "x", "session_id": sid}
            data(await client.call_tool("upload_file", args))
        busy = next(s for s in svc.sessions.listed("local") if s.id == "busy")
        async with anyio.create_task_group() as tasks:
            slow = {"code": "import time\ntime.sleep(60)", "session_id": "busy"}
            tasks.start_soon(client.call_tool, "run_code", slow)
            with anyio.fail_after(30):
                while not busy.lock.locked():
                    await anyio.sleep(0.05)
            # Well under the two minutes a call would wait for it (exec_timeout_s).
            with anyio.fail_after(30):
                listed = (await client.list_resources()).resources
            assert [str(r.uri) for r in listed] == ["sandbox://idle/f.txt"]
            tasks.cancel_scope.cancel()
