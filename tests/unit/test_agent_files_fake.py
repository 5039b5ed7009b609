"""The tools on a backend that keeps workspaces in its sandboxes (``workspace_in_sandbox``,
as Kubernetes does): the fake backend's agent works in a directory of its own, so every
upload, read, listing, run's ``files[]``, download and notebook below went through the
agent's ``fs`` requests (``sessions.agent_files``), and the host's directory stays empty."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp_types import CallToolResult, ImageContent, ResourceLink, TextContent

from mcp_code_sandbox.errors import FileExists_, InvalidPath, QuotaExceeded
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.server.app import build_server
from mcp_code_sandbox.service import SandboxService
from tests.fakes import FakeBackend, fake_service

#: A 1x1 PNG.
PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJ"
    "RU5ErkJggg=="
)


@contextlib.asynccontextmanager
async def served(
    state_dir: Path, *, directory: bool = False, **settings: Any
) -> AsyncIterator[SandboxService]:
    """A service whose sandboxes keep their workspaces (``directory``: on the host, as
    bwrap and docker do: the same calls must give the same results)."""
    backend = FakeBackend(workspace_in_sandbox=not directory)
    try:
        async with fake_service(state_dir, backend, **settings) as svc:
            yield svc
    finally:
        await backend.end_all()


def data(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, result.content
    assert isinstance(result.structured_content, dict)
    return result.structured_content


def host_files(svc: SandboxService) -> list[str]:
    """What the host's workspace directories hold: nothing, the files are the sandbox's."""
    if not svc.backend.workspace_in_sandbox:
        return []
    root = svc.settings.workspaces_dir
    return [str(Path(d, f)) for d, _, names in os.walk(root) for f in names]


@pytest.mark.parametrize("directory", [False, True])
async def test_upload_run_list_read_through_the_agent(state_dir: Path, directory: bool) -> None:
    async with (
        served(state_dir, directory=directory) as svc,
        Client(build_server(svc), mode="legacy") as client,
    ):
        args = {"filename": "in/data.csv", "content_text": "a,b\n1,2\n"}
        up = data(await client.call_tool("upload_file", args))
        sid = up["session_id"]
        assert (up["path"], up["size_bytes"], up["session_created"]) == ("in/data.csv", 8, True)
        code = (
            "import base64\n"
            f"open('dot.png', 'wb').write(base64.b64decode('{PNG}'))\n"
            "rows = open('in/data.csv').read().splitlines()\n"
            "open('out.txt', 'w').write(str(len(rows)))\n"
            "len(rows)"
        )
        result = await client.call_tool("run_code", {"session_id": sid, "code": code})
        run = data(result)
        assert (run["status"], run["result"]) == ("ok", "2")
        assert [(f["path"], f["change"]) for f in run["files"]] == [
            ("dot.png", "created"),
            ("out.txt", "created"),
        ]
        assert len([b for b in result.content if isinstance(b, ImageContent)]) == 1
        links = [str(b.uri) for b in result.content if isinstance(b, ResourceLink)]
        assert f"sandbox://{sid}/out.txt" in links
        listing = data(await client.call_tool("list_files", {"session_id": sid}))
        assert sorted(e["path"] for e in listing["entries"] if e["type"] == "file") == [
            "dot.png",
            "in/data.csv",
            "out.txt",
        ]
        read = await client.call_tool("read_file", {"session_id": sid, "path": "out.txt"})
        assert data(read)["size_bytes"] == 1
        page = read.content[1]
        assert isinstance(page, TextContent) and page.text == "2"
        assert host_files(svc) == []


@pytest.mark.parametrize("directory", [False, True])
async def test_downloads_notebooks_and_saved_output_through_the_agent(
    state_dir: Path, directory: bool
) -> None:
    async with served(state_dir, directory=directory, max_output_bytes=1024) as svc:
        blob = bytes(range(256)) * 64
        up = await svc.upload_file("local", "b.bin", blob, session_id=None, overwrite=False)
        sid = up.session_id
        report = await svc.run_code("local", _request("print('x' * 5000)"), session_id=sid)
        assert report.full_output_path == ".outputs/run-1.txt"
        saved = await svc.read_file("local", sid, ".outputs/run-1.txt", offset=0, max_bytes=None)
        assert saved.data.count(b"x") == 5000
        download = await svc.open_download(sid, "b.bin", lambda owner: owner == "local")
        assert download is not None
        with download.source:
            assert download.source.read() == blob
        assert download.info.size_bytes == len(blob)
        code = f"import base64\nopen('dot.png', 'wb').write(base64.b64decode('{PNG}'))"
        assert (await svc.run_code("local", _request(code), session_id=sid)).status == "ok"
        exported = await svc.export_notebook("local", sid, "session.ipynb")
        notebook = await svc.read_file("local", sid, "session.ipynb", offset=0, max_bytes=None)
        cells = json.loads(notebook.data)["cells"]
        assert exported.runs == 2 and len(cells) == 2
        # The image the second run wrote, read from the sandbox while the notebook was built.
        assert any("image/png" in out.get("data", {}) for out in cells[1]["outputs"])
        assert host_files(svc) == []


@pytest.mark.parametrize("directory", [False, True])
async def test_the_rules_hold_through_the_agent(state_dir: Path, directory: bool) -> None:
    async with served(state_dir, directory=directory, workspace_quota_bytes=4096) as svc:
        up = await svc.upload_file("local", "a.txt", b"1", session_id=None, overwrite=False)
        sid = up.session_id
        code = (
            "import os\n"
            "os.symlink('/etc/passwd', 'pw')\n"
            "os.link('a.txt', 'hard')\n"
            "os.mkfifo('fifo')"
        )
        assert (await svc.run_code("local", _request(code), session_id=sid)).status == "ok"
        for path in ("pw", "hard", "fifo", "pw/x"):
            with pytest.raises(InvalidPath):
                await svc.read_file("local", sid, path, offset=0, max_bytes=None)
        with pytest.raises(FileExists_):
            await svc.upload_file("local", "a.txt", b"2", session_id=sid, overwrite=False)
        with pytest.raises(InvalidPath):
            await svc.upload_file("local", "pw/x", b"2", session_id=sid, overwrite=True)
        with pytest.raises(QuotaExceeded):
            await svc.upload_file("local", "big", b"x" * 5000, session_id=sid, overwrite=False)
        listing = await svc.list_files("local", sid, ".", recursive=True)
        kinds = {e.path: e.type for e in listing.entries}
        assert kinds == {"a.txt": "file", "hard": "file", "pw": "symlink", "fifo": "other"}
        assert host_files(svc) == []


def _request(code: str) -> RunRequest:
    return RunRequest(code=code)
