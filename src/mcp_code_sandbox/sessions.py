"""The session manager: ids, owners, lifetimes, one-call-at-a-time, and cleanup.

Semantics:
- A session is filed under ``(owner, session_id)``: another owner's session of the same
  name is a different session, and one owner never learns of another's (same error as a
  session that does not exist).
- A session is registered synchronously when first named, so two concurrent first calls
  with the same new id get one session. Its workspace is made at once; its sandbox only
  when code first runs (uploads need no sandbox).
- Calls to one session run one at a time in arrival order (``asyncio.Lock`` is FIFO); a
  call that waits longer than its own timeout fails with ``session_busy``.
- ``last_active`` moves at the start and end of every call; the reaper closes sessions
  idle past the TTL or older than the max lifetime, never in the middle of a call.
- A closed or expired id is remembered (bounded) so that reusing it says what was lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from mcp_code_sandbox.agent_client import AgentClient
from mcp_code_sandbox.backends.base import Backend, Limits, Sandbox, SandboxSpec
from mcp_code_sandbox.errors import MaxSessions, SessionBusy, SessionNotFound
from mcp_code_sandbox.ids import mint_session_id, session_key, validate_session_id
from mcp_code_sandbox.settings import Settings
from mcp_code_sandbox.workspace import Workspace, remove_tree

__all__ = ["Session", "SessionManager"]

log = structlog.get_logger("mcp_code_sandbox.sessions")

_TOMBSTONES = 10_000


@dataclass(eq=False)
class Session:
    id: str
    owner: str
    key: str
    workspace: Workspace
    created_at: float
    last_active: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sandbox: Sandbox | None = None
    agent: AgentClient | None = None
    runs: int = 0
    closed: bool = False


@dataclass(frozen=True)
class Acquired:
    """What a tool call gets: the session, locked for this call, and how it came to be."""

    session: Session
    created: bool
    notice: str | None


class SessionManager:
    def __init__(self, settings: Settings, backend: Backend) -> None:
        self.settings = settings
        self.backend = backend
        self._sessions: dict[tuple[str, str], Session] = {}
        self._tombstones: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._instance = f"{os.getpid()}-{os.urandom(4).hex()}"
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False

    # -- lifecycle of the manager -------------------------------------------------------

    @property
    def instance_dir(self) -> Path:
        """This server process's workspaces; other live servers sharing the state dir
        keep theirs, so start-up cleanup removes only directories of dead processes."""
        return self.settings.workspaces_dir / self._instance

    async def start(self) -> None:
        self.settings.run_dir.mkdir(parents=True, exist_ok=True)
        self.instance_dir.mkdir(parents=True, exist_ok=True)
        (self.settings.run_dir / f"{self._instance}.pid").write_text(str(os.getpid()))
        await self._remove_leftovers()
        self._reaper = asyncio.create_task(self._reap_forever(), name="session-reaper")

    async def aclose(self) -> None:
        """Stop every sandbox and delete every workspace; bounded by the backend's stops.

        Idempotent: a signal handler and the normal way out may both call it."""
        if self._closed:
            return
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        sessions = list(self._sessions.values())
        self._sessions.clear()
        await asyncio.gather(*(self._destroy(s) for s in sessions), return_exceptions=True)
        await self.backend.aclose()
        await asyncio.to_thread(remove_tree, self.instance_dir)
        (self.settings.run_dir / f"{self._instance}.pid").unlink(missing_ok=True)

    async def _remove_leftovers(self) -> None:
        for leftover in await self.backend.list_leftovers():
            log.info("removing leftover sandbox", backend_id=leftover.backend_id)
            await self.backend.remove_leftover(leftover)
        for pidfile in self.settings.run_dir.glob("*.pid"):
            instance = pidfile.stem
            if instance == self._instance or _alive(pidfile):
                continue
            log.info("removing workspaces of a server that is gone", instance=instance)
            target = self.settings.workspaces_dir / instance
            await asyncio.to_thread(remove_tree, target)
            pidfile.unlink(missing_ok=True)

    # -- acquiring sessions -----------------------------------------------------------

    @contextlib.asynccontextmanager
    async def acquire(
        self, owner: str, session_id: str | None, *, create: bool, wait_s: float
    ) -> AsyncIterator[Acquired]:
        """Hold ``owner``'s session for one call, creating it when ``create`` allows.

        ``session_id`` None mints a new id (only when ``create``). Unknown ids are
        created under that name when ``create``, else ``SessionNotFound``.
        """
        session, created, notice = self._lookup(owner, session_id, create=create)
        try:
            async with asyncio.timeout(wait_s):
                await session.lock.acquire()
        except TimeoutError:
            raise SessionBusy(
                f"session {session.id} is still running an earlier call after {wait_s:.0f} s "
                "of waiting; wait for it to finish, or use another session"
            ) from None
        try:
            if session.closed:  # closed while this call waited in the queue
                raise SessionNotFound(f"session {session.id} was closed while this call waited")
            session.last_active = time.monotonic()
            yield Acquired(session, created, notice)
        finally:
            session.last_active = time.monotonic()
            session.lock.release()

    def _lookup(
        self, owner: str, session_id: str | None, *, create: bool
    ) -> tuple[Session, bool, str | None]:
        if session_id is None:
            if not create:
                raise SessionNotFound("session_id is required")
            session_id = mint_session_id()
        validate_session_id(session_id)
        found = self._sessions.get((owner, session_id))
        if found is not None:
            return found, False, None
        if not create:
            raise SessionNotFound(
                f"no session {session_id!r}"
                + _gone_suffix(self._tombstones.get((owner, session_id)))
                + "; run_code or upload_file without session_id starts a new one"
            )
        if len(self._sessions) >= self.settings.max_sessions:
            raise MaxSessions(
                f"this server already runs {self.settings.max_sessions} sessions; close one "
                "with close_session, or reuse an existing session_id"
            )
        session = self._register(owner, session_id)
        return session, True, self._tombstones.pop((owner, session_id), None)

    def _register(self, owner: str, session_id: str) -> Session:
        key = session_key(owner, session_id)
        owner_ids = self.backend.workspace_owner
        workspace = Workspace(
            self.instance_dir / key,
            quota_bytes=self.settings.workspace_quota_bytes,
            owner=owner_ids,
        )
        workspace.create()
        now = time.monotonic()
        session = Session(session_id, owner, key, workspace, now, now)
        self._sessions[(owner, session_id)] = session
        log.info("session created", owner=owner, session=session_id)
        return session

    # -- sandboxes ------------------------------------------------------------------------

    def limits(self) -> Limits:
        s = self.settings
        return Limits(
            memory_bytes=s.memory_limit,
            cpu=s.cpu_limit,
            pids=s.pids_limit,
            tmp_bytes=s.tmp_size,
            file_bytes=s.workspace_quota_bytes,
        )

    async def ensure_sandbox(self, session: Session) -> tuple[AgentClient, str | None]:
        """The session's agent, starting a sandbox if it has none or its one died.

        Returns a notice when a previous sandbox was lost (variables are gone then).
        Called with the session's lock held.
        """
        notice = None
        if session.sandbox is not None and (
            not session.sandbox.is_alive() or (session.agent is not None and session.agent.broken)
        ):
            await self._stop_sandbox(session)
            notice = (
                f"the sandbox of session {session.id} had stopped; a new one was started. "
                "Files in /mnt/data are kept; variables and imports from before are gone"
            )
        if session.sandbox is None or session.agent is None:
            spec = SandboxSpec(
                key=session.key,
                owner=session.owner,
                session_id=session.id,
                workspace=session.workspace.root,
                limits=self.limits(),
                env=self._pass_through_env(),
            )
            session.sandbox = await self.backend.create(spec)
            session.agent = AgentClient(session.sandbox.channel)
        return session.agent, notice

    async def restart_sandbox(self, session: Session) -> None:
        await self._stop_sandbox(session)

    def _pass_through_env(self) -> dict[str, str]:
        return {
            name: os.environ[name] for name in self.settings.pass_through_env if name in os.environ
        }

    async def _stop_sandbox(self, session: Session) -> None:
        sandbox, session.sandbox, session.agent = session.sandbox, None, None
        if sandbox is not None:
            await self.backend.stop(sandbox)

    # -- closing ---------------------------------------------------------------------------

    async def close(self, owner: str, session_id: str) -> None:
        validate_session_id(session_id)
        session = self._sessions.get((owner, session_id))
        if session is None:
            raise SessionNotFound(f"no session {session_id!r} (already closed, or never existed)")
        await self._expire(session, f"session {session_id} was closed")

    async def _expire(self, session: Session, reason: str) -> None:
        if self._sessions.get((session.owner, session.id)) is not session:
            return
        del self._sessions[(session.owner, session.id)]
        session.closed = True
        self._tombstones[(session.owner, session.id)] = (
            f"{reason}; files and variables from before are gone"
        )
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)
        await self._destroy(session)
        log.info("session ended", owner=session.owner, session=session.id, reason=reason)

    async def _destroy(self, session: Session) -> None:
        session.closed = True
        await self._stop_sandbox(session)
        await asyncio.to_thread(session.workspace.destroy)

    async def _reap_forever(self) -> None:
        ttl = self.settings.session_ttl_m * 60
        interval = max(0.5, min(15.0, ttl / 4))
        while True:
            await asyncio.sleep(interval)
            await self.reap()

    async def reap(self) -> None:
        """Close sessions idle past the TTL or past their max lifetime (not mid-call)."""
        now = time.monotonic()
        ttl = self.settings.session_ttl_m * 60
        lifetime = self.settings.session_max_lifetime_h * 3600
        for session in list(self._sessions.values()):
            if session.lock.locked():
                continue
            if now - session.last_active > ttl:
                await self._expire(
                    session,
                    f"session {session.id} expired after {self.settings.session_ttl_m:g} min idle",
                )
            elif now - session.created_at > lifetime:
                await self._expire(
                    session,
                    f"session {session.id} reached its maximum lifetime of "
                    f"{self.settings.session_max_lifetime_h:g} h",
                )

    def count(self) -> int:
        return len(self._sessions)


def _gone_suffix(tombstone: str | None) -> str:
    return f" ({tombstone})" if tombstone else ""


def _alive(pidfile: Path) -> bool:
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
