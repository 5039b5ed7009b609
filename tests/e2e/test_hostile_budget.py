"""Issue 10, finding 6: one result budget, so every result reaches the official client.

Mallory's code makes results as large as it can: 200 large ``display()`` outputs, a
20 MB last expression, a 5 MB exception message with a deep traceback, 30,000 new files,
and a run longer than the SDK's streaming threshold (with a progress token, so the
response is an SSE stream, whose events the official client refuses over 1 MiB) that
ends with a big result. Every call must come back to the official client over HTTP,
within ``SANDBOX_MAX_RESULT_BYTES`` as serialized, saying what was cut; the victim keeps
working; and the server's memory does not grow with what was dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.server.fit import ENVELOPE_BYTES
from mcp_code_sandbox.settings import Settings

from ..conftest import each_runtime
from .tenants import Tenants, structured, two_tenants

# The agent is the same on every backend, but on Docker it is the copy baked into the
# image (SANDBOX_IMAGE), and its channel is a socket it connects to.
pytestmark = [pytest.mark.e2e, each_runtime]

BUDGET = 512 * 1024

FLOOD = """
import base64, io, os
from IPython.display import Image, Markdown, SVG, display
png = open('noise.png', 'rb').read()
svg = '<svg xmlns="http://www.w3.org/2000/svg">' + '<!--' + 's' * 200_000 + '-->' + '</svg>'
for i in range(200):
    kind = i % 4
    if kind == 0:
        display(Markdown('m' * 200_000))
    elif kind == 1:
        display('t' * 200_000)
    elif kind == 2:
        display(SVG(svg))
    else:
        display(Image(png))
print('flooded')
"""

NOISE = """
import numpy as np
from PIL import Image
Image.fromarray(np.random.default_rng(1).integers(0, 255, (700, 700, 3), dtype=np.uint8)).save(
    'noise.png')
"""

DEEP_ERROR = """
def dive(n):
    if n == 0:
        raise ValueError('e' * 5_000_000)
    return dive(n - 1)
dive(400)
"""

MANY_FILES = """
import os
os.makedirs('many', exist_ok=True)
for i in range(30_000):
    open(f'many/{i:05}.txt', 'w').close()
print('made')
"""

LONG_BIG = "import time\ntime.sleep(17)\n'x' * 20_000_000"


def wire_bytes(result: Any) -> int:
    """The result as the server serializes it (the SDK dumps by alias, without nulls)."""
    body = result.model_dump_json(by_alias=True, exclude_none=True)
    return len(body.encode("utf-8")) + ENVELOPE_BYTES


async def call(t: Tenants, code: str, **args: Any) -> tuple[dict[str, Any], int]:
    result = await t.mallory.call_tool("run_code", {"code": code, **args})
    return structured(result), wire_bytes(result)


async def list_all(t: Tenants, session_id: str, path: str) -> int:
    """Page through list_files (each page within the budget); the files seen."""
    seen: set[str] = set()
    offset: int | None = 0
    while offset is not None:
        args = {"session_id": session_id, "path": path, "offset": offset}
        listed = await t.mallory.call_tool("list_files", args)
        assert wire_bytes(listed) <= BUDGET
        page = structured(listed)
        seen.update(e["path"] for e in page["entries"] if e["type"] == "file")
        offset = page["next_offset"]
    return len(seen)


async def read_all(t: Tenants, session_id: str, path: str) -> int:
    """Page through read_file (each page within the budget); the bytes read."""
    total = 0
    offset: int | None = 0
    while offset is not None:
        args = {"session_id": session_id, "path": path, "offset": offset}
        read = await t.mallory.call_tool("read_file", args)
        assert wire_bytes(read) <= BUDGET
        page = structured(read)
        total += page["returned_bytes"]
        offset = page["next_offset"]
    return total


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


async def test_hostile_results_fit_the_budget(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings(exec_timeout_s=120.0)
    async with two_tenants(settings) as t:
        session = {"session_id": "mallory-big"}
        await t.run(t.mallory, NOISE, **session)
        await t.victim_is_fine()

        # 1. 200 large displays (~40 MB): the server's memory must not hold them.
        before = rss_bytes(t.proc.pid)
        flood, size = await call(t, FLOOD, **session)
        grown = rss_bytes(t.proc.pid, "VmHWM") - before
        assert flood["status"] == "ok" and flood["stdout"] == "flooded\n", flood
        assert size <= BUDGET, size
        assert flood["displays_truncated"] is True
        assert "display() output(s) were left out" in flood["notice"]
        # The interpreter, the client and a few MB of kept displays: not 40 MB of them.
        assert grown < 150 * 2**20, f"server RSS grew by {grown / 2**20:.0f} MiB"
        await t.victim_is_fine()

        # 2. A 20 MB last expression.
        big, size = await call(t, "'x' * 20_000_000", **session)
        assert big["status"] == "ok" and size <= BUDGET, size
        assert big["result_truncated"] is True and "characters cut" in big["result"]
        assert big["result"].startswith("'xxx") and big["result"].endswith("xxx'")
        assert "last expression was cut" in big["notice"]

        # 3. A 5 MB exception message, 400 frames deep.
        err, size = await call(t, DEEP_ERROR, **session)
        assert err["status"] == "error" and size <= BUDGET, size
        assert err["error"]["name"] == "ValueError" and err["error_truncated"] is True
        assert "characters cut" in err["error"]["value"]
        assert "dive" in err["error"]["traceback"]
        await t.victim_is_fine()

        # 4. 30,000 new files: some listed, the count said, list_files has the rest.
        files, size = await call(t, MANY_FILES, **session)
        assert files["stdout"] == "made\n" and size <= BUDGET, size
        assert files["files_truncated"] is True and 0 < len(files["files"]) <= 100
        assert "at least" in files["notice"] and "list_files shows them all" in files["notice"]
        assert await list_all(t, "mallory-big", "many") == 30_000
        await t.victim_is_fine()

        # 5. A run longer than ~15 s with progress: the answer is an SSE event.
        progress_seen: list[float] = []

        # Named as the SDK's ProgressFnT protocol names them.
        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            progress_seen.append(progress)

        result = await t.mallory.call_tool(
            "run_code", {"code": LONG_BIG, **session}, progress_callback=on_progress
        )
        late = structured(result)
        assert progress_seen, "the server sent no progress: the response was not streamed"
        assert late["status"] == "ok" and late["result_truncated"] is True
        assert wire_bytes(result) <= BUDGET
        await t.victim_is_fine()

        # 6. Reading back a 1.2 MB text whose JSON form is almost twice that: paged.
        await t.run(t.mallory, "open('big.txt', 'w').write('a\"\\\\\\n' * 300_000)", **session)
        assert await read_all(t, "mallory-big", "big.txt") == 1_200_000
        await t.victim_is_fine()
