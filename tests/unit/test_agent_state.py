"""The agent's save and load of a namespace (``agent.state``, ``agent.statefiles``),
in-process with a small shell and whichever pickler this interpreter has: the commit
protocol, what user code may plant in ``.session``, the budget, references between
names. Functions and classes of a session (cloudpickle, IPython) are tested through the
real agent in a sandbox: tests/integration/test_pause_vars.py."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.agent import state, statefiles
from mcp_code_sandbox.agent.run_state import exec_error
from mcp_code_sandbox.agent.stateload import load


class FakeShell:
    def __init__(self, namespace: dict[str, Any] | None = None) -> None:
        self.namespace: dict[str, Any] = namespace if namespace is not None else {}
        self.inputs = ["", "a = 1"]
        self.count = 1

    def user_namespace(self) -> dict[str, Any]:
        return self.namespace

    def is_own(self, name: str, value: Any) -> bool:
        return name == "display"

    def history(self) -> list[str]:
        return list(self.inputs)

    def set_history(self, inputs: list[str]) -> None:
        self.inputs = inputs

    def last_count(self) -> int:
        return self.count

    def set_last_count(self, count: int) -> None:
        self.count = count


def names(entries: list[dict[str, Any]]) -> list[str]:
    return [entry["name"] for entry in entries]


def test_save_then_load_restores_values_identity_modules_history_and_count(
    tmp_path: Path,
) -> None:
    shared = [1, 2]
    old = FakeShell(
        {
            "a": shared,
            "b": shared,
            "d": {"inner": shared},
            "n": 3,
            "os_path": os.path,
            "_private": 1,
            "display": print,
            "lock": threading.Lock(),
        }
    )
    old.count = 7
    report = state.save(old, str(tmp_path), 10_000)
    assert names(report["kept"]) == ["a", "b", "d", "n"]
    assert report["modules"] == [{"name": "os_path", "module": "posixpath"}]
    assert [(d["name"], d["type"]) for d in report["dropped"]] == [("lock", "_thread.lock")]
    assert "not picklable" in report["dropped"][0]["why"]
    assert report["bytes"] > 0
    new = FakeShell()
    loaded = load(new, str(tmp_path))
    assert loaded == {"found": True, "restored": ["a", "b", "d", "n"], "modules": ["os_path"],
                      "failed": []}  # fmt: skip
    ns = new.namespace
    assert ns["a"] == [1, 2] and ns["a"] is ns["b"] and ns["d"]["inner"] is ns["a"]
    assert ns["os_path"] is os.path and ns["n"] == 3
    assert new.inputs == ["", "a = 1"] and new.count == 7


def test_nothing_saved_is_found_false(tmp_path: Path) -> None:
    assert load(FakeShell(), str(tmp_path)) == {
        "found": False, "restored": [], "modules": [], "failed": []
    }  # fmt: skip


def test_the_largest_go_first_and_what_refers_to_them_goes_too(tmp_path: Path) -> None:
    big = bytes(60_000)
    shell = FakeShell({"big": big, "medium": bytes(30_000), "holder": {"b": big}, "small": 1})
    report = state.save(shell, str(tmp_path), 50_000)
    assert names(report["kept"]) == ["medium", "small"]
    why = {d["name"]: d["why"] for d in report["dropped"]}
    assert why["big"].startswith("too large")
    assert why["holder"] == "refers to big, which is not saved"
    assert report["bytes"] < 50_000 + 1000
    new = FakeShell()
    assert load(new, str(tmp_path))["restored"] == ["medium", "small"]
    assert "big" not in new.namespace and "holder" not in new.namespace


def test_a_value_alone_over_the_budget_is_cut_off_while_written(tmp_path: Path) -> None:
    report = state.save(FakeShell({"huge": bytes(5_000_000)}), str(tmp_path), 100_000)
    assert report["kept"] == [] and report["dropped"][0]["why"].startswith("too large")
    # Only the manifest and the (empty-ish) data directory are left on disk.
    total = sum(f.stat().st_size for f in (tmp_path / ".session").rglob("*") if f.is_file())
    assert total < 10_000


def test_a_new_save_replaces_the_old_one_and_leftovers_go(tmp_path: Path) -> None:
    state.save(FakeShell({"x": 1}), str(tmp_path), 10_000)
    session = tmp_path / ".session"
    (session / "data-0123456789abcdef").mkdir()  # a killed save's leftovers
    (session / ".manifest-junk.tmp").write_text("{")
    (session / "junk").write_text("user junk")
    state.save(FakeShell({"y": 2}), str(tmp_path), 10_000)
    entries = sorted(p.name for p in session.iterdir())
    assert len(entries) == 2 and entries[1] == "manifest.json"
    new = FakeShell()
    assert load(new, str(tmp_path))["restored"] == ["y"]


def test_a_save_killed_before_its_commit_leaves_the_previous_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state.save(FakeShell({"generation": 1}), str(tmp_path), 10_000)

    def killed(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt  # what the kernel sees of an interrupt at that moment

    monkeypatch.setattr(statefiles, "_replace", killed)
    with pytest.raises(KeyboardInterrupt):
        state.save(FakeShell({"generation": 2, "extra": [1]}), str(tmp_path), 10_000)
    monkeypatch.undo()
    new = FakeShell()
    assert load(new, str(tmp_path))["restored"] == ["generation"]
    assert new.namespace == {"generation": 1}
    assert len(list((tmp_path / ".session").iterdir())) == 2  # the failed one cleaned up


def test_a_planted_symlink_is_replaced_never_written_through(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    (work / ".session").symlink_to(outside)
    report = load(FakeShell(), str(work))
    assert report["found"] is False and "not a directory" in report["failed"][0]["why"]
    state.save(FakeShell({"x": 1}), str(work), 10_000)
    assert list(outside.iterdir()) == []
    assert (work / ".session").is_dir() and not (work / ".session").is_symlink()
    # Inside .session: a manifest that is a link to a file elsewhere is not read.
    manifest = work / ".session" / "manifest.json"
    (outside / "m.json").write_text(manifest.read_text())
    manifest.unlink()
    manifest.symlink_to(outside / "m.json")
    assert load(FakeShell(), str(work))["found"] is False


def test_a_fifo_or_garbage_in_place_of_a_value_is_reported_not_hung(tmp_path: Path) -> None:
    state.save(FakeShell({"a": [1], "b": [2], "c": [3]}), str(tmp_path), 10_000)
    session = tmp_path / ".session"
    data = next(p for p in session.iterdir() if p.is_dir())
    (data / "v0.pkl").unlink()
    os.mkfifo(data / "v0.pkl")  # opening it for reading would block without O_NONBLOCK
    content = (data / "v1.pkl").read_bytes()
    (data / "v1.pkl").write_bytes(content[: len(content) // 2])  # truncated
    (data / "v2.pkl").write_bytes(b"\x80\x05garbage that is not a pickle".ljust(len(content)))
    manifest = json.loads((session / "manifest.json").read_text())
    for entry in manifest["values"]:
        if entry["name"] == "c":  # garbage of the size the manifest expects
            entry["bytes"] = (data / entry["file"]).stat().st_size
    (session / "manifest.json").write_text(json.dumps(manifest))
    report = load(FakeShell(), str(tmp_path))
    assert report["found"] is True and report["restored"] == []
    why = {f["name"]: f["why"] for f in report["failed"]}
    assert "not a regular file" in why["a"]
    assert "truncated" in why["b"]
    assert "UnpicklingError" in why["c"] or "Error" in why["c"]


@pytest.mark.parametrize(
    "manifest",
    [b"{", b"[]", b'{"format": 99}', b'{"format": 1, "data": "../../etc", "modules": [], '
     b'"values": []}', b"\xff\xfe", b'{"format": 1, "data": "data-0000000000000000"}'],
)  # fmt: skip
def test_a_broken_manifest_is_found_false_with_why(tmp_path: Path, manifest: bytes) -> None:
    (tmp_path / ".session").mkdir()
    (tmp_path / ".session" / "manifest.json").write_bytes(manifest)
    report = load(FakeShell(), str(tmp_path))
    assert report["found"] is False and report["failed"][0]["type"] == "manifest"


def test_malformed_entries_of_a_manifest_are_named(tmp_path: Path) -> None:
    state.save(FakeShell({"a": [1]}), str(tmp_path), 10_000)
    path = tmp_path / ".session" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["values"] += [{"name": "b", "type": "t", "file": "../../x", "bytes": 1}, "junk"]
    manifest["modules"] = [{"name": "m", "module": "no_such_module_here"}, {"name": "x"}]
    path.write_text(json.dumps(manifest))
    new = FakeShell()
    report = load(new, str(tmp_path))
    assert report["restored"] == ["a"] and report["modules"] == []
    assert {f["name"] for f in report["failed"]} >= {"b", "m", "?"}
    assert new.namespace == {"a": [1]}


def test_the_report_is_bounded(tmp_path: Path) -> None:
    shell = FakeShell({f"v{i}": [i] for i in range(state.MAX_REPORTED + 20)})
    report = state.save(shell, str(tmp_path), 10_000_000)
    assert len(report["kept"]) == state.MAX_REPORTED
    assert len(load(FakeShell(), str(tmp_path))["restored"]) == state.MAX_REPORTED


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"state": "save"}, "max_bytes"),
        ({"state": "save", "max_bytes": 0}, "max_bytes"),
        ({"state": "save", "max_bytes": True}, "max_bytes"),
        ({"state": "dump", "max_bytes": 1}, "'state'"),
        ({"state": "load", "language": "bash"}, "Python only"),
        ({"state": "load"}, None),
        ({"state": "save", "max_bytes": 10}, None),
    ],
)
def test_exec_with_state_is_checked(fields: dict[str, Any], problem: str | None) -> None:
    message = {"op": "exec", "id": 1, "code": "", **fields}
    found = exec_error(message, {"python", "bash"})
    assert (found is None) if problem is None else (found is not None and problem in found)


class Node:
    """A module-level class, so stdlib pickle can save its instances by reference."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.other: Node | None = None


