"""The session table: the live sessions by ``(owner, session_id)``, what is remembered of
the ended ones (tombstones), and each session's record on disk. Everything else in
``sessions/`` finds a session here, and writes its record through here.

Semantics:
- One lookup by ``(owner, session_id)`` (:meth:`SessionTable.get`) and one by id alone
  (:meth:`SessionTable.with_id`, for a download link that names no owner): the only ways
  in, so that a miss can later be filled from the records a replica shares.
- A closed or expired id is remembered (bounded) so that reusing it says what was lost.
- A record's ``last_active`` is rewritten at most every ``RECORD_EVERY_S`` per session
  (:meth:`SessionTable.save`): a restart only needs the idle time to within seconds of a
  30-minute TTL, and a burst of calls then costs no disk writes at all. What the record
  says about a pause is rewritten at once when it changes (:meth:`SessionTable.touch`):
  a server that dies next must not restore a checkpoint that is running again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import structlog

from mcp_code_sandbox.sessions import records
from mcp_code_sandbox.sessions.lifecycle import Phase
from mcp_code_sandbox.sessions.session import Session
from mcp_code_sandbox.sessions.uids import UidLease
from mcp_code_sandbox.settings import Settings
from mcp_code_sandbox.workspace import Workspace

__all__ = ["RECORD_EVERY_S", "SessionTable"]

log = structlog.get_logger("mcp_code_sandbox.sessions.table")

#: Longest a session's on-disk ``last_active`` lags behind the truth (see above).
RECORD_EVERY_S = 10.0
#: Ended ids remembered, oldest forgotten first: a bound on what a flood of ids costs.
_TOMBSTONES = 10_000


@dataclass
class _Written:
    """When a session's record was last written (monotonic), and whether it said paused."""

    at: float
    paused: bool


