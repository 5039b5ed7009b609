"""The session manager: ids, owners, lifetimes, one-call-at-a-time, and cleanup.

A session's value types are in :mod:`.session`; its sandboxes and runners are started,
replaced and stopped by :mod:`.sandboxes` (the manager owns one and hands out its
executors); crash recovery is planned by :mod:`.recovery` and applied here.

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
- ``last_active`` moves at the start and end of every call; the reaper closes sessions
  idle past the TTL or older than the max lifetime, never in the middle of a call.
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
- A closed or expired id is remembered (bounded) so that reusing it says what was lost.
- Every session has a record on disk (:mod:`mcp_code_sandbox.sessions.records`) and a workspace
  at ``workspaces_dir/<slot>``, so a server killed with SIGKILL can be followed by one
  that finds them. The record's ``last_active`` is rewritten at the start and end of a
  call but at most every ``RECORD_EVERY_S`` per session: one small file write per call
  would be cheap too, but a restart only needs the idle time to within seconds of a
  30-minute TTL, and a burst of calls then costs no disk writes at all.
- Who holds a session, and who may take over what a dead server left, is the rule of
  :mod:`.holder` (the manager's ``role``). At start, under a lock that two servers
  starting at once share, the state directory's service re-attaches what a dead service
  left where the backend can (docker: the container and its interpreter outlive the
  server; same id, owner, files and variables) and removes the rest (bwrap: its
  sandboxes died with their server, so only their workspaces and records remain); any
  server removes what dead private servers left.
- Shutdown (``aclose``) is not a crash: it stops every sandbox and deletes every
  workspace and record, or (a service keeping its sessions) pauses them for its
  successor. A private server's janitor (:mod:`.janitor`) removes what a crash left.
- Where the backend can run each sandbox as a host uid of its own, every session leases
  one (:mod:`.uids`) when it is registered, before its record and workspace exist (the
  workspace is given to it), keeps it for its whole life (every sandbox and runner of the
  session runs as it), records it, and lets it go after its record is removed. A
  re-attached session gets the uid its record names back, or is not re-attached.
- Ending a session (close, expiry, shutdown) first marks it closed (queued calls then
  fail with ``session_not_found``, and no call starts a sandbox for it any more), stops
  its sandbox (which ends a running cell), waits, bounded, for the call in flight and for
  any sandbox start in flight, stops whatever those left, and only then removes the
  workspace: a close that returns ``ok`` leaves no sandbox running. A start is never
  cancelled half-way (docker-py's calls run on in their threads, and what they create
  would be lost): it runs to its end, and a sandbox made for a closed session, or for a
  call that was cancelled meanwhile, is stopped at once.
- One session's failure never stops the others' cleanup: a backend step that fails is
  logged, the rest is still freed, and what remains is retried at every reaper pass.
  The reaper catches everything but its cancellation, and is started again if it dies.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import structlog

from mcp_code_sandbox.backends.base import Backend, Limits, Sandbox, SandboxSpec
from mcp_code_sandbox.backends.runner_images import RunnerImage, RunnerSandbox
from mcp_code_sandbox.errors import (
    SandboxError,
    SandboxFailed,
    SessionBusy,
    SessionNotFound,
)
from mcp_code_sandbox.metrics import EndReason, Metrics
from mcp_code_sandbox.sessions import quota, records, runlog
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.egress import Wish
from mcp_code_sandbox.sessions.holder import PidFile, Role, ServiceLock, service_pid
from mcp_code_sandbox.sessions.ids import mint_session_id, session_key, validate_session_id
from mcp_code_sandbox.sessions.janitor import Janitor
from mcp_code_sandbox.sessions.mounts import MountedWorkspaces
from mcp_code_sandbox.sessions.moving import fits_pool, forget_moved, move_into
from mcp_code_sandbox.sessions.overview import files_held
from mcp_code_sandbox.sessions.pool import Pooled, WarmPool
from mcp_code_sandbox.sessions.quota import QuotaMode
from mcp_code_sandbox.sessions.recovery import Adopted, Kept, recover
from mcp_code_sandbox.sessions.room import Room, over_disk_budget
from mcp_code_sandbox.sessions.sandboxes import Sandboxes
from mcp_code_sandbox.sessions.session import (
    END_WAIT_S,
    Acquired,
    Handout,
    Paused,
    Session,
)
from mcp_code_sandbox.sessions.uids import UidLease, uid_pool
from mcp_code_sandbox.sessions.workers import WorkerThreads
from mcp_code_sandbox.settings import Settings
from mcp_code_sandbox.workspace import Workspace
from mcp_code_sandbox.workspace.spares import SPARES_DIR, SpareImages
from mcp_code_sandbox.workspace.volume import IMAGE_SUFFIX, Volume, image_bytes

__all__ = ["SessionManager"]

log = structlog.get_logger("mcp_code_sandbox.sessions.manager")

_TOMBSTONES = 10_000
#: Longest a session's on-disk ``last_active`` lags behind the truth (see above).
RECORD_EVERY_S = 10.0
#: Idle sessions the reaper pauses at once.
_PAUSES_AT_ONCE = 4


class SessionManager:
    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        metrics: Metrics | None = None,
        *,
        role: Role | None = None,
        janitor: bool = False,
    ) -> None:
        """``role``: what this server may take over, and what its successor may (see
        :mod:`.holder`); ``None``: the state directory's service when it keeps its
        sessions at shutdown, else a private server. ``janitor``: a private server
        whose process a client may kill (stdio, ``exec``) starts a janitor process that
        removes what it leaves if it dies without ending its sessions (:mod:`.janitor`)."""
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
        self.metrics.track_states(self._count_state, self.paused_bytes)
        #: Where blocking work on sessions' files runs (never on the event loop).
        self.threads = WorkerThreads(settings.worker_threads)
        self._sessions: dict[tuple[str, str], Session] = {}
        self._tombstones: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._instance = f"{os.getpid()}-{os.urandom(4).hex()}"
        self._reaper: asyncio.Task[None] | None = None
        #: Ended sessions that still hold something (a sandbox a stop failed to free,
        #: files not removed): the reaper tries again at every pass.
        self._unfinished: dict[str, Session] = {}
        self._closed = False
        #: How the workspace quota binds sandboxes here; decided in :meth:`start`.
        self.quota = QuotaMode(False, "not started")
        #: Workspace images formatted ahead (filesystem quotas only; see :meth:`start`).
        self.spares: SpareImages | None = None
        #: Host uids, one per session, when the backend can use them.
        self.uids = uid_pool(settings) if backend.per_sandbox_uids else None
        #: Starts, replaces and stops the sessions' sandboxes and runners.
        self.sandboxes = Sandboxes(
            settings, backend, self.metrics, outlive_server=role is Role.SERVICE
        )
        #: The running-session limits, kept by pausing the longest idle.
        self.room = Room(settings, self._sessions.values, self._pause)
        #: Places for the mounts of sessions without a sandbox (file calls on them).
        self.mounts = MountedWorkspaces(settings)
        #: Warm sandboxes for new sessions (started by :meth:`start`).
        self.pool = WarmPool(
            settings,
            backend,
            self.metrics,
            self.sandboxes,
            self.threads,
            instance=self._instance,
            handover=role is Role.SERVICE,
            workspace_for=self._workspace,
            lease_uid=self._lease_uid,
        )

    # -- lifecycle of the manager -------------------------------------------------------

    async def start(self) -> None:
        """Raises ``ConfigError`` for a second service on one state directory."""
        run_dir = self.settings.run_dir
        if self.role is Role.SERVICE:
            self._service_lock = ServiceLock.claim(run_dir)
        else:
            pid = await asyncio.to_thread(service_pid, run_dir)
            if pid is not None:
                log.info(
                    "a service runs on this state directory: this server's sessions are its "
                    "own, and it leaves the service's alone",
                    service_pid=pid,
                    state_dir=str(self.settings.state_dir),
                )
        run_dir.mkdir(parents=True, exist_ok=True)
        self.settings.workspaces_dir.mkdir(parents=True, exist_ok=True)
        self._pid_file = PidFile.claim(run_dir / f"{self._instance}.pid")
        if self._wants_janitor:  # before any sandbox or workspace of ours exists
            try:
                self._janitor = await asyncio.to_thread(
                    Janitor.spawn, self.settings, self.backend.name, self._instance
                )
            except OSError as exc:  # an interpreter this uid may run but not start again
                log.warning(
                    "no janitor: if this server is killed, the next start on its state "
                    "directory removes what it leaves",
                    error=str(exc),
                )
        self.quota = await asyncio.to_thread(quota.choose, self.settings, self.backend)
        log.info("workspace quota", enforced=self.quota.describe())
        if self.uids is not None:
            await asyncio.to_thread(self.uids.open)
        recovered = await recover(
            self.settings,
            self.backend,
            instance=self._instance,
            spec_for=self._spec_for,
            uids=self.uids,
            takes_over=self.role is Role.SERVICE,
        )
        await self.sandboxes.start()
        for adopted in recovered.adopt:
            self._adopt(adopted)
        for kept in recovered.paused:
            self._keep(kept)
        for owner, session_id, why in recovered.lost:
            self._tombstone(owner, session_id, why)
        self._start_reaper()
        if self.quota.filesystem:  # after recovery, which sweeps a dead server's spares
            self.spares = SpareImages(
                self.settings.volumes_dir / SPARES_DIR,
                image_bytes(self.settings.workspace_quota_bytes),
                self.settings.workspace_spare_images,
            )
            await asyncio.to_thread(self.spares.start)
        self.pool.start()

    async def aclose(self) -> None:
        """Stop every sandbox and delete every workspace; bounded by the backend's stops.
        A service with ``keep_sessions_on_shutdown`` pauses them all for its successor
        instead.

        Idempotent: a signal handler and the normal way out may both call it."""
        if self._closed:
            return
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.wait({self._reaper})  # whatever it ended with, shutdown goes on
        sessions = list(self._sessions.values())
        self._sessions.clear()
        keep = self.role is Role.SERVICE and self.settings.keep_sessions_on_shutdown
        end = self._leave if keep else self._destroy
        log.info(
            "shutting down: pausing every session for the next server"
            if keep
            else "shutting down: ending every session",
            sessions=len(sessions),
        )
        unfinished = list(self._unfinished.values())
        # Each session on its own: one that fails is logged and the others still end.
        for outcome in await asyncio.gather(
            *(end(s) for s in sessions),
            *(self._destroy(s) for s in unfinished),
            self.pool.aclose(),
            return_exceptions=True,
        ):
            if isinstance(outcome, BaseException):
                log.error("session not cleaned up at shutdown", error=repr(outcome))
        await self.sandboxes.egress.aclose()  # the proxies of detached sandboxes
        if self.spares is not None:
            await asyncio.to_thread(self.spares.close)
        try:
            await self.backend.aclose()
        except Exception:
            log.exception("the backend did not close cleanly")
        if self._pid_file is not None:
            self._pid_file.release()
        if self._service_lock is not None:
            self._service_lock.release()
        if self._janitor is not None and not self._unfinished:
            # Everything of ours is gone: nothing for it to do. Otherwise it is left to
            # clean up what could not be freed once this process has exited.
            await asyncio.to_thread(self._janitor.dismiss)

    @property
    def instance(self) -> str:
        """This server process's name in records and pid files (``<pid>-<random>``)."""
        return self._instance

    def _adopt(self, adopted: Adopted) -> None:
        """Register a session a dead server left, as :func:`.recovery.recover` returned
        it: its re-attached sandbox and its uid. Called by :meth:`start`."""
        record, sandbox = adopted.record, adopted.sandbox
        self._register_recorded(
            record,
            adopted.uid_lease,
            sandbox=sandbox,
            agent=AgentClient(sandbox.channel),
            workspace_made=True,  # its filesystem outlived the old server, still mounted
        )
        log.info("session re-attached", owner=record.owner, session=record.session_id)

    def _keep(self, kept: Kept) -> None:
        """Register a paused session a dead server left (:func:`.recovery.recover`): no
        sandbox; its first call that runs code resumes it. A server that died during a
        pause left the last complete saved state, or none: its files at least."""
        record = kept.record
        try:
            paused = Paused.from_json(record.paused) if record.paused is not None else None
        except (ValueError, TypeError) as exc:
            log.warning(
                "a paused session's record is damaged", session=record.session_id, error=str(exc)
            )
            paused = None
        if paused is None:
            paused = Paused(
                "files",
                record.last_active,
                why="the server stopped during a pause: these are the variables of the last "
                "complete pause, if there was one",
                load=True,  # its last complete saved variables, if there are some
            )
        self._register_recorded(record, kept.uid_lease, paused=paused)
        log.info("paused session kept", owner=record.owner, session=record.session_id)

    def _register_recorded(
        self, record: records.SessionRecord, lease: UidLease | None, **state: Any
    ) -> None:
        """Register a recorded session as it is now (``state``: its sandbox, or its pause)
        and write its record as ours: a later start must leave it alone."""
        mono, wall = time.monotonic(), time.time()
        session = Session(
            record.session_id,
            record.owner,
            record.key,
            record.slot,
            self._workspace(record.slot, record.uid),
            created_at=mono - (wall - record.created_at),
            last_active=mono - (wall - record.last_active),
            created_wall=record.created_at,
            uid_lease=lease,
            **state,
        )
        self._sessions[(record.owner, record.session_id)] = session
        self._save(session, force=True)

    def _spec_for(self, record: records.SessionRecord) -> SandboxSpec:
        """The spec a recorded session's sandbox was made with (recovery re-attaches it)."""
        workspace = self._workspace(record.slot, record.uid)
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
        if create and (session_id is None or (owner, session_id) not in self._sessions):
            await self.room.make(owner)  # a new session runs: room first (see ``room``)
            session, created, notice = self._lookup(owner, session_id, create=True, pool=pool)
        else:
            session, created, notice = self._lookup(owner, session_id, create=create, pool=pool)
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
        try:
            if session.closed:  # closed while this call waited in the queue
                raise SessionNotFound(f"session {session.id} was closed while this call waited")
            if not session.workspace_made and not (runs and session.paused is None):
                if not runs and session.workspace.volume is not None:
                    await self.mounts.take(session, wait_s)  # see ``mounts``
                await self._make_workspace(session)
            self._touch(session)
            yield Acquired(session, created, notice)
        finally:
            try:
                if not session.closed:
                    self._touch(session)
                    await self._let_go(session)
            finally:
                session.lock.release()

    async def _let_go(self, session: Session) -> None:
        """At the end of a call (lock held): a session left without a sandbox (paused,
        or one that never ran code) lets its workspace's mount go now, unless another
        call waits for it; a paused one's state is measured again (a file call may have
        changed it). One with a sandbox now gives its place in ``mounts`` back."""
        if session.sandbox is not None or session.runners:
            await self.mounts.give_back(session)
        elif not session.queued:
            if session.workspace_made and session.workspace.volume is not None:
                session.files_kept = await files_held(self.threads, session)
            await self._unmount(session)

    async def _make_workspace(self, session: Session) -> None:
        await self.threads.run(session.owner, session.workspace.create)
        if session.closed:  # closed meanwhile: its destroy may have run before the mount
            await self.threads.run(session.owner, session.workspace.destroy)
            raise SessionNotFound(f"session {session.id} was closed while it was being made")
        session.workspace_made = True

    def _touch(self, session: Session) -> None:
        session.last_active = time.monotonic()
        # A resumed session's record must stop saying paused now: a server that dies
        # next must not restore a checkpoint that is running again.
        self._save(session, force=session.recorded_paused != (session.paused is not None))

    def _save(self, session: Session, *, force: bool = False) -> None:
        """Write the session's record, at most every ``RECORD_EVERY_S`` unless ``force``."""
        now = time.monotonic()
        if not force and now - session.saved_at < RECORD_EVERY_S:
            return
        try:
            records.write_record(self.settings.sessions_dir, self._record(session))
        except OSError as exc:  # a full disk must not fail the call; the next write retries
            log.warning("cannot write the session record", session=session.id, error=str(exc))
            return
        session.saved_at = now
        session.recorded_paused = session.paused is not None

    def _record(self, session: Session) -> records.SessionRecord:
        """``session``'s record as it stands now."""
        idle = time.monotonic() - session.last_active
        return records.SessionRecord(
            owner=session.owner,
            session_id=session.id,
            key=session.key,
            slot=session.slot,
            instance=self._instance,
            created_at=session.created_wall,
            last_active=time.time() - idle,
            uid=session.uid,
            paused=None if session.paused is None else session.paused.to_json(),
            pausing=session.pausing,
            replaces=None if session.replaces is None else session.replaces.slot,
            handover=self.role is Role.SERVICE,
        )

    def _lookup(
        self, owner: str, session_id: str | None, *, create: bool, pool: bool = False
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
        self.room.check(owner)
        pooled = self.pool.claim() if pool else None
        session = (
            self._register(owner, session_id)
            if pooled is None
            else self._take(owner, session_id, pooled)
        )
        return session, True, self._tombstones.pop((owner, session_id), None)

    def _register(self, owner: str, session_id: str) -> Session:
        key = session_key(owner, session_id)
        slot = records.new_slot(key)
        now = time.monotonic()
        lease = self._lease_uid(slot)
        try:
            workspace = self._workspace(slot, None if lease is None else lease.uid)
            session = Session(session_id, owner, key, slot, workspace, now, now, time.time())
            session.uid_lease = lease
            self._save(session, force=True)  # before the workspace: see ``records``
        except BaseException:
            records.remove_record(self.settings.sessions_dir, slot)  # then the uid is free
            if lease is not None:
                lease.release()
            raise
        return self._created(session)

    def _take(self, owner: str, session_id: str, pooled: Pooled) -> Session:
        """A new session made of a warm sandbox: its slot, workspace, uid and sandbox
        become the session's, and its record is rewritten as the session's (owner and id
        bound now, on disk: recovery and re-attach work as for any session)."""
        now = time.monotonic()
        session = Session(
            session_id,
            owner,
            pooled.key,
            pooled.slot,
            pooled.workspace,
            now,
            now,
            time.time(),
            sandbox=pooled.sandbox,
            agent=pooled.agent,
            workspace_made=True,
            uid_lease=pooled.uid_lease,
        )
        try:
            self._save(session, force=True)
        except BaseException:
            self.pool.retire(pooled)  # its record still says ``pool``: nobody's
            raise
        return self._created(session)

    def _created(self, session: Session) -> Session:
        self._sessions[(session.owner, session.id)] = session
        self.metrics.session_created()
        log.info("session created", owner=session.owner, session=session.id)
        return session

    def _lease_uid(self, slot: str) -> UidLease | None:
        if self.uids is None:
            return None
        return self.uids.lease(str(records.record_path(self.settings.sessions_dir, slot)))

    def _workspace(self, slot: str, uid: int | None) -> Workspace:
        """``uid``: the session's own (its workspace's owner), else the backend's shared."""
        return Workspace(
            self.settings.workspaces_dir / slot,
            quota_bytes=self.settings.workspace_quota_bytes,
            owner=self.backend.workspace_owner if uid is None else (uid, uid),
            volume=self._volume(slot) if self.quota.filesystem else None,
        )

    def _volume(self, slot: str) -> Volume:
        image = self.settings.volumes_dir / f"{slot}{IMAGE_SUFFIX}"
        return Volume(image, image_bytes(self.settings.workspace_quota_bytes), self.spares)

    def _tombstone(self, owner: str, session_id: str, reason: str) -> None:
        self._tombstones[(owner, session_id)] = (
            f"{reason}; files and variables from before are gone"
        )
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)

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
    ) -> Handout:
        """What runs this call's code in ``session`` (see :meth:`.sandboxes.Sandboxes.executor`).
        ``pool``: the call wants a sandbox of the warm pool's kind (as for ``acquire``), so
        a paused session it resumes moves into a warm sandbox when one is ready and its
        files are few enough (:mod:`.moving`). Called by the service with the session's
        lock held."""
        if session.paused is None:
            if not session.workspace_made:
                return await self._mounting(session, network=network, runner=runner)
            return await self.sandboxes.executor(session, network=network, runner=runner)
        await self.room.make(session.owner, exclude=session)  # it runs again: room first
        self.room.check(session.owner)  # in the step in which ``make`` returned (``room``)
        session.resuming = True
        try:
            pooled = self.pool.claim() if pool and fits_pool(session) else None
            if pooled is not None:
                try:
                    await move_into(session, pooled, self.settings, self.threads, self._record)
                finally:  # not moved (or the call cancelled before the move committed)
                    if session.sandbox is not pooled.sandbox:
                        self.pool.retire(pooled)
            return await self.sandboxes.executor(session, network=network, runner=runner)
        finally:
            session.resuming = False

    async def _mounting(
        self, session: Session, *, network: Wish, runner: RunnerImage | None
    ) -> Handout:
        """The executor of a session whose workspace is not mounted yet (a new one, from
        ``acquire(runs=True)``): its directory is made first (a container's bind needs it
        at the create), then its filesystem is mounted while the backend starts the
        sandbox, which waits for the mount only where it must (docker: between the
        container's create and its start). Whatever the executor did, the mount has
        ended when this returns, and what it raised is raised."""
        await self.threads.run(session.owner, session.workspace.make_root)
        mounting = asyncio.ensure_future(self._make_workspace(session))
        try:
            handout = await self.sandboxes.executor(
                session, network=network, runner=runner, mounted=mounting
            )
        finally:
            await asyncio.wait({mounting})
            if not mounting.cancelled():
                mounting.exception()  # raised by the executor already, or just below
        await mounting  # a sandbox running already (none is, in practice) did not wait
        return handout

    # -- closing ---------------------------------------------------------------------------

    async def close(self, owner: str, session_id: str) -> None:
        """End the session now: see the module docstring for what waits for what.

        Raises ``SandboxFailed`` (the session is closed all the same) saying precisely
        what could not be freed; the reaper keeps trying."""
        validate_session_id(session_id)
        session = self._sessions.get((owner, session_id))
        if session is None:
            raise SessionNotFound(f"no session {session_id!r} (already closed, or never existed)")
        remains = await self._expire(session, f"session {session_id} was closed", "closed")
        if remains:
            raise SandboxFailed(
                f"session {session_id} is closed, but " + "; ".join(remains) + ". The server "
                "tries again every few seconds and at its next start; nothing to do here"
            )

    async def _expire(self, session: Session, reason: str, why: EndReason) -> list[str]:
        """End ``session``; what could not be freed (in words; empty: nothing)."""
        if self._sessions.get((session.owner, session.id)) is not session:
            return []
        del self._sessions[(session.owner, session.id)]
        # Unfinished until destroyed: an end cut short (a cancelled close_session, a reaper
        # pass cancelled by shutdown) is finished by the reaper or by shutdown, not leaked.
        self._unfinished[session.slot] = session
        self.metrics.session_ended(why)
        session.closed = True
        await self.mounts.give_back(session)
        self._tombstone(session.owner, session.id, reason)
        remains = await self._destroy(session)
        log.info("session ended", owner=session.owner, session=session.id, reason=reason)
        return remains

    async def _leave(self, session: Session) -> None:
        """Shut down without ending ``session``: it is paused (its record says how), its
        workspace kept. The next server on this state dir keeps it and resumes it on
        its first call (see :mod:`.recovery`)."""
        await self._pause(session, wait=False)
        await self._unmount(session)  # one paused earlier may have been mounted since
        if session.uid_lease is not None:
            session.uid_lease.release()  # reserved by its record for the next server
        log.info("session paused for the next server", owner=session.owner, session=session.id)

    # -- pausing ---------------------------------------------------------------------------

    async def pause(self, owner: str, session_id: str) -> Paused | None:
        """Pause ``owner``'s session now, as the reaper does when it is idle; how it was
        kept (``None``: it had no sandbox to pause). For operators and the benchmarks.
        ``SessionNotFound`` as for a call."""
        session, _, _ = self._lookup(owner, session_id, create=False)
        if session.sandbox is None and not session.runners:
            return session.paused
        await self._pause(session)
        return session.paused

    async def _pause(self, session: Session, *, wait: bool = True) -> None:
        """Pause ``session`` (see :meth:`.sandboxes.Sandboxes.pause`) under its lock: a
        call arriving meanwhile waits for the pause, then resumes it. Its record says
        ``pausing`` until the pause is complete, so a server that dies meanwhile leaves
        a session the next one keeps. ``wait`` False (shutdown): a call still holding
        the session is not waited for; its sandbox is stopped under it."""
        if wait:
            await session.lock.acquire()
        try:
            if session.closed or session.paused is not None:
                return
            session.pausing = True
            self._save(session, force=True)
            paused = await self.sandboxes.pause(session)
            count, size = await files_held(self.threads, session) or (0, 0)
            # Its bytes: the checkpoint's, then the workspace's on disk (measured by
            # ``_unmount``; saved variables are in the workspace).
            paused = dataclasses.replace(
                paused, bytes=_outside_bytes(paused), file_count=count, files_bytes=size
            )
            session.paused, session.pausing = paused, False
            session.files_kept = (count, size)
            self._save(session, force=True)
            await self._unmount(session)
            log.info("session paused", owner=session.owner, session=session.id, kind=paused.kind)
        finally:
            if wait:
                session.lock.release()

    async def _unmount(self, session: Session) -> None:
        """Let go of the filesystem of a session without a sandbox (mounted again by its
        next call), then measure a paused one's state on disk. A filesystem still busy
        (a download reading a file) stays mounted, and the reaper tries again."""
        if session.workspace_made and session.workspace.volume is not None:
            try:
                gone = await self.threads.run(session.owner, session.workspace.unmount)
            except (SandboxError, OSError) as exc:
                log.warning("cannot unmount a paused workspace", session=session.id, error=str(exc))
                gone = False
            if gone:
                session.workspace_made = False
                await self.mounts.give_back(session)
        await self._measure(session)

    async def _measure(self, session: Session) -> None:
        """Set a paused session's ``bytes`` to what its state holds on the host's disk
        now: allocated blocks, never the sizes its files claim (a hostile session's
        sparse files would else count terabytes against every owner's budget)."""
        paused = session.paused
        if paused is None:
            return
        try:
            disk = await self.threads.run(session.owner, session.workspace.disk_bytes)
        except (SandboxError, OSError) as exc:
            log.warning("cannot measure a paused workspace", session=session.id, error=str(exc))
            return
        if session.paused is paused and paused.bytes != _outside_bytes(paused) + disk:
            session.paused = dataclasses.replace(paused, bytes=_outside_bytes(paused) + disk)
            self._save(session, force=True)

    def paused_bytes(self) -> int:
        """Bytes of paused sessions' state on disk, all owners (for the disk budget)."""
        return sum(s.paused.bytes for s in self._sessions.values() if s.paused is not None)

    def _count_state(self, state: str) -> int:
        paused = sum(1 for s in self._sessions.values() if s.paused is not None)
        return paused if state == "paused" else len(self._sessions) - paused

    async def _destroy(self, session: Session) -> list[str]:
        """Stop everything of ``session`` and remove its files; what remains, in words.

        Never raises for a backend's or the disk's failure: the session is then kept in
        ``_unfinished`` and this runs again at the reaper's next pass. Idempotent; calls
        for one session take turns."""
        async with session.ending:
            return await self._destroy_now(session)

    async def _destroy_now(self, session: Session) -> list[str]:
        session.closed = True
        await self._release(session)  # ends a running cell: its call returns soon
        await self._settle(session)
        remains = await self._release(session, retry=False)  # what those calls left
        if session.paused is not None:
            await self.sandboxes.discard(session.paused)
        if session.replaces is not None:  # a slot it moved out of that could not go then
            moved = session.replaces
            if await forget_moved(self.settings, self.threads, session.owner, moved):
                session.replaces = None
            else:
                remains.append(f"its old files in {moved.workspace.root} could not be removed")
        try:
            await self.threads.run(session.owner, session.workspace.destroy)
        except Exception as exc:
            log.error("cannot remove a session's files", session=session.id, error=repr(exc))
            remains.append(f"its files in {session.workspace.root} could not be removed ({exc})")
        else:
            runlog.remove_log(self.settings.runlogs_dir, session.slot)  # before its record
            records.remove_record(self.settings.sessions_dir, session.slot)
            if session.uid_lease is not None:
                session.uid_lease.release()  # after the record: see ``uids``
        if remains:
            self._unfinished[session.slot] = session
        else:
            self._unfinished.pop(session.slot, None)
        return remains

    async def _settle(self, session: Session) -> None:
        """Wait (bounded) until no call holds ``session`` and no start is in flight."""
        try:
            async with asyncio.timeout(END_WAIT_S):
                async with session.lock:  # FIFO: the calls queued before fail at once
                    pass
                while session.starting:
                    await asyncio.wait(set(session.starting))
        except TimeoutError:
            log.error(
                "a call or sandbox start of an ended session is still in flight; "
                "what it starts will be stopped when it ends",
                session=session.id,
                waited_s=END_WAIT_S,
            )

    async def _release(self, session: Session, *, retry: bool = True) -> list[str]:
        """Stop the session's sandbox and runners; those that a stop failed to free (in
        words). A failed stop is logged, kept in ``unstopped`` and tried again next time
        (``retry``: this time too)."""
        held: list[Sandbox | RunnerSandbox] = []
        if retry:
            held, session.unstopped = session.unstopped, []
        if session.sandbox is not None:
            held.append(session.sandbox)
        held.extend(session.runners.values())
        session.sandbox, session.agent = None, None
        session.runners.clear()
        for thing in held:
            await self.sandboxes.free(session, thing)
        return [
            f"its sandbox {thing.backend_id} could not be stopped" for thing in session.unstopped
        ]

    def _start_reaper(self) -> None:
        self._reaper = asyncio.create_task(self._reap_forever(), name="session-reaper")
        self._reaper.add_done_callback(self._reaper_ended)

    def _reaper_ended(self, task: asyncio.Task[None]) -> None:
        """The reaper catches every failure, so this is for one it did not foresee: with
        no reaper, no session of any owner would expire again."""
        if self._closed or task.cancelled():
            return
        log.error("the session reaper died; starting it again", error=repr(task.exception()))
        self._start_reaper()

    async def _reap_forever(self) -> None:
        spans = [self.settings.session_ttl_m * 60]
        if self.settings.pause_after_m > 0:
            spans.append(self.settings.pause_after_m * 60)
        interval = max(0.5, min(15.0, min(spans) / 4))
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reap()
            except Exception:  # reap isolates sessions; this is the last guard
                log.exception("a reaper pass failed; the next one tries again")

    async def reap(self) -> None:
        """Close sessions idle past the TTL or past their max lifetime, pause those idle
        past ``pause_after_m`` (never mid-call), keep paused state within its disk
        budget, and try again to free what earlier ends left. Each session on its own:
        one that fails is logged and tried again at the next pass."""
        now = time.monotonic()
        ttl = self.settings.session_ttl_m * 60
        lifetime = self.settings.session_max_lifetime_h * 3600
        pause_after = self.settings.pause_after_m * 60
        to_pause: list[Session] = []
        for session in list(self._sessions.values()):
            if session.lock.locked():
                continue
            idle = now - session.last_active
            if idle > ttl:
                reason = (
                    f"session {session.id} expired after {self.settings.session_ttl_m:g} min idle"
                )
                await self._isolated(session, self._expire(session, reason, "idle"))
            elif now - session.created_at > lifetime:
                reason = (
                    f"session {session.id} reached its maximum lifetime of "
                    f"{self.settings.session_max_lifetime_h:g} h"
                )
                await self._isolated(session, self._expire(session, reason, "lifetime"))
            elif (
                pause_after > 0
                and idle > pause_after
                and session.paused is None
                and (session.sandbox is not None or session.runners)
            ):
                to_pause.append(session)
            elif _mount_left(session):
                async with session.lock:  # free (checked above): taken at once
                    await self._unmount(session)  # busy at its call's end (a download)
        # A few at a time: each waits on its sandbox (a save, a checkpoint), not the CPU.
        for start in range(0, len(to_pause), _PAUSES_AT_ONCE):
            batch = to_pause[start : start + _PAUSES_AT_ONCE]
            await asyncio.gather(*(self._paused_isolated(s) for s in batch))
        await self._keep_within_disk_budget()
        await self._keep_within_paused_limit()
        for session in list(self._unfinished.values()):
            await self._isolated(session, self._destroy(session))

    async def _paused_isolated(self, session: Session) -> None:
        try:
            await self._pause(session)
        except Exception:
            log.exception("pausing a session failed", owner=session.owner, session=session.id)

    async def _keep_within_disk_budget(self) -> None:
        """Past ``paused_disk_bytes``, expire paused sessions: the longest idle of the
        owner whose paused state takes the most disk first (:func:`.room.over_disk_budget`)."""
        budget = self.settings.paused_disk_bytes
        for session in over_disk_budget(self._sessions.values(), budget):
            if session.lock.locked():  # a call came meanwhile: decide again next pass
                return
            reason = (
                f"session {session.id} was paused and then expired to keep paused sessions "
                f"within SANDBOX_PAUSED_DISK_BYTES ({budget} bytes); the owner whose paused "
                "sessions take the most disk loses its longest idle first"
            )
            await self._isolated(session, self._expire(session, reason, "disk"))

    async def _keep_within_paused_limit(self) -> None:
        """Past ``max_paused_sessions``, expire paused sessions: the longest idle of the
        owner holding the most paused sessions first (one owner's flood costs that owner)."""
        limit = self.settings.max_paused_sessions
        paused = [s for s in self._sessions.values() if s.paused is not None]
        excess = len(paused) - limit
        if excess <= 0:
            return
        by_owner = collections.Counter(s.owner for s in paused)
        for _ in range(excess):
            free = [s for s in paused if not s.lock.locked() and not s.closed]
            if not free:
                return
            session = min(free, key=lambda s: (-by_owner[s.owner], s.last_active))
            paused.remove(session)
            by_owner[session.owner] -= 1
            reason = (
                f"session {session.id} was paused and then expired to keep within "
                f"SANDBOX_MAX_PAUSED_SESSIONS ({limit}); the owner holding the most paused "
                "sessions loses its longest idle first"
            )
            await self._isolated(session, self._expire(session, reason, "limit"))

    async def _isolated(self, session: Session, end: Awaitable[list[str]]) -> None:
        try:
            remains = await end
        except Exception:
            log.exception("ending a session failed", owner=session.owner, session=session.id)
            self._unfinished[session.slot] = session
            return
        if remains:
            log.warning(
                "an ended session still holds resources; trying again at the next pass",
                owner=session.owner,
                session=session.id,
                remains=remains,
            )

    def tombstones(self) -> dict[tuple[str, str], str]:
        """Why each remembered ``(owner, session_id)`` ended (for tests and operators)."""
        return dict(self._tombstones)

    def with_id(self, session_id: str) -> list[Session]:
        """The live sessions named ``session_id``, of every owner (a download link names
        no owner: its signature tells which of these it is for)."""
        return [s for (_, sid), s in self._sessions.items() if sid == session_id]

    def listed(self, owner: str | None = None) -> list[Session]:
        """The live sessions: every owner's (``owner`` None) or ``owner``'s. Read-only,
        for the operator's page (``sessions.overview``)."""
        return [s for (who, _), s in self._sessions.items() if owner is None or who == owner]

    def count(self, owner: str | None = None) -> int:
        """Open sessions: all of them, or ``owner``'s."""
        if owner is None:
            return len(self._sessions)
        return sum(1 for who, _ in self._sessions if who == owner)


def _gone_suffix(tombstone: str | None) -> str:
    return f" ({tombstone})" if tombstone else ""


def _outside_bytes(paused: Paused) -> int:
    """What a pause holds outside the workspace: its checkpoint image, if any."""
    return (paused.checkpoint.bytes or 0) if paused.checkpoint is not None else 0


def _mount_left(session: Session) -> bool:
    """Is a session without a sandbox still mounted, no call holding or awaiting it?"""
    return (
        session.workspace_made
        and session.workspace.volume is not None
        and session.sandbox is None
        and not session.runners
        and not session.queued
        and not session.lock.locked()
    )
