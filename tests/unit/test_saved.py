"""The host's parsers of the agent's save and load reports: the text comes from the sandbox,
so every shape that is not the documented one is refused with SandboxFailed, and what is
accepted is bounded and free of control characters."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mcp_code_sandbox.errors import SandboxFailed
from mcp_code_sandbox.sessions.saved import (
    MAX_ENTRIES,
    MAX_NAME_CHARS,
    MAX_WHY_CHARS,
    LoadReport,
    SaveReport,
    Variable,
    parse_load,
    parse_save,
)

SAVE = {
    "kept": [{"name": "df", "type": "pandas.DataFrame", "bytes": 1234}],
    "modules": [{"name": "np", "module": "numpy"}],
    "dropped": [{"name": "g", "type": "generator", "why": "not picklable: TypeError"}],
    "bytes": 1300,
}
LOAD = {
    "found": True,
    "restored": ["df", "f"],
    "modules": ["np"],
    "failed": [{"name": "x", "type": "__main__.A", "why": "refers to A"}],
}


def test_a_save_report_is_parsed() -> None:
    report = parse_save(json.dumps(SAVE))
    assert report == SaveReport(
        kept=(Variable("df", "pandas.DataFrame", bytes=1234),),
        modules=(Variable("np", "numpy"),),
        dropped=(Variable("g", "generator", why="not picklable: TypeError"),),
        bytes=1300,
    )


def test_a_load_report_is_parsed() -> None:
    report = parse_load(json.dumps(LOAD))
    assert report == LoadReport(
        found=True,
        restored=("df", "f"),
        modules=("np",),
        failed=(Variable("x", "__main__.A", why="refers to A"),),
    )
    empty = parse_load('{"found": false, "restored": [], "modules": [], "failed": []}')
    assert not empty.found and empty.restored == ()


def _with(base: dict[str, Any], **changes: Any) -> str:
    return json.dumps({**base, **changes})


@pytest.mark.parametrize(
    "text",
    [
        None,
        "",
        "not json",
        "[]",
        '"a string"',
        "[" * 100_000,  # nesting deep enough to exhaust a recursive parser
        _with(SAVE, kept={"df": 1}),
        _with(SAVE, kept=[["df", "x", 1]]),
        _with(SAVE, kept=[{"name": 1, "type": "t", "bytes": 1}]),
        _with(SAVE, kept=[{"name": "a", "type": "t", "bytes": -1}]),
        _with(SAVE, kept=[{"name": "a", "type": "t", "bytes": True}]),
        _with(SAVE, kept=[{"name": "a", "type": "t", "bytes": 1.5}]),
        _with(SAVE, kept=[{"name": "a", "type": "t", "bytes": 10**30}]),
        _with(SAVE, kept=[{"name": "a", "type": None, "bytes": 1}]),
        _with(SAVE, modules=[{"name": "np"}]),
        _with(SAVE, dropped=[{"name": "g", "type": "t"}]),
        _with(SAVE, bytes="12"),
        json.dumps({k: v for k, v in SAVE.items() if k != "dropped"}),
        '{"kept": [], "modules": [], "dropped": [], "bytes": 1' + "0" * 5000 + "}",
        "x" * (9 * 1024 * 1024),
    ],
)
def test_a_hostile_save_report_is_sandbox_failed(text: Any) -> None:
    with pytest.raises(SandboxFailed):
        parse_save(text)


@pytest.mark.parametrize(
    "text",
    [
        None,
        "{}",
        _with(LOAD, found="yes"),
        _with(LOAD, found=1),
        _with(LOAD, restored="df"),
        _with(LOAD, restored=[1]),
        _with(LOAD, modules=[{"name": "np"}]),
        _with(LOAD, failed=[{"name": "x", "type": "t"}]),
        _with(LOAD, failed=["x"]),
    ],
)
def test_a_hostile_load_report_is_sandbox_failed(text: Any) -> None:
    with pytest.raises(SandboxFailed):
        parse_load(text)


def test_accepted_text_is_bounded_and_clean() -> None:
    evil = "\x1b]52;c;cGF3bmVk\x07x\x1b[2J\r\n\x00" + "n" * 5000
    many = [{"name": f"v{i}", "type": evil, "bytes": i} for i in range(MAX_ENTRIES + 500)]
    report = parse_save(
        _with(SAVE, kept=many, dropped=[{"name": evil, "type": "t", "why": evil * 3}])
    )
    assert len(report.kept) == MAX_ENTRIES
    for variable in (*report.kept, *report.dropped):
        for text in (variable.name, variable.type, variable.why or ""):
            assert "\x1b" not in text and "\x00" not in text and "\n" not in text
            assert "\r" not in text and "\x07" not in text
    assert all(len(v.type) <= MAX_NAME_CHARS for v in report.kept)
    assert len(report.dropped[0].name) <= MAX_NAME_CHARS
    assert len(report.dropped[0].why or "") <= MAX_WHY_CHARS
    loaded = parse_load(_with(LOAD, restored=[f"v{i}" for i in range(5000)]))
    assert len(loaded.restored) == MAX_ENTRIES
