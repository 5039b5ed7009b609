"""Which run results the tool layer shapes on the event loop (``tool_results.light``):
no image to decode, little text, few files; everything else goes to a worker thread."""

from __future__ import annotations

from typing import Any

from mcp_code_sandbox.run.execute import ImageFile, RunReport
from mcp_code_sandbox.server.tool_results import LIGHT_FILES, LIGHT_TEXT_BYTES, light
from mcp_code_sandbox.sessions.executor import Display
from mcp_code_sandbox.workspace import Change


def report(**changes: Any) -> RunReport:
    values: dict[str, Any] = {
        "status": "ok",
        "exit_code": None,
        "result": "2",
        "error": None,
        "execution_count": 1,
        "state_lost": False,
        "session_id": "s",
        "session_created": False,
        "notice": None,
        "language": "python",
        "stdout": "",
        "stderr": "",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "full_output_path": None,
        "files": [],
        "duration_ms": 1,
    }
    values.update(changes)
    return RunReport(**values)


def test_a_plain_cell_is_light() -> None:
    assert light(report())
    assert light(report(stdout="x" * (LIGHT_TEXT_BYTES - 10)))
    files = [Change(f"f{i}.txt", 1, "text/plain", "created") for i in range(LIGHT_FILES)]
    assert light(report(files=files))
    assert light(report(displays=[Display("display", "text/markdown", b"# hi")]))


def test_images_much_text_or_many_files_are_not() -> None:
    png = b"\x89PNG\r\n\x1a\n" + bytes(10)
    assert not light(report(image_files=[ImageFile("a.png", "image/png", png)]))
    assert not light(report(displays=[Display("figure", "image/png", png)]))
    assert not light(report(stdout="x" * (LIGHT_TEXT_BYTES + 1)))
    assert not light(report(result="x" * LIGHT_TEXT_BYTES, stderr="y"))
    error = {"name": "E", "value": "v", "traceback": "t" * LIGHT_TEXT_BYTES}
    assert not light(report(error=error))
    files = [Change(f"f{i}.txt", 1, "text/plain", "created") for i in range(LIGHT_FILES + 1)]
    assert not light(report(files=files))
