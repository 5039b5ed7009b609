"""plan_recovery: what a starting server does with dead servers' records and sandboxes;
and the records on disk that it, and every replica, reads.

plan_recovery is pure: records and leftovers are built by hand, nothing touches a disk or
an engine. The file helpers at the end write and read records in a temporary directory."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.backends.base import Leftover
from mcp_code_sandbox.sessions.records import (
    SLOT_PATTERN,
    Plan,
    SessionRecord,
    load_records,
    plan_recovery,
    record_path,
    records_of,
    write_record,
)

WORKSPACES = Path("/var/lib/mcs/workspaces")
NOW = 1_700_000_000.0
TTL_S = 30 * 60.0
LIFETIME_S = 24 * 3600.0
DEAD = "host-1-dead"
LIVE = "host-2-live"


def key(n: int) -> str:
    return f"s{n:031x}"


def record(n: int, **kw: Any) -> SessionRecord:
    values: dict[str, Any] = {
        "owner": "alice",
        "session_id": f"session-{n}",
        "key": key(n),
        "slot": f"{key(n)}-0000abcd",
        "instance": DEAD,
        "created_at": NOW - 3600,
        "last_active": NOW - 60,
    }
    values.update(kw)
    made = SessionRecord(**values)
    assert SLOT_PATTERN.fullmatch(made.slot)
    return made


def leftover(rec: SessionRecord, backend_id: str = "c1", **kw: Any) -> Leftover:
    """A sandbox whose labels and workspace match ``rec``."""
    values: dict[str, Any] = {
        "backend_id": backend_id,
        "key": rec.key,
        "owner": rec.owner,
        "session_id": rec.session_id,
        "running": True,
        "workspace": WORKSPACES / rec.slot,
    }
    values.update(kw)
    return Leftover(**values)


def plan(
    records: list[SessionRecord],
    leftovers: list[Leftover],
    slots: list[str] | None = None,
    *,
    max_sessions: int = 10,
    takes_over: bool = True,
) -> Plan:
    return plan_recovery(
        records,
        leftovers,
        [r.slot for r in records] if slots is None else slots,
        workspaces_dir=WORKSPACES,
        alive=lambda instance: instance == LIVE,
        now=NOW,
        ttl_s=TTL_S,
        lifetime_s=LIFETIME_S,
        max_sessions=max_sessions,
        takes_over=takes_over,
    )


def test_matching_running_leftover_within_ttl_is_reattached() -> None:
    rec = record(1)
    lo = leftover(rec)
    p = plan([rec], [lo])
    assert p.reattach == [(rec, lo)]
    assert p.remove_leftovers == []
    assert p.drop == []
    assert p.stray_slots == []


def test_workspace_reported_with_links_resolved_still_matches(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    rec = record(1)
    lo = leftover(rec, workspace=real / rec.slot)
    p = plan_recovery(
        [rec],
        [lo],
        [rec.slot],
        workspaces_dir=link,
        alive=lambda _: False,
        now=NOW,
        ttl_s=TTL_S,
        lifetime_s=LIFETIME_S,
        takes_over=True,
        max_sessions=10,
    )
    assert p.reattach == [(rec, lo)]


def test_idle_past_ttl_is_dropped_and_its_leftover_removed() -> None:
    rec = record(1, last_active=NOW - TTL_S - 1)
    lo = leftover(rec)
    p = plan([rec], [lo])
    assert p.reattach == []
    assert p.remove_leftovers == [lo]
    assert p.drop == [(rec, "session session-1 expired after 30 min idle")]


def test_idle_exactly_ttl_is_still_reattached() -> None:
    rec = record(1, last_active=NOW - TTL_S)
    lo = leftover(rec)
    assert plan([rec], [lo]).reattach == [(rec, lo)]


def test_past_max_lifetime_is_dropped_and_its_leftover_removed() -> None:
    rec = record(1, created_at=NOW - LIFETIME_S - 1)
    lo = leftover(rec)
    p = plan([rec], [lo])
    assert p.reattach == []
    assert p.remove_leftovers == [lo]
    assert p.drop == [(rec, "session session-1 reached its maximum lifetime of 24 h")]


def test_expired_record_without_leftover_gives_the_expiry_reason() -> None:
    rec = record(1, last_active=NOW - 2 * TTL_S)
    assert plan([rec], []).drop == [(rec, "session session-1 expired after 30 min idle")]


def test_idle_reason_wins_when_both_limits_are_past() -> None:
    rec = record(1, created_at=NOW - 2 * LIFETIME_S, last_active=NOW - 2 * TTL_S)
    assert plan([rec], []).drop == [(rec, "session session-1 expired after 30 min idle")]


def test_labels_that_do_not_match_the_record_are_removed() -> None:
    rec = record(1)
    for bad in (
        leftover(rec, owner="mallory"),
        leftover(rec, session_id="other"),
        leftover(rec, key=key(2)),
        leftover(rec, owner=None, session_id=None, key=None),
    ):
        p = plan([rec], [bad])
        assert p.reattach == [], bad
        assert p.remove_leftovers == [bad]
        assert p.drop == [(rec, "session session-1 was lost when the server restarted")]


def test_leftover_that_is_not_running_is_removed() -> None:
    rec = record(1)
    lo = leftover(rec, running=False)
    p = plan([rec], [lo])
    assert p.reattach == []
    assert p.remove_leftovers == [lo]
    assert [r for r, _ in p.drop] == [rec]


def test_leftover_without_a_usable_workspace_is_removed() -> None:
    rec = record(1)
    for workspace in (
        None,
        Path("/elsewhere") / rec.slot,
        WORKSPACES / "sub" / rec.slot,
        WORKSPACES / "not-a-slot",
        WORKSPACES / rec.key,  # the key alone is not a slot
    ):
        lo = leftover(rec, workspace=workspace)
        p = plan([rec], [lo])
        assert p.reattach == [], workspace
        assert p.remove_leftovers == [lo], workspace
        assert [r for r, _ in p.drop] == [rec]


def test_leftover_with_a_workspace_no_record_claims_is_removed() -> None:
    rec = record(1)
    orphan = leftover(record(2))
    p = plan([rec], [orphan])
    assert p.remove_leftovers == [orphan]
    assert p.reattach == []


def test_a_live_servers_sandbox_and_record_are_left_alone() -> None:
    rec = record(1, instance=LIVE)
    # Its labels may name the dead server that made it: a live server re-attached it.
    lo = leftover(rec)
    runner = leftover(rec, "c2", runner="perl")
    stopped = leftover(rec, "c3", running=False, owner="mallory")
    p = plan([rec], [lo, runner, stopped])
    assert p.reattach == []
    assert p.remove_leftovers == []
    assert p.drop == []
    assert p.stray_slots == []


def test_two_leftovers_for_one_slot_only_one_is_reattached() -> None:
    rec = record(1)
    first, second = leftover(rec, "c1"), leftover(rec, "c2")
    p = plan([rec], [first, second])
    assert p.reattach == [(rec, first)]
    assert p.remove_leftovers == [second]
    assert p.drop == []


def test_a_stopped_duplicate_does_not_hide_the_running_one() -> None:
    rec = record(1)
    stopped, running = leftover(rec, "c1", running=False), leftover(rec, "c2")
    p = plan([rec], [stopped, running])
    assert p.reattach == [(rec, running)]
    assert p.remove_leftovers == [stopped]


def test_runner_leftover_is_removed_even_when_it_matches() -> None:
    rec = record(1)
    runner = leftover(rec, "runner", runner="perl")
    p = plan([rec], [runner])
    assert p.reattach == []
    assert p.remove_leftovers == [runner]
    assert p.drop == [(rec, "session session-1 was lost when the server restarted")]


def test_runner_leftover_does_not_stop_its_session_being_reattached() -> None:
    rec = record(1)
    main = leftover(rec, "main")
    runner = leftover(rec, "runner", runner="perl")
    for order in ([runner, main], [main, runner]):
        p = plan([rec], order)
        assert p.reattach == [(rec, main)], order
        assert p.remove_leftovers == [runner], order
        assert p.drop == []


def test_more_candidates_than_max_sessions_keeps_the_most_recently_active() -> None:
    old = record(1, last_active=NOW - 300)
    newest = record(2, last_active=NOW - 10)
    middle = record(3, last_active=NOW - 100)
    los = {r.slot: leftover(r, f"c-{r.session_id}") for r in (old, newest, middle)}
    p = plan([old, newest, middle], list(los.values()), max_sessions=2)
    assert p.reattach == [(newest, los[newest.slot]), (middle, los[middle.slot])]
    assert p.remove_leftovers == [los[old.slot]]
    assert p.drop == [(old, "session session-1 was lost when the server restarted")]


def test_workspace_dirs_without_a_record_are_stray() -> None:
    dead, live = record(1), record(2, instance=LIVE)
    stray_b, stray_a = f"{key(9)}-ffffffff", f"{key(8)}-00000000"
    p = plan([dead, live], [], [stray_b, dead.slot, live.slot, stray_a])
    assert p.stray_slots == sorted([stray_a, stray_b])
    assert [r for r, _ in p.drop] == [dead]


def test_dead_record_without_leftover_is_dropped_as_lost() -> None:
    rec = record(1)
    p = plan([rec], [])
    assert p.reattach == []
    assert p.remove_leftovers == []
    assert p.drop == [(rec, "session session-1 was lost when the server restarted")]


def test_nothing_to_do() -> None:
    assert plan([], [], []) == Plan()


def test_mixed() -> None:
    """Every kind at once: each leftover lands in exactly one place."""
    keep = record(1)
    expired = record(2, last_active=NOW - 2 * TTL_S)
    lost = record(3)
    live = record(4, instance=LIVE)
    keep_lo = leftover(keep, "keep")
    keep_runner = leftover(keep, "keep-runner", runner="ruby")
    expired_lo = leftover(expired, "expired")
    live_lo = leftover(live, "live")
    foreign = leftover(keep, "foreign", workspace=Path("/elsewhere") / keep.slot)
    records = [keep, expired, lost, live]
    p = plan(records, [keep_lo, keep_runner, expired_lo, live_lo, foreign])
    assert p.reattach == [(keep, keep_lo)]
    assert p.remove_leftovers == [keep_runner, expired_lo, foreign]
    assert dict((r.slot, why) for r, why in p.drop) == {
        expired.slot: "session session-2 expired after 30 min idle",
        lost.slot: "session session-3 was lost when the server restarted",
    }
    assert p.stray_slots == []


# -- paused sessions (issue 13) -------------------------------------------------------------


def paused(n: int, backend_id: str | None = None, **kw: Any) -> SessionRecord:
    pause: dict[str, Any] = {"kind": "variables", "at": NOW - 120, "bytes": 10}
    if backend_id is not None:
        pause = {"kind": "memory", "at": NOW - 120, "checkpoint": {"backend_id": backend_id}}
    return record(n, paused=pause, **kw)


def test_a_paused_session_is_kept_with_its_checkpointed_sandbox() -> None:
    memory, variables = paused(1, "c1"), paused(2)
    stopped = leftover(memory, "c1", running=False)
    result = plan([memory, variables], [stopped])
    assert result.keep_paused == [memory, variables] or result.keep_paused == [variables, memory]
    assert result.remove_leftovers == [] and result.drop == [] and result.reattach == []


def test_a_paused_sessions_other_sandboxes_and_forged_ones_are_removed() -> None:
    memory = paused(1, "c1")
    other = leftover(memory, "c2", running=False)  # not the checkpoint the record names
    forged = leftover(memory, "c1", running=False, owner="mallory")
    result = plan([memory], [other, forged])
    assert result.keep_paused == [memory]
    assert sorted(lo.backend_id for lo in result.remove_leftovers) == ["c1", "c2"]


def test_a_paused_session_past_its_ttl_goes_with_its_checkpoint() -> None:
    memory = paused(1, "c1", last_active=NOW - 2 * TTL_S)
    held = leftover(memory, "c1", running=False)
    result = plan([memory], [held])
    assert result.keep_paused == [] and result.remove_leftovers == [held]
    [(dropped, why)] = result.drop
    assert dropped == memory and "expired" in why


def test_a_session_whose_pause_was_under_way_is_kept_unless_it_can_be_reattached() -> None:
    pausing, running = record(1, pausing=True), record(2, pausing=True)
    alive = leftover(running, "c2")
    result = plan([pausing, running], [alive])
    assert result.keep_paused == [pausing]
    assert [(r, lo.backend_id) for r, lo in result.reattach] == [(running, "c2")]


def test_a_fork_being_filled_when_its_server_died_is_removed_with_its_sandbox(
    tmp_path: Path,
) -> None:
    half = record(1, forking=True)
    write_record(tmp_path, half)
    assert load_records(tmp_path) == [half]
    result = plan([half], [leftover(half)])
    assert result.reattach == [] and result.keep_paused == []
    assert [(r, "being forked" in why) for r, why in result.drop] == [(half, True)]
    assert [lo.backend_id for lo in result.remove_leftovers] == ["c1"]


def test_kept_and_reattached_sessions_share_the_session_limit_most_recent_first() -> None:
    old = paused(1, "c1", last_active=NOW - 600)
    new = paused(2, last_active=NOW - 10)
    middle = record(3, last_active=NOW - 60)
    result = plan(
        [old, new, middle],
        [leftover(old, "c1", running=False), leftover(middle, "c3")],
        max_sessions=2,
    )
    assert result.keep_paused == [new]
    assert [r for r, _ in result.reattach] == [middle]
    assert [lo.backend_id for lo in result.remove_leftovers] == ["c1"]
    assert [r for r, _ in result.drop] == [old]


# -- a paused session moved into a warm sandbox (issue 13) ------------------------------------


def test_the_slot_a_session_moved_out_of_is_removed_without_a_tombstone() -> None:
    # The server died after the moved record was written, before the old one was removed.
    old = paused(1)
    moved = paused(2, session_id=old.session_id, replaces=old.slot)
    warm = leftover(moved, "c2", owner="", session_id="")  # the pooled sandbox it moved into
    result = plan([old, moved], [warm])
    assert result.superseded == [old]
    assert result.keep_paused == [moved]
    assert result.drop == [] and result.stray_slots == []
    # Paused: its running warm sandbox is not re-attached (the saved variables load again).
    assert result.remove_leftovers == [warm]


def test_replaces_never_removes_another_sessions_slot() -> None:
    other = paused(1, session_id="someone-else")
    forged = paused(2, replaces=other.slot)
    result = plan([other, forged], [])
    assert result.superseded == []
    assert sorted(r.session_id for r in result.keep_paused) == ["session-2", "someone-else"]


def test_a_live_servers_moved_slot_is_left_alone() -> None:
    old = paused(1, instance=LIVE)
    moved = paused(2, session_id=old.session_id, replaces=old.slot)
    assert plan([old, moved], []).superseded == []


# -- who may take over what (sessions.holder) ---------------------------------------------


def test_a_private_server_leaves_a_dead_services_sessions_exactly_as_they_are() -> None:
    running = record(1)
    paused = record(2, paused={"kind": "variables"})
    pausing = record(3, pausing=True)
    expired = record(4, last_active=NOW - TTL_S - 1)  # even one past its TTL: not its to end
    lo = leftover(running)
    p = plan([running, paused, pausing, expired], [lo], takes_over=False)
    assert p == Plan()  # nothing re-attached, kept, dropped, removed or called stray


def test_the_next_service_takes_over_what_a_dead_service_left() -> None:
    running, paused = record(1), record(2, paused={"kind": "variables"})
    lo = leftover(running)
    p = plan([running, paused], [lo], takes_over=True)
    assert p.reattach == [(running, lo)] and p.keep_paused == [paused]
    assert p.drop == [] and p.remove_leftovers == []


def test_a_dead_private_servers_sessions_are_garbage_to_any_server() -> None:
    for takes_over in (False, True):
        mine = record(1, handover=False)
        paused = record(2, handover=False, paused={"kind": "variables"})
        lo = leftover(mine)
        p = plan([mine, paused], [lo], takes_over=takes_over)
        assert p.reattach == [] and p.keep_paused == []
        assert sorted(r.slot for r, _ in p.drop) == sorted([mine.slot, paused.slot])
        assert p.remove_leftovers == [lo]


def test_a_live_private_servers_sessions_are_never_touched() -> None:
    for takes_over in (False, True):
        live = record(1, handover=False, instance=LIVE)
        p = plan([live], [leftover(live)], takes_over=takes_over)
        assert p == Plan()


# -- replicas: sandboxes whose creator still lives (issue 25) ------------------------------


def test_a_live_creators_sandbox_that_no_dead_record_claims_is_left_alone() -> None:
    """Another replica made it and holds its session, whatever the records list says."""
    unknown = leftover(record(1), creator_alive=True)  # no record names its slot at all
    runner = leftover(record(2), "r2", creator_alive=True, runner="perl")
    p = plan([], [unknown, runner])
    assert p == Plan()


def test_a_live_creators_sandbox_a_dead_holder_took_is_reattached() -> None:
    """Replica A made it, replica B took the session over and died: B's record claims it."""
    rec = record(1)  # held by DEAD, a service (handover)
    lo = leftover(rec, creator_alive=True)
    p = plan([rec], [lo])
    assert p.reattach == [(rec, lo)]
    assert p.remove_leftovers == [] and p.drop == []


