"""A session as the manager keeps it, and what a call gets of it.

:class:`Session` is the manager's record of one session in memory (its lock, sandbox,
runners, workspace, uid); :class:`Acquired` is what a tool call holds, :class:`Handout`
what a run gets to execute with. The helpers at the end are shared by the manager
(:mod:`.manager`: lifetimes, ending) and the sandbox keeper (:mod:`.sandboxes`: starting,
replacing, stopping).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from mcp_code_sandbox.backends.base import Sandbox
from mcp_code_sandbox.backends.runner_images import RunnerSandbox
from mcp_code_sandbox.errors import SessionNotFound
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.executor import Executor
from mcp_code_sandbox.sessions.uids import UidLease
from mcp_code_sandbox.workspace import Workspace

__all__ = [
    "END_WAIT_S",
    "Acquired",
    "Handout",
    "Session",
    "check_open",
    "closed_while",
    "stop_logged",
]

log = structlog.get_logger("mcp_code_sandbox.sessions")

#: How long ending a session waits for its call in flight and its sandbox starts in
#: flight (a start is bounded by the backend's own timeouts, well below this).
END_WAIT_S = 120.0
_T = TypeVar("_T")


@dataclass(eq=False)
class Session:
    id: str
    owner: str
    key: str
    #: Its directory name under workspaces_dir, and its record's name (see ``records``).
    slot: str
    workspace: Workspace
    #: ``created_at`` and ``last_active`` are monotonic; ``created_wall`` is wall-clock,
    #: for the record (monotonic time means nothing to the next process).
    created_at: float
    last_active: float
    created_wall: float
    #: Monotonic time the record was last written.
    saved_at: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sandbox: Sandbox | None = None
    agent: AgentClient | None = None
    #: Containers of runner images this session used, by language (docker only).
    runners: dict[str, RunnerSandbox] = field(default_factory=dict)
    runs: int = 0
    closed: bool = False
    #: Sandbox and runner starts in flight, and stops of what they made too late.
    starting: set[asyncio.Task[Any]] = field(default_factory=set)
    #: What a stop failed to free, retried until it goes (see ``SessionManager._release``).
    unstopped: list[Sandbox | RunnerSandbox] = field(default_factory=list)
    #: Held while the session is being destroyed: a close, the reaper and shutdown may all
    #: try, one after the other (never two stops of one sandbox at once).
    ending: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: The workspace exists (with its filesystem mounted, if it has one): made by the
    #: first call holding the lock, in a worker thread (a mount takes 20-30 ms).
    workspace_made: bool = False
    #: The host uid of its sandboxes, held for its whole life; ``None``: the backend's
    #: shared uid.
    uid_lease: UidLease | None = None

    @property
    def uid(self) -> int | None:
        return None if self.uid_lease is None else self.uid_lease.uid


@dataclass(frozen=True)
class Acquired:
    """What a tool call gets: the session, locked for this call, and how it came to be."""

    session: Session
    created: bool
    notice: str | None


@dataclass(frozen=True)
class Handout:
    """What :meth:`SessionManager.executor` hands a run: what runs its code, and what the
    session lost getting it ready."""

    executor: Executor
    #: The run's number in its session (1, 2, ...): names its saved output.
    run: int
    #: Said when the session's previous sandbox was replaced (it had died, or this call's
    #: network differs): its variables are gone. ``None``: nothing was lost.
    notice: str | None = None


def closed_while(session: Session, what: str) -> str:
    return (
        f"session {session.id} was closed while {what}; its sandbox was stopped. "
        "run_code or upload_file without session_id starts a new one"
    )


def check_open(session: Session) -> None:
    if session.closed:
        raise SessionNotFound(closed_while(session, "this call waited"))


async def stop_logged(stop: Callable[[_T], Awaitable[None]], thing: _T, session: Session) -> bool:
    """``stop(thing)``; False (logged) when it failed. Backends' stops should never raise:
    this is the session side's guard for one that does."""
    try:
        await stop(thing)
    except Exception:
        log.exception("cannot stop a sandbox", owner=session.owner, session=session.id)
        return False
    return True
