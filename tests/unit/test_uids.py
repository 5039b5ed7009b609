"""The host uid pool: leases that never overlap, across pools and processes, and come back.

Real files and real ``flock`` in a temporary lease dir; other servers are real processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Awaitable
from pathlib import Path

import pytest

from mcp_code_sandbox.errors import BackendUnavailable, MaxSessions
from mcp_code_sandbox.sessions import records
from mcp_code_sandbox.sessions.uids import UidPool, taken_in
from mcp_code_sandbox.settings import ConfigError, load_settings

START = 0x7000_0000


def pool(directory: Path, size: int = 8, taken: tuple[int, ...] = ()) -> UidPool:
    def reserved(holder: str, uid: int) -> bool:
        return holder.startswith("/") and records.recorded_uid(Path(holder)) == uid

    return UidPool(directory, START, size, reserved=reserved, taken=taken)


def write_record(sessions: Path, uid: int) -> str:
    """A session record that names ``uid``; its path, the lease's holder."""
    key = "s" + "a" * 31
    record = records.SessionRecord(
        "alice", "sid", key, records.new_slot(key), "1-x", 0.0, 0.0, uid=uid
    )
    records.write_record(sessions, record)
    return str(records.record_path(sessions, record.slot))


def test_leases_are_distinct_lowest_first_and_come_back(tmp_path: Path) -> None:
    uids = pool(tmp_path / "uids")
    a, b = uids.lease("/h/a"), uids.lease("/h/b")
    assert (a.uid, b.uid) == (START, START + 1)
    a.release()
    a.release()  # idempotent
    assert uids.lease("/h/c").uid == START  # free again, no record reserves it
    assert (tmp_path / "uids").stat().st_mode & 0o777 == 0o700


def test_two_pools_on_one_dir_never_share(tmp_path: Path) -> None:
    first, second = pool(tmp_path), pool(tmp_path)
    held = [first.lease(f"/h/{i}").uid for i in range(3)]
    held += [second.lease(f"/h/{i}").uid for i in range(3, 6)]
    assert len(set(held)) == 6


def test_exhaustion_is_max_sessions_naming_the_range(tmp_path: Path) -> None:
    uids = pool(tmp_path, size=3, taken=(START + 1,))
    uids.lease("/h/a")
    uids.lease("/h/b")
    with pytest.raises(MaxSessions, match=f"{START}-{START + 2}.*close a session"):
        uids.lease("/h/c")


def test_ids_of_real_users_are_skipped(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "passwd").write_text(f"root:x:0:0::/root:/bin/sh\nbob:x:{START + 1}:5::/:/bin/sh\n")
    (etc / "group").write_text(f"g:x:{START + 3}:\n")
    (etc / "subuid").write_text(f"carol:{START + 5}:2\nzed:100000:65536\n# comment\n")
    (etc / "subgid").write_text("")
    taken = taken_in(START, 8, etc)
    assert taken == {START + 1, START + 3, START + 5, START + 6}
    uids = pool(tmp_path / "uids", taken=tuple(taken))
    assert [uids.lease(f"/h/{i}").uid for i in range(4)] == [
        START,
        START + 2,
        START + 4,
        START + 7,
    ]
    assert uids.skipped == 4


def test_a_record_reserves_its_uid_after_its_server_let_go(tmp_path: Path) -> None:
    sessions = tmp_path / "sessions"
    uids = pool(tmp_path / "uids")
    lease = uids.lease("placeholder")
    holder = write_record(sessions, lease.uid)
    lease.release()
    reclaimed = uids.reclaim(lease.uid, holder)  # as recovery does, naming the record
    assert reclaimed is not None
    uid = reclaimed.uid
    reclaimed.release()  # the server died: its record still names the uid
    assert uids.lease("/h/other").uid != uid  # reserved: nobody else takes it
    again = uids.reclaim(uid, holder)  # the next server on that state dir does
    assert again is not None and again.uid == uid
    assert uids.reclaim(uid, "/h/other") is None  # held now
    again.release()
    assert uids.reclaim(uid, "/h/other") is None  # reserved for its record
    Path(holder).unlink()  # the session ended (or was dropped at recovery)
    assert uids.lease("/h/other").uid == uid


def test_reclaim_refuses_what_is_not_the_ranges(tmp_path: Path) -> None:
    uids = pool(tmp_path, size=4, taken=(START + 2,))
    assert uids.reclaim(START - 1, "/h/a") is None
    assert uids.reclaim(START + 4, "/h/a") is None
    assert uids.reclaim(START + 2, "/h/a") is None


