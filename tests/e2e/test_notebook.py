"""The session as a notebook (issue 15): every run is recorded on the host, and
``export_notebook`` writes them, in order, as a valid Jupyter notebook into the workspace,
with a download link. Driven through the official MCP client against the real HTTP
server; the notebook is fetched over HTTP and opened with nbformat's reader (what
nbclient and JupyterLab use)."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import nbclient
import nbformat
import pytest
from mcp import Client

from mcp_code_sandbox.settings import Settings

from ..conftest import each_backend
from .conftest import http_server
from .tenants import structured, two_tenants

pytestmark = [pytest.mark.e2e]

PNG = b"\x89PNG\r\n\x1a\n"
RUNS: list[tuple[str, str]] = [
    ("python", "print('hello from python')"),
    ("python", "40 + 2"),
    ("python", "1 / 0"),
    ("python", "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('drawn')"),
    ("bash", "echo from bash; echo oops >&2; exit 3"),
    ("python", "plt.plot([1, 2]); plt.savefig('saved.png')"),
]


@pytest.fixture
def served(make_settings: Callable[..., Settings]) -> Iterator[tuple[str, Settings]]:
    settings = make_settings()
    with http_server(settings) as base:
        yield base, settings


def data(result: Any) -> dict[str, Any]:
    assert not result.is_error, result.content
    assert result.structured_content is not None
    return dict(result.structured_content)


@each_backend
async def test_export_notebook_writes_every_run_in_order(
    served: tuple[str, Settings],
) -> None:
    base, settings = served
    session = "nb-1"
    async with Client(f"{base}/mcp", mode="legacy") as client:
        for language, code in RUNS:
            run = {"code": code, "language": language, "session_id": session}
            data(await client.call_tool("run_code", run))
        # Recorded on the host, never in the workspace the sandbox can write.
        logs = list(settings.runlogs_dir.glob("*.jsonl"))
        assert len(logs) == 1 and len(logs[0].read_bytes().splitlines()) == len(RUNS)
        listed = data(await client.call_tool("list_files", {"session_id": session}))
        assert "session.ipynb" not in {e["path"] for e in listed["entries"]}

        result = await client.call_tool("export_notebook", {"session_id": session})
        out = data(result)
        assert out["path"] == "session.ipynb" and out["runs"] == len(RUNS)
        assert out["download_url"], out
        links = [c for c in result.content if c.type == "resource_link"]
        assert [link.uri for link in links] == [f"sandbox://{session}/session.ipynb"]
        listed = data(await client.call_tool("list_files", {"session_id": session}))
        sizes = {e["path"]: e["size_bytes"] for e in listed["entries"]}
        assert sizes["session.ipynb"] == out["size_bytes"]

        download = httpx.get(out["download_url"], timeout=30)
        assert download.status_code == 200
        nb = nbformat.reads(download.text, as_version=4)
        nbformat.validate(nb)
        nbclient.NotebookClient(nb)  # what would run it accepts it as it is
        check_cells(nb)

        # Closing the session removes its record of runs with it.
        await client.call_tool("close_session", {"session_id": session})
        assert not list(settings.runlogs_dir.glob("*.jsonl"))


def check_cells(nb: Any) -> None:
    cells = nb.cells
    assert [c.cell_type for c in cells] == ["code"] * len(RUNS)
    assert [c.source for c in cells[:4]] == [code for _, code in RUNS[:4]]
    assert [c.execution_count for c in cells[:4]] == [1, 2, 3, 4]

    hello, answer, failed, figure, bash, saved = cells
    assert [(o.output_type, o.name, o.text) for o in hello.outputs] == [
        ("stream", "stdout", "hello from python\n")
    ]
    assert [o.output_type for o in answer.outputs] == ["execute_result"]
    assert answer.outputs[0].data == {"text/plain": "42"}
    assert answer.outputs[0].execution_count == 2
    error = failed.outputs[-1]
    assert error.output_type == "error" and error.ename == "ZeroDivisionError"
    assert error.evalue == "division by zero" and any("1 / 0" in line for line in error.traceback)

    images = [o for o in figure.outputs if o.output_type == "display_data"]
    assert len(images) == 1 and set(images[0].data) == {"image/png"}, figure.outputs
    assert base64.b64decode(images[0].data["image/png"]).startswith(PNG)
    # The figure is an image, not also "<Figure size 640x480 with 1 Axes>".
    assert "Figure size" not in json.dumps(figure.outputs)

    assert bash.source == "%%bash\n" + RUNS[4][1] and bash.execution_count is None
    assert [(o.output_type, o.get("name")) for o in bash.outputs] == [
        ("stream", "stdout"),
        ("stream", "stderr"),
        ("error", None),
    ]
    assert bash.outputs[0].text == "from bash\n" and bash.outputs[1].text == "oops\n"
    assert bash.metadata["mcp_code_sandbox"]["exit_code"] == 3

    # A saved image is embedded from the workspace file it refers to.
    embedded = [o for o in saved.outputs if o.output_type == "display_data"]
    assert [o.metadata.get("filename") for o in embedded] == ["saved.png"]
    assert base64.b64decode(embedded[0].data["image/png"]).startswith(PNG)


@pytest.mark.bwrap
async def test_export_notebook_refuses_bad_paths_and_sessions(
    served: tuple[str, Settings],
) -> None:
    base, _ = served
    async with Client(f"{base}/mcp", mode="legacy") as client:
        data(await client.call_tool("run_code", {"code": "1", "session_id": "nb-2"}))
        for path, code in (
            ("../escape.ipynb", "invalid_filename"),
            ("/etc/x.ipynb", "invalid_filename"),
            ("notes.txt", "invalid_filename"),
        ):
            bad = await client.call_tool("export_notebook", {"session_id": "nb-2", "path": path})
            assert bad.is_error and (bad.meta or {}).get("error_code") == code, (path, bad)
        missing = await client.call_tool("export_notebook", {"session_id": "nope"})
        assert missing.is_error
        assert (missing.meta or {}).get("error_code") == "session_not_found"
        # A path in a subdirectory is fine, and an empty session is an empty notebook.
        data(await client.call_tool("run_code", {"code": "", "session_id": "nb-3"}))
        out = data(
            await client.call_tool(
                "export_notebook", {"session_id": "nb-2", "path": "out/analysis.ipynb"}
            )
        )
        assert out["path"] == "out/analysis.ipynb" and out["runs"] == 1


#: Issue 27, finding 6: newline-heavy output (two bytes a line in the run log, a JSON
#: string a line in the notebook nbformat writes: six times the log), then long code,
#: whose code-only records grew the log to twice its budget, then a line per run.
NEWLINES = "print('\\n' * 30000, end='')"
LONG_CODE = "#" * 20_000 + "\n1"
BUDGET = 256 * 1024


@pytest.mark.bwrap
async def test_a_hostile_session_cannot_grow_its_run_log_or_notebook_past_the_budget(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    # Outputs kept whole in results (not cut to the text budget), so that they fill the log.
    env = {"SANDBOX_NOTEBOOK_MAX_BYTES": str(BUDGET), "SANDBOX_MAX_RESULT_TOKENS": "100000"}
    async with two_tenants(settings, **env) as t:
        await t.run(t.victim, "print('mine')", session_id="victim-nb")
        for code in [NEWLINES] * 6 + [LONG_CODE] * 10:
            await t.run(t.mallory, code, session_id="hog")
        logs = {p: p.stat().st_size for p in settings.runlogs_dir.glob("*.jsonl")}
        assert logs and max(logs.values()) <= BUDGET, logs
        for _ in range(3):  # full: a run more does not grow it
            await t.run(t.mallory, LONG_CODE, session_id="hog")
        assert {p: p.stat().st_size for p in logs} == logs

        out = structured(await t.mallory.call_tool("export_notebook", {"session_id": "hog"}))
        assert out["size_bytes"] <= BUDGET
        assert "were not recorded" in out["notice"], out
        nb = nbformat.reads(httpx.get(out["download_url"], timeout=30).text, as_version=4)
        nbformat.validate(nb)
        said = nb.cells[-1].source
        assert nb.cells[-1].cell_type == "markdown" and "SANDBOX_NOTEBOOK_MAX_BYTES" in said
        assert "were not recorded" in said and "reached its size limit" in said
        assert nb.cells[0].outputs[0].text == "\n" * 30000  # what fits is whole

        # The other owner's notebook is whole, and its work goes on.
        mine = structured(await t.victim.call_tool("export_notebook", {"session_id": "victim-nb"}))
        assert mine["notice"] is None
        theirs = nbformat.reads(httpx.get(mine["download_url"], timeout=30).text, as_version=4)
        assert [c.outputs[0].text for c in theirs.cells] == ["mine\n"]
        await t.victim_is_fine()


#: Issue 27, finding 7: what a sandbox displays, made to run in whoever opens the
#: notebook. HTML is not a kind the agent sends, so the attacker's code makes it one.
HOSTILE_OUTPUTS = """
import sys
from IPython.display import SVG, Markdown, display
for module in list(sys.modules.values()):
    if isinstance(getattr(module, 'RICH_MIMES', None), tuple):
        module.RICH_MIMES = ('text/html',) + module.RICH_MIMES
