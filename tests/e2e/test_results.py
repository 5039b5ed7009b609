"""Results people read (issue 15): what a notebook user notices, on every runtime, through
the official MCP client against the real HTTP server.

A figure is an image and not also ``<Figure size ...>``; a DataFrame that is a cell's
value comes back once, as a markdown table; rich displays come back by type;
``list_runtimes`` says which packages (and versions) can be imported; a timeout says in
words what became of the interpreter; Python results carry an exit code; a run whose
session is closed under it says so; and saved full outputs are not listed as the
session's files.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from mcp import Client

from mcp_code_sandbox.settings import Settings

from ..conftest import each_runtime
from .conftest import http_server

pytestmark = [pytest.mark.e2e, each_runtime]

FRAME = (
    "import pandas as pd\n"
    "df = pd.DataFrame({'city': ['Oslo', 'Lima|Peru'] * 20, 'n': range(40)})\n"
    "df"
)


@pytest.fixture
def base(make_settings: Callable[..., Settings]) -> Iterator[str]:
    with http_server(make_settings(), SANDBOX_MAX_OUTPUT_BYTES="1024") as url:
        yield url


def data(result: Any) -> dict[str, Any]:
    assert not result.is_error, result.content
    assert result.structured_content is not None
    return dict(result.structured_content)


async def run(client: Client, code: str, **args: Any) -> dict[str, Any]:
    return data(await client.call_tool("run_code", {"code": code, "session_id": "r", **args}))


async def test_figures_frames_runtimes_and_exit_codes(base: str) -> None:
    async with Client(f"{base}/mcp", mode="legacy") as client:
        result = await client.call_tool(
            "run_code",
            {"code": "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nNone", "session_id": "r"},
        )
        figure = data(result)
        assert [c.type for c in result.content].count("image") == 1
        assert figure["displays"] == [], figure["displays"]  # not "<Figure size 640x480 ...>"
        assert "Figure size" not in json.dumps(figure)
        # A figure that is the cell's value: its image, and no "<Figure ...>" result.
        result = await client.call_tool(
            "run_code", {"code": "plt.plot([3, 1])\nplt.gcf()", "session_id": "r"}
        )
        value = data(result)
        assert [c.type for c in result.content].count("image") == 1
        assert (value["result"], value["displays"]) == (None, [])

        frame = await run(client, FRAME)
        assert frame["displays"] == []  # once: the table is the result
        table = frame["result"].splitlines()
        assert table[0] == "|  | city | n |" and table[1] == "| --- | --- | --- |"
        assert table[2] == "| 0 | Oslo | 0 |" and table[3] == "| 1 | Lima\\|Peru | 1 |"
        assert "| … | … | … |" in table and table[-1] == (
            "40 rows × 2 columns (shown: 20 rows, 2 columns)"
        )

        assert (await run(client, "1 + 1"))["exit_code"] == 0
        failed = await run(client, "raise ValueError('no')")
        assert (failed["status"], failed["exit_code"]) == ("error", 1)

        runtimes = data(await client.call_tool("list_runtimes", {}))["runtimes"]
        python = next(r for r in runtimes if r["language"] == "python")
        for package in ("pandas", "numpy", "matplotlib"):
            assert python["packages"].get(package, "")[:1].isdigit(), python["packages"]


RICH = """
from IPython.display import HTML, JSON, Latex, display
import matplotlib.pyplot as plt, pandas as pd
from PIL import Image
display({"text/latex": r"$\\alpha$"}, raw=True)
display({"application/json": {"a": [1, 2]}}, raw=True)
display(HTML("<b>bold</b>"))
display({"application/javascript": "alert(1)"}, raw=True)
Image.new("RGB", (8, 8), "blue").show()
display(pd.DataFrame({"price": [177.48850000000002, 1.5]}))
plt.plot([1, 2])
"""


async def test_rich_outputs_come_back_once_and_nothing_vanishes(base: str) -> None:
    async with Client(f"{base}/mcp", mode="legacy") as client:
        result = await client.call_tool("run_code", {"code": RICH, "session_id": "rich"})
        rich = data(result)
        assert rich["status"] == "ok", rich
        shown = [(d["mime_type"], d["text"]) for d in rich["displays"]]
        assert shown == [
            ("text/latex", "$\\alpha$"),
            ("application/json", '{"a": [1, 2]}'),
            ("text/html", "<b>bold</b>"),
            ("text/markdown", "|  | price |\n| --- | --- |\n| 0 | 177.4885 |\n| 1 | 1.5000 |"),
        ]
        # Image.show() and the figure: two images inline, no viewer started.
        assert [c.type for c in result.content].count("image") == 2
        assert rich["stderr"] == "", rich["stderr"]
        # The line plt.plot returned is not the result beside its figure.
        assert rich["result"] is None
        assert "1 display() output(s) were left out" in rich["notice"]
        value = await run(client, "HTML('<i>x</i>')", session_id="rich")
        assert value["result"] is None
        assert [(d["mime_type"], d["text"]) for d in value["displays"]] == [
            ("text/html", "<i>x</i>")
        ]


async def test_a_timeout_says_what_became_of_the_interpreter(base: str) -> None:
    async with Client(f"{base}/mcp", mode="legacy") as client:
        await run(client, "import time\nkept = 'yes'")
        slow = await run(client, "time.sleep(30)", timeout_s=2)
        assert (slow["status"], slow["state_lost"]) == ("timeout", False)
        assert (
            slow["notice"] == "timed out after 2 s; the interpreter was interrupted, variables kept"
        )
        assert (await run(client, "kept"))["result"] == "'yes'"

        code = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(30)"
        stuck = await run(client, code, timeout_s=2)
        assert (stuck["status"], stuck["state_lost"]) == ("timeout", True)
        assert stuck["notice"] == (
            "timed out after 2 s; the code did not stop when interrupted, so the interpreter "
            "was restarted: variables are gone, files in /mnt/data are kept"
        )
        bash = await run(client, "sleep 30", language="bash", timeout_s=2)
        assert bash["status"] == "timeout"
        assert (
            bash["notice"]
            == "timed out after 2 s; the program was stopped (files in /mnt/data are kept)"
        )


@pytest.mark.parametrize("language", ["python", "bash"])
async def test_a_run_whose_session_is_closed_says_so(base: str, language: str) -> None:
    code = "import time\nprint('started', flush=True)\ntime.sleep(60)"
    if language == "bash":
        code = "echo started; sleep 60"
    async with Client(f"{base}/mcp", mode="legacy") as client:
        await run(client, "1", session_id="doomed")
        started = asyncio.Event()

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            started.set()

        call = asyncio.create_task(
            client.call_tool(
                "run_code",
                {"code": code, "language": language, "session_id": "doomed"},
                progress_callback=on_progress,
            )
        )
        await asyncio.wait_for(started.wait(), 60)
        data(await client.call_tool("close_session", {"session_id": "doomed"}))
        result = await asyncio.wait_for(call, 60)
        assert result.is_error and (result.meta or {}).get("error_code") == "session_not_found"
        text = result.content[0].text  # type: ignore[union-attr]
        assert "session doomed was closed while this call ran" in text
        assert "files and variables are gone" in text and "are kept" not in text


async def test_saved_outputs_are_not_listed_as_files(base: str) -> None:
    async with Client(f"{base}/mcp", mode="legacy") as client:
        flood = await run(client, "print('x' * 5000)")
        assert flood["stdout_truncated"] and flood["full_output_path"]
        saved = flood["full_output_path"]
        listing = data(await client.call_tool("list_files", {"session_id": "r"}))
        assert not [e for e in listing["entries"] if e["path"].startswith(".outputs")]
        by_path = data(
            await client.call_tool("list_files", {"session_id": "r", "path": ".outputs"})
        )
        assert [e["path"] for e in by_path["entries"]] == [saved]
