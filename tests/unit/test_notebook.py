"""The notebook built from a session's run log (``run.notebook``): valid for every kind of
run, within its byte budget with what was cut said in it, built in bounded memory, and
never carrying active content a sandbox produced."""

from __future__ import annotations

import base64
import json
import re
import tracemalloc
from pathlib import Path
from typing import Any

import nbformat

from mcp_code_sandbox.run.notebook import build_notebook, write_notebook
from mcp_code_sandbox.sessions.runlog import RecordedDisplay, RunEntry, RunLog

from .test_runlog import PNG, entry

SLOT = "s" + "0" * 31 + "-0badcafe"
MiB = 1024 * 1024


def read(raw: bytes) -> Any:
    nb = nbformat.reads(raw.decode("utf-8"), as_version=4)
    nbformat.validate(nb)
    return nb


def test_a_notebook_of_every_kind_of_run_validates() -> None:
    entries: list[RunEntry | int] = [
        entry("print('hi')", stdout="hi\n", result="3", execution_count=1),
        entry(
            "1/0",
            status="error",
            exit_code=1,
            execution_count=2,
            error={"name": "ZeroDivisionError", "value": "division by zero", "traceback": "tb"},
        ),
        entry("import time; time.sleep(9)", status="timeout", exit_code=1, error=None),
        entry("ls", language="bash", stdout="a\n", execution_count=None),
        entry("console.log(1)", language="javascript", status="error", exit_code=2),
        entry("puts 1", language="ruby", stdout="1\n```\n", execution_count=None),
        entry("plt.savefig('p.png')", image_files=["p.png", "gone.png"]),
        entry("big()", outputs_dropped=True),
        2,
    ]
    files = {"p.png": PNG}
    raw = build_notebook(entries, files.get, MiB)
    nb = read(raw)
    kinds = [c.cell_type for c in nb.cells]
    assert kinds == ["code"] * 5 + ["markdown", "code", "code", "markdown"]
    assert [c.id for c in nb.cells] == [f"run-{n}" for n in range(1, 10)]
    assert nb.cells[3].source == "%%bash\nls"
    assert nb.cells[4].source == "%%script node\nconsole.log(1)"
    assert nb.cells[4].outputs[-1].evalue == "exit code 2"
    assert nb.cells[2].outputs[-1].ename == "Timeout"
    assert "````ruby\nputs 1\n````" in nb.cells[5].source  # fenced past the output's ```
    shown = [o.data for o in nb.cells[6].outputs]
    assert shown[0]["image/png"] and shown[1] == {"text/plain": "[image file /mnt/data/gone.png]"}
    assert "1 run(s) were recorded without their outputs" in nb.cells[-1].source
    assert "2 run(s) were not recorded" in nb.cells[-1].source
    assert json.loads(raw)["metadata"]["kernelspec"]["name"] == "python3"


def test_newline_heavy_runs_stay_within_the_budget_and_the_cut_is_said() -> None:
    """Issue 27, finding 6: newline-heavy output made a notebook six times its run log
    (nbformat writes a JSON string per line). The notebook is within its budget; runs that
    do not fit are shown without outputs, then left out, and its last cell says so."""
    budget = 256 * 1024
    lines = "\n" * 30_000
    runs: list[RunEntry | int] = [
        entry(f"print('\\n' * 30000)  # {n}", stdout=lines) for n in range(2000)
    ]
    raw = build_notebook(runs, lambda _: None, budget)
    assert len(raw) <= budget
    nb = read(raw)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code[0].outputs[0].text == "\n" * 30_000  # what fits is whole
    assert 0 < len(code) < 2000
    said = nb.cells[-1].source
    assert "this notebook reached its size limit" in said and "SANDBOX_NOTEBOOK_MAX_BYTES" in said
    assert re.search(r"the last \d+ run\(s\) are left out", said)
    cut = [c for c in code if c.metadata["mcp_code_sandbox"].get("outputs_cut")]
    assert all(c.outputs == [] for c in cut)


