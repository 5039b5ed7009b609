"""The session manager: ids, owners, one-call-at-a-time, pausing, and its rooms' wiring.

A session's value types are in :mod:`.session` and its phases in :mod:`.lifecycle`; the
live sessions, their tombstones and records in :mod:`.table`; its sandboxes and runners
are started, replaced and stopped by :mod:`.sandboxes` (the manager owns one and hands
out its executors); the reaper decides in :mod:`.reaper`, and a session ends step by
step in :mod:`.ending`; crash recovery is planned by :mod:`.recovery` and applied here.

Semantics:
- A session is filed under ``(owner, session_id)``: another owner's session of the same
  name is a different session, and one owner never learns of another's (same error as a
  session that does not exist).
- A session is registered synchronously when first named, so two concurrent first calls
  with the same new id get one session. Its workspace is made by the first call that
  holds its lock (in a worker thread: with a filesystem per workspace that is a mount);
  its sandbox only when code first runs (uploads need no sandbox).
- Calls to one session run one at a time in arrival order (``asyncio.Lock`` is FIFO); a
  call that waits longer than its own timeout fails with ``session_busy``.
- ``last_active`` moves at the start and end of every call; the reaper (:mod:`.reaper`)
  ends sessions idle past the TTL or older than the max lifetime, never mid-call.
- Limits on running sessions: ``max_sessions`` in all, ``sessions_per_owner`` each; a
  call that needs one more pauses the longest-idle running session (:mod:`.room`).
  Paused ones are bounded by ``max_paused_sessions`` and ``paused_disk_bytes`` (by what
  they hold on disk, the largest owner first: :func:`.room.over_disk_budget`).
- A session without a sandbox (paused, or one that never ran code) has its workspace
  mounted for a file call only: the call takes a place in :mod:`.mounts`, and its end
  unmounts the workspace (the reaper retries one still busy) and measures a paused one.
- A session created by a call that runs code in a sandbox of the default kind takes a
  warm one from :mod:`.pool` when there is one (its slot, workspace, uid and sandbox
  become the session's; owner and id are bound then); else it starts one as before.
  Pooled sandboxes count toward no limit, and shutdown stops them too. A paused session
  resumed by such a call moves into a warm sandbox where it fits (:mod:`.moving`).
- Every session has a record on disk (:mod:`.records`, written by :mod:`.table`) and a
  workspace at ``workspaces_dir/<slot>``, for the server that follows a SIGKILL.
- Who holds a session, and who may take over what a dead server left, is the rule of
  :mod:`.holder` (the manager's ``role``); at start, :mod:`.recovery` re-attaches or
  removes what dead servers left. Shutdown (``aclose``) is not a crash: it ends every
  session, or (a service keeping its sessions) pauses them for its successor. A private
  server's janitor (:mod:`.janitor`) removes what a crash left.
- New sessions, their uids and every slot's workspace are made by :mod:`.making`.
- Replicas (``SANDBOX_REPLICA``) share the state directory's sessions: a session
  another replica holds is taken over before the call that names it (:mod:`.replicas`).
- Ending a session (close, expiry, shutdown) is :mod:`.ending`'s: a close that returns
  ``ok`` leaves no sandbox running, and what an end could not free is retried at every
  reaper pass and at shutdown.
- A fork (:mod:`.forking`) is a new session made, with the source's lock held, of a copy
  of the source's files and saved variables; the source is neither paused nor resumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
from collections.abc import AsyncIterator, Awaitable, Callable

import structlog

from mcp_code_sandbox import tracing
from mcp_code_sandbox.backends.base import Backend, Limits, SandboxSpec
from mcp_code_sandbox.backends.runner_images import RunnerImage
from mcp_code_sandbox.errors import InvalidArgument, SandboxFailed, SessionBusy, SessionNotFound
from mcp_code_sandbox.metrics import EndReason, Metrics
from mcp_code_sandbox.sessions import forking, records
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.agent_files import AgentFiles
from mcp_code_sandbox.sessions.egress import Wish
from mcp_code_sandbox.sessions.ending import Ending
from mcp_code_sandbox.sessions.forking import Forked
from mcp_code_sandbox.sessions.holder import PidFile, Role, ServiceLock, note_service
from mcp_code_sandbox.sessions.ids import mint_session_id, validate_session_id
from mcp_code_sandbox.sessions.janitor import Janitor
from mcp_code_sandbox.sessions.lifecycle import Phase, transition
from mcp_code_sandbox.sessions.making import Making
from mcp_code_sandbox.sessions.mounts import MountedWorkspaces
from mcp_code_sandbox.sessions.moving import fits_pool, move_into
from mcp_code_sandbox.sessions.pausing import Pausing
from mcp_code_sandbox.sessions.pool import PoolStatus, WarmPool
from mcp_code_sandbox.sessions.quota import QuotaMode
from mcp_code_sandbox.sessions.reaper import Reaper
from mcp_code_sandbox.sessions.recovery import take_over_all
from mcp_code_sandbox.sessions.replicas import Replicas
from mcp_code_sandbox.sessions.room import Room
from mcp_code_sandbox.sessions.sandboxes import Sandboxes
from mcp_code_sandbox.sessions.session import END_WAIT_S, Acquired, Handout, Paused, Session
from mcp_code_sandbox.sessions.shared import Shared, shared_of
from mcp_code_sandbox.sessions.table import SessionTable
from mcp_code_sandbox.sessions.uids import uid_pool
from mcp_code_sandbox.sessions.workers import WorkerThreads
from mcp_code_sandbox.settings import Settings
from mcp_code_sandbox.workspace.seam import DirectoryFiles, Files

__all__ = ["SessionManager"]

log = structlog.get_logger("mcp_code_sandbox.sessions.manager")


class SessionManager:
    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        metrics: Metrics | None = None,
        *,
        role: Role | None = None,
        janitor: bool = False,
        replica: bool = False,
    ) -> None:
        """``role``: what this server may take over, and what its successor may (see
        :mod:`.holder`); ``None``: the state directory's service when it keeps its
        sessions at shutdown, else a private server. ``janitor``: a private server
        whose process a client may kill (stdio, ``exec``) starts a janitor process that
        removes what it leaves if it dies without ending its sessions (:mod:`.janitor`).
        ``replica``: a service that shares its state directory's sessions with other
        replicas (:mod:`.replicas`)."""
        self.settings = settings
        if role is None:
            role = Role.SERVICE if settings.keep_sessions_on_shutdown else Role.PRIVATE
        self.role = role
        self._janitor: Janitor | None = None
        self._wants_janitor = janitor and role is Role.PRIVATE
        #: Held for this server's life when it is the state directory's service.
        self._service_lock: ServiceLock | None = None
        #: This server's pid file, locked for its life (:class:`.holder.PidFile`).
        self._pid_file: PidFile | None = None
        self.backend = backend
        self.metrics = metrics or Metrics(backend.name)
        self.metrics.track_sessions(self.count)
        #: Where blocking work on sessions' files runs (never on the event loop).
        self.threads = WorkerThreads()
        self._instance = f"{os.getpid()}-{os.urandom(4).hex()}"
        #: Host uids, one per session, when the backend can use them.
        self.uids = uid_pool(settings) if backend.per_sandbox_uids else None
        #: Makes new sessions and every slot's workspace (its quota decided at start).
        self.making = Making(settings, backend, self.metrics, self.threads, self.uids)
        #: The live sessions, their tombstones and records.
        self.table = SessionTable(
            settings,
            instance=self._instance,
            handover=role is Role.SERVICE,
            workspace_for=self.making.workspace,
        )
        self.metrics.track_states(self.table.count_state, self.table.paused_bytes)
        self._closed = False
        #: Starts, replaces and stops the sessions' sandboxes and runners.
        self.sandboxes = Sandboxes(
            settings, backend, self.metrics, outlive_server=role is Role.SERVICE
        )
        #: Places for the mounts of sessions without a sandbox (file calls on them).
        self.mounts = MountedWorkspaces(settings)
        #: Pauses sessions (for the reaper, the room and shutdown).
        self.pausing = Pausing(self.sandboxes, self.threads, self.table, self.mounts)
        #: Ends sessions, and retries what an end left.
        self.ending = Ending(
            settings, self.threads, self.table, self.mounts, self.metrics, self.sandboxes
        )
        #: Sessions any server serves, on a backend whose sandboxes are their registry.
        registry = shared_of(backend)
        self.shared = (
            None
            if registry is None
            else Shared(
                backend,
                registry,
                self.table,
                self._spec_for,
                self.metrics,
                instance=self._instance,
                egress=self.sandboxes.egress,
            )
        )
        end_idle: Callable[[Session, str, EndReason], Awaitable[None]] = self.ending.end_logged
        if self.shared is not None:  # served elsewhere since: let go, not ended
            end_idle = self.shared.end_idle(end_idle)
        if self.shared is not None and registry is not None and registry.keeps_workspaces:
            # A paused session's record is its kept workspace, which ends with it.
            self.pausing.hand_on = self.shared.paused
            self.ending.forgets = self.shared
        #: Expires and pauses idle sessions (started by :meth:`start`).
        self.reaper = Reaper(
            settings,
            self.table.__iter__,
            end=end_idle,
            pause=self.pausing.pause,
            unmount=self.pausing.unmount,
            retry=self.ending.retry,
        )
        #: Warm sandboxes for new sessions (started by :meth:`start`).
        self.pool = WarmPool(
            settings,
            backend,
            self.metrics,
            self.sandboxes,
            self.threads,
            instance=self._instance,
            handover=role is Role.SERVICE,
            workspace_for=self.making.workspace,
            lease_uid=self.making.lease_uid,
        )
        #: This server's part in the registry its replicas share, when it is one.
        self.replicas = (
            Replicas(
                settings,
                backend,
                self.table,
                self.sandboxes,
                uids=self.uids,
                spec_for=self._spec_for,
                pausing=self.pausing,
                mounts=self.mounts,
                pool=self.pool,
                recover=self._recover,
                metrics=self.metrics,
            )
            if replica and role is Role.SERVICE
            else None
        )
        #: The running-session limits (every replica's), kept by pausing the longest idle.
        self.room = Room(settings, self.table.__iter__, self.pausing.pause, self.replicas)

    # -- lifecycle of the manager -------------------------------------------------------

    async def start(self) -> None:
        """Raises ``ConfigError`` for a second service on one state directory."""
        run_dir = self.settings.run_dir
        if self.role is Role.SERVICE:
            self._service_lock = ServiceLock.claim(run_dir, replica=self.replicas is not None)
        else:
            await asyncio.to_thread(note_service, run_dir, self.settings.state_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.settings.workspaces_dir.mkdir(parents=True, exist_ok=True)
        self._pid_file = PidFile.claim(run_dir / f"{self._instance}.pid")
        if self._wants_janitor:  # before any sandbox or workspace of ours exists
            self._janitor = await Janitor.start(self.settings, self.backend.name, self._instance)
        await self.making.choose_quota()
        if self.uids is not None:
            await asyncio.to_thread(self.uids.open)
        await self._recover()
        if self.shared is not None:
            await self.shared.start()
        await self.sandboxes.start()
        if self.replicas is not None:
            await self.replicas.start()
        self.reaper.start(lambda: self.reap())  # looked up at each pass (tests wrap it)
        await self.making.start_spares(self._instance)  # after recovery: see ``making``
        self.pool.start()

    async def aclose(self) -> None:
        """Stop every sandbox and delete every workspace; bounded by the backend's stops.
        A service with ``keep_sessions_on_shutdown`` pauses them all for its successor
        instead.

        Idempotent: a signal handler and the normal way out may both call it."""
        if self._closed:
            return
        self._closed = True
        await self.reaper.stop()
        sessions = self.table.clear()
        end: Callable[[Session], Awaitable[object]]
        if self.shared is not None:  # in the cluster, for whichever server is called next
            end, how = self.shared.let_go, "leaving every session running in the cluster"
        elif self.replicas is not None:  # the others go on serving them, unpaused
            end, how = self.replicas.hand_on, "leaving every session running for the replicas"
        elif self.role is Role.SERVICE and self.settings.keep_sessions_on_shutdown:
            end, how = self.pausing.leave, "pausing every session for the next server"
        else:
            end, how = self.ending.destroy, "ending every session"
        log.info(f"shutting down: {how}", sessions=len(sessions))
        unfinished = list(self.ending.unfinished.values())
        # Each session on its own: one that fails is logged and the others still end.
        for outcome in await asyncio.gather(
            *(end(s) for s in sessions),
            *(self.ending.destroy(s) for s in unfinished),
            self.pool.aclose(),
            return_exceptions=True,
        ):
            if isinstance(outcome, BaseException):
                log.error("session not cleaned up at shutdown", error=repr(outcome))
        if self.replicas is not None:
            await self.replicas.aclose()
        await self.sandboxes.egress.aclose()  # any proxy a stop cut short left open
        await self.making.close()
        try:
            await self.backend.aclose()
        except Exception:
            log.exception("the backend did not close cleanly")
        if self._pid_file is not None:  # a replica's stays: the others take over
            self._pid_file.release(keep=self.replicas is not None)
        if self._service_lock is not None:
            self._service_lock.release()
        if self._janitor is not None and not self.ending.unfinished:
            # Everything of ours is gone: nothing for it to do. Otherwise it is left to
            # clean up what could not be freed once this process has exited.
            await asyncio.to_thread(self._janitor.dismiss)

    async def _recover(self) -> None:
        """Take over (re-attach or keep paused) or remove what dead servers left, and
        add what is taken over (at start; a replica also when another one died)."""
        takes_over = self.role is Role.SERVICE
        await take_over_all(
            self.settings,
            self.backend,
            self.table,
            spec_for=self._spec_for,
            uids=self.uids,
            takes_over=takes_over,
        )

    @property
    def quota(self) -> QuotaMode:
        """How the workspace quota binds sandboxes here (decided at :meth:`start`)."""
        return self.making.quota

    @property
    def instance(self) -> str:
        """This server process's name in records and pid files (``<pid>-<random>``)."""
        return self._instance

    def _spec_for(self, record: records.SessionRecord) -> SandboxSpec:
        """The spec a recorded session's sandbox was made with (recovery re-attaches it)."""
        workspace = self.making.workspace(record.slot, record.uid)
        return self.sandboxes.spec(
            record.key, record.owner, record.session_id, workspace, uid=record.uid
        )

    # -- acquiring sessions -----------------------------------------------------------

    @contextlib.asynccontextmanager
    async def acquire(
        self,
        owner: str,
        session_id: str | None,
        *,
        create: bool,
        wait_s: float,
        pool: bool = False,
        runs: bool = False,
    ) -> AsyncIterator[Acquired]:
        """Hold ``owner``'s session for one call, creating it when ``create`` allows.

        ``session_id`` None mints a new id (only when ``create``). Unknown ids are
        created under that name when ``create``, else ``SessionNotFound``. ``pool``: the
        call runs code in a sandbox of the pool's kind (no network, no runner, no env of
        its own), so a session it creates takes a warm sandbox when there is one.
        ``runs``: the call asks for its :meth:`executor` next, which mounts the workspace
        of a session that is not paused (a new one) while its sandbox starts; else the
        workspace is mounted here.
        """
        tracing.mark_replica(self._instance)
        with tracing.span("claim session"):
            while True:
                claimed = await self._claim(owner, session_id, create, wait_s, pool)
                session, created, notice = claimed
                if session.phase is not Phase.HANDED_ON:
                    break
                session.lock.release()  # another replica took it while this call waited
        try:
            if session.closed:  # closed while this call waited in the queue
                raise SessionNotFound(f"session {session.id} was closed while this call waited")
            if not session.workspace_made and not (runs and session.paused is None):
                if not runs and session.workspace.volume is not None:
                    await self.mounts.take(session, wait_s)  # see ``mounts``
                await self.making.mount(session)
            self.table.touch(session)
            yield Acquired(session, created, notice)
        finally:
            try:
                # Not one let go meanwhile (a resume that failed: see ``executor``).
                held = self.table.get(session.owner, session.id) is session
                if not session.closed and held:
                    self.table.touch(session)
                    if self.shared is not None:
                        await self.shared.touch(session)
                    await self.pausing.after_call(session)
            finally:
                session.lock.release()

    async def _claim(
        self, owner: str, session_id: str | None, create: bool, wait_s: float, pool: bool
    ) -> tuple[Session, bool, str | None]:
        """``acquire``'s session, found, taken over or created, and locked for the call.
        A replica takes it over, or makes it, holding its lease (``replicas.held``)."""
        held: contextlib.AbstractAsyncContextManager[None] = contextlib.nullcontext()
        if self.replicas is not None and session_id is not None:
            held = self.replicas.held(owner, session_id, wait_s)
        async with held:
            session, created, notice = await self._found(owner, session_id, create, pool)
        session.queued += 1  # not idle while a call waits for it (see ``room``)
        try:
            async with asyncio.timeout(wait_s):
                await session.lock.acquire()
        except TimeoutError:
            raise SessionBusy(
                f"session {session.id} is still running an earlier call after {wait_s:.0f} s "
                "of waiting; wait for it to finish, or use another session"
            ) from None
        finally:
            session.queued -= 1
        return session, created, notice

    async def _found(
        self, owner: str, session_id: str | None, create: bool, pool: bool
    ) -> tuple[Session, bool, str | None]:
        unknown = session_id is not None and self.table.get(owner, session_id) is None
        if self.shared is not None and session_id is not None and unknown:
            adopted = await self.shared.adopt(owner, session_id)  # another server's, maybe
            if adopted is not None:
                return adopted, False, None
        if create and (session_id is None or self.table.get(owner, session_id) is None):
            if self.replicas is not None:  # the others' sessions count toward the limits
                await self.replicas.refresh(unless_recent=True)
                if pool:  # and their warm sandboxes are this one's when it has none
                    await self.replicas.borrow()
            await self.room.make(owner)  # a new session runs: room first (see ``room``)
            return self._lookup(owner, session_id, create=True, pool=pool)
        return self._lookup(owner, session_id, create=create, pool=pool)

    def _lookup(
        self, owner: str, session_id: str | None, *, create: bool, pool: bool = False
    ) -> tuple[Session, bool, str | None]:
        if session_id is None:
            if not create:
                raise SessionNotFound("session_id is required")
            session_id = mint_session_id()
        validate_session_id(session_id)
        found = self.table.get(owner, session_id)
        if found is not None:
            return found, False, None
        if not create:
            raise SessionNotFound(
                f"no session {session_id!r}"
                + _gone_suffix(self.table.gone(owner, session_id))
                + "; run_code or upload_file without session_id starts a new one"
            )
        self.room.check(owner)
        pooled = self.pool.claim() if pool else None
        if pooled is None:
            session = self.making.fresh(self.table, owner, session_id)
        else:
            retire = self.pool.retire
            session = self.making.from_pool(self.table, owner, session_id, pooled, retire)
        return session, True, self.table.reborn(owner, session_id)

    # -- sandboxes ------------------------------------------------------------------------

    def limits(self) -> Limits:
        """The limits every sandbox gets (from settings)."""
        return self.sandboxes.limits()

    async def executor(
        self,
        session: Session,
        *,
        network: Wish = None,
        runner: RunnerImage | None = None,
        pool: bool = False,
        counted: bool = True,
    ) -> Handout:
        """What runs this call's code in ``session`` (see :meth:`.sandboxes.Sandboxes.handout`).
        ``pool``: the call wants a sandbox of the warm pool's kind (as for ``acquire``), so
        a paused session it resumes moves into a warm sandbox when one is ready and its
        files are few enough (:mod:`.moving`). ``counted``: as for
        :meth:`.sandboxes.Sandboxes.handout`. Called by the service with the session's
        lock held."""
        handout = functools.partial(
            self.sandboxes.handout, session, network=network, runner=runner, counted=counted
        )
        if session.phase is not Phase.PAUSED:
            if not session.workspace_made:  # a new session: mounted while it starts

                def start(mounted: Awaitable[None]) -> Awaitable[Handout]:
                    return handout(mounted=mounted)

                return await self.making.mounting(session, start)
            return await handout()
        await self.room.make(session.owner, exclude=session)  # it runs again: room first
        self.room.check(session.owner)  # in the step in which ``make`` returned (``room``)
        session.phase = transition(session.phase, Phase.RESUMING)
        try:
            pooled = self.pool.claim() if pool and fits_pool(session) else None
            if pooled is not None:
                try:
                    await move_into(session, pooled, self.settings, self.threads, self.table)
                finally:  # not moved (or the call cancelled before the move committed)
                    if session.sandbox is not pooled.sandbox:
                        self.pool.retire(pooled)
            return await handout()
        finally:
            if session.phase is Phase.RESUMING:  # not closed meanwhile
                back = Phase.RUNNING if session.paused is None else Phase.PAUSED
                session.phase = transition(session.phase, back)
                if back is Phase.PAUSED and self.shared is not None and self.pausing.hand_on:
                    # Not resumed: the cluster says where it is (resumed by another
                    # server meanwhile, or paused still); its next call adopts it again.
                    await self.shared.let_go(session)

    # -- files ---------------------------------------------------------------------------

    def files(self, session: Session) -> Files:
        """``session``'s files, where its backend keeps them (:mod:`..workspace.seam`): its
        directory, in its owner's worker threads; or, with ``workspace_in_sandbox``, its
        sandbox, through its agent (a sandbox started for the call if it has none). For
        calls holding the session's lock."""
        blocking = self.threads.of(session.owner)
        if not self.backend.workspace_in_sandbox:
            return DirectoryFiles(session.workspace, blocking)

        async def agent() -> AgentClient:
            return await self._files_agent(session)

        quota = session.workspace.quota_bytes
        return AgentFiles(agent, quota_bytes=quota, blocking=blocking)

    async def _files_agent(self, session: Session) -> AgentClient:
        """The agent a file call asks: the running sandbox's, whatever its network; else
        a sandbox started (or resumed) as a run's would be, not counted as a run."""
        running, agent = session.sandbox, session.agent
        if running is not None and running.is_alive() and agent is not None and not agent.broken:
            return agent
        await self.executor(session, counted=False)
        if session.agent is None:  # a runner's handout never comes here: no runner asked
            raise SandboxFailed(f"session {session.id} has no sandbox to reach its files")
        return session.agent

    # -- restarting the interpreter -------------------------------------------------------

    async def restart(self, session: Session) -> None:
        """Give ``session`` a fresh interpreter, its files kept (``restart_interpreter``).
        A running one's agent restarts it (:meth:`.sandboxes.Sandboxes.restart`). A paused
        one stays paused and forgets what its pause kept of the interpreter (a checkpoint
        is discarded, saved variables are not loaded): its next call starts fresh, as a
        resume with its files only, and says nothing of lost variables (none were
        wanted). Called by the service with the session's lock held."""
        paused = session.paused
        if paused is None:
            await self.sandboxes.restart(session)
            return
        if paused.kind == "files" and paused.why is None:
            return
        await self.sandboxes.discard(paused)
        outside = (paused.checkpoint.bytes or 0) if paused.checkpoint is not None else 0
        session.paused = dataclasses.replace(
            paused, kind="files", checkpoint=None, saved=(), dropped=(), why=None,
            load=False, bytes=max(0, paused.bytes - outside),
        )  # fmt: skip
        self.table.save(session, force=True)

    # -- closing ---------------------------------------------------------------------------

    async def close(self, owner: str, session_id: str) -> None:
        """End the session now: see the module docstring for what waits for what.

        Raises ``SandboxFailed`` (the session is closed all the same) saying precisely
        what could not be freed; the reaper keeps trying."""
        validate_session_id(session_id)
        if self.replicas is not None:
            await self.replicas.take(owner, session_id, END_WAIT_S)
        if self.shared is not None and self.table.get(owner, session_id) is None:
            await self.shared.adopt(owner, session_id)  # another server's, or none's
        session = self.table.get(owner, session_id)
        if session is None:
            raise SessionNotFound(f"no session {session_id!r} (already closed, or never existed)")
        remains = await self.ending.end(session, f"session {session_id} was closed", "closed")
        if remains:
            raise SandboxFailed(
                f"session {session_id} is closed, but " + "; ".join(remains) + ". The server "
                "tries again every few seconds and at its next start; nothing to do here"
            )

    # -- forking ---------------------------------------------------------------------------

    async def fork(
        self, owner: str, session_id: str, new_session_id: str | None, *, wait_s: float
    ) -> Forked:
        """A new session of ``owner`` with a copy of ``session_id``'s files and variables
        (see :mod:`.forking`); ``new_session_id`` None mints its id. The source's lock is
        held until its files are copied; the fork is made as any new session (room and
        limits first, a warm sandbox when one is ready). ``SessionNotFound`` as for a
        call; ``InvalidArgument`` for a ``new_session_id`` in use; what a refused copy
        raises (the fork is ended then, the source as it was). ``InvalidArgument`` on a
        backend whose sessions' files live in their sandboxes (kubernetes): the copy is
        made on the host."""
        validate_session_id(session_id)
        if self.backend.workspace_in_sandbox:
            raise InvalidArgument(
                f"fork_session is not available on the {self.backend.name} backend yet: a "
                "session's files live in its sandbox, where this server cannot copy them"
            )
        if new_session_id is not None:
            validate_session_id(new_session_id)
            if self.table.get(owner, new_session_id) is not None:
                raise forking.taken(new_session_id)
        fork: Session | None = None
        done: Forked | None = None
        try:
            async with contextlib.AsyncExitStack() as source_held:
                held = self.acquire(owner, session_id, create=False, wait_s=wait_s)
                source = (await source_held.enter_async_context(held)).session
                kept = await forking.keep_state(self.sandboxes, self.settings, source)
                made = self.acquire(owner, new_session_id, create=True, wait_s=wait_s, pool=True)
                async with made as new:
                    if not new.created:  # named by another call meanwhile
                        raise forking.taken(new.session.id)
                    fork = new.session
                    fork.phase = transition(fork.phase, Phase.FORKING)
                    self.table.save(fork, force=True)  # before its copy: see ``records``
                    copied = await forking.copy_files(self.threads, self.settings, source, fork)
                    await source_held.aclose()  # the source's next call may go on now
                    report, why = await forking.load_state(self.sandboxes, fork, kept)
                    if fork.phase is Phase.FORKING:  # not closed meanwhile
                        fork.phase = transition(fork.phase, Phase.RUNNING)
                        self.table.save(fork, force=True)
                    done = forking.forked(source, fork, kept, copied, report, why, new.notice)
        finally:
            if fork is not None and done is None:  # its copy was refused, or cut short
                await self.ending.end_logged(fork, f"session {fork.id} was not forked", "closed")
                self.table.reborn(owner, fork.id)  # never made: no tombstone to tell
        assert done is not None  # else what stopped it was raised
        log.info("session forked", owner=owner, session=session_id, fork=done.session_id)
        return done

    # -- pausing ---------------------------------------------------------------------------

    async def pause(self, owner: str, session_id: str) -> Paused | None:
        """Pause ``owner``'s session now, as the reaper does when it is idle; how it was
        kept (``None``: it had no sandbox to pause). For operators and the benchmarks.
        ``SessionNotFound`` as for a call."""
        if self.replicas is not None:
            await self.replicas.take(owner, session_id, END_WAIT_S)
        session, _, _ = self._lookup(owner, session_id, create=False)
        if session.sandbox is None and not session.runners:
            return session.paused
        await self.pausing.pause(session)
        return session.paused

    def paused_bytes(self) -> int:
        """Bytes of paused sessions' state on disk, all owners (for the disk budget)."""
        return self.table.paused_bytes()

    async def reap(self) -> None:
        """One pass of the reaper (:mod:`.reaper`); its loop calls this every few seconds.
        A replica first takes over what replicas that died left."""
        if self.replicas is not None:
            await self.replicas.reap()
        await self.reaper.reap()

    def tombstones(self) -> dict[tuple[str, str], str]:
        """Why each remembered ``(owner, session_id)`` ended (for tests and operators)."""
        return self.table.tombstones()

    def with_id(self, session_id: str) -> list[Session]:
        """The live sessions named ``session_id``, of every owner (see ``table``)."""
        return self.table.with_id(session_id)

    def listed(self, owner: str | None = None) -> list[Session]:
        """The live sessions: every owner's (``owner`` None) or ``owner``'s. Read-only,
        for the operator's page (``sessions.overview``)."""
        return self.table.listed(owner)

    def elsewhere(self, owner: str | None = None) -> list[records.SessionRecord]:
        """The sessions other replicas hold, as their records say (every owner's, or
        ``owner``'s); none for a server alone. Blocking: call it in a worker thread (but
        with ``shared``, read from memory: call it on the event loop)."""
        if self.shared is not None:
            return self.shared.elsewhere(owner)
        return [] if self.replicas is None else self.replicas.elsewhere(owner)

    @property
    def replica(self) -> bool:
        """Is this server one of several serving the same sessions: its state directory's
        replicas (:mod:`.replicas`), or a cluster's servers (:mod:`.shared`)?"""
        return self.replicas is not None or self.shared is not None

    def count(self, owner: str | None = None) -> int:
        """Open sessions: all of them, or ``owner``'s."""
        return self.table.count(owner)

    # Questions service.py asks -----------------------------------------------------------
    # The service asks these instead of reaching through to the manager's parts (its
    # sandboxes' egress proxies, the warm pool, the quota mode).

    def check_egress(self) -> None:
        """Parse the egress policy and read the secrets file now (blocking: a worker
        thread); raises what they raise. Called by the service at start when network
        is allowed, so that a bad allowlist stops the server, not a user's call."""
        self.sandboxes.egress.check()

    def check_network(self, hosts: tuple[str, ...]) -> None:
        """Raise ``NetworkNotAllowed`` naming a host of a call's wish that the server's
        policy does not allow (``hosts`` empty: ``network=true``, the whole policy).
        Called by the service before it holds a session."""
        self.sandboxes.egress.policy(hosts)

    def blocked_hosts(self, session: Session) -> list[str]:
        """Hosts ``session``'s egress proxy refused since it was last asked. Called by the
        run path as it builds a run's report, with the session's lock held."""
        return self.sandboxes.blocked_hosts(session)

    def hold_pool_while(self, held_by: Callable[[], str | None]) -> None:
        """Start no warm sandbox while ``held_by`` says why not (``None``: start them).
        Called by the service while the runtime sandboxes need is still being built."""
        self.pool.held_by = held_by

    def refill_pool(self) -> None:
        """Start the warm sandboxes missing now (in the background). Called by the
        service once a build it held the pool for has gone further."""
        self.pool.refill()

    def pool_status(self) -> PoolStatus:
        """The warm pool's target size, ready and starting sandboxes, and preloads."""
        return self.pool.status()

    def quota_on_disk(self) -> bool:
        """Is each workspace a filesystem of its own, its quota the kernel's (else the
        run path watches the workspace)? Known once the manager has started."""
        return self.making.quota.filesystem


def _gone_suffix(tombstone: str | None) -> str:
    return f" ({tombstone})" if tombstone else ""
