"""A session as the manager keeps it, and what a call gets of it.

:class:`Session` is the manager's record of one session in memory (its lock, sandbox,
runners, workspace, uid); :class:`Acquired` is what a tool call holds, :class:`Handout`
what a run gets to execute with. The helpers at the end are shared by the manager
(:mod:`.manager`: lifetimes, ending) and the sandbox keeper (:mod:`.sandboxes`: starting,
replacing, stopping).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import structlog

from mcp_code_sandbox.backends.base import Sandbox
from mcp_code_sandbox.backends.checkpoints import Checkpoint
from mcp_code_sandbox.backends.runner_images import RunnerSandbox
from mcp_code_sandbox.errors import SessionNotFound
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.executor import Executor
from mcp_code_sandbox.sessions.lifecycle import CLOSED, Phase
from mcp_code_sandbox.sessions.uids import UidLease
from mcp_code_sandbox.workspace import Workspace

__all__ = [
    "END_WAIT_S",
    "Acquired",
    "Handout",
    "Moved",
    "PauseKind",
    "Paused",
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


PauseKind = Literal["memory", "variables", "files"]


@dataclass(frozen=True)
class Paused:
    """How a paused session was kept (see :mod:`.sandboxes`, ``pause``): its sandbox is
    stopped and holds no RAM; its next call resumes it.

    ``memory``: the backend checkpointed the whole sandbox (``checkpoint``); ``variables``:
    the interpreter saved its namespace into the workspace's ``.session/`` (``saved``
    names what was kept, ``dropped`` what was not); ``files``: nothing of the interpreter
    was kept (``why`` says why, ``None`` when it had nothing to keep: no sandbox ran)."""

    kind: PauseKind
    #: Wall-clock time of the pause.
    at: float
    #: Paused state on disk: the checkpoint image or saved variables, plus the files.
    bytes: int = 0
    checkpoint: Checkpoint | None = None
    #: ``(name, type)`` of each variable saved (``variables``), and of each dropped.
    saved: tuple[tuple[str, str], ...] = ()
    dropped: tuple[tuple[str, str, str], ...] = ()
    why: str | None = None
    #: Resume loads ``.session/``: the pause saved variables, or a server died during a
    #: pause and the last complete saved state is all there is.
    load: bool = False
    #: The workspace at the pause (its files, and the bytes they hold with ``.session/``
    #: and ``.packages/``): what ``list_sessions`` shows while the volume is unmounted.
    file_count: int = 0
    files_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["saved"] = [list(pair) for pair in self.saved]
        data["dropped"] = [list(entry) for entry in self.dropped]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Paused:
        """A record's pause, written by a server of ours (the state dir is not the
        sandbox's); still checked, and ``ValueError`` when it is not one."""
        kind = data.get("kind")
        if kind not in ("memory", "variables", "files"):
            raise ValueError(f"not a pause kind: {kind!r}")
        raw = data.get("checkpoint")
        checkpoint = None
        if isinstance(raw, dict) and isinstance(raw.get("backend_id"), str):
            size = raw.get("bytes")
            checkpoint = Checkpoint(raw["backend_id"], size if isinstance(size, int) else None)
        return cls(
            kind=kind,
            at=float(data.get("at", 0.0)),
            bytes=int(data.get("bytes", 0)),
            checkpoint=checkpoint,
            saved=tuple((str(n), str(t)) for n, t in data.get("saved") or ()),
            dropped=tuple((str(n), str(t), str(w)) for n, t, w in data.get("dropped") or ()),
            why=None if data.get("why") is None else str(data["why"]),
            load=data.get("load") is True,
            file_count=int(data.get("file_count", 0)),
            files_bytes=int(data.get("files_bytes", 0)),
        )


@dataclass(frozen=True)
class Moved:
    """The slot a session moved out of (:mod:`.moving`), with what it still holds there."""

    slot: str
    workspace: Workspace
    uid_lease: UidLease | None


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
    #: Where it is in its lifecycle; moved by :func:`.lifecycle.transition` only.
    phase: Phase = Phase.RUNNING
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sandbox: Sandbox | None = None
    agent: AgentClient | None = None
    #: Containers of runner images this session used, by language (docker only).
    runners: dict[str, RunnerSandbox] = field(default_factory=dict)
    runs: int = 0
    #: Sandbox and runner starts in flight, and stops of what they made too late.
    starting: set[asyncio.Task[Any]] = field(default_factory=set)
    #: What a stop failed to free, retried until it goes (see :meth:`.ending.Ending.release`).
    unstopped: list[Sandbox | RunnerSandbox] = field(default_factory=list)
    #: Held while the session is being destroyed: a close, the reaper and shutdown may all
    #: try, one after the other (never two stops of one sandbox at once).
    ending: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: The workspace exists (with its filesystem mounted, if it has one): made by the
    #: first call holding the lock, in a worker thread (a mount blocks). An axis of its
    #: own, beside ``phase``: a session of any phase may be mounted or not.
    workspace_made: bool = False
    #: ``(files, bytes)`` of the workspace when it was last unmounted without a sandbox
    #: (a pause, or the end of a file call): what the overview and ``list_sessions`` show
    #: until it is mounted again. ``None``: never measured so.
    files_kept: tuple[int, int] | None = None
    #: The host uid of its sandboxes, held for its whole life; ``None``: the backend's
    #: shared uid.
    uid_lease: UidLease | None = None
    #: How it was kept: set by its pause (phase ``PAUSED``), let go of by its resume
    #: (during ``RESUMING``); an ending session may still hold one (a checkpoint to free).
    paused: Paused | None = None
    #: Calls waiting for its lock: a session with one is not idle, even while its lock
    #: is free for a moment between two calls (``room`` never pauses it then).
    queued: int = 0
    #: The slot it moved out of (resumed into a warm sandbox), until that slot is gone:
    #: its record says so, for a server that dies in between (see ``records``).
    replaces: Moved | None = None

    @property
    def closed(self) -> bool:
        """Ended or ending: no call may use it any more."""
        return self.phase in CLOSED

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
    """What :meth:`.manager.SessionManager.executor` hands a run: what runs its code, and what the
    session lost getting it ready."""

    executor: Executor
    #: The run's number in its session (1, 2, ...): names its saved output.
    run: int
    #: Said when the session's previous sandbox was replaced (it had died, or this call's
    #: network differs): its variables are gone. ``None``: nothing was lost.
    notice: str | None = None
    #: How a paused session came back for this call: ``memory`` or ``variables``; ``None``
    #: when it was not paused, or came back with its files alone (``notice`` says so).
    resumed: str | None = None


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
