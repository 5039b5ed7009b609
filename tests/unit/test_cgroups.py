"""cgroups.detect / create / remove / list_leftovers against fake cgroup trees.

cgroup v2 logic can only be tested this way here: this machine mounts cgroup v1 (the
integration tests exercise v1 for real). A fake tree is plain directories and files, so
the kernel's own behaviour (interface files appearing on mkdir, EBUSY) is not simulated:
these tests check which files we read and write, and what we conclude from them.
"""

from __future__ import annotations

import os
from pathlib import Path

from mcp_code_sandbox.backends.base import Limits
from mcp_code_sandbox.backends.bwrap import cgroups

LIMITS = Limits(memory_bytes=256 << 20, cpu=0.5, pids=64, tmp_bytes=1 << 20, file_bytes=1 << 20)


def fake_v1(root: Path, own: str = "/") -> Path:
    files = {"memory": "memory.limit_in_bytes", "cpu": "cpu.cfs_quota_us", "pids": "pids.max"}
    for controller, limit_file in files.items():
        base = root / controller / own.lstrip("/") / cgroups.BASE_NAME
        base.mkdir(parents=True)
        (base / limit_file).write_text("max\n")
    return root


def fake_v2(root: Path, controllers: str = "cpu memory pids", procs: str = "") -> Path:
    own = root / "svc"
    own.mkdir(parents=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (own / "cgroup.controllers").write_text(controllers + "\n")
    (own / "cgroup.subtree_control").write_text("")
    (own / "cgroup.procs").write_text(procs)
    return root


def test_v1_detect_and_create(tmp_path: Path) -> None:
    support = cgroups.detect(fake_v1(tmp_path), proc_cgroup="4:memory:/\n8:pids:/\n1:cpu:/\n")
    assert support.version == 1
    assert support.enforceable == {"memory", "cpu", "pids"}
    handle = support.create("k1", LIMITS)
    assert handle is not None and len(handle.dirs) == 3
    mem = tmp_path / "memory" / cgroups.BASE_NAME / support.name_for("k1")
    assert (mem / "memory.limit_in_bytes").read_text() == str(256 << 20)
    cpu = tmp_path / "cpu" / cgroups.BASE_NAME / support.name_for("k1")
    assert (cpu / "cpu.cfs_quota_us").read_text() == "50000"
    assert (cpu / "cpu.cfs_period_us").read_text() == "100000"
    assert [p.name for p in handle.procs_files] == ["cgroup.procs"] * 3


def test_v1_uses_own_cgroup_when_visible(tmp_path: Path) -> None:
    fake_v1(tmp_path, own="/svc/a")
    support = cgroups.detect(tmp_path, proc_cgroup="4:memory:/svc/a\n8:pids:/svc/a\n1:cpu:/svc/a\n")
    assert support.bases["memory"] == tmp_path / "memory/svc/a" / cgroups.BASE_NAME


def test_v1_missing_hierarchy_is_reported(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    support = cgroups.detect(tmp_path, proc_cgroup="")
    assert "pids" not in support.enforceable and "pids" in support.reasons


def test_v1_base_made_by_another_user_is_rlimits_only(tmp_path: Path) -> None:
    """A base directory left by a root server: a server that is not root sees it exists
    but cannot make its sandboxes' cgroups in it (starting one would fail)."""
    root = fake_v1(tmp_path)
    bases = [root / c / cgroups.BASE_NAME for c in ("memory", "cpu", "pids")]
    for base in bases:
        base.chmod(0o555)
    try:
        support = cgroups.detect(root, proc_cgroup="")
    finally:
        for base in bases:
            base.chmod(0o755)
    if os.geteuid() != 0:  # root ignores file modes: nothing to observe then
        assert not support.enforceable and "not writable" in support.reasons["memory"]
        assert support.create("k", LIMITS) is None
    else:
        assert support.enforceable == {"memory", "cpu", "pids"}


def test_nothing_mounted(tmp_path: Path) -> None:
    support = cgroups.detect(tmp_path, proc_cgroup="")
    assert support.version is None and not support.enforceable
    assert support.create("k", LIMITS) is None


def test_v2_enables_controllers_and_creates(tmp_path: Path) -> None:
    root = fake_v2(tmp_path)
    support = cgroups.detect(root, proc_cgroup="0::/svc\n")
    assert support.version == 2 and support.enforceable == {"memory", "cpu", "pids"}
    assert (root / "svc" / "cgroup.subtree_control").read_text() == "+memory +cpu +pids"
    base = root / "svc" / cgroups.BASE_NAME
    assert (base / "cgroup.subtree_control").read_text() == "+memory +cpu +pids"
    handle = support.create("k2", LIMITS)
    assert handle is not None and handle.dirs == [base / support.name_for("k2")]
    d = handle.dirs[0]
    assert (d / "memory.max").read_text() == str(256 << 20)
    assert (d / "cpu.max").read_text() == "50000 100000"
    assert (d / "pids.max").read_text() == "64"


def test_v2_moves_the_server_into_a_leaf(tmp_path: Path) -> None:
    root = fake_v2(tmp_path, procs=f"{os.getpid()}\n")
    cgroups.detect(root, proc_cgroup="0::/svc\n")
    assert (root / "svc" / "server" / "cgroup.procs").read_text() == str(os.getpid())


def test_v2_without_delegated_controllers(tmp_path: Path) -> None:
    support = cgroups.detect(fake_v2(tmp_path, controllers="cpu"), proc_cgroup="0::/svc\n")
    assert support.enforceable == {"cpu"}
    assert "not delegated" in support.reasons["memory"]


def test_v2_read_only_is_rlimits_only(tmp_path: Path) -> None:
    root = fake_v2(tmp_path)
    (root / "svc" / "cgroup.subtree_control").chmod(0o444)
    os.chmod(root / "svc", 0o555)
    try:
        support = cgroups.detect(root, proc_cgroup="0::/svc\n")
    finally:
        os.chmod(root / "svc", 0o755)
    if os.geteuid() != 0:  # root ignores file modes: nothing to observe then
        assert not support.enforceable and "Delegate=yes" in support.reasons["memory"]


def test_remove_and_leftovers(tmp_path: Path) -> None:
    support = cgroups.detect(fake_v1(tmp_path), proc_cgroup="")
    handle = support.create("live", LIMITS)
    dead = tmp_path / "pids" / cgroups.BASE_NAME / "999999999-1-gone"
    dead.mkdir()
    leftovers = support.list_leftovers()
    assert [h.dirs[0].name for h in leftovers] == ["999999999-1-gone"]
    # A fake tree's directories hold files, so rmdir fails: remove() gives up, bounded.
    assert handle is not None and handle.remove(attempts=2) is False
    for d in handle.dirs:
        for f in d.iterdir():
            f.unlink()
    assert handle.remove(attempts=2) is True and not handle.dirs


def test_process_start_time() -> None:
    assert cgroups.process_start_time(os.getpid())
    assert cgroups.process_start_time(999_999_999) is None
