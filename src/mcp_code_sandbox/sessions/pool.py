"""The warm pool: sandboxes started before anyone asks, so that a new session costs a
claim instead of a sandbox start.

The session manager owns one :class:`WarmPool` and asks it for a sandbox when a call
creates a session whose sandbox would be the pool's kind (:meth:`.manager.SessionManager.acquire`
with ``pool=True``). Semantics:

- Up to its target of sandboxes of the default spec (no network, the server's env and
  limits, ``preload`` imported) are kept ready. The target is ``pool_size`` at rest; it
  grows when a burst of new sessions outruns the refills and shrinks back when they stop,
  never above a ceiling bounded by memory and the session limits (:mod:`.demand`
  decides; the pool stops the extra sandboxes itself, oldest first, one per second).
  Each is made like a session's: a fresh workspace slot, its record (``pool``:
  unclaimed) written before the workspace, a uid of its own where the backend uses them,
  the sandbox started and its agent ready.
- :meth:`WarmPool.claim` hands out the oldest usable one and refills at once. The claimer
  takes everything (slot, workspace, record, uid, sandbox): a sandbox serves one session
  only, ever, and the session's end stops it like any other. Nothing ran in it before:
  its workspace is empty, its ``/tmp`` its own, its interpreter at execution count 0.
- One that died, whose agent broke, or older than :data:`MAX_AGE_S` is stopped and
  replaced, never handed out: checked at every claim and every second in the background.
- Pooled sandboxes count toward no session limit; there are never more than the
  target of them ready or starting, and at most ``_STARTS_AT_ONCE`` start at once
  (a burst's own cold starts come first). A start that fails is logged and counted, and
  the next one waits, doubling up to ``_BACKOFF_MAX_S``: an engine that is down is not
  hammered.
- Where the backend keeps a pool of its own (kubernetes: see
  :mod:`mcp_code_sandbox.backends.own_pool`), this one starts nothing, and
  :meth:`WarmPool.status` shows the backend's.
- :meth:`WarmPool.aclose` (shutdown) starts nothing more, waits (bounded) for the starts
  in flight, and stops every pooled sandbox and removes its files and record. After a
  crash, the next server's recovery removes them: a record that says ``pool`` is never
  re-attached (:func:`.records.plan_recovery`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from mcp_code_sandbox.backends.base import Backend, Sandbox, SandboxSpec
from mcp_code_sandbox.backends.own_pool import OwnPool
from mcp_code_sandbox.metrics import Metrics
from mcp_code_sandbox.sessions import demand, records, runlog
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.sandboxes import Sandboxes
from mcp_code_sandbox.sessions.session import END_WAIT_S
from mcp_code_sandbox.sessions.uids import UidLease
from mcp_code_sandbox.sessions.workers import WorkerThreads
from mcp_code_sandbox.settings import Settings
from mcp_code_sandbox.workspace import Workspace

__all__ = ["PoolStatus", "Pooled", "WarmPool"]

log = structlog.get_logger("mcp_code_sandbox.sessions.pool")

#: Pooled sandboxes started at once: refills yield the cores to a burst's cold starts.
_STARTS_AT_ONCE = 1
#: How often the pool looks for dead or aged sandboxes and refills.
_WATCH_S = 1.0
_BACKOFF_MAX_S = 60.0
#: Whose worker threads make and remove pooled workspaces (not any tenant's share).
_THREADS_OWNER = "(pool)"
#: A pooled sandbox older than this is replaced, never handed out, so that a new session
#: gets no interpreter that has idled for long (nor an image or runtime rebuilt since it
#: started); one cold start an hour per pooled sandbox costs little.
MAX_AGE_S = 3600.0


@dataclass(eq=False)
class Pooled:
    """A warm sandbox with everything a session needs, until a session claims it."""

    key: str
    slot: str
    workspace: Workspace
    uid_lease: UidLease | None
    sandbox: Sandbox
    agent: AgentClient
    #: Monotonic time it became ready.
    made_at: float


@dataclass(frozen=True)
class PoolStatus:
    """What ``doctor``, ``list_runtimes`` and ``/readyz`` show of the pool."""

    #: The target now (``floor`` at rest); 0: no pool.
    size: int
    ready: int
    starting: int
    preload: tuple[str, ...]
    #: ``SANDBOX_POOL_SIZE``, and the most the target may grow to (:mod:`.demand`).
    floor: int
    ceiling: int
    #: :class:`.demand.Trend`'s value.
    trend: str
    #: The newest change of the target, or ``None``.
    decision: demand.Decision | None

    def as_json(self) -> dict[str, object]:
        decision = self.decision
        return {
            "size": self.size,
            "ready": self.ready,
            "starting": self.starting,
            "preload": list(self.preload),
            "floor": self.floor,
            "ceiling": self.ceiling,
            "trend": self.trend,
            "decision": None if decision is None else dataclasses.asdict(decision),
        }


class WarmPool:
    """Keeps its target of warm sandboxes; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        metrics: Metrics,
        sandboxes: Sandboxes,
        threads: WorkerThreads,
        *,
        instance: str,
        handover: bool,
        workspace_for: Callable[[str, int | None], Workspace],
        lease_uid: Callable[[str], UidLease | None],
    ) -> None:
        """``handover``: the records' (``records.SessionRecord.handover``), by the
        manager's role."""
        self.settings = settings
        #: The floor (SANDBOX_POOL_SIZE); 0: off, also where the backend pools itself.
        self.size = 0 if isinstance(backend, OwnPool) else settings.pool_size
        spare_uids = None
        if backend.per_sandbox_uids:  # never a uid a session or a paused one could need
            used = settings.max_sessions + settings.max_paused_sessions
            spare_uids = settings.uid_range_size - used
        top = demand.ceiling(
            self.size,
            max_sessions=settings.max_sessions,
            memory_limit=settings.memory_limit,
            available=demand.available_memory(),
            spare_uids=spare_uids,
        )
        #: The target, and why it moved (the watch and each claim ask it).
        self.demand = demand.Demand(self.size, top)
        self.backend = backend
        self.metrics = metrics
        self.sandboxes = sandboxes
        self.threads = threads
        self.instance = instance
        self.handover = handover
        self.workspace_for = workspace_for
        self.lease_uid = lease_uid
        self._ready: collections.deque[Pooled] = collections.deque()
        self._starting: set[asyncio.Task[None]] = set()
        #: Stops of retired sandboxes in flight (shutdown waits for them too).
        self._retiring: set[asyncio.Task[None]] = set()
        self._closed = False
        #: Why no sandbox should be started now (the first-start build of what sandboxes
        #: need is under way: a start would only fail, and its warning would tell the
        #: user to build it by hand), or ``None``. Set by the service; asked by refill.
        self.held_by: Callable[[], str | None] | None = None
        self._failures = 0
        self._next_start = 0.0
        self._watcher: asyncio.Task[None] | None = None
        metrics.track_pool(self._count)
        metrics.track_pool_demand(
            lambda: self.demand.target, self.size, top, lambda: self.demand.trend.value
        )

    # -- the manager's calls ------------------------------------------------------------

    def start(self) -> None:
        """Begin filling the pool, and watching it. Called by the manager's ``start``."""
        if self.size == 0:
            return
        self._watcher = asyncio.create_task(self._watch_forever(), name="warm-pool")
        self.refill()

    def claim(self) -> Pooled | None:
        """The oldest usable warm sandbox, now the caller's; ``None`` when there is none
        (the caller starts one as before). Refills in the background either way."""
        if self.size == 0 or self._closed:
            return None
        began = time.monotonic()
        found = None
        while self._ready:
            pooled = self._ready.popleft()
            if self._usable(pooled, began):
                found = pooled
                break
            self.retire(pooled)
        self.metrics.pool_claimed(found is not None, time.monotonic() - began)
        self._decided(self.demand.claimed(began, time.time(), hit=found is not None))
        self.refill()
        return found

    def lend(self, borrower: str) -> Pooled | None:
        """The oldest usable warm sandbox for another replica (``borrower``), its record
        rewritten as the borrower's (a borrower that dies leaves a dead server's pooled
        sandbox, which recovery removes); ``None`` when none is ready. The caller lets
        go of its channel and uid. Refills in the background either way."""
        now = time.monotonic()
        found = None
        while self._ready and found is None:
            pooled = self._ready.popleft()
            if self._usable(pooled, now):
                found = pooled
            else:
                self.retire(pooled)
        if found is not None:  # demand too, met here (another's miss is its own to count)
            uid = None if found.uid_lease is None else found.uid_lease.uid
            self._write_record(found.key, found.slot, uid, borrower)
            self.demand.claimed(now, time.time(), hit=True)
        self.refill()
        return found

    def put(self, pooled: Pooled) -> None:
        """A warm sandbox lent by another replica, ready here now."""
        if self._closed:
            self.retire(pooled)
        else:
            self._ready.append(pooled)

    def spec(self, key: str, workspace: Workspace, uid: int | None) -> SandboxSpec:
        """The spec of a pooled sandbox (nobody's yet; its interpreter preloads)."""
        spec = self.sandboxes.spec(key, records.POOL_OWNER, records.POOL_OWNER, workspace, uid=uid)
        return dataclasses.replace(spec, preload=tuple(self.settings.preload))

    def ready_sandboxes(self) -> list[Pooled]:
        """The warm sandboxes now waiting, oldest first (for tests and operators' views)."""
        return list(self._ready)

    def status(self) -> PoolStatus:
        if isinstance(self.backend, OwnPool):  # its pool stands in for this one
            own = self.backend.pool_counts()
            preload = tuple(self.settings.preload) if own.size else ()
            return PoolStatus(
                size=own.size,
                ready=own.ready,
                starting=own.starting,
                preload=preload,
                floor=own.size,
                ceiling=own.size,
                trend=demand.Trend.RESTING.value,
                decision=None,
            )
        # Only pooled interpreters preload: with no pool, nothing is imported ahead.
        preload = tuple(self.settings.preload) if self.size else ()
        d = self.demand
        return PoolStatus(
            d.target if self.size else 0,
            len(self._ready),
            len(self._starting),
            preload,
            self.size,
            d.ceiling if self.size else 0,
            d.trend.value,
            d.last,
        )

    async def aclose(self) -> None:
        """Stop every pooled sandbox and remove its files; bounded by the backend's stops
        and by ``END_WAIT_S`` for starts in flight (a start is never cut short: what it
        made would be lost). Idempotent."""
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.wait({self._watcher})
        pending = self._starting | self._retiring
        if pending:
            _, late = await asyncio.wait(pending, timeout=END_WAIT_S)
            if late:
                log.error("pooled sandbox starts still in flight at shutdown", count=len(late))
        ready, self._ready = list(self._ready), collections.deque()
        await asyncio.gather(*(self._discard(pooled) for pooled in ready))

    # -- keeping it full -------------------------------------------------------------------

    def refill(self) -> None:
        """Start what is missing, at most ``_STARTS_AT_ONCE`` at a time; nothing on a
        host where no sandbox can start (the backend said why, once)."""
        if self._closed or time.monotonic() < self._next_start or self.backend.host_problem:
            return
        if self.held_by is not None and self.held_by() is not None:
            return
        missing = self.demand.target - len(self._ready) - len(self._starting)
        for _ in range(min(missing, _STARTS_AT_ONCE - len(self._starting))):
            task = asyncio.create_task(self._fill_one(), name="warm-pool-start")
            self._starting.add(task)
            task.add_done_callback(self._started)

    def _started(self, task: asyncio.Task[None]) -> None:
        self._starting.discard(task)
        if not task.cancelled() and task.exception() is not None:  # _fill_one logs its own
            log.error("a pooled sandbox start failed unexpectedly", error=repr(task.exception()))
        self.refill()  # the next one, if any is missing

    async def _fill_one(self) -> None:
        began = time.monotonic()
        try:
            pooled = await self._make()
        except Exception as exc:
            if self.backend.host_problem is not None:  # said by the backend; not retried
                log.error("the warm pool is off: no sandbox can start on this host")
                return
            self._failures += 1
            delay = min(_BACKOFF_MAX_S, 2.0 ** min(self._failures, 6))
            self._next_start = time.monotonic() + delay
            log.warning("a pooled sandbox did not start", error=str(exc), retry_in_s=delay)
            return
        self._failures = 0
        self.metrics.pool_refilled(time.monotonic() - began)
        self.demand.refilled(time.monotonic() - began)
        if self._closed:
            await self._discard(pooled)
        else:
            self._ready.append(pooled)

    async def _make(self) -> Pooled:
        """One warm sandbox: record, workspace, sandbox, in that order (see ``records``);
        what was made is undone when a later step fails."""
        key = "s" + secrets.token_hex(16)[:31]  # the shape of a session's key
        slot = records.new_slot(key)
        lease = self.lease_uid(slot)
        uid = None if lease is None else lease.uid
        workspace = self.workspace_for(slot, uid)
        made: list[str] = []
        try:
            self._write_record(key, slot, uid)
            made.append("record")
            await self.threads.run(_THREADS_OWNER, workspace.create)
            made.append("workspace")
            spec = self.spec(key, workspace, uid)
            with self.metrics.counting_backend_errors():
                # Never cancelled: shutdown waits for the starts in flight instead.
                sandbox = await self.backend.create(spec)
        except BaseException:
            await asyncio.shield(self._undo(slot, workspace, lease, made))
            raise
        return Pooled(
            key, slot, workspace, lease, sandbox, AgentClient(sandbox.channel), time.monotonic()
        )

    def _write_record(
        self, key: str, slot: str, uid: int | None, instance: str | None = None
    ) -> None:
        now = time.time()
        record = records.SessionRecord(
            owner=records.POOL_OWNER,
            session_id=records.POOL_OWNER,
            key=key,
            slot=slot,
            instance=self.instance if instance is None else instance,
            created_at=now,
            last_active=now,
            uid=uid,
            pool=True,
            handover=self.handover,
        )
        records.write_record(self.settings.sessions_dir, record)

    # -- retiring ---------------------------------------------------------------------------

    def _usable(self, pooled: Pooled, now: float) -> bool:
        return (
            pooled.sandbox.is_alive()
            and not pooled.agent.broken
            and now - pooled.made_at < MAX_AGE_S
        )

    def retire(self, pooled: Pooled) -> None:
        """Stop ``pooled`` in the background (a claim must not wait for it). Called here,
        and by the manager for one it claimed but could not register."""
        task = asyncio.create_task(self._discard(pooled), name="warm-pool-retire")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _discard(self, pooled: Pooled) -> None:
        """Stop a pooled sandbox and remove its workspace, record and uid. Never raises:
        what could not be removed is logged, and the next server's recovery removes it
        (its record says ``pool``)."""
        try:
            await self.backend.stop(pooled.sandbox)
        except Exception:
            log.exception("cannot stop a pooled sandbox", slot=pooled.slot)
            return  # its record stays: it names what to remove
        await self._undo(pooled.slot, pooled.workspace, pooled.uid_lease, ["record", "workspace"])

    async def _undo(
        self, slot: str, workspace: Workspace, lease: UidLease | None, made: list[str]
    ) -> None:
        if "workspace" in made:
            try:
                await self.threads.run(_THREADS_OWNER, workspace.destroy)
            except Exception as exc:
                log.error("cannot remove a pooled workspace", slot=slot, error=repr(exc))
                return  # the record stays with it (see ``records``: record first, last)
        # A run log under its name: a paused session's, linked by a move that did not
        # complete (``moving``); before the record, as for a session.
        runlog.remove_log(self.settings.runlogs_dir, slot)
        records.remove_record(self.settings.sessions_dir, slot)
        if lease is not None:
            lease.release()  # after the record: see ``uids``

    async def _watch_forever(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_S)
            try:
                self._prune()
                self._settle()
                self.refill()
            except Exception:  # the pool's watch must outlive anything it meets
                log.exception("a warm pool pass failed; the next one tries again")

    def _prune(self) -> None:
        now = time.monotonic()
        for pooled in list(self._ready):
            if not self._usable(pooled, now):
                self._ready.remove(pooled)
                alive = pooled.sandbox.is_alive()
                log.info("replacing a pooled sandbox", slot=pooled.slot, alive=alive)
                self.retire(pooled)

    def _settle(self) -> None:
        """Shrink after idle (:meth:`.demand.Demand.settle`), and stop one sandbox past
        the target, the oldest: one a pass, as stops cost the host too."""
        held = len(self._ready) + len(self._starting)
        self._decided(self.demand.settle(time.monotonic(), time.time(), held))
        if self.demand.excess(held) and self._ready:
            self.retire(self._ready.popleft())

    def _decided(self, decision: demand.Decision | None) -> None:
        if decision is not None:
            self.metrics.pool_decided(decision.kind)
            log.info("warm pool target changed", target=decision.target, why=decision.why)

    def _count(self, state: str) -> int:
        return len(self._ready) if state == "ready" else len(self._starting)