def test_a_live_creators_sandbox_a_dead_holder_claims_is_removed_when_expired() -> None:
    rec = record(1, last_active=NOW - TTL_S - 1)
    lo = leftover(rec, creator_alive=True)
    p = plan([rec], [lo])
    assert p.reattach == [] and p.remove_leftovers == [lo]
    assert [r for r, _ in p.drop] == [rec]


# -- records on disk --------------------------------------------------------------------------


def test_a_record_round_trips_with_its_run_count(tmp_path: Path) -> None:
    """The next holder goes on counting runs (each names its saved output)."""
    rec = record(1, runs=7, paused={"kind": "variables", "bytes": 3}, uid=100_123)
    write_record(tmp_path, rec)
    assert load_records(tmp_path) == [rec]
    assert [p.name for p in tmp_path.iterdir()] == [f"{rec.slot}.json"]  # no temporary left


@pytest.mark.parametrize("hostile", [-3, True, "12", 1.5, None, [1]])
def test_a_hostile_run_count_reads_as_no_runs(tmp_path: Path, hostile: object) -> None:
    rec = record(1, runs=4)
    write_record(tmp_path, rec)
    path = record_path(tmp_path, rec.slot)
    raw = json.loads(path.read_text())
    raw["runs"] = hostile
    path.write_text(json.dumps(raw))
    [read] = load_records(tmp_path)
    assert read.runs == 0 and read == dataclasses.replace(rec, runs=0)