def test_a_dead_process_frees_its_leases_and_a_live_one_keeps_them(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from mcp_code_sandbox.sessions.uids import UidPool
        uids = UidPool(Path({str(tmp_path)!r}), {START}, 64, reserved=lambda h, u: False)
        held = [uids.lease(f"/other/{{i}}") for i in range(int(sys.argv[1]))]
        print(*(lease.uid for lease in held), flush=True)
        sys.stdin.readline()
        """
    )
    other = subprocess.Popen(
        [sys.executable, "-c", script, "5"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert other.stdout is not None and other.stdin is not None
    theirs = set(map(int, other.stdout.readline().split()))
    uids = pool(tmp_path, size=64)
    mine = {uids.lease(f"/mine/{i}").uid for i in range(5)}
    assert len(theirs) == 5 and not theirs & mine
    other.stdin.close()  # it exits without releasing anything
    assert other.wait(timeout=30) == 0
    other.stdout.close()
    assert {uids.lease(f"/mine/again/{i}").uid for i in range(5)} == theirs


def test_many_processes_leasing_at_once_never_share(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from mcp_code_sandbox.sessions.uids import UidPool
        uids = UidPool(Path({str(tmp_path)!r}), {START}, 1000, reserved=lambda h, u: False)
        held = [uids.lease(f"/p/{{i}}") for i in range(40)]
        print(*(lease.uid for lease in held), flush=True)
        sys.stdin.readline()
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    seen: list[int] = []
    for proc in procs:
        assert proc.stdout is not None
        seen += map(int, proc.stdout.readline().split())
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
        assert proc.stdout is not None
        proc.stdout.close()
    assert len(seen) == 160 and len(set(seen)) == 160


def test_a_lease_dir_others_may_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(BackendUnavailable, match="no one else may write"):
        pool(shared).lease("/h/a")
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(BackendUnavailable, match="SANDBOX_UID_LEASE_DIR"):
        pool(blocked / "uids").lease("/h/a")


def test_records_keep_their_uid_and_refuse_a_bad_one(tmp_path: Path) -> None:
    holder = Path(write_record(tmp_path, START + 7))
    [record] = records.load_records(tmp_path)
    assert record.uid == START + 7 and records.recorded_uid(holder) == START + 7
    raw = json.loads(holder.read_text())
    raw["uid"] = "0"
    holder.write_text(json.dumps(raw))
    assert records.recorded_uid(holder) is None
    del raw["uid"]  # a record of a server before per-session uids
    holder.write_text(json.dumps(raw))
    assert records.load_records(tmp_path)[0].uid is None


def test_the_range_settings_are_checked() -> None:
    settings = load_settings(environ={})
    assert (settings.uid_range_start, settings.uid_range_size) == (0x7000_0000, 65536)
    assert settings.uid_lease_dir == Path("/run/mcp-code-sandbox/uids")
    for bad in (
        {"SANDBOX_UID_RANGE_START": "1000"},  # real users
        {"SANDBOX_UID_RANGE_START": str(2**31 - 10), "SANDBOX_UID_RANGE_SIZE": "100"},
        {"SANDBOX_UID_RANGE_SIZE": "5", "SANDBOX_MAX_SESSIONS": "10"},
    ):
        with pytest.raises(ConfigError):
            load_settings(environ=bad)


def test_uid_in_the_plan_must_match_the_containers_label(tmp_path: Path) -> None:
    from mcp_code_sandbox.backends.base import Leftover

    key = "s" + "b" * 31
    slot = records.new_slot(key)
    record = records.SessionRecord("alice", "sid", key, slot, "dead", 100.0, 100.0, uid=START)
    workspace = tmp_path / slot

    def plan(uid: int | None) -> records.Plan:
        leftover = Leftover("c1", key, "alice", "sid", True, workspace, uid=uid)
        return records.plan_recovery(
            [record],
            [leftover],
            [slot],
            workspaces_dir=tmp_path,
            alive=lambda _: False,
            now=110.0,
            ttl_s=1800,
            lifetime_s=86400,
            takes_over=True,
            max_sessions=10,
        )

    assert [r.uid for r, _ in plan(START).reattach] == [START]
    assert plan(START + 1).reattach == [] and len(plan(START + 1).remove_leftovers) == 1
    assert os.path.basename(str(workspace)) == slot


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a workspace to another uid")
async def test_the_runtime_probe_runs_as_a_uid_of_its_own(tmp_path: Path) -> None:
    from mcp_code_sandbox.backends.base import Limits, SandboxSpec
    from mcp_code_sandbox.run.languages import RUNTIMES
    from mcp_code_sandbox.run.probe import RuntimeProbe

    seen: list[tuple[SandboxSpec, int]] = []

    class Backend:
        workspace_owner = None

        async def create(self, spec: SandboxSpec, mounted: Awaitable[None] | None = None) -> object:
            if mounted is not None:
                await mounted
            seen.append((spec, spec.workspace.stat().st_uid))
            return type("Box", (), {"ready": {"languages": {"python": "3"}}})()

        async def stop(self, sandbox: object) -> None:
            pass

    uids = pool(tmp_path / "uids")
    settings = load_settings({"state_dir": str(tmp_path)}, environ={})
    limits = Limits(memory_bytes=1, cpu=1.0, pids=16, tmp_bytes=1, file_bytes=1)
    probe = RuntimeProbe(settings, Backend(), lambda: limits, RUNTIMES, uids)  # type: ignore[arg-type]
    assert await probe.get() == {"python": "3"}
    [(spec, owner)] = seen
    assert spec.uid == START and owner == START  # never root, never a tenant's uid
    assert uids.lease("/h/next").uid == START  # given back
