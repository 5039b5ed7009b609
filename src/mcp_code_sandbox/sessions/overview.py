"""What the operator's ``/ui`` page shows of each session: read-only figures gathered now.

Called by the service for one owner's sessions or every owner's. Each figure is read
without the session's lock (a page view must not queue behind a 60 s cell): the memory
and CPU through the backend (``Backend.usage``), waited for at most
:data:`FIGURE_TIMEOUT_S`; the workspace's size by a walk in the owner's worker threads,
bounded by :data:`WALK_LIMIT` entries (a thread cannot be interrupted, so the entry bound
is what keeps it short; past it the size is a lower bound). A figure that is not there
in time, or whose session ends meanwhile, is unknown (``None``), never an error of the
page.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from mcp_code_sandbox.backends.base import Backend, Usage
from mcp_code_sandbox.errors import SandboxError
from mcp_code_sandbox.sessions.records import SessionRecord
from mcp_code_sandbox.sessions.session import Paused, Session
from mcp_code_sandbox.sessions.workers import WorkerThreads

__all__ = [
    "FIGURE_TIMEOUT_S",
    "WALK_LIMIT",
    "SessionSummary",
    "SessionView",
    "files_held",
    "overview",
    "summaries",
]

FIGURE_TIMEOUT_S = 2.0
#: Entries a workspace walk reads at most for the page; past it the size is a lower bound.
WALK_LIMIT = 50_000


@dataclass(frozen=True)
class SessionView:
    owner: str
    session_id: str
    #: ``busy`` (a call holds it now), ``running`` (a live sandbox, idle), ``paused``
    #: (idle, its sandbox put away to disk), or ``no sandbox`` (files only: nothing ran
    #: yet, or its sandbox was stopped).
    state: str
    created_at: float  # wall clock
    age_s: float
    idle_s: float
    runs: int
    memory_bytes: int | None
    cpu_seconds: float | None
    workspace_bytes: int | None
    #: The replica that holds it (``SANDBOX_REPLICA``); empty for a server alone.
    replica: str = ""


def _state(session: Session) -> str:
    if session.lock.locked():
        return "busy"
    if session.paused is not None:
        return "paused"
    if session.sandbox is not None and session.sandbox.is_alive():
        return "running"
    return "no sandbox"


async def _usage(backend: Backend, session: Session) -> Usage | None:
    sandbox = session.sandbox
    if sandbox is None or not sandbox.is_alive():
        return None
    try:
        async with asyncio.timeout(FIGURE_TIMEOUT_S):
            return await backend.usage(sandbox)
    except TimeoutError:
        return None


async def _workspace_bytes(threads: WorkerThreads, session: Session) -> int | None:
    if not session.workspace_made and session.files_kept is not None and not session.closed:
        return session.files_kept[1]  # put away: as measured when it was unmounted
    if not session.workspace_made or session.closed:
        return None
    try:
        async with asyncio.timeout(FIGURE_TIMEOUT_S):
            walk = session.workspace.usage_bytes
            return await threads.run(session.owner, walk, WALK_LIMIT)
    except (TimeoutError, SandboxError, OSError):
        return None  # ended meanwhile, or a walk too slow for a page


async def _view(
    backend: Backend, threads: WorkerThreads, session: Session, replica: str
) -> SessionView:
    usage, size = await asyncio.gather(_usage(backend, session), _workspace_bytes(threads, session))
    now = time.monotonic()
    return SessionView(
        owner=session.owner,
        session_id=session.id,
        state=_state(session),
        created_at=session.created_wall,
        age_s=now - session.created_at,
        idle_s=0.0 if session.lock.locked() else now - session.last_active,
        runs=session.runs,
        memory_bytes=None if usage is None else usage.memory_bytes,
        cpu_seconds=None if usage is None else usage.cpu_seconds,
        workspace_bytes=size,
        replica=replica,
    )


async def overview(
    sessions: list[Session],
    backend: Backend,
    threads: WorkerThreads,
    *,
    replica: str = "",
    elsewhere: Sequence[SessionRecord] = (),
) -> list[SessionView]:
    """One :class:`SessionView` per session, oldest first, gathered concurrently; with
    those other replicas hold (``elsewhere``: their records) as their records say."""
    views = await asyncio.gather(*(_view(backend, threads, s, replica) for s in sessions))
    return sorted([*views, *map(_recorded_view, elsewhere)], key=lambda v: v.created_at)


def _recorded_view(record: SessionRecord) -> SessionView:
    """A session another replica holds, as its record says (its figures are that
    replica's to measure: unknown here)."""
    now = time.time()
    paused = record.paused is not None
    return SessionView(
        owner=record.owner,
        session_id=record.session_id,
        state="paused" if paused else "running",
        created_at=record.created_at,
        age_s=now - record.created_at,
        idle_s=max(0.0, now - record.last_active),
        runs=record.runs,
        memory_bytes=None,
        cpu_seconds=None,
        workspace_bytes=None,
        replica=record.instance,
    )


@dataclass(frozen=True)
class SessionSummary:
    """One session as ``list_sessions`` shows it to its owner."""

    session_id: str
    created_at: float  # wall clock
    last_active: float  # wall clock
    state: Literal["running", "paused"]
    #: Bytes the workspace holds (``.session/`` and ``.packages/`` too) and its files;
    #: ``None`` when the walk did not finish in time.
    workspace_bytes: int | None
    file_count: int | None
    #: ``(name, type)`` of the variables a pause saved; ``None`` unless paused with them.
    saved_variables: tuple[tuple[str, str], ...] | None


async def summaries(
    sessions: list[Session],
    threads: WorkerThreads,
    elsewhere: Sequence[SessionRecord] = (),
) -> list[SessionSummary]:
    """A :class:`SessionSummary` per session, oldest first. A session's files are as
    they were measured when its filesystem was put away (a pause, the end of a file call
    on a session without a sandbox), while it is. Those other replicas hold
    (``elsewhere``) are as their records say: their files unknown while they run."""
    ours = await asyncio.gather(*(_summary(threads, s) for s in sessions))
    return sorted([*ours, *map(_recorded_summary, elsewhere)], key=lambda s: s.created_at)


def _recorded_summary(record: SessionRecord) -> SessionSummary:
    paused = None
    if record.paused is not None:
        with contextlib.suppress(ValueError, TypeError):
            paused = Paused.from_json(record.paused)
    return SessionSummary(
        session_id=record.session_id,
        created_at=record.created_at,
        last_active=record.last_active,
        state="paused" if record.paused is not None else "running",
        workspace_bytes=None if paused is None else paused.files_bytes,
        file_count=None if paused is None else paused.file_count,
        saved_variables=paused.saved if paused is not None and paused.kind == "variables" else None,
    )


async def _summary(threads: WorkerThreads, session: Session) -> SessionSummary:
    paused = session.paused
    count: int | None
    size: int | None
    if not session.workspace_made and session.files_kept is not None:
        count, size = session.files_kept
    elif paused is not None and not session.workspace_made:
        count, size = paused.file_count, paused.files_bytes
    else:
        count, size = await _files(threads, session)
    now_mono, now_wall = time.monotonic(), time.time()
    busy = session.lock.locked()
    return SessionSummary(
        session_id=session.id,
        created_at=session.created_wall,
        last_active=now_wall if busy else now_wall - (now_mono - session.last_active),
        state="paused" if paused is not None else "running",
        workspace_bytes=size,
        file_count=count,
        saved_variables=paused.saved if paused is not None and paused.kind == "variables" else None,
    )


async def _files(threads: WorkerThreads, session: Session) -> tuple[int | None, int | None]:
    try:
        async with asyncio.timeout(FIGURE_TIMEOUT_S):
            held = await files_held(threads, session)
    except TimeoutError:
        return None, None
    return held if held is not None else (None, None)


async def files_held(threads: WorkerThreads, session: Session) -> tuple[int, int] | None:
    """The workspace's files and the bytes it holds (``.session/`` and ``.packages/``
    too), by a walk in the owner's worker threads bounded by :data:`WALK_LIMIT`; zeros
    when it is not made (or put away), ``None`` when it cannot be read. For
    ``list_sessions`` and for the manager, which records them at a pause."""
    if not session.workspace_made or session.closed:
        return 0, 0
    try:
        snapshot = await threads.run(
            session.owner, session.workspace.snapshot, WALK_LIMIT, count_hidden=True
        )
    except (SandboxError, OSError):
        return None
    return len(snapshot.files), snapshot.used_bytes