def test_names_that_refer_to_each_other_are_saved_together(tmp_path: Path) -> None:
    parent, child, alone = Node("parent"), Node("child"), Node("alone")
    parent.other, child.other = child, parent  # a cycle between two names (fig and ax)
    users = {"parent": parent}  # refers into the cycle from outside
    shell = FakeShell({"parent": parent, "alone": alone, "child": child, "users": users})
    report = state.save(shell, str(tmp_path), 100_000)
    assert set(names(report["kept"])) == {"parent", "alone", "child", "users"}
    by_name = {v["name"]: v["bytes"] for v in report["kept"]}
    assert by_name["parent"] > 0 and by_name["child"] == 0  # one file, counted once
    new = FakeShell()
    assert set(load(new, str(tmp_path))["restored"]) == {"parent", "alone", "child", "users"}
    ns = new.namespace
    assert ns["parent"].other is ns["child"] and ns["child"].other is ns["parent"]
    assert ns["users"]["parent"] is ns["parent"]


def test_a_cycle_over_the_budget_is_dropped_whole(tmp_path: Path) -> None:
    a, b = Node("a" * 40_000), Node("b")
    a.other, b.other = b, a
    report = state.save(FakeShell({"a": a, "b": b, "c": 1}), str(tmp_path), 20_000)
    assert names(report["kept"]) == ["c"]
    why = {d["name"]: d["why"] for d in report["dropped"]}
    assert why["a"].startswith("too large") and why["b"] == "refers to a, which is not saved"
    # Each fits alone; together (what a load needs) they pass the budget.
    a.name, b.name = "a" * 12_000, "b" * 12_000
    report = state.save(FakeShell({"a": a, "b": b, "c": 1}), str(tmp_path), 20_000)
    assert names(report["kept"]) == ["c"]
    assert sorted(names(report["dropped"])) == ["a", "b"]
    assert all(d["why"].startswith("too large") for d in report["dropped"])
