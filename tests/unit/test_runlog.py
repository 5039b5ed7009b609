"""A session's run log (``sessions.runlog``): in order, bounded on disk (hard), tolerant
of a torn last line and of what a sandbox's strings hold."""

from __future__ import annotations

from pathlib import Path

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


def test_past_its_budget_a_run_keeps_only_its_code_then_is_counted(tmp_path: Path) -> None:
    log = RunLog(tmp_path, SLOT, 2600)
    log.append(entry("a", stdout="x" * 1500))
    log.append(entry("b", stdout="y" * 1500))  # would pass 2600: its code only
    for _ in range(20):
        log.append(entry("c" * 200))  # code-only entries while they fit, then counted
    found, missing = log.read()
    assert found[0].stdout == "x" * 1500 and not found[0].outputs_dropped
    assert (found[1].code, found[1].stdout, found[1].outputs_dropped) == ("b", "", True)
    assert missing > 0 and len(found) + missing == 22
    assert log.path.stat().st_size <= 2600


def test_a_full_log_stops_growing_and_counts_every_run(tmp_path: Path) -> None:
    """The bound is hard: a full log ends with one counter, rewritten in place, however
    many more runs come (before, it grew to twice its budget, then a line per run)."""
    log = RunLog(tmp_path, SLOT, 4096)
    for _ in range(5):
        log.append(entry("#" * 20_000, stdout="\n" * 1000))  # code past the code-only cut
    full = log.path.stat().st_size
    for _ in range(500):
        log.append(entry("#" * 20_000, stdout="\n" * 1000))
    assert log.path.stat().st_size == full <= 4096
    found, missing = log.read()
    assert len(found) + missing == 505
    assert list(log.records())[-1] == missing - sum(1 for f in found if f is None)


def test_a_lone_surrogate_from_a_sandbox_is_recorded_not_fatal(tmp_path: Path) -> None:
    log = RunLog(tmp_path, SLOT, 1 << 20)
    bad = {"name": "ValueError", "value": "\ud800", "traceback": "\udfff"}
    log.append(entry("raise ValueError", status="error", error=bad))
    (found,) = log.entries()
    assert found.error == {"name": "ValueError", "value": "?", "traceback": "?"}


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