def test_a_record_without_runs_reads_as_no_runs(tmp_path: Path) -> None:
    """Records written before the field existed."""
    rec = record(1)
    write_record(tmp_path, rec)
    path = record_path(tmp_path, rec.slot)
    raw = json.loads(path.read_text())
    del raw["runs"]
    path.write_text(json.dumps(raw))
    assert load_records(tmp_path) == [rec]


def test_a_record_keeps_its_sandboxs_network_for_the_next_holder(tmp_path: Path) -> None:
    rec = record(1)
    egress = {"dir": rec.slot, "hosts": ["pypi.org"]}
    write_record(tmp_path, dataclasses.replace(rec, egress=egress))
    [read] = load_records(tmp_path)
    assert read.egress == egress


@pytest.mark.parametrize(
    "hostile",
    [{"dir": "../../etc", "hosts": None}, {"dir": "x"}, {"dir": None}, "dir", {"hosts": [1]}],
)
def test_a_record_whose_network_names_no_proxy_dir_of_ours_is_not_one(
    tmp_path: Path, hostile: object
) -> None:
    # The directory becomes a path under the state dir: a record naming anything but a
    # name of the shape a server makes is refused whole, as for a slot.
    rec = record(1)
    write_record(tmp_path, rec)
    path = record_path(tmp_path, rec.slot)
    raw = json.loads(path.read_text())
    raw["egress"] = hostile
    path.write_text(json.dumps(raw))
    assert load_records(tmp_path, remove_bad=False) == []


