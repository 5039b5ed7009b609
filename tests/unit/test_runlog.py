"""A session's run log (``sessions.runlog``) and the notebook built from it
(``run.notebook``): bounded on disk, tolerant of a torn last line, and a valid notebook
for every kind of run."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat

from mcp_code_sandbox.run.notebook import build_notebook
from mcp_code_sandbox.sessions import records, runlog
from mcp_code_sandbox.sessions.runlog import RecordedDisplay, RunEntry, RunLog

SLOT = "s" + "0" * 31 + "-0badcafe"
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16


def entry(code: str = "1", **fields: object) -> RunEntry:
    values: dict[str, object] = {
        "language": "python",
        "code": code,
        "status": "ok",
        "exit_code": 0,
        "stdout": "",
        "stderr": "",
        "result": None,
        "error": None,
        "execution_count": 1,
        "duration_ms": 3,
        "started_at": 1.0,
    }
    values.update(fields)
    return RunEntry(**values)  # type: ignore[arg-type]


def test_entries_round_trip_in_order_with_images_as_bytes(tmp_path: Path) -> None:
    log = RunLog(tmp_path / "runlogs", SLOT, 1 << 20)
    assert log.entries() == []
    first = entry("print(1)", stdout="1\n", displays=[RecordedDisplay("image/png", data=PNG)])
    second = entry("x", status="error", error={"name": "NameError", "value": "x", "traceback": ""})
    log.append(first)
    log.append(second)
    assert log.entries() == [first, second]
    assert log.path == tmp_path / "runlogs" / f"{SLOT}.jsonl"
    assert log.path.stat().st_mode & 0o777 == 0o600


def test_past_its_budget_a_run_keeps_only_its_code_then_nothing(tmp_path: Path) -> None:
    log = RunLog(tmp_path, SLOT, 2000)
    log.append(entry("a", stdout="x" * 1500))
    log.append(entry("b", stdout="y" * 1500))  # over 2000: its code only
    for _ in range(20):
        log.append(entry("c" * 200))  # until twice the budget, then markers
    found, missing = log.read()
    assert found[0].stdout == "x" * 1500 and not found[0].outputs_dropped
    assert (found[1].code, found[1].stdout, found[1].outputs_dropped) == ("b", "", True)
    assert missing > 0 and len(found) + missing == 22
    assert log.path.stat().st_size <= 2 * 2000 + 20 * len('{"skipped":true}\n')


def test_a_torn_last_line_is_counted_not_fatal(tmp_path: Path) -> None:
    log = RunLog(tmp_path, SLOT, 1 << 20)
    log.append(entry("ok"))
    with log.path.open("ab") as out:
        out.write(b'{"language": "python", "co')  # a server killed mid-write
    found, missing = log.read()
    assert [e.code for e in found] == ["ok"] and missing == 1


def test_remove_and_sweep_follow_the_records(tmp_path: Path) -> None:
    logs, sessions = tmp_path / "runlogs", tmp_path / "sessions"
    kept = "s" + "1" * 31 + "-00000001"
    for slot in (SLOT, kept):
        RunLog(logs, slot, 1 << 20).append(entry())
    sessions.mkdir()
    records.record_path(sessions, kept).write_text("{}")
    runlog.sweep(logs, lambda slot: records.record_path(sessions, slot).exists())
    assert [p.name for p in logs.iterdir()] == [f"{kept}.jsonl"]
    runlog.remove_log(logs, kept)
    runlog.remove_log(logs, kept)  # idempotent
    assert not any(logs.iterdir())


def test_a_notebook_of_every_kind_of_run_validates(tmp_path: Path) -> None:
    entries = [
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
    ]
    files = {"p.png": PNG}
    raw = build_notebook(entries, 2, files.get)
    nb = nbformat.reads(raw.decode(), as_version=4)
    nbformat.validate(nb)
    kinds = [c.cell_type for c in nb.cells]
    assert kinds == ["code"] * 5 + ["markdown", "code", "code", "markdown"]
    assert nb.cells[3].source == "%%bash\nls"
    assert nb.cells[4].source == "%%script node\nconsole.log(1)"
    assert nb.cells[4].outputs[-1].evalue == "exit code 2"
    assert nb.cells[2].outputs[-1].ename == "Timeout"
    assert "````ruby\nputs 1\n````" in nb.cells[5].source  # fenced past the output's ```
    shown = [o.data for o in nb.cells[6].outputs]
    assert shown[0]["image/png"] and shown[1] == {"text/plain": "[image file /mnt/data/gone.png]"}
    assert "1 run(s) above are shown without their outputs" in nb.cells[-1].source
    assert "2 later run(s) are not in this notebook" in nb.cells[-1].source
    assert json.loads(raw)["metadata"]["kernelspec"]["name"] == "python3"
