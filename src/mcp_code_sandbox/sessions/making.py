"""Making sessions: a new one's slot, uid, record and workspace, or a warm sandbox made a
session's; and the workspace of any slot, with its filesystem where the quota is the
kernel's.

Order (see :mod:`.records`): a new session's uid is leased first, then its record is
written, and only then is its workspace made (by its first call, :meth:`Making.mount`):
a workspace without a record is always garbage. A session made of a warm sandbox takes
the sandbox's slot, workspace, uid and sandbox, and its record is rewritten as the
session's before it is added. Whether each workspace is a filesystem of its own (its
quota the kernel's) is decided once, at the manager's start (:meth:`choose_quota`);
where it is, a few formatted images are kept ready (:mod:`..workspace.spares`), in a
directory of this server's own.

Uids. Where the backend can run each sandbox as a host uid of its own, every session
leases one (:mod:`.uids`) when it is made, before its record and workspace exist (the
workspace is given to it), keeps it for its whole life (every sandbox and runner of the
session runs as it), records it, and lets it go after its record is removed. A
re-attached session gets the uid its record names back, or is not re-attached.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog

from mcp_code_sandbox.backends.base import Backend
from mcp_code_sandbox.errors import SessionNotFound
from mcp_code_sandbox.metrics import Metrics
from mcp_code_sandbox.sessions import quota, records
from mcp_code_sandbox.sessions.ids import session_key
from mcp_code_sandbox.sessions.pool import Pooled
from mcp_code_sandbox.sessions.quota import QuotaMode
from mcp_code_sandbox.sessions.session import Session
from mcp_code_sandbox.sessions.table import SessionTable
from mcp_code_sandbox.sessions.uids import UidLease, UidPool
from mcp_code_sandbox.sessions.workers import WorkerThreads
from mcp_code_sandbox.settings import Settings
from mcp_code_sandbox.workspace import Workspace
from mcp_code_sandbox.workspace.spares import SPARES_DIR, SpareImages
from mcp_code_sandbox.workspace.volume import IMAGE_SUFFIX, Volume, image_bytes

__all__ = ["Making"]

log = structlog.get_logger("mcp_code_sandbox.sessions.manager")

_T = TypeVar("_T")


class Making:
    """Makes sessions and their workspaces for the session manager, which owns one."""

    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        metrics: Metrics,
        threads: WorkerThreads,
        uids: UidPool | None,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.metrics = metrics
        self.threads = threads
        self.uids = uids
        #: How the workspace quota binds sandboxes here; decided by :meth:`choose_quota`.
        self.quota = QuotaMode(False, "not started")
        #: Workspace images formatted ahead (filesystem quotas only).
        self.spares: SpareImages | None = None

    async def choose_quota(self) -> None:
        self.quota = await asyncio.to_thread(quota.choose, self.settings, self.backend)
        log.info("workspace quota", enforced=self.quota.describe())

    async def start_spares(self, instance: str) -> None:
        """Keep formatted images ready (after recovery, which sweeps dead servers')."""
        if self.quota.filesystem:
            self.spares = SpareImages(
                self.settings.volumes_dir / SPARES_DIR / instance,
                image_bytes(self.settings.workspace_quota_bytes),
            )
            await asyncio.to_thread(self.spares.start)

    async def close(self) -> None:
        if self.spares is not None:
            await asyncio.to_thread(self.spares.close)

    # -- new sessions -------------------------------------------------------------------

    def fresh(self, table: SessionTable, owner: str, session_id: str) -> Session:
        """A new session of its own slot, added to ``table`` with its record written."""
        key = session_key(owner, session_id)
        slot = records.new_slot(key)
        now = time.monotonic()
        lease = self.lease_uid(slot)
        try:
            workspace = self.workspace(slot, None if lease is None else lease.uid)
            session = Session(session_id, owner, key, slot, workspace, now, now, time.time())
            session.uid_lease = lease
            table.save(session, force=True)  # before the workspace: see ``records``
        except BaseException:
            table.drop_slot(slot)  # then the uid is free
            if lease is not None:
                lease.release()
            raise
        return self._created(table, session)

    def from_pool(
        self,
        table: SessionTable,
        owner: str,
        session_id: str,
        pooled: Pooled,
        retire: Callable[[Pooled], None],
    ) -> Session:
        """A new session made of a warm sandbox: its slot, workspace, uid and sandbox
        become the session's, and its record is rewritten as the session's (owner and id
        bound now, on disk: recovery and re-attach work as for any session)."""
        now, key, slot = time.monotonic(), pooled.key, pooled.slot
        session = Session(session_id, owner, key, slot, pooled.workspace, now, now, time.time())
        session.sandbox, session.agent = pooled.sandbox, pooled.agent
        session.workspace_made, session.uid_lease = True, pooled.uid_lease
        try:
            table.save(session, force=True)
        except BaseException:
            retire(pooled)  # its record still says ``pool``: nobody's
            raise
        return self._created(table, session)

    def _created(self, table: SessionTable, session: Session) -> Session:
        table.add(session)
        self.metrics.session_created()
        log.info("session created", owner=session.owner, session=session.id)
        return session

    def lease_uid(self, slot: str) -> UidLease | None:
        if self.uids is None:
            return None
        return self.uids.lease(str(records.record_path(self.settings.sessions_dir, slot)))

    # -- workspaces ---------------------------------------------------------------------

    def workspace(self, slot: str, uid: int | None) -> Workspace:
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

    async def mount(self, session: Session) -> None:
        """Make ``session``'s workspace (with a filesystem: mount it), in a worker thread."""
        await self.threads.run(session.owner, session.workspace.create)
        if session.closed:  # closed meanwhile: its destroy may have run before the mount
            await self.threads.run(session.owner, session.workspace.destroy)
            raise SessionNotFound(f"session {session.id} was closed while it was being made")
        session.workspace_made = True

    async def mounting(
        self, session: Session, start: Callable[[Awaitable[None]], Awaitable[_T]]
    ) -> _T:
        """``start(mounted)`` for a session whose workspace is not mounted yet (a new one):
        its directory is made first (a container's bind needs it at the create), then its
        filesystem is mounted while ``start`` starts the sandbox, which waits for
        ``mounted`` only where it must (docker: between the container's create and its
        start). Whatever ``start`` did, the mount has ended when this returns, and what
        it raised is raised."""
        await self.threads.run(session.owner, session.workspace.make_root)
        mounting = asyncio.ensure_future(self.mount(session))
        try:
            started = await start(mounting)
        finally:
            await asyncio.wait({mounting})
            if not mounting.cancelled():
                mounting.exception()  # raised by ``start`` already, or just below
        await mounting  # a sandbox running already (none is, in practice) did not wait
        return started
