"""Copying a paused session's files into a warm sandbox's workspace (workspace/transfer.py):
hostile trees, from the host side."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from mcp_code_sandbox.workspace.fs import MAX_DEPTH
from mcp_code_sandbox.workspace.transfer import CopyRefused, copy_tree

BIG = 1 << 30


def copy(source: Path, target: Path, **kw: object) -> object:
    values: dict[str, object] = {"owner": None, "max_bytes": BIG, "max_entries": 10_000}
    values.update(kw)
    return copy_tree(source, target, **values)  # type: ignore[arg-type]


@pytest.fixture
def trees(tmp_path: Path) -> tuple[Path, Path]:
    source, target = tmp_path / "old", tmp_path / "new"
    source.mkdir()
    target.mkdir()
    return source, target


def test_files_dirs_and_links_are_copied_links_never_followed(trees: tuple[Path, Path]) -> None:
    source, target = trees
    (source / "sub" / "deeper").mkdir(parents=True)
    (source / "sub" / "deeper" / "data.txt").write_text("deep")
    os.chmod(source / "sub" / "deeper" / "data.txt", 0o4750)  # set-uid: not carried
    os.utime(source / "sub" / "deeper" / "data.txt", ns=(1, 2_000_000_000))
    secret = source.parent / "secret"
    secret.write_text("host file")
    (source / "to-secret").symlink_to(secret)
    (source / "to-dir").symlink_to("sub")
    os.mkfifo(source / "fifo")
    copied = copy(source, target)
    data = target / "sub" / "deeper" / "data.txt"
    assert data.read_text() == "deep"
    assert stat.S_IMODE(data.stat().st_mode) == 0o750
    assert data.stat().st_mtime_ns == 2_000_000_000
    assert os.readlink(target / "to-secret") == str(secret)
    assert os.readlink(target / "to-dir") == "sub"
    assert not (target / "fifo").exists()
    assert (copied.files, copied.dirs, copied.links, copied.skipped) == (1, 2, 2, 1)  # type: ignore[attr-defined]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_every_entry_is_given_to_the_new_owner(trees: tuple[Path, Path]) -> None:
    source, target = trees
    (source / "d").mkdir()
    (source / "d" / "f").write_text("x")
    (source / "l").symlink_to("d")
    copy(source, target, owner=(54321, 54322))
    for path in (target / "d", target / "d" / "f", target / "l"):
        st = os.lstat(path)
        assert (st.st_uid, st.st_gid) == (54321, 54322), path


def test_a_hard_link_refuses_the_copy(trees: tuple[Path, Path]) -> None:
    source, target = trees
    (source / "a").write_text("A")
    os.link(source / "a", source / "b")
    with pytest.raises(CopyRefused, match="hard links"):
        copy(source, target)


def test_files_with_hard_links_can_be_left_out_and_named(trees: tuple[Path, Path]) -> None:
    source, target = trees
    (source / "sub").mkdir()
    (source / "sub" / "a").write_text("A")
    os.link(source / "sub" / "a", source / "b")
    (source / "kept").write_text("K")
    os.mkfifo(source / "sub" / "pipe")
    copied = copy(source, target, hard_links="skip")
    assert (target / "kept").read_text() == "K"
    assert not (target / "b").exists() and not (target / "sub" / "a").exists()
    assert sorted(copied.left_out) == ["b", "sub/a", "sub/pipe"]  # type: ignore[attr-defined]
    assert copied.skipped == 3  # type: ignore[attr-defined]


def test_a_sparse_file_counts_at_the_size_it_claims(trees: tuple[Path, Path]) -> None:
    source, target = trees
    with open(source / "sparse", "wb") as f:
        f.truncate(100 << 30)
    with pytest.raises(CopyRefused, match="bytes"):
        copy(source, target, max_bytes=1 << 20)
    assert not (target / "sparse").exists()


def test_too_many_bytes_or_entries_refuse_the_copy(trees: tuple[Path, Path]) -> None:
    source, target = trees
    for n in range(5):
        (source / f"f{n}").write_bytes(b"x" * 100)
    with pytest.raises(CopyRefused, match="bytes"):
        copy(source, target, max_bytes=450)
    again = target.parent / "again"
    again.mkdir()
    with pytest.raises(CopyRefused, match="entries"):
        copy(source, again, max_entries=3)


def test_a_tree_deeper_than_the_walks_refuses_the_copy(trees: tuple[Path, Path]) -> None:
    source, target = trees
    deep = source
    for _ in range(MAX_DEPTH + 1):
        deep = deep / "d"
    deep.mkdir(parents=True)
    with pytest.raises(CopyRefused, match="deeper"):
        copy(source, target)
