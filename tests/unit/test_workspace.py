"""Workspace: hostile paths from clients, hostile files from the sandbox. Real files only.

The file tests run on both implementations of the workspace seam (``workspace.seam``):
the host's directory (``DirectoryFiles``) and the agent's, over the real agent's ``fs``
requests (``sessions.agent_files.AgentFiles``, the Kubernetes backend's): the same
rules, results and errors on each. Life-cycle tests (create, destroy, owners) are the
directory's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from mcp_code_sandbox.errors import (
    FileExists_,
    InvalidArgument,
    InvalidFilename,
    InvalidPath,
    NotFound,
    QuotaExceeded,
)
from mcp_code_sandbox.workspace import (
    Snapshot,
    Workspace,
    diff,
    guess_mime,
    is_text,
    is_text_mime,
    looks_like_text,
    parse_path,
    remove_tree,
)
from mcp_code_sandbox.workspace.entries import Change, FileInfo, ListResult, ReadResult
from mcp_code_sandbox.workspace.seam import DirectoryFiles, Files
from tests.fakes import agent_files

SRC = Path(__file__).resolve().parents[2] / "src"


class SyncFiles:
    """A :class:`Files` called from a plain test, on ``runner``'s loop; ``root`` is the
    directory the sandbox sees as /mnt/data, where tests plant what user code would."""

    def __init__(self, files: Files, root: Path, runner: asyncio.Runner) -> None:
        self.files = files
        self.root = root
        self._runner = runner

    def write_file(self, rel: str, data: bytes | BinaryIO, *, overwrite: bool) -> FileInfo:
        return self._runner.run(self.files.write_file(rel, data, overwrite=overwrite))

    def read_file(self, rel: str, *, offset: int = 0, max_bytes: int) -> ReadResult:
        return self._runner.run(self.files.read_file(rel, offset=offset, max_bytes=max_bytes))

    def open_file(self, rel: str) -> tuple[BinaryIO, FileInfo]:
        return self._runner.run(self.files.open_file(rel))

    def list_files(
        self, rel: str = ".", *, recursive: bool = True, limit: int = 10000
    ) -> ListResult:
        return self._runner.run(self.files.list_files(rel, recursive=recursive, limit=limit))

    def snapshot(self, limit: int = 20000, *, count_hidden: bool = False) -> Snapshot:
        return self._runner.run(self.files.snapshot(limit, count_hidden=count_hidden))

    def usage_bytes(self, limit: int = 200_000) -> int:
        return self._runner.run(self.files.usage_bytes(limit))

    @staticmethod
    def diff(before: Snapshot, after: Snapshot) -> list[Change]:
        return diff(before, after)


MakeFiles = Callable[[int], SyncFiles]


async def _blocking(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(fn, *args, **kwargs)


@pytest.fixture(params=["directory", "agent"])
def make_ws(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeFiles]:
    """Makes a workspace of that quota at ``tmp_path/ws``, on the directory or the agent."""
    with asyncio.Runner() as runner:
        stack = contextlib.AsyncExitStack()

        def make(quota_bytes: int) -> SyncFiles:
            workspace = Workspace(tmp_path / "ws", quota_bytes=quota_bytes)
            workspace.create()
            if request.param == "directory":
                return SyncFiles(DirectoryFiles(workspace, _blocking), workspace.root, runner)
            opened = agent_files(workspace.root, quota_bytes, _blocking)
            files = runner.run(stack.enter_async_context(opened))
            return SyncFiles(files, workspace.root, runner)

        try:
            yield make
        finally:
            runner.run(stack.aclose())


@pytest.fixture
def ws(make_ws: MakeFiles) -> SyncFiles:
    return make_ws(1 << 20)


@pytest.fixture
def dir_ws(tmp_path: Path) -> Workspace:
    """The directory's own workspace: its life cycle is not the seam's."""
    workspace = Workspace(tmp_path / "ws", quota_bytes=1 << 20)
    workspace.create()
    return workspace


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# --- parse_path ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rel",
    [
        "",
        "../x",
        "a/../../x",
        "a/..",
        "..",
        "/etc/passwd",
        "/mnt/datax/y",
        "a\x00b",
        "a\nb",
        "a\x1bb",
        "a\x7fb",
        "a\x85b",
        "a\\b",
        "..\\x",
        "x" * 256,
        "a/" * 2049,
        "\udcff",
    ],
)
def test_parse_path_refuses_hostile_paths(rel: str) -> None:
    with pytest.raises(InvalidPath) as info:
        parse_path(rel, for_upload=False)
    assert "like 'data.csv'" in info.value.message  # says what a valid path looks like
    with pytest.raises(InvalidFilename):
        parse_path(rel, for_upload=True)


@pytest.mark.parametrize(
    ("rel", "parts"),
    [
        ("ok.txt", ("ok.txt",)),
        ("/mnt/data/ok.txt", ("ok.txt",)),
        ("./a//b/./c.csv", ("a", "b", "c.csv")),
        ("x" * 255, ("x" * 255,)),
        ("données/ü.txt", ("données", "ü.txt")),
        ("a..b", ("a..b",)),
        (".hidden", (".hidden",)),
    ],
)
def test_parse_path_accepts_and_normalises(rel: str, parts: tuple[str, ...]) -> None:
    assert parse_path(rel, for_upload=True) == parts


@pytest.mark.parametrize("rel", [".", "/mnt/data", "/mnt/data/", "./"])
def test_root_is_a_path_but_not_a_filename(rel: str) -> None:
    assert parse_path(rel, for_upload=False) == ()
    with pytest.raises(InvalidFilename):
        parse_path(rel, for_upload=True)


def test_upload_name_with_trailing_slash_is_refused() -> None:
    assert parse_path("dir/", for_upload=False) == ("dir",)
    with pytest.raises(InvalidFilename):
        parse_path("dir/", for_upload=True)


# --- write ---------------------------------------------------------------------------------


def test_write_then_read_round_trip(ws: SyncFiles) -> None:
    info = ws.write_file("/mnt/data/sub/dir/data.csv", b"a,b\n1,2\n", overwrite=False)
    assert (info.path, info.size_bytes, info.mime_type) == ("sub/dir/data.csv", 8, "text/csv")
    assert info.modified.endswith("Z")
    read = ws.read_file("sub/dir/data.csv", max_bytes=100)
    assert read.data == b"a,b\n1,2\n" and read.eof and read.is_text
    assert _tree(ws.root) == {"sub", "sub/dir", "sub/dir/data.csv"}


def test_upload_overwrite_semantics(ws: SyncFiles) -> None:
    ws.write_file("a.txt", b"one", overwrite=False)
    with pytest.raises(FileExists_):
        ws.write_file("a.txt", b"two", overwrite=False)
    assert (ws.root / "a.txt").read_bytes() == b"one"
    ws.write_file("a.txt", b"three", overwrite=True)
    assert (ws.root / "a.txt").read_bytes() == b"three"
    assert _tree(ws.root) == {"a.txt"}  # no temporary files left


def test_write_refuses_to_replace_a_directory_or_symlink(ws: SyncFiles) -> None:
    (ws.root / "d").mkdir()
    (ws.root / "link").symlink_to("/etc/passwd")
    for name in ("d", "link"):
        with pytest.raises(InvalidPath):
            ws.write_file(name, b"x", overwrite=True)
        with pytest.raises(FileExists_):
            ws.write_file(name, b"x", overwrite=False)
    assert (ws.root / "link").is_symlink() and (ws.root / "d").is_dir()
    assert _tree(ws.root) == {"d", "link"}


def test_write_through_symlinked_dir_is_refused(ws: SyncFiles, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (ws.root / "link").symlink_to(outside)
    (ws.root / "etc").symlink_to("/etc")
    for rel in ("link/x", "link/new/x", "etc/x"):
        with pytest.raises(InvalidPath, match="symbolic link"):
            ws.write_file(rel, b"pwned", overwrite=True)
    assert list(outside.iterdir()) == []
    assert not Path("/etc/x").exists()


def test_write_below_a_file_is_refused(ws: SyncFiles) -> None:
    ws.write_file("f", b"x", overwrite=False)
    with pytest.raises(InvalidPath, match="not a directory"):
        ws.write_file("f/g", b"y", overwrite=False)


def test_quota_exceeded_leaves_nothing_behind(make_ws: MakeFiles) -> None:
    ws = make_ws(100)
    ws.write_file("a.bin", b"x" * 60, overwrite=False)
    with pytest.raises(QuotaExceeded) as info:
        ws.write_file("new/dir/b.bin", b"y" * 41, overwrite=False)
    assert info.value.details == {"used_bytes": 60, "quota_bytes": 100}
    assert _tree(ws.root) == {"a.bin"}  # no partial file, no temp file, no new dirs
    ws.write_file("b.bin", b"y" * 40, overwrite=False)  # exactly at the quota is fine
    # Replacing a file counts only the difference.
    ws.write_file("a.bin", b"z" * 60, overwrite=True)
    assert ws.usage_bytes() == 100


def test_quota_counts_what_the_sandbox_wrote(make_ws: MakeFiles) -> None:
    ws = make_ws(100)
    (ws.root / "deep" / "er").mkdir(parents=True)
    (ws.root / "deep" / "er" / "big").write_bytes(b"x" * 90)
    with pytest.raises(QuotaExceeded):
        ws.write_file("c", b"y" * 11, overwrite=False)


def test_packages_saved_outputs_and_variables_are_counted_but_neither_artifacts_nor_listed(
    ws: SyncFiles,
) -> None:
    before = ws.snapshot()
    site = ws.root / ".packages" / "python" / "lib" / "site-packages" / "demo"
    site.mkdir(parents=True)
    (site / "__init__.py").write_bytes(b"x" * 70)
    (ws.root / ".outputs").mkdir()
    (ws.root / ".outputs" / "run-1.txt").write_bytes(b"y" * 20)
    # The variables a paused session saved (agent/statefiles.py).
    (ws.root / ".session" / "data-0123456789abcdef").mkdir(parents=True)
    (ws.root / ".session" / "data-0123456789abcdef" / "v0.pkl").write_bytes(b"p" * 40)
    (ws.root / ".session" / "manifest.json").write_bytes(b"m" * 5)
    (ws.root / "data.csv").write_bytes(b"z" * 10)
    after = ws.snapshot(count_hidden=True)
    assert [change.path for change in ws.diff(before, after)] == ["data.csv"]
    assert after.hidden_bytes == 135 and after.used_bytes == 145
    listed = [entry.path for entry in ws.list_files(".").entries]
    assert ".packages" not in listed and not any(p.startswith(".packages/") for p in listed)
    assert not any(p.startswith(".outputs") for p in listed)
    assert not any(p.startswith(".session") for p in listed)
    assert "data.csv" in listed
    by_path = [entry.path for entry in ws.list_files(".packages").entries]
    assert ".packages/python/lib/site-packages/demo/__init__.py" in by_path
    assert [e.path for e in ws.list_files(".outputs").entries] == [".outputs/run-1.txt"]
    assert {e.path for e in ws.list_files(".session").entries} >= {
        ".session/manifest.json",
        ".session/data-0123456789abcdef/v0.pkl",
    }


def test_invalid_quota_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        Workspace(tmp_path, quota_bytes=0)


# --- read ----------------------------------------------------------------------------------


def test_read_symlink_to_passwd_is_refused(ws: SyncFiles) -> None:
    (ws.root / "passwd").symlink_to("/etc/passwd")
    with pytest.raises(InvalidPath, match="symbolic link") as info:
        ws.read_file("passwd", max_bytes=1000)
    assert "root:" not in str(info.value)


def test_read_through_symlinked_dir_is_refused(ws: SyncFiles) -> None:
    (ws.root / "link").symlink_to("/etc")
    with pytest.raises(InvalidPath, match="symbolic link"):
        ws.read_file("link/passwd", max_bytes=1000)
    (ws.root / "root").symlink_to("/")
    with pytest.raises(InvalidPath):
        ws.read_file("root/etc/passwd", max_bytes=1000)


def test_read_hard_link_to_outside_file_is_refused(ws: SyncFiles, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    os.link(secret, ws.root / "stolen.txt")
    with pytest.raises(InvalidPath, match="hard link") as info:
        ws.read_file("stolen.txt", max_bytes=1000)
    assert "host secret" not in str(info.value)
    with pytest.raises(InvalidPath):
        ws.open_file("stolen.txt")


def test_read_fifo_does_not_hang(ws: SyncFiles) -> None:
    os.mkfifo(ws.root / "fifo")
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            ws.read_file("fifo", max_bytes=10)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), "reading a FIFO hung the server"
    assert len(outcome) == 1 and isinstance(outcome[0], InvalidPath)


def test_read_socket_is_refused(ws: SyncFiles) -> None:
    import socket

    sock = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    try:
        os.chdir(ws.root)  # AF_UNIX paths are short: bind by a relative name
        sock.bind("sock")
    finally:
        os.chdir(cwd)
    with sock, pytest.raises(InvalidPath):
        ws.read_file("sock", max_bytes=10)


def test_read_directory_and_root_are_refused(ws: SyncFiles) -> None:
    (ws.root / "d").mkdir()
    with pytest.raises(InvalidPath, match="directory"):
        ws.read_file("d", max_bytes=10)
    with pytest.raises(InvalidPath):
        ws.read_file(".", max_bytes=10)


def test_read_missing_is_not_found(ws: SyncFiles) -> None:
    with pytest.raises(NotFound):
        ws.read_file("nope.txt", max_bytes=10)
    with pytest.raises(NotFound):
        ws.read_file("no/such/dir.txt", max_bytes=10)


def test_read_paging(ws: SyncFiles) -> None:
    ws.write_file("t.txt", b"0123456789", overwrite=False)
    first = ws.read_file("t.txt", offset=0, max_bytes=4)
    assert (first.data, first.next_offset, first.eof, first.size_bytes) == (b"0123", 4, False, 10)
    last = ws.read_file("t.txt", offset=8, max_bytes=4)
    assert (last.data, last.next_offset, last.eof) == (b"89", 10, True)
    exact = ws.read_file("t.txt", offset=6, max_bytes=4)
    assert exact.eof
    beyond = ws.read_file("t.txt", offset=50, max_bytes=4)
    assert (beyond.data, beyond.eof) == (b"", True)
    meta = ws.read_file("t.txt", max_bytes=0)
    assert (meta.data, meta.size_bytes, meta.mime_type) == (b"", 10, "text/plain")
    with pytest.raises(InvalidArgument):
        ws.read_file("t.txt", offset=-1, max_bytes=4)


def test_read_detects_binary_and_magic(ws: SyncFiles) -> None:
    ws.write_file("noext", b"\x89PNG\r\n\x1a\n" + b"\x00" * 20, overwrite=False)
    read = ws.read_file("noext", max_bytes=100)
    assert read.mime_type == "image/png" and not read.is_text
    ws.write_file("notes", "héllo\n".encode(), overwrite=False)
    notes = ws.read_file("notes", max_bytes=100)
    assert notes.mime_type == "application/octet-stream" and notes.is_text


def test_open_file_streams_and_checks(ws: SyncFiles) -> None:
    ws.write_file("r.pdf", b"%PDF-1.4 ...", overwrite=False)
    stream, info = ws.open_file("r.pdf")
    with stream:
        assert stream.read() == b"%PDF-1.4 ..."
    assert (info.size_bytes, info.mime_type) == (12, "application/pdf")
    (ws.root / "l").symlink_to("r.pdf")
    with pytest.raises(InvalidPath):
        ws.open_file("l")


# --- listing -------------------------------------------------------------------------------


def test_listing_shows_symlinks_and_does_not_descend(ws: SyncFiles) -> None:
    ws.write_file("b/c.py", b"print(1)", overwrite=False)
    ws.write_file("a.txt", b"hi", overwrite=False)
    (ws.root / "etc").symlink_to("/etc")
    (ws.root / "pw").symlink_to("/etc/passwd")
    os.mkfifo(ws.root / "f")
    listing = ws.list_files()
    got = {e.path: (e.type, e.size_bytes, e.mime_type) for e in listing.entries}
    assert got == {
        "a.txt": ("file", 2, "text/plain"),
        "b": ("directory", 0, "inode/directory"),
        "b/c.py": ("file", 8, "text/x-python"),
        "etc": ("symlink", 0, "inode/symlink"),
        "f": ("other", 0, "inode/fifo"),
        "pw": ("symlink", 0, "inode/symlink"),
    }
    assert [e.path for e in listing.entries] == ["a.txt", "b", "b/c.py", "etc", "f", "pw"]
    assert not listing.truncated and listing.path == "."
    assert all(e.modified.endswith("Z") for e in listing.entries)


def test_listing_subdir_non_recursive_and_errors(ws: SyncFiles) -> None:
    ws.write_file("d/x/y.txt", b"1", overwrite=False)
    ws.write_file("d/z.txt", b"2", overwrite=False)
    ws.write_file(".outputs/run-1.txt", b"out", overwrite=False)
    shallow = ws.list_files("/mnt/data/d", recursive=False)
    assert [e.path for e in shallow.entries] == ["d/x", "d/z.txt"]
    assert ".outputs/run-1.txt" not in {e.path for e in ws.list_files().entries}
    assert [e.path for e in ws.list_files(".outputs").entries] == [".outputs/run-1.txt"]
    (ws.root / "etc").symlink_to("/etc")
    with pytest.raises(InvalidPath):
        ws.list_files("etc")
    with pytest.raises(InvalidPath):
        ws.list_files("d/z.txt")
    with pytest.raises(NotFound):
        ws.list_files("missing")
    with pytest.raises(InvalidPath):
        ws.list_files("../")
    with pytest.raises(InvalidArgument):
        ws.list_files(limit=0)


def test_listing_limit_truncates(ws: SyncFiles) -> None:
    for i in range(30):
        (ws.root / f"f{i:02}").write_bytes(b"")
    listing = ws.list_files(limit=10)
    assert len(listing.entries) == 10 and listing.truncated
    paths = [e.path for e in listing.entries]
    assert paths == sorted(paths)
    assert not ws.list_files(limit=30).truncated


def test_listing_deep_tree_is_bounded(ws: SyncFiles) -> None:
    fd = os.open(ws.root, os.O_RDONLY)
    for _ in range(100):  # deeper than any walk descends
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(fd)
    listing = ws.list_files()
    assert listing.truncated and 0 < len(listing.entries) < 100


def test_listing_survives_hostile_names_and_mtimes(ws: SyncFiles) -> None:
    raw = os.fsencode(ws.root) + b"/bad\xff\nname"
    with open(raw, "wb"):
        pass
    (ws.root / "future").write_bytes(b"")
    os.utime(ws.root / "future", ns=(0, 2**62))
    entries = {e.path: e for e in ws.list_files().entries}
    assert "bad\ufffd\nname" in entries
    assert entries["future"].modified.endswith("Z")


# --- snapshot / diff -----------------------------------------------------------------------


def test_snapshot_diff_created_and_modified(ws: SyncFiles) -> None:
    ws.write_file("keep.txt", b"same", overwrite=False)
    ws.write_file("edit.csv", b"1,2", overwrite=False)
    ws.write_file("gone.txt", b"bye", overwrite=False)
    before = ws.snapshot()
    st = os.stat(ws.root / "edit.csv")
    (ws.root / "edit.csv").write_bytes(b"3,4")  # same size, new content
    os.utime(ws.root / "edit.csv", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    (ws.root / "gone.txt").unlink()
    (ws.root / "plots").mkdir()
    (ws.root / "plots" / "fig.png").write_bytes(b"\x89PNG")
    (ws.root / ".outputs").mkdir()
    (ws.root / ".outputs" / "run-1.txt").write_bytes(b"out")
    after = ws.snapshot()
    changes = diff(before, after)
    assert [(c.path, c.change, c.size_bytes, c.mime_type) for c in changes] == [
        ("edit.csv", "modified", 3, "text/csv"),
        ("plots/fig.png", "created", 4, "image/png"),
    ]
    assert ws.diff(before, after) == changes
    assert ".outputs/run-1.txt" not in after.files


def test_diff_catches_rewrite_that_keeps_size_and_mtime(ws: SyncFiles) -> None:
    ws.write_file("data.csv", b"1,2", overwrite=False)
    st = os.stat(ws.root / "data.csv")
    before = ws.snapshot()
    time.sleep(0.01)
    (ws.root / "data.csv").write_bytes(b"3,4")
    os.utime(ws.root / "data.csv", ns=(st.st_atime_ns, st.st_mtime_ns))  # like copy2
    assert [c.change for c in diff(before, ws.snapshot())] == ["modified"]


def test_snapshot_ignores_links_and_is_bounded(ws: SyncFiles) -> None:
    (ws.root / "etc").symlink_to("/etc")
    (ws.root / "pw").symlink_to("/etc/passwd")
    for i in range(20):
        (ws.root / f"f{i}").write_bytes(b"x")
    full = ws.snapshot()
    assert set(full.files) == {f"f{i}" for i in range(20)} and not full.truncated
    partial = ws.snapshot(limit=5)
    assert partial.truncated and len(partial.files) <= 5
    assert diff(Snapshot({}, False), Snapshot({}, False)) == []


def test_failed_writes_leave_no_temp_files(make_ws: MakeFiles) -> None:
    ws = make_ws(10)
    ws.write_file("a", b"1", overwrite=False)
    before = ws.snapshot()
    for call in (
        lambda: ws.write_file("a", b"2", overwrite=False),
        lambda: ws.write_file("b", b"x" * 11, overwrite=False),
        lambda: ws.write_file("../b", b"x", overwrite=False),
    ):
        with pytest.raises((FileExists_, QuotaExceeded, InvalidFilename)):
            call()
    assert diff(before, ws.snapshot()) == []
    assert _tree(ws.root) == {"a"}


# --- life cycle ----------------------------------------------------------------------------


def _hostile_tree(root: Path) -> None:
    (root / "locked" / "inner").mkdir(parents=True)
    (root / "locked" / "inner" / "f").write_bytes(b"x")
    (root / "readonly").mkdir()
    (root / "readonly" / "g").write_bytes(b"y")
    (root / "etc").symlink_to("/etc")
    os.mkfifo(root / "fifo")
    os.chmod(root / "locked" / "inner", 0)
    os.chmod(root / "locked", 0)
    os.chmod(root / "readonly", 0o500)


def test_destroy_removes_hostile_tree_without_following_links(
    dir_ws: Workspace, tmp_path: Path
) -> None:
    ws = dir_ws
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"keep")
    (ws.root / "out").symlink_to(outside)
    _hostile_tree(ws.root)
    ws.destroy()
    assert not ws.root.exists()
    assert (outside / "keep").read_bytes() == b"keep"
    ws.destroy()  # idempotent


def test_destroy_deep_tree(dir_ws: Workspace) -> None:
    ws = dir_ws
    fd = os.open(ws.root, os.O_RDONLY)
    for _ in range(300):
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(fd)
    ws.destroy()
    assert not ws.root.exists()


def test_destroy_as_unprivileged_owner(tmp_path: Path) -> None:
    # As root, chmod 000 stops nothing; run the removal as a plain uid to prove it works
    # for a server that is not root (and whose sandbox shares its uid).
    if os.geteuid() != 0:
        root = tmp_path / "ws"
        root.mkdir()
        _hostile_tree(root)
        remove_tree(root)
        assert not root.exists()
        return
    base = Path(tempfile.mkdtemp())
    try:
        _run_as_other_uid(base)
    finally:
        remove_tree(base)


def _run_as_other_uid(base: Path) -> None:
    # The child gets its own copy of the package: the server's tree may not be readable.
    shutil.copytree(
        SRC / "mcp_code_sandbox",
        base / "src" / "mcp_code_sandbox",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    root = base / "ws"
    script = "\n".join(
        [
            "import os, sys",
            f"sys.path.insert(0, {str(base / 'src')!r})",
            "from pathlib import Path",
            "from mcp_code_sandbox.workspace import remove_tree",
            inspect.getsource(_hostile_tree),
            f"root = Path({str(root)!r}); root.mkdir(); _hostile_tree(root)",
            "remove_tree(root)",
            "print('gone' if not root.exists() else 'left')",
        ]
    )
    for dirpath, _dirs, _files in os.walk(base):
        os.chown(dirpath, 12345, 12345)
    os.chmod(base, 0o755)
    python = _python_for(12345)
    if python is None:
        pytest.skip("no Python >= 3.11 that uid 12345 can run (the venv's is under /root)")
    done = subprocess.run(
        [python, "-S", "-c", script],
        user=12345,
        group=12345,
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert done.stdout.strip() == "gone", done.stderr


def _python_for(uid: int) -> str | None:
    check = "import sys; sys.exit(sys.version_info < (3, 11))"
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            ok = (
                subprocess.run(
                    [candidate, "-S", "-c", check],
                    user=uid,
                    group=uid,
                    capture_output=True,
                    timeout=30,
                    cwd="/",
                ).returncode
                == 0
            )
        except OSError:
            continue
        if ok:
            return candidate
    return None


def test_owner_is_given_everything_created(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    ws = Workspace(tmp_path / "ws", quota_bytes=1 << 20, owner=(12345, 12345))
    ws.create()
    ws.write_file("a/b/c.txt", b"x", overwrite=False)
    for path in (ws.root, ws.root / "a", ws.root / "a" / "b", ws.root / "a" / "b" / "c.txt"):
        st = os.stat(path)
        assert (st.st_uid, st.st_gid) == (12345, 12345), path
    assert stat.S_IMODE(os.stat(ws.root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(ws.root / "a").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(ws.root / "a/b/c.txt").st_mode) == 0o644


def test_create_keeps_existing_files(dir_ws: Workspace) -> None:
    ws = dir_ws
    ws.write_file("a.txt", b"1", overwrite=False)
    ws.create()
    assert (ws.root / "a.txt").read_bytes() == b"1"


# --- mime ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "head", "mime"),
    [
        ("x.csv", None, "text/csv"),
        ("x.md", None, "text/markdown"),
        ("x.parquet", None, "application/vnd.apache.parquet"),
        ("x.py", None, "text/x-python"),
        ("x.ipynb", None, "application/x-ipynb+json"),
        ("x.ts", None, "text/x-typescript"),
        ("X.PNG", None, "image/png"),
        ("a.tar.gz", None, "application/gzip"),
        ("x.xlsx", None, "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"),
        ("data:text/html,x", None, "application/octet-stream"),
        ("blob", b"\x89PNG\r\n\x1a\nrest", "image/png"),
        ("blob", b"\xff\xd8\xff\xe0", "image/jpeg"),
        ("blob", b"GIF89a", "image/gif"),
        ("blob", b"RIFF\x00\x00\x00\x00WEBPVP8 ", "image/webp"),
        ("blob", b"%PDF-1.7", "application/pdf"),
        ("blob", b"PK\x03\x04", "application/zip"),
        ("blob", b"hello", "application/octet-stream"),
        ("blob", None, "application/octet-stream"),
    ],
)
def test_guess_mime(name: str, head: bytes | None, mime: str) -> None:
    assert guess_mime(name, head) == mime


def test_text_helpers() -> None:
    assert is_text("text/csv") and is_text("application/json") and is_text("image/svg+xml")
    assert not is_text("image/png")
    assert looks_like_text("é€".encode()[:-1])  # cut mid-character at the end
    assert looks_like_text("é€".encode()[1:])  # a page starting mid-character
    assert not looks_like_text(b"a\x00b")
    assert not looks_like_text(b"\xff\xfe\xfa")
    assert is_text_mime("text/plain", b"\xff")
    assert is_text_mime("application/octet-stream", b"plain")
    assert not is_text_mime("image/png", b"plain")
