"""The tools through the SDK's in-memory MCP client, against ``build_server`` on the
fake backend: what a client sees (structured results, content blocks, error codes)."""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from mcp import Client
from mcp_types import (
    BlobResourceContents,
    CallToolResult,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
)

from mcp_code_sandbox.errors import SandboxFailed
from mcp_code_sandbox.run.languages import RUNTIMES
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.server.app import build_server
from mcp_code_sandbox.service import SandboxService
from tests.conftest import valued
from tests.e2e.test_tools import TOOLS
from tests.fakes import FakeBackend, fake_service


@contextlib.asynccontextmanager
async def connected(
    state_dir: Path, **settings: Any
) -> AsyncIterator[tuple[Client, SandboxService]]:
    """A client connected in memory to the real tool layer of a fake-backed service."""
    async with (
        fake_service(state_dir, **settings) as svc,
        Client(build_server(svc), mode="legacy") as client,
    ):
        yield client, svc


def data(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, result.content
    assert isinstance(result.structured_content, dict)
    # The same JSON as text, with only the fields that have a value (DESIGN §6).
    first = result.content[0]
    assert isinstance(first, TextContent)
    assert json.loads(first.text) == valued(result.structured_content)
    return result.structured_content


def error_code(result: CallToolResult) -> str:
    assert result.is_error
    code = str((result.meta or {}).get("error_code"))
    first = result.content[0]
    assert isinstance(first, TextContent) and first.text.startswith(f"{code}: ")
    return code


async def test_the_six_tools_are_listed_with_schemas(state_dir: Path) -> None:
    async with connected(state_dir) as (client, _):
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert set(tools) == TOOLS
        for tool in tools.values():
            assert tool.output_schema and tool.output_schema["type"] == "object"
        run = tools["run_code"]
        assert run.input_schema["properties"]["language"]["enum"] == list(RUNTIMES)
        assert run.input_schema["required"] == ["code"]
        assert tools["close_session"].annotations.destructive_hint is True  # type: ignore[union-attr]
        assert tools["read_file"].annotations.read_only_hint is True  # type: ignore[union-attr]


async def test_a_workflow_upload_run_list_read_close(state_dir: Path) -> None:
    async with connected(state_dir) as (client, svc):
        up = data(
            await client.call_tool(
                "upload_file", {"filename": "in/data.csv", "content_text": "a,b\n1,2\n"}
            )
        )
        sid = up["session_id"]
        assert (up["path"], up["size_bytes"], up["session_created"]) == ("in/data.csv", 8, True)
        code = (
            "rows = open('in/data.csv').read().splitlines()\n"
            "open('out.txt', 'w').write(str(len(rows)))\n"
            "print('rows:', len(rows))\n"
            "rows[-1]"
        )
        result = await client.call_tool("run_code", {"session_id": sid, "code": code})
        run = data(result)
        assert (run["status"], run["stdout"], run["result"], run["session_created"]) == (
            "ok",
            "rows: 2\n",
            "'1,2'",
            False,
        )
        assert [(f["path"], f["change"]) for f in run["files"]] == [("out.txt", "created")]
        links = [str(b.uri) for b in result.content if isinstance(b, ResourceLink)]
        assert links == [f"sandbox://{sid}/out.txt"]
        listing = data(await client.call_tool("list_files", {"session_id": sid}))
        assert sorted(e["path"] for e in listing["entries"] if e["type"] == "file") == [
            "in/data.csv",
            "out.txt",
        ]
        read = await client.call_tool("read_file", {"session_id": sid, "path": "out.txt"})
        meta = data(read)
        assert (meta["encoding"], meta["size_bytes"], meta["eof"]) == ("text", 1, True)
        page = read.content[1]
        assert isinstance(page, TextContent) and page.text == "2"
        closed = data(await client.call_tool("close_session", {"session_id": sid}))
        assert closed == {"session_id": sid, "status": "closed"}
        assert svc.backend.running() == []  # type: ignore[attr-defined]
        gone = await client.call_tool("list_files", {"session_id": sid})
        assert error_code(gone) == "session_not_found"


async def test_a_run_as_text_says_only_what_has_a_value(state_dir: Path) -> None:
    async with connected(state_dir) as (client, _):
        result = await client.call_tool("run_code", {"code": "6*7"})
        run = data(result)
        first = result.content[0]
        assert isinstance(first, TextContent)
        text = json.loads(first.text)
        assert text == {
            "session_id": run["session_id"],
            "session_created": True,
            "language": "python",
            "status": "ok",
            "exit_code": 0,
            "result": "42",
            "execution_count": 1,
            "duration_ms": run["duration_ms"],
        }
        # The structured result stays complete: every field of the output schema.
        assert run["stdout"] == "" and run["state_lost"] is False and run["error"] is None
        assert len(run) >= 24


LOUD = "import sys\nprint('o' * 90_000)\nprint('e' * 90_000, file=sys.stderr)\n'r' * 50_000"


async def test_a_results_text_stays_under_what_a_client_reads(state_dir: Path) -> None:
    # Claude Code cuts a tool result at 25,000 tokens; by default ours stays under
    # 20,000 even at three bytes a token (code and numbers; English prose is four).
    async with connected(state_dir) as (client, _):
        result = await client.call_tool("run_code", {"code": LOUD})
        run = data(result)
        text = sum(len(b.text.encode()) for b in result.content if isinstance(b, TextContent))
        assert text <= 20_000 * 3
        # Head and tail kept, the rest saved and pointed to; what else was cut is said.
        assert run["stdout_truncated"] and run["full_output_path"]
        assert run["stdout"].startswith("o" * 1000) and run["stdout"].endswith("o" * 1000 + "\n")
        assert run["result_truncated"] and "SANDBOX_MAX_RESULT_TOKENS" in run["notice"]
    # The operator can raise it.
    async with connected(state_dir, max_result_tokens=100_000) as (client, _):
        run = data(await client.call_tool("run_code", {"code": LOUD}))
        assert not run["result_truncated"] and len(run["result"]) == 50_002


async def test_a_text_page_stays_under_what_a_client_reads(state_dir: Path) -> None:
    async with connected(state_dir) as (client, _):
        lines = "".join(f"{i},{i * 3.5}\n" for i in range(30_000))  # ~330 KB of CSV
        args = {"filename": "big.csv", "content_text": lines, "session_id": "pages"}
        data(await client.call_tool("upload_file", args))
        got, offset, pages = "", 0, 0
        while True:
            page = {"session_id": "pages", "path": "big.csv", "offset": offset}
            result = await client.call_tool("read_file", page)
            meta = data(result)
            text = sum(len(b.text.encode()) for b in result.content if isinstance(b, TextContent))
            assert text <= 20_000 * 3  # Claude Code's 25,000 tokens, at 3 bytes a token
            got += result.content[1].text  # type: ignore[union-attr]
            pages += 1
            if meta["next_offset"] is None:
                break
            offset = meta["next_offset"]
        assert got == lines and pages >= 6


async def test_binary_upload_and_a_paged_read(state_dir: Path) -> None:
    async with connected(state_dir, max_read_bytes=64 * 1024) as (client, _):
        blob = bytes(range(256)) * 4
        up = data(
            await client.call_tool(
                "upload_file",
                {"filename": "b.bin", "content_base64": base64.b64encode(blob).decode()},
            )
        )
        sid = up["session_id"]
        text = "x" * 40_000 + "y" * 40_000
        await client.call_tool(
            "upload_file", {"session_id": sid, "filename": "t.txt", "content_text": text}
        )
        pages: list[str] = []
        offset: int | None = 0
        while offset is not None and len(pages) < 10:
            args = {"session_id": sid, "path": "t.txt", "offset": offset}
            read = await client.call_tool("read_file", args)
            meta = data(read)
            assert meta["offset"] == offset and meta["next_offset"] == (
                None if meta["eof"] else offset + meta["returned_bytes"]
            )
            pages.append(read.content[1].text)  # type: ignore[union-attr]
            offset = meta["next_offset"]
        assert len(pages) >= 2 and "".join(pages) == text
        binary = await client.call_tool("read_file", {"session_id": sid, "path": "b.bin"})
        assert data(binary)["encoding"] == "resource"
        block = binary.content[1]
        assert isinstance(block, EmbeddedResource)
        assert isinstance(block.resource, BlobResourceContents)
        assert base64.b64decode(block.resource.blob) == blob


async def test_images_a_run_writes_come_back_as_image_blocks(state_dir: Path) -> None:
    # A 1x1 PNG.
    png = (
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJ"
        "RU5ErkJggg=="
    )
    async with connected(state_dir) as (client, _):
        code = f"import base64\nopen('dot.png', 'wb').write(base64.b64decode('{png}'))"
        result = await client.call_tool("run_code", {"code": code})
        assert [f["mime_type"] for f in data(result)["files"]] == ["image/png"]
        images = [b for b in result.content if isinstance(b, ImageContent)]
        assert len(images) == 1 and images[0].mime_type == "image/png"


async def test_list_runtimes(state_dir: Path) -> None:
    async with connected(state_dir, memory_limit="256m") as (client, _):
        runtimes = data(await client.call_tool("list_runtimes", {}))["runtimes"]
        by_name = {r["language"]: r for r in runtimes}
        assert "python" in by_name and set(by_name) <= set(RUNTIMES)
        python = by_name["python"]
        assert (python["backend"], python["stateful"]) == ("fake", True)
        assert python["version"].count(".") == 2  # the agent's own, from its ready
        assert python["limits"]["memory_bytes"] == 256 * 1024**2
        assert python["limits"]["enforcement"]["workspace"] == "checked"


async def test_failures_are_error_results_with_their_code(state_dir: Path) -> None:
    # Pausing off: past max_sessions a new session is refused, not made room for.
    async with connected(state_dir, max_sessions=1, pause_after_m=0) as (client, svc):
        sid = data(await client.call_tool("run_code", {"code": "1"}))["session_id"]
        calls: list[tuple[str, dict[str, Any], str]] = [
            ("read_file", {"session_id": sid, "path": "../etc/passwd"}, "invalid_path"),
            ("read_file", {"session_id": sid, "path": "missing.txt"}, "not_found"),
            ("read_file", {"session_id": "nobody", "path": "x"}, "session_not_found"),
            ("close_session", {"session_id": "bad id!"}, "invalid_session_id"),
            ("upload_file", {"session_id": sid, "filename": "x", "content_base64": "@@"},
             "invalid_content"),
            ("upload_file", {"session_id": sid, "filename": "x"}, "invalid_argument"),
            ("run_code", {"session_id": sid, "code": "1", "language": "cobol"},
             "unsupported_language"),
            ("run_code", {"code": "1"}, "max_sessions"),
            ("run_code", {"session_id": sid, "code": 1}, "invalid_argument"),
        ]  # fmt: skip
        for tool, arguments, code in calls:
            assert error_code(await client.call_tool(tool, arguments)) == code, (tool, arguments)
        # A sandbox that cannot start: the call fails, the session and server go on.
        await client.call_tool("close_session", {"session_id": sid})
        backend = svc.backend
        assert isinstance(backend, FakeBackend)
        backend.fail_creates = 1
        failed = await client.call_tool("run_code", {"code": "1", "session_id": "s"})
        assert error_code(failed) == "sandbox_failed"
        assert (
            data(await client.call_tool("run_code", {"code": "1", "session_id": "s"}))["result"]
            == "1"
        )
        # User code failing is a result, not a tool error.
        user = data(await client.call_tool("run_code", {"code": "1/0", "session_id": "s"}))
        assert user["status"] == "error" and user["error"]["name"] == "ZeroDivisionError"


async def test_restart_interpreter_reports_a_restart_not_an_error(state_dir: Path) -> None:
    async with connected(state_dir) as (client, _):
        made = data(await client.call_tool("run_code", {"code": "x = 1"}))
        sid = made["session_id"]
        done = data(await client.call_tool("restart_interpreter", {"session_id": sid}))
        assert (done["session_id"], done["restarted"], done["state"]) == (sid, True, "running")
        assert "variables" in done["message"] and "kept" in done["message"]
        after = data(await client.call_tool("run_code", {"code": "x", "session_id": sid}))
        assert after["status"] == "error" and after["error"]["name"] == "NameError"
        assert after["state_lost"] is False and after.get("notice") is None
        gone = await client.call_tool("restart_interpreter", {"session_id": "nope"})
        assert error_code(gone) == "session_not_found"


async def test_list_sessions_names_a_bounded_number_of_saved_variables(state_dir: Path) -> None:
    async with connected(state_dir) as (client, svc):
        await svc.run_code("local", RunRequest("\n".join(f"v{i} = {i}" for i in range(150))), "s")
        await svc.sessions.pause("local", "s")
        [listed] = data(await client.call_tool("list_sessions", {}))["sessions"]
        assert (listed["session_id"], listed["state"]) == ("s", "paused")
        assert len(listed["saved_variables"]) == 100
        assert listed["saved_variables_more"] == 50
        assert {"name": "v0", "type": "int"} in listed["saved_variables"]


async def test_an_error_quoting_a_host_path_reaches_the_client_without_it(
    state_dir: Path,
) -> None:
    """A backend's error may quote a tool's text (the Docker engine names a bind mount's
    source): the client reads the setting in its place, never the server's directory."""
    async with connected(state_dir) as (client, svc):
        backend = svc.backend
        assert isinstance(backend, FakeBackend)

        async def refused(spec: Any, *, mounted: Any = None) -> Any:
            raise SandboxFailed(
                f"the Docker engine refused (HTTP 400): invalid mount config for type "
                f'"bind": bind source path does not exist: {spec.workspace}'
            )

        backend.create = refused  # type: ignore[method-assign]
        failed = await client.call_tool("run_code", {"code": "1", "session_id": "s"})
        assert error_code(failed) == "sandbox_failed"
        text = failed.content[0].text  # type: ignore[union-attr]
        assert str(state_dir) not in text
        assert "bind source path does not exist: $SANDBOX_STATE_DIR/workspaces/" in text
        # A path the client gave is quoted as given: hiding it would say whose it is.
        own = await client.call_tool("read_file", {"session_id": "s", "path": str(state_dir)})
        assert error_code(own) == "invalid_path"
        assert f"'{state_dir}'" in own.content[0].text  # type: ignore[union-attr]
