"""A Python cell's output in real sandboxes, on every backend: buffered inside the sandbox
(``agent/outstream.py``, ``agent/coalesce.py``), it still arrives in order, still streams
while the cell runs, and is cut and saved exactly as before."""

from __future__ import annotations

import pytest

from mcp_code_sandbox.run import execute
from mcp_code_sandbox.run.request import RunRequest

from ..conftest import MakeService, each_backend

LINES = 200_000

#: Markers on stdout and stderr, Python's and a child's, each after enough padding that
#: the output passes the budget and the whole of it is saved in arrival order.
INTERLEAVED = """
import os, subprocess, sys
pad = 'x' * 3000
for i in range(4):
    print(f'{pad}<out-{i}>')
    print(f'{pad}<err-{i}>', file=sys.stderr)
os.system('echo "<child-out>"; echo "<child-err>" >&2')
print('<out-4>')
subprocess.run(['sh', '-c', 'echo "<child-out-2>"'])
print('<err-4>', file=sys.stderr)
print('<out-5>')
"""
ORDER = [
    *(f"<{name}-{i}>" for i in range(4) for name in ("out", "err")),
    "<child-out>",
    "<child-err>",
    "<out-4>",
    "<child-out-2>",
    "<err-4>",
    "<out-5>",
]


@each_backend
async def test_interleaved_stdout_and_stderr_arrive_in_order(make_service: MakeService) -> None:
    async with make_service(max_output_bytes=4096) as svc:
        r = await svc.run_code("local", RunRequest(INTERLEAVED), "s")
        assert r.status == "ok", r.error
        assert r.stdout_truncated and r.stderr_truncated and r.full_output_path
        full = await svc.read_file("local", "s", r.full_output_path, offset=0, max_bytes=None)
        text = full.data.decode()
        positions = [text.find(marker) for marker in ORDER]
        assert -1 not in positions, [m for m, p in zip(ORDER, positions, strict=True) if p < 0]
        assert positions == sorted(positions), sorted(zip(positions, ORDER, strict=True))
        assert r.stdout.endswith("<out-4>\n<child-out-2>\n<out-5>\n")
        assert r.stderr.endswith("<child-err>\n<err-4>\n")


@each_backend
async def test_output_streams_while_the_cell_runs(
    make_service: MakeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(execute, "PROGRESS_EVERY_S", 0.2)
    progress: list[str] = []

    async def on_progress(elapsed: float, total: float, message: str) -> None:
        progress.append(message)

    code = "import time\nprint('first')\ntime.sleep(2)\nprint('last')"
    async with make_service() as svc:
        r = await svc.run_code("local", RunRequest(code), "s", on_progress)
    assert r.stdout == "first\nlast\n"
    # The first line reached the host while the cell was still asleep.
    assert any("first" in message and "last" not in message for message in progress)


@each_backend
async def test_200000_printed_lines_are_cut_and_saved_whole(make_service: MakeService) -> None:
    expected = "".join(f"{i}\n" for i in range(LINES))
    code = f"for i in range({LINES}):\n    print(i)"
    async with make_service() as svc:
        r = await svc.run_code("local", RunRequest(code, timeout_s=120), "s")
        assert r.status == "ok" and r.stdout_truncated and not r.stderr_truncated
        # Head and tail of half the budget each, the cut marked between: as before.
        half = svc.settings.stream_bytes // 2
        head, _, rest = r.stdout.partition("\n[... ")
        where = f"full output in /mnt/data/{r.full_output_path}"
        assert head == expected[:half]
        assert rest == f"{len(expected) - 2 * half} bytes cut; {where} ...]\n" + expected[-half:]
        saved = b""
        while len(saved) < len(expected) + 1:  # read pages of the saved file to its end
            page = await svc.read_file(
                "local", "s", r.full_output_path, offset=len(saved), max_bytes=None
            )
            if not page.data:
                break
            saved += page.data
        assert saved.decode() == expected
