"""The agent's ``fs`` requests (agent/files.py), in process: what a host (or a hostile
frame) can ask, and what comes back. The rules shared with the host's directory are
tested on both sides in test_workspace.py; here what is the agent's alone: pages,
chunked writes, checks of every field."""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.agent import files as agent_files
from mcp_code_sandbox.agent.files import READ_PAGE_BYTES, Files


@pytest.fixture
def files(tmp_path: Path) -> Files:
    root = tmp_path / "ws"
    root.mkdir()
    return Files(str(root))


def ask(files: Files, action: str, **fields: Any) -> dict[str, Any]:
    return dict(files.handle({"op": "fs", "id": 7, "action": action, **fields}))


def write(files: Files, path: list[str], data: bytes, **fields: Any) -> dict[str, Any]:
    values: dict[str, Any] = {"offset": 0, "size": len(data), "quota": 1 << 20, "end": True}
    values.update(fields)
    encoded = base64.b64encode(data).decode()
    return ask(files, "write", path=path, data=encoded, **values)


@pytest.mark.parametrize(
    "path",
    [["..", "etc"], ["."], [""], ["a/b"], ["a\x00b"], ["é" * 200], "a.txt", [1], None],
)
def test_a_path_that_is_not_a_list_of_plain_names_is_refused(files: Files, path: Any) -> None:
    answer = ask(files, "read", path=path, max_bytes=10)
    assert (answer["ok"], answer["code"]) == (False, "invalid_path")
    assert answer["id"] == 7


@pytest.mark.parametrize(
    "fields",
    [{"offset": -1}, {"offset": True}, {"max_bytes": "10"}, {"max_bytes": 1.5}],
)
def test_malformed_numbers_are_refused_not_crashed_on(files: Files, fields: Any) -> None:
    write(files, ["a"], b"x")
    answer = ask(files, "read", path=["a"], **{"max_bytes": 1, **fields})
    assert (answer["ok"], answer["code"]) == (False, "invalid_argument")


def test_an_unknown_action_is_refused(files: Files) -> None:
    answer = ask(files, "chmod", path=["a"])
    assert (answer["ok"], answer["code"]) == (False, "invalid_argument")


def test_a_read_sends_at_most_a_page(files: Files) -> None:
    Path(files.root, "big").write_bytes(b"x" * (READ_PAGE_BYTES + 10))
    answer = ask(files, "read", path=["big"], offset=5, max_bytes=1 << 30)
    assert len(base64.b64decode(answer["data"])) == READ_PAGE_BYTES
    assert answer["size"] == READ_PAGE_BYTES + 10


def test_walks_come_in_pages_within_their_budget(
    files: Files, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_files, "PAGE_BYTES", 2000)
    names = [f"{i:03}" + "n" * 200 for i in range(40)]
    for name in names:
        Path(files.root, name).write_bytes(b"")
    got: list[str] = []
    start: int | None = 0
    pages = 0
    while start is not None:
        answer = ask(files, "list", path=[], start=start)
        assert answer["ok"] and answer["entries"], answer
        assert sum(len(entry[0]) for entry in answer["entries"]) <= 2000
        got.extend(entry[0] for entry in answer["entries"])
        start = answer["next"]
        pages += 1
    assert got == names and pages > 1
    snapshot = ask(files, "snapshot", start=0)
    assert snapshot["next"] is not None and not snapshot["truncated"]


def test_one_entry_longer_than_a_page_still_comes(
    files: Files, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_files, "PAGE_BYTES", 10)
    Path(files.root, "x" * 200).write_bytes(b"")
    answer = ask(files, "list", path=[])
    assert [entry[0] for entry in answer["entries"]] == ["x" * 200]
    assert answer["next"] is None


def test_a_write_in_chunks_is_installed_at_its_end_only(files: Files) -> None:
    first = write(files, ["d", "f.bin"], b"abc", size=6, end=False)
    assert first["ok"]
    assert not Path(files.root, "d", "f.bin").exists()
    last = write(files, ["d", "f.bin"], b"def", offset=3, size=6)
    assert last["ok"] and last["size"] == 6
    assert Path(files.root, "d", "f.bin").read_bytes() == b"abcdef"
    assert sorted(os.listdir(Path(files.root, "d"))) == ["f.bin"]  # no temporary file


@pytest.mark.parametrize(
    "second",
    [
        {"offset": 5},  # out of order
        {"path": ["other"]},  # another file's chunk
        {"data": b"toolong", "end": False},  # more than the size
        {"data": b"", "end": True},  # ends before its size
    ],
)
def test_a_broken_write_leaves_nothing(files: Files, second: dict[str, Any]) -> None:
    assert write(files, ["f"], b"abc", size=6, end=False)["ok"]
    answer = write(
        files,
        second.get("path", ["f"]),
        second.get("data", b"def"),
        offset=second.get("offset", 3),
        size=6,
        end=second.get("end", True),
    )
    assert (answer["ok"], answer["code"]) == (False, "invalid_argument")
    assert os.listdir(files.root) == []


def test_another_request_or_an_abort_drops_a_write_in_progress(files: Files) -> None:
    for action in ("usage", "abort"):
        assert write(files, ["f"], b"abc", size=6, end=False)["ok"]
        assert ask(files, action)["ok"]
        assert os.listdir(files.root) == []
        answer = write(files, ["f"], b"def", offset=3, size=6)
        assert answer["code"] == "invalid_argument"


def test_the_quota_is_checked_before_a_write(files: Files) -> None:
    Path(files.root, "a").write_bytes(b"x" * 60)
    answer = write(files, ["new", "b"], b"y" * 41, quota=100)
    assert (answer["ok"], answer["code"]) == (False, "quota_exceeded")
    assert answer["details"] == {"used_bytes": 60, "quota_bytes": 100}
    assert os.listdir(files.root) == ["a"]  # no new directory either


def test_oversized_or_undecodable_data_is_refused(files: Files) -> None:
    for data in ("not base64!", "A" * ((agent_files.WRITE_CHUNK_BYTES // 3 + 2) * 4), 5):
        answer = ask(files, "write", path=["f"], data=data, offset=0, size=1, quota=10)
        assert (answer["ok"], answer["code"]) == (False, "invalid_argument")
    assert os.listdir(files.root) == []