class SessionTable:
    """The live sessions of this server, their tombstones and their records."""

    def __init__(
        self,
        settings: Settings,
        *,
        instance: str,
        handover: bool,
        workspace_for: Callable[[str, int | None], Workspace],
    ) -> None:
        """``instance``: this server, as its records name it; ``handover``: may a
        successor take its sessions over (records say so); ``workspace_for(slot, uid)``:
        the workspace of a slot (for sessions loaded from their records)."""
        self.settings = settings
        self.instance = instance
        self.handover = handover
        self._workspace_for = workspace_for
        self._sessions: dict[tuple[str, str], Session] = {}
        self._tombstones: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._written: dict[Session, _Written] = {}

    # -- the index ---------------------------------------------------------------------

    def get(self, owner: str, session_id: str) -> Session | None:
        """``owner``'s live session ``session_id``; ``None``: none (see :meth:`gone`)."""
        return self._sessions.get((owner, session_id))

    def with_id(self, session_id: str) -> list[Session]:
        """The live sessions named ``session_id``, of every owner (a download link names
        no owner: its signature tells which of these it is for)."""
        return [s for (_, sid), s in self._sessions.items() if sid == session_id]

    def listed(self, owner: str | None = None) -> list[Session]:
        """The live sessions: every owner's (``owner`` None) or ``owner``'s."""
        return [s for (who, _), s in self._sessions.items() if owner is None or who == owner]

    def __iter__(self) -> Iterator[Session]:
        return iter(self._sessions.values())

    def count(self, owner: str | None = None) -> int:
        """Live sessions: all of them, or ``owner``'s."""
        if owner is None:
            return len(self._sessions)
        return sum(1 for who, _ in self._sessions if who == owner)

    def paused_bytes(self) -> int:
        """Bytes of paused sessions' state on disk, all owners (for the disk budget)."""
        return sum(s.paused.bytes for s in self._sessions.values() if s.paused is not None)

    def count_state(self, state: str) -> int:
        """Live sessions ``paused``, or running (any other ``state``): for the metrics."""
        paused = sum(1 for s in self._sessions.values() if s.paused is not None)
        return paused if state == "paused" else len(self._sessions) - paused

    def add(self, session: Session) -> None:
        self._sessions[(session.owner, session.id)] = session

    def remove(self, session: Session) -> bool:
        """Take ``session`` out of the index; False when it was not in it (ended already)."""
        if self._sessions.get((session.owner, session.id)) is not session:
            return False
        del self._sessions[(session.owner, session.id)]
        return True

    def clear(self) -> list[Session]:
        """Take every session out (shutdown); the sessions that were in."""
        sessions = list(self._sessions.values())
        self._sessions.clear()
        return sessions

    def from_record(
        self, record: records.SessionRecord, lease: UidLease | None, phase: Phase
    ) -> Session:
        """A session as its ``record`` describes it, not added yet: the caller sets it up
        as it is now (its sandbox, or its pause), adds it and writes its record as ours
        (a later start must leave it alone)."""
        mono, wall = time.monotonic(), time.time()
        return Session(
            record.session_id,
            record.owner,
            record.key,
            record.slot,
            self._workspace_for(record.slot, record.uid),
            created_at=mono - (wall - record.created_at),
            last_active=mono - (wall - record.last_active),
            created_wall=record.created_at,
            phase=phase,
            uid_lease=lease,
            runs=record.runs,
        )

    # -- tombstones --------------------------------------------------------------------

    def tombstone(self, owner: str, session_id: str, reason: str) -> None:
        self._tombstones[(owner, session_id)] = (
            f"{reason}; files and variables from before are gone"
        )
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)

    def gone(self, owner: str, session_id: str) -> str | None:
        """Why ``owner``'s session ``session_id`` ended, if it is remembered."""
        return self._tombstones.get((owner, session_id))

    def reborn(self, owner: str, session_id: str) -> str | None:
        """Forget the tombstone of an id used again; what it said."""
        return self._tombstones.pop((owner, session_id), None)

    def tombstones(self) -> dict[tuple[str, str], str]:
        """Why each remembered ``(owner, session_id)`` ended (for tests and operators)."""
        return dict(self._tombstones)

    # -- records -----------------------------------------------------------------------

    def touch(self, session: Session) -> None:
        """A call starts or ends: ``last_active`` is now (on disk within ``RECORD_EVERY_S``,
        and at once when what the record says about a pause changed)."""
        session.last_active = time.monotonic()
        written = self._written.get(session)
        self.save(session, force=written is None or written.paused != _paused(session))

    def save(self, session: Session, *, force: bool = False) -> None:
        """Write the session's record, at most every ``RECORD_EVERY_S`` unless ``force``.
        Never raises for the disk: a full disk must not fail the call, the next write
        retries."""
        written = self._written.get(session)
        if not force and written is not None and time.monotonic() - written.at < RECORD_EVERY_S:
            return
        self.write(session)

    def write(self, session: Session) -> bool:
        """Write the session's record now; False (logged) when the disk refused."""
        now = time.monotonic()
        try:
            records.write_record(self.settings.sessions_dir, self.record(session))
        except OSError as exc:
            log.warning("cannot write the session record", session=session.id, error=str(exc))
            return False
        self._written[session] = _Written(now, _paused(session))
        return True

    def drop_record(self, session: Session) -> None:
        """Remove the session's record (its end, once its files are gone)."""
        self.drop_slot(session.slot)
        self._written.pop(session, None)

    def drop_slot(self, slot: str) -> None:
        """Remove the record of ``slot`` (a session that could not be made, or the slot
        a session moved out of)."""
        records.remove_record(self.settings.sessions_dir, slot)

    def record(self, session: Session) -> records.SessionRecord:
        """``session``'s record as it stands now."""
        idle = time.monotonic() - session.last_active
        return records.SessionRecord(
            owner=session.owner,
            session_id=session.id,
            key=session.key,
            slot=session.slot,
            instance=self.instance,
            created_at=session.created_wall,
            last_active=time.time() - idle,
            uid=session.uid,
            paused=None if session.paused is None else session.paused.to_json(),
            pausing=session.phase is Phase.PAUSING,
            forking=session.phase is Phase.FORKING,
            replaces=None if session.replaces is None else session.replaces.slot,
            handover=self.handover,
            runs=session.runs,
            egress=_egress(session),
        )

    def forget(self, session: Session) -> None:
        """Take ``session`` out without ending it (another replica holds it now): its
        record stays, as this server last wrote it."""
        self.remove(session)
        self._written.pop(session, None)


def _egress(session: Session) -> dict[str, Any] | None:
    """Its running sandbox's network as a record keeps it (see ``records``)."""
    egress = None if session.sandbox is None else session.sandbox.spec.egress
    if egress is None:
        return None
    hosts = None if egress.hosts is None else list(egress.hosts)
    return {"dir": egress.host_dir.name, "hosts": hosts}


def _paused(session: Session) -> bool:
    """Does the record say paused? (It holds the pause's data while there is some.)"""
    return session.paused is not None
