"""Session records on disk, and the pure decision of what a starting server does with them.

The records must survive a SIGKILL of the server, so it is not only in memory: one small
JSON file per session at ``<state_dir>/sessions/<slot>.json`` (owner, session id, key,
slot, the server instance holding it, wall-clock creation and last activity, the host uid
its sandbox runs as; no secrets, no code), plus the sandboxes' own labels
(:class:`~.backends.base.Leftover`). A record also reserves its uid while it exists
(:mod:`.uids`).

Layout. A session's workspace is ``<state_dir>/workspaces/<slot>``, where ``slot`` is its
key plus 8 random hex digits: fixed for the session's whole life (a restarted server finds
it there, and a surviving container has it bind-mounted), but different for two sessions
of the same owner and id held by two live servers that share a state dir (two stdio
servers of one user, say). The record's ``instance`` names the server process holding the
session; that process's pid file under ``run_dir`` says whether it still lives, and a live
server's records, workspaces and sandboxes are never touched by another.

Writes are atomic (a temporary file renamed into place), so a reader never sees half a
record. Order: the record is written before the workspace is made and removed after it is
deleted, so a workspace directory without a record is always garbage.

Semantics of :func:`plan_recovery`: who may take over what is :mod:`.holder`'s rule. A
dead private server's records (``handover`` false), and a dead server's pooled sandboxes
that no session claimed, are removed with their workspaces and sandboxes by any server. A
dead service's records are left exactly as they are by every server but the next service,
for which: a leftover sandbox is re-attached when a record of a dead server claims its
workspace, owner, id (or the pool's, for a sandbox a session took from the warm pool), key
and uid, it runs, and the session is within its idle TTL and max lifetime (by the
recorded wall-clock times); at most ``max_sessions``, the most recently active first.
Every other leftover of a dead server is removed, and so is every dead server's record
(with its workspace) that is not re-attached. A dead server's fork still being filled
(``forking``) is removed by any server. A record whose session moved to another slot
(named by that slot's record as ``replaces``, same owner and id) is removed without a
word: the session is the other record's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mcp_code_sandbox.backends.base import Leftover

__all__ = [
    "POOL_OWNER",
    "SLOT_PATTERN",
    "Plan",
    "SessionRecord",
    "checkpoint_id",
    "list_slots",
    "load_records",
    "made_for",
    "new_slot",
    "plan_recovery",
    "read_record",
    "record_path",
    "recorded_uid",
    "records_of",
    "remove_record",
    "write_record",
]

#: The owner and session id of a pooled sandbox before a session claims it (records and
#: labels). No session has it: owners and ids are never empty.
POOL_OWNER = ""
SLOT_PATTERN = re.compile(r"(s[0-9a-f]{31})-[0-9a-f]{8}")
_SUFFIX = ".json"
#: A temporary record older than this is from a server killed mid-write.
_STALE_TMP_S = 60.0


def new_slot(key: str) -> str:
    return f"{key}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class SessionRecord:
    owner: str
    session_id: str
    key: str
    slot: str
    #: The server process holding the session (its pid file is ``run_dir/<instance>.pid``).
    instance: str
    #: Wall-clock seconds (``time.time()``): they must mean the same in the next process.
    created_at: float
    last_active: float
    #: The host uid (and gid) of the session's sandboxes, leased from :mod:`.uids`;
    #: ``None`` when its backend runs every sandbox as one shared uid.
    uid: int | None = None
    #: A pooled sandbox's record, not yet claimed by a session (``owner`` and
    #: ``session_id`` are empty then): never re-attached, never reported as lost.
    pool: bool = False
    #: The session is paused (:class:`.session.Paused` as JSON): a later server keeps it
    #: and resumes it on its first call. ``None``: it was running.
    paused: dict[str, Any] | None = None
    #: A pause was under way: a server that died meanwhile left its last complete state
    #: (or files alone); a later server keeps the session as paused all the same.
    pausing: bool = False
    #: A fork being filled (:mod:`.forking`): a server that died meanwhile left a half
    #: copy, removed by whoever finds it (the source is as it was).
    forking: bool = False
    #: The slot this session moved from (a paused session resumed into a warm sandbox:
    #: its files were copied into this slot's workspace, then this record was written).
    #: That slot's record, if still there, is stale: removed with its workspace.
    replaces: str | None = None
    #: Kept for the holder's successor when the holder is gone: the holder was the state
    #: directory's service (see :mod:`.holder`). False: a private server's, removed by
    #: whoever finds it after its holder died. Records without the field say True.
    handover: bool = True
    #: Runs so far (each names its saved output): the next holder goes on counting.
    runs: int = 0
    #: The running sandbox's network: the name of its egress proxy's directory (under
    #: ``state_dir/egress``) and the hosts its last call asked for (``None``: the whole
    #: policy). A replica taking the session over opens a proxy there again. ``None``:
    #: no network (or paused).
    egress: dict[str, Any] | None = None


def record_path(directory: Path, slot: str) -> Path:
    return directory / f"{slot}{_SUFFIX}"


def read_record(path: Path) -> SessionRecord | None:
    """The record at ``path``; ``None`` when there is no valid one there."""
    return _parse(path)


def recorded_uid(path: Path) -> int | None:
    """The uid the record at ``path`` holds; ``None`` when there is no valid record."""
    record = _parse(path)
    return None if record is None else record.uid


def write_record(directory: Path, record: SessionRecord) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{record.slot}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        json.dump(asdict(record), out, separators=(",", ":"))
    os.replace(tmp, record_path(directory, record.slot))


def remove_record(directory: Path, slot: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        record_path(directory, slot).unlink()


def load_records(directory: Path, *, remove_bad: bool = True) -> list[SessionRecord]:
    """Every valid record; corrupt ones and stale temporary files are deleted (unless
    ``remove_bad`` is False: a reader that is not recovery, beside live writers)."""
    records: list[SessionRecord] = []
    if not directory.is_dir():
        return records
    now = time.time()
    for path in directory.iterdir():
        if path.name.endswith(".tmp"):
            if not remove_bad:
                continue
            with contextlib.suppress(OSError):
                if now - path.lstat().st_mtime > _STALE_TMP_S:
                    path.unlink()
            continue
        if not path.name.endswith(_SUFFIX):
            continue
        record = _parse(path)
        if record is None:
            if remove_bad:
                path.unlink(missing_ok=True)
        else:
            records.append(record)
    return records


def records_of(directory: Path, key: str) -> list[SessionRecord]:
    """The valid records of one session key (its slots: ``<key>-<random>``); blocking."""
    found = []
    for path in directory.glob(f"{key}-*{_SUFFIX}"):
        record = _parse(path)
        if record is not None and record.key == key:
            found.append(record)
    return found


def _parse(path: Path) -> SessionRecord | None:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        record = SessionRecord(
            owner=str(raw["owner"]),
            session_id=str(raw["session_id"]),
            key=str(raw["key"]),
            slot=str(raw["slot"]),
            instance=str(raw["instance"]),
            created_at=float(raw["created_at"]),
            last_active=float(raw["last_active"]),
            uid=_uid(raw.get("uid")),
            pool=raw.get("pool", False) is True,
            paused=_paused(raw.get("paused")),
            pausing=raw.get("pausing", False) is True,
            forking=raw.get("forking", False) is True,
            replaces=_slot(raw.get("replaces")),
            handover=raw.get("handover", True) is not False,
            runs=_count(raw.get("runs")),
            egress=_egress(raw.get("egress")),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # The slot becomes a path: it must be one we could have made, and match its file.
    match = SLOT_PATTERN.fullmatch(record.slot)
    if match is None or match.group(1) != record.key or path.name != record.slot + _SUFFIX:
        return None
    return record


def _egress(value: object) -> dict[str, Any] | None:
    """A record's ``egress``, checked (``ValueError`` when it is not one): the directory is
    a name of the shape a server makes (no path), the hosts a list of names or null."""
    if value is None:
        return None
    if not isinstance(value, dict) or SLOT_PATTERN.fullmatch(str(value.get("dir"))) is None:
        raise ValueError(f"not an egress: {value!r}")
    hosts = value.get("hosts")
    if hosts is not None and not (
        isinstance(hosts, list) and all(isinstance(h, str) for h in hosts)
    ):
        raise ValueError(f"not a list of hosts: {hosts!r}")
    return {"dir": value["dir"], "hosts": hosts}


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _paused(value: object) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("not a pause")
    return value


def _slot(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or SLOT_PATTERN.fullmatch(value) is None:
        raise ValueError(f"not a slot: {value!r}")
    return value


def _uid(value: object) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value <= 0:
        raise ValueError(f"not a uid: {value!r}")
    return value


def list_slots(workspaces_dir: Path) -> set[str]:
    """Workspace directories named like slots (other names are not this layout's)."""
    if not workspaces_dir.is_dir():
        return set()
    return {p.name for p in workspaces_dir.iterdir() if SLOT_PATTERN.fullmatch(p.name)}


@dataclass
class Plan:
    """What a starting server does with what dead servers left (see the module doc)."""

    reattach: list[tuple[SessionRecord, Leftover]] = field(default_factory=list)
    #: Paused sessions (or ones a pause was under way for) to register as paused; a
    #: checkpointed one's stopped sandbox is kept with it.
    keep_paused: list[SessionRecord] = field(default_factory=list)
    remove_leftovers: list[Leftover] = field(default_factory=list)
    #: Records to delete with their workspaces, each with why (for the tombstone).
    drop: list[tuple[SessionRecord, str]] = field(default_factory=list)
    #: Workspace directories that no record claims.
    stray_slots: list[str] = field(default_factory=list)
    #: Records of slots their session moved out of (``SessionRecord.replaces``): removed
    #: with their workspaces; the session lives on in the record that replaced them.
    superseded: list[SessionRecord] = field(default_factory=list)


def checkpoint_id(record: SessionRecord) -> str | None:
    """The backend id of the stopped sandbox holding a paused session's memory."""
    checkpoint = (record.paused or {}).get("checkpoint")
    backend_id = checkpoint.get("backend_id") if isinstance(checkpoint, dict) else None
    return backend_id if isinstance(backend_id, str) else None


def plan_recovery(
    records: Iterable[SessionRecord],
    leftovers: Iterable[Leftover],
    slots_on_disk: Iterable[str],
    *,
    workspaces_dir: Path,
    alive: Callable[[str], bool],
    now: float,
    ttl_s: float,
    lifetime_s: float,
    max_sessions: int,
    takes_over: bool,
) -> Plan:
    """Decide, without side effects. ``slots_on_disk`` must be listed before the records
    are loaded (a live server writes its record before it makes the workspace).
    ``takes_over``: this server is its state directory's service (:mod:`.holder`), the
    only one that re-attaches or keeps what a dead service left; every other server
    leaves those records, workspaces and sandboxes exactly as they are."""
    plan = Plan()
    records = list(records)
    live = {r.slot for r in records if alive(r.instance)}
    dead = {r.slot: r for r in records if r.slot not in live}
    for gone in list(dead.values()):
        if gone.pool or not gone.handover:  # a private server's, or nobody's yet
            why = f"session {gone.session_id} ended with the server that held it"
            plan.drop.append((dead.pop(gone.slot), why))
        elif gone.forking:  # a half copy: the fork was never made
            why = f"session {gone.session_id} was being forked when its server died"
            plan.drop.append((dead.pop(gone.slot), why))
        elif not takes_over:
            live.add(dead.pop(gone.slot).slot)  # its successor's to take over
    for mover in list(dead.values()):
        old = dead.get(mover.replaces) if mover.replaces is not None else None
        if old is not None and (old.owner, old.session_id) == (mover.owner, mover.session_id):
            plan.superseded.append(dead.pop(old.slot))
    candidates: dict[str, tuple[SessionRecord, Leftover]] = {}
    held: dict[str, Leftover] = {}  # checkpointed sandboxes of paused sessions
    for leftover in leftovers:
        slot = _slot_of(leftover.workspace, workspaces_dir)
        if slot in live:
            continue  # a live server re-attached it earlier: its labels still say otherwise
        record = dead.get(slot) if slot is not None else None
        if leftover.creator_alive and record is None:
            continue  # a live server's, and no dead server's record claims it
        fresh = record is not None and _expiry(record, now, ttl_s, lifetime_s) is None
        if (
            record is not None
            and fresh
            and record.paused is not None
            and checkpoint_id(record) == leftover.backend_id
            and made_for(leftover, record)
        ):
            held[record.slot] = leftover
        elif (
            record is not None
            and fresh
            and record.paused is None
            and leftover.runner is None  # a runner holds nothing but the workspace's files
            and slot not in candidates
            and leftover.running
            and made_for(leftover, record)
        ):
            candidates[record.slot] = (record, leftover)
        else:
            plan.remove_leftovers.append(leftover)
    keep: list[SessionRecord | tuple[SessionRecord, Leftover]] = [*candidates.values()]
    keep.extend(
        r
        for r in dead.values()
        if r.slot not in candidates
        and not r.pool
        and (r.paused is not None or r.pausing)
        and _expiry(r, now, ttl_s, lifetime_s) is None
    )
    keep.sort(key=lambda kept: _record_of(kept).last_active, reverse=True)
    for kept in keep[max_sessions:]:
        if isinstance(kept, tuple):
            plan.remove_leftovers.append(kept[1])
        elif kept.slot in held:
            plan.remove_leftovers.append(held.pop(kept.slot))
    chosen: set[str] = set()
    for kept in keep[:max_sessions]:
        if isinstance(kept, tuple):
            plan.reattach.append(kept)
        else:
            plan.keep_paused.append(kept)
        chosen.add(_record_of(kept).slot)
    plan.remove_leftovers.extend(v for slot, v in held.items() if slot not in chosen)
    for record in dead.values():
        if record.slot not in chosen:
            why = _expiry(record, now, ttl_s, lifetime_s) or (
                f"session {record.session_id} was lost when the server restarted"
            )
            plan.drop.append((record, why))
    known = {r.slot for r in records}
    plan.stray_slots = sorted(set(slots_on_disk) - known)
    return plan


def _record_of(kept: SessionRecord | tuple[SessionRecord, Leftover]) -> SessionRecord:
    return kept[0] if isinstance(kept, tuple) else kept


def made_for(leftover: Leftover, record: SessionRecord) -> bool:
    """Do the leftover's labels name the recorded session? A sandbox started for the pool
    is labelled with the pool's empty owner and id, and keeps them once claimed: the key,
    slot (checked by the caller) and uid then tell."""
    if record.pool or (leftover.key, leftover.uid) != (record.key, record.uid):
        return False
    return (leftover.owner, leftover.session_id) in (
        (record.owner, record.session_id),
        (POOL_OWNER, POOL_OWNER),
    )


def _slot_of(workspace: Path | None, workspaces_dir: Path) -> str | None:
    # The engine may report the bind mount's source with the links resolved.
    if workspace is None or workspace.parent not in (workspaces_dir, workspaces_dir.resolve()):
        return None
    return workspace.name if SLOT_PATTERN.fullmatch(workspace.name) else None


def _expiry(record: SessionRecord, now: float, ttl_s: float, lifetime_s: float) -> str | None:
    if now - record.last_active > ttl_s:
        return f"session {record.session_id} expired after {ttl_s / 60:g} min idle"
    if now - record.created_at > lifetime_s:
        return (
            f"session {record.session_id} reached its maximum lifetime of {lifetime_s / 3600:g} h"
        )
    return None