display(SVG('<svg xmlns="http://www.w3.org/2000/svg" onload="alert(1)">'
            '<script>alert(2)</script><rect width="9" height="9"/></svg>'))
display(Markdown('[x](javascript:alert(3)) <img src=x onerror=alert(4)>'))
display({'text/html': '<img src=x onerror=alert(5)><script>alert(6)</script>'}, raw=True)
"""
INERT_HTML = re.compile(r'<img src="data:image/svg\+xml;base64,([A-Za-z0-9+/=]*)" alt="SVG image">')


@pytest.mark.bwrap
async def test_hostile_html_svg_and_markdown_are_inert_in_the_notebook(
    make_settings: Callable[..., Settings],
) -> None:
    async with two_tenants(make_settings()) as t:
        await t.run(t.mallory, HOSTILE_OUTPUTS, session_id="xss")
        out = structured(await t.mallory.call_tool("export_notebook", {"session_id": "xss"}))
        nb = nbformat.reads(httpx.get(out["download_url"], timeout=30).text, as_version=4)
        nbformat.validate(nb)
        bundles = [o.data for o in nb.cells[0].outputs if o.output_type == "display_data"]
        assert len(bundles) == 3, nb.cells[0].outputs
        for bundle in bundles:
            assert set(bundle) <= {"text/plain", "text/html"}, bundle
            if "text/html" in bundle:  # an SVG, as an image: no script runs in one
                shown = INERT_HTML.fullmatch(bundle["text/html"])
                assert shown and b"onload" in base64.b64decode(shown.group(1)), bundle
        texts = " ".join(b["text/plain"] for b in bundles)
        assert "onerror=alert(4)" in texts and "<script>alert(6)</script>" in texts


@pytest.mark.bwrap
async def test_a_session_that_forges_its_execution_count_still_exports(
    served: tuple[str, Settings],
) -> None:
    """The count is the interpreter's, which the session's code can set: a negative one
    made the notebook invalid and its export an ``internal_error``."""
    base, _ = served
    async with Client(f"{base}/mcp", mode="legacy") as client:
        for code in ("get_ipython().execution_count = -10", "6 * 7"):
            data(await client.call_tool("run_code", {"code": code, "session_id": "nb-neg"}))
        out = data(await client.call_tool("export_notebook", {"session_id": "nb-neg"}))
        nb = nbformat.reads(httpx.get(out["download_url"], timeout=30).text, as_version=4)
        nbformat.validate(nb)
        assert nb.cells[1].outputs[0].data == {"text/plain": "42"}
