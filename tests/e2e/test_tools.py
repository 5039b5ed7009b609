"""The MCP surface beyond the workflow: schemas and annotations, progress, cancellation,
the file resource, image budgets, rich displays, and state across calls."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from mcp import Client, MCPError
from mcp_types import ImageContent

from mcp_code_sandbox.backends import create_backend
from mcp_code_sandbox.run.languages import RUNTIMES
from mcp_code_sandbox.server.app import build_server
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.settings import Settings

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap]

#: The contract's tools (DESIGN.md), for this test and the fast one on the fake backend.
TOOLS = {
    "run_code",
    "upload_file",
    "read_file",
    "list_files",
    "close_session",
    "list_sessions",
    "restart_interpreter",
    "list_runtimes",
    "export_notebook",
    "fork_session",
}


async def test_tools_schemas_and_annotations(inproc: Client) -> None:
    tools = {t.name: t for t in (await inproc.list_tools()).tools}
    assert set(tools) == TOOLS
    for tool in tools.values():
        assert tool.output_schema and tool.output_schema["type"] == "object"
        assert tool.description
    run = tools["run_code"]
    assert run.input_schema["properties"]["language"]["enum"] == list(RUNTIMES)
    assert run.input_schema["required"] == ["code"]
    assert run.annotations is not None and run.description is not None
    assert run.annotations.open_world_hint is False  # network not allowed on this server
    assert run.annotations.read_only_hint is False
    for name in ("read_file", "list_files", "list_sessions", "list_runtimes"):
        annotations = tools[name].annotations
        assert annotations is not None
        assert annotations.read_only_hint is True
        assert annotations.idempotent_hint is True
    close_annotations = tools["close_session"].annotations
    assert close_annotations is not None and close_annotations.destructive_hint is True
    assert "7 days without calls" in run.description and "no network" in run.description
    assert "idle for 10 min is paused" in run.description


async def test_progress_is_reported_during_a_run(inproc: Client) -> None:
    seen: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total, message))

    code = "import time\nfor i in range(6):\n    print('step', i, flush=True)\n    time.sleep(1)"
    arguments = {"code": code, "timeout_s": 120}
    result = await inproc.call_tool("run_code", arguments, progress_callback=on_progress)
    assert not result.is_error
    assert len(seen) >= 2
    progress = [p for p, _, _ in seen]
    assert progress == sorted(set(progress))  # strictly increasing, as MCP requires
    # Out of the most the call may take: its timeout, so a client can draw a bar.
    assert all(total is not None and p <= total for p, total, _ in seen)
    assert seen[0][1] == 120
    assert any(m and "step" in m for _, _, m in seen)


async def test_cancellation_interrupts_the_run(inproc: Client) -> None:
    up = await inproc.call_tool("run_code", {"code": "kept = 'yes'"})
    sid = up.structured_content["session_id"]
    with anyio.move_on_after(2):
        await inproc.call_tool(
            "run_code", {"session_id": sid, "code": "import time\ntime.sleep(120)\nkept = 'no'"}
        )
    # The run was interrupted, not left running: the next call is served at once, with the
    # interpreter's state intact (SIGINT, not a restart).
    with anyio.fail_after(20):
        after = await inproc.call_tool("run_code", {"session_id": sid, "code": "kept"})
    assert after.structured_content["result"] == "'yes'"
    assert after.structured_content["state_lost"] is False


async def test_workspace_files_are_resources(inproc: Client) -> None:
    up = await inproc.call_tool("upload_file", {"filename": "d/notes.txt", "content_text": "hi"})
    sid = up.structured_content["session_id"]
    templates = (await inproc.list_resource_templates()).resource_templates
    assert any(t.uri_template == "sandbox://{session_id}/{+path}" for t in templates)
    read = await inproc.read_resource(f"sandbox://{sid}/d/notes.txt")
    assert read.contents[0].text == "hi"  # type: ignore[union-attr]
    with pytest.raises(MCPError, match="not_found"):
        await inproc.read_resource(f"sandbox://{sid}/d/missing.txt")
    with pytest.raises(MCPError, match="session_not_found"):
        await inproc.read_resource("sandbox://nobody/d/notes.txt")


async def test_images_are_capped_and_downscaled(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings(max_images=4, max_image_bytes=60_000)
    service = SandboxService(settings, create_backend(settings))
    await service.start()
    code = """
import numpy as np, matplotlib.pyplot as plt
for i in range(6):
    plt.figure(figsize=(8, 8), dpi=150)
    plt.imshow(np.random.rand(300, 300))
"""
    try:
        async with Client(build_server(service), mode="legacy") as client:
            result = await client.call_tool("run_code", {"code": code})
    finally:
        await service.aclose()
    images = [b for b in result.content if isinstance(b, ImageContent)]
    assert len(images) == 4
    for image in images:
        assert len(base64.b64decode(image.data)) <= 60_000
    assert "2 more image(s) not shown" in result.structured_content["notice"]


async def test_rich_displays(inproc: Client) -> None:
    code = (
        "from IPython.display import display, Markdown\n"
        "display(Markdown('# Title'))\n"
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3]); plt.show()\n"
        "print('after show')"
    )
    result = await inproc.call_tool("run_code", {"code": code})
    data: dict[str, Any] = result.structured_content
    assert {"mime_type": "text/markdown", "text": "# Title"} in data["displays"]
    assert len([b for b in result.content if isinstance(b, ImageContent)]) == 1
    assert data["stdout"] == "after show\n"


async def test_errors_are_results_with_trimmed_tracebacks(inproc: Client) -> None:
    code = "open('partial.csv', 'w').write('a,b')\ndef f():\n    1/0\nf()"
    result = await inproc.call_tool("run_code", {"code": code})
    assert not result.is_error
    data: dict[str, Any] = result.structured_content
    assert data["status"] == "error"
    assert [f["path"] for f in data["files"]] == ["partial.csv"]  # failed runs diff too
    assert data["error"]["name"] == "ZeroDivisionError"
    assert "1/0" in data["error"]["traceback"]
    assert "mcs_agent" not in data["error"]["traceback"]
    assert "site-packages" not in data["error"]["traceback"]


async def test_parallel_tool_calls_to_one_session_queue(inproc: Client) -> None:
    up = await inproc.call_tool("run_code", {"code": "log = []"})
    sid = up.structured_content["session_id"]
    calls = [
        inproc.call_tool(
            "run_code",
            {"session_id": sid, "code": f"import time; time.sleep(0.2); log.append({i}); log"},
        )
        for i in range(3)
    ]
    results = await asyncio.gather(*calls)
    assert all(not r.is_error for r in results)
    final = await inproc.call_tool("run_code", {"session_id": sid, "code": "sorted(log) == log"})
    assert final.structured_content["result"] == "True"


async def test_list_runtimes(inproc: Client) -> None:
    result = await inproc.call_tool("list_runtimes", {})
    runtimes = {r["language"]: r for r in result.structured_content["runtimes"]}
    assert list(runtimes) == list(RUNTIMES)
    assert all(runtimes[lang]["stateful"] is False for lang in ("javascript", "typescript", "bash"))
    python = runtimes["python"]
    assert python["language"] == "python" and python["backend"] == "bwrap"
    assert python["version"].startswith("3.")
    assert {"pandas", "numpy", "matplotlib", "ipython"} <= set(python["packages"])
    assert python["limits"]["memory_bytes"] == 512 * 1024**2
