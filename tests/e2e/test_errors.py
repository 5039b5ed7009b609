"""Every error code of DESIGN §7 that this server can produce, each provoked for real
through the MCP tool layer: ``isError``, text ``"<code>: <message>"``, ``_meta.error_code``.

``unauthorized`` is refused before any tool runs: an HTTP 401 with ``WWW-Authenticate:
Bearer`` (test_auth.py, test_oauth.py); ``internal_error`` is what an unexpected bug
becomes, and has no honest way to be provoked here.
"""

from __future__ import annotations

import asyncio
import base64
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, MCPError, StdioServerParameters

from mcp_code_sandbox.backends import create_backend
from mcp_code_sandbox.server.app import build_server
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.settings import Settings

from ..conftest import long_dir
from .conftest import server_env

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap]


def assert_error(result: Any, code: str) -> str:
    assert result.is_error, result.content
    text = result.content[0].text
    assert text.startswith(f"{code}: "), text
    assert (result.meta or {}).get("error_code") == code
    return str(text)


async def new_session(client: Client) -> str:
    up = await client.call_tool("upload_file", {"filename": "a.txt", "content_text": "a"})
    assert not up.is_error, up.content
    return str(up.structured_content["session_id"])


async def test_invalid_argument_from_schema_and_from_us(inproc: Client) -> None:
    missing = await inproc.call_tool("run_code", {})
    assert "code" in assert_error(missing, "invalid_argument")
    wrong_type = await inproc.call_tool("list_files", {"session_id": 5})
    assert_error(wrong_type, "invalid_argument")
    both = await inproc.call_tool(
        "upload_file", {"filename": "x", "content_text": "a", "content_base64": "YQ=="}
    )
    assert_error(both, "invalid_argument")
    too_long = await inproc.call_tool("run_code", {"code": "1", "timeout_s": 100000})
    assert_error(too_long, "invalid_argument")


async def test_invalid_session_id(inproc: Client) -> None:
    for bad in ("../etc", "a/b", "x" * 65, "bad id"):
        assert_error(
            await inproc.call_tool("run_code", {"code": "1", "session_id": bad}),
            "invalid_session_id",
        )


async def test_session_not_found(inproc: Client) -> None:
    for tool in ("read_file", "list_files", "close_session"):
        args = (
            {"session_id": "never-made", "path": "x"}
            if tool == "read_file"
            else {"session_id": "never-made"}
        )
        assert_error(await inproc.call_tool(tool, args), "session_not_found")


async def test_session_busy(inproc: Client) -> None:
    sid = await new_session(inproc)
    slow = asyncio.create_task(
        inproc.call_tool("run_code", {"session_id": sid, "code": "import time; time.sleep(4)"})
    )
    await asyncio.sleep(1.0)
    busy = await inproc.call_tool("run_code", {"session_id": sid, "code": "1", "timeout_s": 0.5})
    assert_error(busy, "session_busy")
    assert not (await slow).is_error