def test_records_of_finds_only_that_keys_slots(tmp_path: Path) -> None:
    first = record(1)
    second = record(1, slot=f"{key(1)}-0000ef01", instance=LIVE)
    other = record(2)
    for rec in (first, second, other):
        write_record(tmp_path, rec)
    record_path(tmp_path, f"{key(1)}-00000bad").write_text("{not json")
    found = records_of(tmp_path, key(1))
    assert sorted(r.slot for r in found) == sorted([first.slot, second.slot])
    assert records_of(tmp_path, key(3)) == []
    assert record_path(tmp_path, f"{key(1)}-00000bad").exists()  # a reader removes nothing


def test_a_record_whose_name_is_not_its_slot_is_not_read(tmp_path: Path) -> None:
    """A slot becomes a path: a record copied under another session's name is ignored."""
    rec = record(2)
    write_record(tmp_path, rec)
    forged = record_path(tmp_path, f"{key(1)}-0000abcd")
    forged.write_text(record_path(tmp_path, rec.slot).read_text())
    assert records_of(tmp_path, key(1)) == []
    assert load_records(tmp_path, remove_bad=False) == [rec]


def test_only_recovery_removes_corrupt_records_and_stale_temporaries(tmp_path: Path) -> None:
    """A replica reading beside live writers never deletes what it cannot read."""
    good = record(1)
    write_record(tmp_path, good)
    corrupt = record_path(tmp_path, f"{key(2)}-0000abcd")
    corrupt.write_text('{"owner": "alice"')
    stale = tmp_path / f".{good.slot}.00000000.tmp"
    stale.write_text("{")
    os.utime(stale, (NOW, NOW))  # long ago: a server killed mid-write
    assert load_records(tmp_path, remove_bad=False) == [good]
    assert corrupt.exists() and stale.exists()
    assert load_records(tmp_path) == [good]
    assert not corrupt.exists() and not stale.exists()