def test_workspace_images_are_embedded_while_they_fit_then_named() -> None:
    budget = 512 * 1024
    images = {f"p{n}.png": PNG + bytes(100_000) for n in range(16)}
    raw = build_notebook([entry("save()", image_files=list(images))], images.get, budget)
    assert len(raw) <= budget
    nb = read(raw)
    data = [o.data for o in nb.cells[0].outputs]
    embedded = [d for d in data if "image/png" in d]
    assert 0 < len(embedded) < 16
    assert {"text/plain": "[image file /mnt/data/p15.png]"} in data
    assert f"{16 - len(embedded)} image file(s) are named, not embedded" in nb.cells[-1].source


def test_an_export_of_a_full_log_holds_a_cell_at_a_time(tmp_path: Path) -> None:
    """Issue 27, finding 6: one export of a 31.6 MB log raised the server's peak memory
    by 1.4 GB (the whole log, its entries and the notebook held at once, the notebook
    six times the log). Streamed, the export's peak is a small fraction of its budget,
    however long the log."""
    budget = 16 * MiB
    log = RunLog(tmp_path / "runlogs", SLOT, budget)
    for n in range(400):
        log.append(entry(f"print('\\n' * 50000)  # {n}", stdout="\n" * 50_000))
    assert log.path.stat().st_size > budget // 2
    with (tmp_path / "out.ipynb").open("wb") as out:
        tracemalloc.start()
        try:
            written = write_notebook(log.records(), lambda _: None, out, budget)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < budget // 8, peak
    assert written.size_bytes == (tmp_path / "out.ipynb").stat().st_size <= budget
    assert len(read((tmp_path / "out.ipynb").read_bytes()).cells) == written.runs + 1


HOSTILE_SVG = (
    '<svg xmlns="http://www.w3.org/2000/svg" onload="alert(1)">'
    "<script>alert(2)</script><rect width='9' height='9'/></svg>"
)
HOSTILE_HTML = '<img src=x onerror="alert(3)"><script>alert(4)</script>'
HOSTILE_MARKDOWN = "[click](javascript:alert(5)) <img src=x onerror=alert(6)>"


def test_html_svg_and_markdown_outputs_are_inert() -> None:
    """Issue 27, finding 7: a sandbox's HTML, SVG and markdown outputs went into the
    notebook as they were, run by every viewer that renders them. The notebook carries
    them as text, and an SVG as an image (where no script runs)."""
    displays = [
        RecordedDisplay("image/svg+xml", text=HOSTILE_SVG),
        RecordedDisplay("text/html", text=HOSTILE_HTML),
        RecordedDisplay("text/markdown", text=HOSTILE_MARKDOWN),
        RecordedDisplay("image/png", data=PNG),
    ]
    nb = read(build_notebook([entry("show()", displays=displays)], lambda _: None, MiB))
    svg, html, markdown, png = (o.data for o in nb.cells[0].outputs)
    assert_inert(nb)
    shown = re.fullmatch(
        r'<img src="data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)" alt="SVG image">',
        svg["text/html"],
    )
    assert shown and base64.b64decode(shown.group(1)).decode() == HOSTILE_SVG
    assert html == {"text/plain": HOSTILE_HTML}
    assert markdown == {"text/plain": HOSTILE_MARKDOWN}
    assert base64.b64decode(png["image/png"]) == PNG


def assert_inert(nb: Any) -> None:
    """No output a viewer would run: only plain text, PNG/JPEG, and HTML that is one
    ``<img>`` of a base64 SVG."""
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            for mime, value in output.get("data", {}).items():
                assert mime in ("text/plain", "image/png", "image/jpeg", "text/html"), mime
                if mime == "text/html":
                    assert re.fullmatch(
                        r'<img src="data:image/svg\+xml;base64,[A-Za-z0-9+/=]*" alt="SVG image">',
                        value,
                    ), value


def test_strings_a_sandbox_sent_become_valid_utf8() -> None:
    bad = {"name": "ValueError", "value": "\ud800", "traceback": "x\udfff"}
    raw = build_notebook([entry("raise", status="error", error=bad)], lambda _: None, MiB)
    assert read(raw).cells[0].outputs[-1].evalue == "?"


def test_a_forged_execution_count_does_not_break_the_export() -> None:
    """The count is the agent's word, and code in the sandbox can speak for the agent: a
    negative one made the notebook invalid, and its export an internal error."""
    forged = entry("1", execution_count=-7, result="1")
    cell = read(build_notebook([forged], lambda _: None, MiB)).cells[0]
    assert cell.execution_count is None and cell.outputs[0].execution_count is None