async def test_max_sessions(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings(max_sessions=1, pause_after_m=0)  # else the idlest would pause
    service = SandboxService(settings, create_backend(settings))
    await service.start()
    try:
        async with Client(build_server(service), mode="legacy") as client:
            await new_session(client)
            second = await client.call_tool(
                "upload_file", {"filename": "b.txt", "content_text": "b"}
            )
            assert_error(second, "max_sessions")
    finally:
        await service.aclose()


@pytest.mark.parametrize(
    "name", ["../escape.txt", "/etc/passwd", "a/../../x", "x\0y", "", "dir\\file", "a" * 300]
)
async def test_invalid_filename(inproc: Client, name: str) -> None:
    assert_error(
        await inproc.call_tool("upload_file", {"filename": name, "content_text": "x"}),
        "invalid_filename",
    )


async def test_invalid_path_and_not_found(inproc: Client) -> None:
    sid = await new_session(inproc)
    for bad in ("../../etc/passwd", "/etc/passwd", "x\0"):
        assert_error(
            await inproc.call_tool("read_file", {"session_id": sid, "path": bad}), "invalid_path"
        )
    assert_error(
        await inproc.call_tool("read_file", {"session_id": sid, "path": "nope.txt"}), "not_found"
    )


async def test_file_exists(inproc: Client) -> None:
    sid = await new_session(inproc)
    again = await inproc.call_tool(
        "upload_file", {"session_id": sid, "filename": "a.txt", "content_text": "b"}
    )
    assert_error(again, "file_exists")
    over = await inproc.call_tool(
        "upload_file",
        {"session_id": sid, "filename": "a.txt", "content_text": "b", "overwrite": True},
    )
    assert not over.is_error


@pytest.mark.parametrize("payload", ["not base64!!", "YWJ", "\u00e9\u00e9\u00e9\u00e9"])
async def test_invalid_content(inproc: Client, payload: str) -> None:
    result = await inproc.call_tool("upload_file", {"filename": "b.bin", "content_base64": payload})
    assert_error(result, "invalid_content")


async def test_code_too_large(inproc: Client) -> None:
    huge = "x = 1\n" * 20_000  # 120 KB > 100 KiB
    assert_error(await inproc.call_tool("run_code", {"code": huge}), "code_too_large")


async def test_upload_too_large(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings(max_upload_bytes=1000)
    service = SandboxService(settings, create_backend(settings))
    await service.start()
    try:
        async with Client(build_server(service), mode="legacy") as client:
            text = await client.call_tool(
                "upload_file", {"filename": "big.txt", "content_text": "x" * 1001}
            )
            assert_error(text, "upload_too_large")
            b64 = base64.b64encode(b"\0" * 5000).decode()
            blob = await client.call_tool(
                "upload_file", {"filename": "big.bin", "content_base64": b64}
            )
            assert_error(blob, "upload_too_large")
    finally:
        await service.aclose()


async def test_artifact_too_large(inproc: Client) -> None:
    sid = await new_session(inproc)
    made = await inproc.call_tool(
        "run_code",
        {
            "session_id": sid,
            "code": "import os\nopen('blob.bin','wb').write(os.urandom(2 * 1024 * 1024))",
        },
    )
    assert not made.is_error
    # read_file pages it (see test_hostile_loop); a resource read has no pages: refused.
    with pytest.raises(MCPError, match=r"^artifact_too_large: .*read_file") as refused:
        await inproc.read_resource(f"sandbox://{sid}/blob.bin")
    assert refused.value.data["error_code"] == "artifact_too_large"


async def test_quota_exceeded(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings(workspace_quota_bytes=10_000)
    service = SandboxService(settings, create_backend(settings))
    await service.start()
    try:
        async with Client(build_server(service), mode="legacy") as client:
            sid = await new_session(client)
            result = await client.call_tool(
                "upload_file",
                {"session_id": sid, "filename": "big.txt", "content_text": "x" * 20_000},
            )
            assert_error(result, "quota_exceeded")
    finally:
        await service.aclose()


async def test_unsupported_language(inproc: Client) -> None:
    assert_error(
        await inproc.call_tool("run_code", {"code": "1", "language": "cobol"}),
        "unsupported_language",
    )


async def test_network_not_allowed(inproc: Client) -> None:
    for network in (True, ["pypi", "api.example.com"]):  # a list of hosts is valid input
        assert_error(
            await inproc.call_tool("run_code", {"code": "1", "network": network}),
            "network_not_allowed",
        )


async def test_env_not_allowed(inproc: Client) -> None:
    assert_error(
        await inproc.call_tool("run_code", {"code": "1", "env": {"A": "b"}}), "env_not_allowed"
    )


async def test_backend_unavailable(make_settings: Callable[..., Settings]) -> None:
    """A server whose PATH has no bubblewrap answers with what to install."""
    settings = make_settings()
    env = server_env(settings.state_dir, settings.runtime_dir)
    env["PATH"] = "/nonexistent"
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "mcp_code_sandbox", "serve"], env=env
    )
    async with Client(params, mode="legacy") as client:
        text = assert_error(
            await client.call_tool("run_code", {"code": "1"}), "backend_unavailable"
        )
        assert "bubblewrap" in text


async def test_sandbox_failed(make_settings: Callable[..., Settings]) -> None:
    """A memory limit too small for the interpreter to start: the sandbox fails to come up,
    the server says so and stays up for the next call."""
    settings = make_settings(memory_limit="6m")
    service = SandboxService(settings, create_backend(settings))
    await service.start()
    try:
        async with Client(build_server(service), mode="legacy") as client:
            assert_error(await client.call_tool("run_code", {"code": "1"}), "sandbox_failed")
            assert not (await client.call_tool("list_runtimes", {})).is_error
    finally:
        await service.aclose()


#: A call the leak test makes: tool, arguments, and the error code it must get (``None``:
#: it must succeed). The tool ``block`` puts a file where the server makes a directory.
Call = tuple[str, dict[str, Any], str | None]


async def _error_texts(settings: Settings, calls: list[Call]) -> list[str]:
    """The error texts of ``calls``, made in order to a server of ``settings``."""
    service = SandboxService(settings, create_backend(settings))
    await service.start()
    texts = []
    try:
        async with Client(build_server(service), mode="legacy") as client:
            for tool, args, code in calls:
                if tool == "block":
                    path = settings.state_dir / args["dir"]
                    shutil.rmtree(path, ignore_errors=True)
                    path.write_text("in the way")
                    continue
                result = await client.call_tool(tool, args)
                if code is None:
                    assert not result.is_error, (tool, result.content)
                else:
                    texts.append(assert_error(result, code))
    finally:
        await service.aclose()
    return texts


async def test_no_error_names_where_the_server_keeps_its_files(
    make_settings: Callable[..., Settings], state_dir: Path
) -> None:
    """Errors with a deep state dir (issue 30), several about the server's own files:
    each says what failed and what to do, and none names a directory of the server's."""
    deep = long_dir(state_dir, 150)
    unbuilt = make_settings(state_dir=str(deep), runtime_dir=str(deep / "runtime"))
    texts = await _error_texts(unbuilt, [("run_code", {"code": "1"}, "backend_unavailable")])
    assert "mcp-code-sandbox setup" in texts[0]
    settings = make_settings(
        state_dir=str(deep), allow_network=True, network_allow="example.com",
        workspace_quota_bytes=100_000,
    )  # fmt: skip
    sid, big = {"session_id": "leaks"}, "x" * 200_000
    texts += await _error_texts(
        settings,
        [
            ("upload_file", {**sid, "filename": "a.txt", "content_text": "a"}, None),
            ("upload_file", {**sid, "filename": "a.txt", "content_text": "b"}, "file_exists"),
            ("upload_file", {**sid, "filename": "b", "content_text": big}, "quota_exceeded"),
            ("upload_file", {**sid, "filename": "../a", "content_text": "a"}, "invalid_filename"),
            ("read_file", {**sid, "path": "missing.txt"}, "not_found"),
            ("list_files", {"session_id": "never-made"}, "session_not_found"),
            ("run_code", {**sid, "code": "1", "language": "cobol"}, "unsupported_language"),
            ("block", {"dir": "egress"}, None),
            ("run_code", {**sid, "code": "1", "network": True}, "sandbox_failed"),
        ],
    )  # fmt: skip
    assert "egress proxy" in texts[-1] and "without network" in texts[-1]
    for text in texts:
        assert str(deep) not in text and str(state_dir) not in text, text
