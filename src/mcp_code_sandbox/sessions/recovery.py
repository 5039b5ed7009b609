"""What a starting server does with what dead servers left: re-attach or remove.

Called once by :meth:`.manager.SessionManager.start`, with its collaborators given
explicitly (the settings' directories and limits, the backend, this server's instance
name, how to build a record's sandbox spec, the uid pool, the clock). The decision is the
pure :func:`.records.plan_recovery`; this module gathers its inputs (workspace dirs,
records, the backend's leftovers), carries out the removals, re-attaches what the plan
keeps, and RETURNS what the manager registers (:class:`Recovered`): it never reaches into
the manager. It holds an exclusive ``flock`` on ``run_dir/recovery.lock`` throughout, so
two servers starting on one state dir never both re-attach, or both remove, one session:
the second sees the records the first rewrote (a re-attached session's record names its
new server before the lock is let go).

Which servers are dead: those whose pid file (``run_dir/<instance>.pid``) nobody locks
and whose mark names no live process (by pid and start time, see :mod:`.holder`). A live
server's records, workspaces and sandboxes are never touched, including sandboxes it
re-attached (their labels still name the server that made them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from mcp_code_sandbox.backends.base import Backend, Leftover, Sandbox, SandboxSpec
from mcp_code_sandbox.backends.checkpoints import Checkpoint, checkpoints_of
from mcp_code_sandbox.errors import SandboxError, SandboxFailed
from mcp_code_sandbox.sessions import records, runlog
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.holder import pid_file_alive
from mcp_code_sandbox.sessions.lifecycle import Phase
from mcp_code_sandbox.sessions.session import Paused, Session
from mcp_code_sandbox.sessions.table import SessionTable
from mcp_code_sandbox.sessions.uids import UidLease, UidPool
from mcp_code_sandbox.settings import Settings
from mcp_code_sandbox.workspace import remove_tree, spares
from mcp_code_sandbox.workspace.volume import IMAGE_SUFFIX, PROBE_PREFIX, release

__all__ = [
    "Adopted",
    "Kept",
    "Recovered",
    "Unsandboxed",
    "adopted_session",
    "alive",
    "dead_instances",
    "kept_session",
    "recover",
    "take_lent",
    "take_over",
    "take_over_all",
    "unsandboxed_session",
]

log = structlog.get_logger("mcp_code_sandbox.sessions.manager")

#: A probe's mount older than this is a dead server's (a probe takes a fraction of a second).
_STALE_PROBE_S = 600.0

#: Builds the sandbox spec of a recorded session (the manager's: limits, env, workspace).
SpecFor = Callable[[records.SessionRecord], SandboxSpec]


@dataclass(frozen=True)
class Adopted:
    """A dead server's session whose sandbox was re-attached, its record already this
    server's: the manager registers it as it is."""

    record: records.SessionRecord
    sandbox: Sandbox
    #: Its host uid, leased again; ``None`` when the backend uses no per-session uids.
    uid_lease: UidLease | None


@dataclass(frozen=True)
class Kept:
    """A dead server's paused session (or one it was pausing), its record already this
    server's: the manager registers it as paused, to resume on its first call."""

    record: records.SessionRecord
    uid_lease: UidLease | None


@dataclass(frozen=True)
class Unsandboxed:
    """A session another replica let go of with no sandbox to take back (files only), its
    record already this server's: the manager registers it running; its next call that
    runs code starts a sandbox."""

    record: records.SessionRecord
    uid_lease: UidLease | None


@dataclass
class Recovered:
    """What recovery leaves the manager to apply."""

    adopt: list[Adopted] = field(default_factory=list)
    paused: list[Kept] = field(default_factory=list)
    #: Sessions of dead servers that are gone: ``(owner, session_id, why)``, so that a
    #: call naming one again says what was lost.
    lost: list[tuple[str, str, str]] = field(default_factory=list)


async def recover(
    settings: Settings,
    backend: Backend,
    *,
    instance: str,
    spec_for: SpecFor,
    uids: UidPool | None,
    takes_over: bool,
    clock: Callable[[], float] = time.time,
) -> Recovered:
    """Remove what dead servers left, re-attach what the plan keeps (as ``instance``),
    and return what to adopt and which sessions were lost. ``takes_over``: this server
    is its state directory's service (:mod:`.holder`); otherwise it only removes what
    dead private servers left, and adopts nothing."""
    lock_fd = os.open(settings.run_dir / "recovery.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        await asyncio.to_thread(fcntl.flock, lock_fd, fcntl.LOCK_EX)
        await _remove_dead_instances(settings, instance)
        # Slots before records: a live server writes a record before making its workspace.
        slots = await asyncio.to_thread(records.list_slots, settings.workspaces_dir)
        saved = await asyncio.to_thread(records.load_records, settings.sessions_dir)
        plan = records.plan_recovery(
            saved,
            await backend.list_leftovers(live_too=takes_over),
            slots,
            workspaces_dir=settings.workspaces_dir,
            alive=lambda other: alive(settings.run_dir / f"{other}.pid"),
            now=clock(),
            ttl_s=settings.session_ttl_m * 60,
            lifetime_s=settings.session_max_lifetime_h * 3600,
            max_sessions=settings.max_sessions + settings.max_paused_sessions,
            takes_over=takes_over,
        )
        ctx = _Context(settings, backend, instance, spec_for, uids)
        return await _carry_out(ctx, plan)
    finally:
        os.close(lock_fd)  # releases the lock


async def take_over(
    settings: Settings,
    backend: Backend,
    record: records.SessionRecord,
    *,
    instance: str,
    spec_for: SpecFor,
    uids: UidPool | None,
    let_go: Callable[[], Awaitable[records.SessionRecord | None]],
) -> Adopted | Kept | Unsandboxed | str | None:
    """Take over one session a live replica holds (:mod:`.replicas`); the caller holds the
    session's lease. ``let_go`` asks the holder to let go, and returns the record as the
    holder last wrote it (``None``: the session ended meanwhile). It is asked once this
    server listens for the sandbox's agent, so that the agent, which reconnects at once
    when the holder closes its end, finds this server there.

    Returns the re-attached or paused session, or one without a sandbox (files only: it
    had none, or it could not be taken back); ``None`` when it ended meanwhile; why it
    was lost when a pause it had cannot be kept. Nothing of a live holder's session is
    ever removed here. ``SandboxFailed`` (nothing changed) when its uid is still held."""
    ctx = _Context(settings, backend, instance, spec_for, uids)
    now: records.SessionRecord | None = None
    sandbox: Sandbox | None = None
    if record.paused is None and not record.pausing:
        leftover = await _running(ctx, record)

        async def bound() -> None:
            nonlocal now
            now = await let_go()
            if now is None or now.paused is not None or now.pausing:
                raise _NotRunning  # ended or paused meanwhile: no agent comes back

        if leftover is not None:
            try:
                sandbox = await backend.reattach(leftover, spec_for(record), bound=bound)
            except _NotRunning:
                pass
            except SandboxError as exc:
                log.warning(
                    "taking over a sandbox failed", session=record.session_id, error=exc.message
                )
    if now is None:  # not asked yet: paused, or its sandbox was not found
        now = await let_go()
        if now is None:
            return None
    if sandbox is None and (now.paused is not None or now.pausing):
        kept = await _keep_paused(ctx, now)
        return kept if kept is not None else f"session {now.session_id} was lost in a handover"
    if sandbox is None:  # its sandbox started after the first look, or it has none
        leftover = await _running(ctx, now)
        if leftover is not None:
            try:
                sandbox = await backend.reattach(leftover, spec_for(now))
            except SandboxError:
                sandbox = None
            if sandbox is None:
                log.warning("a handed-over sandbox could not be taken back; its files are kept")
                await backend.remove_leftover(leftover)
    try:
        lease = await _reclaim_uid(ctx, now)
    except SandboxError:
        if sandbox is not None:
            sandbox.channel.close()  # its agent waits for the next taker
        raise SandboxFailed(
            f"session {now.session_id} could not be taken over from another replica yet "
            "(its host uid is still held); try again"
        ) from None
    mine = _make_ours(ctx, now)
    return Unsandboxed(mine, lease) if sandbox is None else Adopted(mine, sandbox, lease)


class _NotRunning(Exception):
    pass


async def take_lent(
    settings: Settings,
    backend: Backend,
    record: records.SessionRecord,
    spec: SandboxSpec,
    uids: UidPool | None,
) -> tuple[Sandbox, UidLease | None] | None:
    """Re-attach the warm sandbox of a pool record another replica has just lent this one
    (its record already names this one), with its uid; ``None`` when it cannot be (what
    is left of it is then removed: a pooled sandbox holds nothing of anyone's)."""
    ctx = _Context(settings, backend, record.instance, lambda _: spec, uids)
    leftover = await _running(ctx, record)
    sandbox = None if leftover is None else await backend.reattach(leftover, spec)
    lease = None
    if sandbox is not None:
        try:
            lease = await _reclaim_uid(ctx, record)
        except SandboxError:
            sandbox.channel.close()
            sandbox = None
    if sandbox is None:
        if leftover is not None:
            await backend.remove_leftover(leftover)
        await _forget(settings, record.slot)
        return None
    return sandbox, lease


async def _running(ctx: _Context, record: records.SessionRecord) -> Leftover | None:
    """The running sandbox ``record``'s session (or, for a pool record, the pool) has:
    its agent's container, if any."""
    slot_dir = ctx.settings.workspaces_dir / record.slot
    unclaimed = (record.key, record.uid, records.POOL_OWNER, records.POOL_OWNER)
    for leftover in await ctx.backend.list_leftovers(live_too=True):
        if (
            leftover.workspace == slot_dir
            and leftover.runner is None
            and leftover.running
            and (
                (leftover.key, leftover.uid, leftover.owner, leftover.session_id) == unclaimed
                if record.pool
                else records.made_for(leftover, record)
            )
        ):
            return leftover
    return None


def dead_instances(run_dir: Path, mine: str) -> bool:
    """Has a server whose pid file is in ``run_dir`` died (its records and sandboxes are
    then to be taken over, or removed)? Blocking."""
    return any(p.stem != mine and not alive(p) for p in run_dir.glob("*.pid"))


def adopted_session(table: SessionTable, adopted: Adopted) -> Session:
    """The session of ``adopted`` as it is now (for the manager to add): its re-attached
    sandbox and its uid."""
    record, sandbox = adopted.record, adopted.sandbox
    session = table.from_record(record, adopted.uid_lease, Phase.RUNNING)
    session.sandbox, session.agent = sandbox, AgentClient(sandbox.channel)
    session.workspace_made = True  # its filesystem outlived the old server, mounted
    log.info("session re-attached", owner=record.owner, session=record.session_id)
    return session


def unsandboxed_session(table: SessionTable, taken: Unsandboxed) -> Session:
    """The session of ``taken`` as it is now (for the manager to add): files, no sandbox."""
    return table.from_record(taken.record, taken.uid_lease, Phase.RUNNING)


def kept_session(table: SessionTable, kept: Kept) -> Session:
    """The paused session of ``kept`` (for the manager to add): no sandbox; its first call
    that runs code resumes it. A server that died during a pause left the last complete
    saved state, or none: its files at least."""
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
    session = table.from_record(record, kept.uid_lease, Phase.PAUSED)
    session.paused = paused
    log.info("paused session kept", owner=record.owner, session=record.session_id)
    return session


async def take_over_all(
    settings: Settings,
    backend: Backend,
    table: SessionTable,
    *,
    spec_for: SpecFor,
    uids: UidPool | None,
    takes_over: bool,
) -> None:
    """:func:`recover` as ``table``'s server, and add to ``table`` what it took over (its
    records now this server's: a later start leaves them alone); the lost are tombstoned."""
    instance = table.instance
    recovered = await recover(
        settings, backend, instance=instance, spec_for=spec_for, uids=uids, takes_over=takes_over
    )
    for session in [
        *(adopted_session(table, adopted) for adopted in recovered.adopt),
        *(kept_session(table, kept) for kept in recovered.paused),
    ]:
        table.add(session)
        table.save(session, force=True)
    for owner, session_id, why in recovered.lost:
        table.tombstone(owner, session_id, why)


@dataclass(frozen=True)
class _Context:
    settings: Settings
    backend: Backend
    instance: str
    spec_for: SpecFor
    uids: UidPool | None


async def _carry_out(ctx: _Context, plan: records.Plan) -> Recovered:
    for leftover in plan.remove_leftovers:
        log.info("removing leftover sandbox", backend_id=leftover.backend_id)
        await ctx.backend.remove_leftover(leftover)
    # Concurrently: each waits (bounded) for its agent to reconnect.
    results = await asyncio.gather(*(_reattach(ctx, r, lo) for r, lo in plan.reattach))
    recovered = Recovered()
    drop = list(plan.drop)
    for (record, leftover), adopted in zip(plan.reattach, results, strict=True):
        if adopted is None:
            await ctx.backend.remove_leftover(leftover)
            drop.append((record, f"session {record.session_id} was lost in a server restart"))
        else:
            recovered.adopt.append(adopted)
    for record in plan.keep_paused:
        kept = await _keep_paused(ctx, record)
        if kept is None:
            drop.append((record, f"session {record.session_id} was lost in a server restart"))
        else:
            recovered.paused.append(kept)
    for record, why in drop:
        if record.pool:  # warm, never claimed: nothing of anyone's was lost
            log.info("removing a pooled sandbox of a server that is gone", slot=record.slot)
            await _forget(ctx.settings, record.slot)
            continue
        log.info("removing a session of a server that is gone", session=record.session_id)
        await _forget(ctx.settings, record.slot)
        recovered.lost.append((record.owner, record.session_id, why))
    for record in plan.superseded:
        log.info("removing the slot a session moved out of", session=record.session_id)
        await _forget(ctx.settings, record.slot)
    for slot in plan.stray_slots:
        await _forget(ctx.settings, slot)
    # Run logs whose record is gone (a server killed between removing the two).
    sessions_dir = ctx.settings.sessions_dir
    await asyncio.to_thread(
        runlog.sweep,
        ctx.settings.runlogs_dir,
        lambda slot: records.record_path(sessions_dir, slot).exists(),
    )
    await asyncio.to_thread(_sweep_volumes, ctx.settings)
    return recovered


async def _reattach(
    ctx: _Context, record: records.SessionRecord, leftover: Leftover
) -> Adopted | None:
    lease = None
    try:
        lease = await _reclaim_uid(ctx, record)
        sandbox = await ctx.backend.reattach(leftover, ctx.spec_for(record))
    except SandboxError as exc:
        log.warning("re-attach failed", session=record.session_id, error=exc.message)
        sandbox = None
    if sandbox is None:
        if lease is not None:
            lease.release()  # the record goes next (``_forget``), and the uid is free
        return None
    return Adopted(_make_ours(ctx, record), sandbox, lease)


async def _keep_paused(ctx: _Context, record: records.SessionRecord) -> Kept | None:
    """Keep a paused session for this server: its uid leased again and its record made
    ours. ``None`` (its checkpoint discarded) when its uid is not free."""
    try:
        lease = await _reclaim_uid(ctx, record)
    except SandboxError as exc:
        log.warning("a paused session cannot be kept", session=record.session_id, error=exc.message)
        backend_id = records.checkpoint_id(record)
        checkpoints = checkpoints_of(ctx.backend)
        if backend_id is not None and checkpoints is not None:
            await checkpoints.discard(Checkpoint(backend_id))
        return None
    return Kept(_make_ours(ctx, record), lease)


def _make_ours(ctx: _Context, record: records.SessionRecord) -> records.SessionRecord:
    """The record rewritten as this server's, before the lock is let go: a later start
    must leave its session alone."""
    mine = dataclasses.replace(record, instance=ctx.instance)
    try:
        records.write_record(ctx.settings.sessions_dir, mine)
    except OSError as exc:  # the manager writes it again when it registers the session
        log.warning("cannot write the session record", session=record.session_id, error=str(exc))
    return mine


async def _reclaim_uid(ctx: _Context, record: records.SessionRecord) -> UidLease | None:
    """The uid of a session about to be re-attached, leased again; ``None`` when the
    backend uses no per-session uids. Raises ``SandboxFailed`` when the session cannot
    have it back (another server holds it, or the record names none): its sandbox runs
    as that uid, so it is not re-attached."""
    if ctx.uids is None:
        return None
    holder = str(records.record_path(ctx.settings.sessions_dir, record.slot))
    lease = None
    if record.uid is not None:
        lease = await asyncio.to_thread(ctx.uids.reclaim, record.uid, holder)
    if lease is None:
        raise SandboxFailed(f"the host uid {record.uid} of the session is not free")
    return lease


async def _forget(settings: Settings, slot: str) -> None:
    """Delete a workspace (unmounting its filesystem, deleting its image), then its
    record (that order: see :mod:`.records`)."""
    image = settings.volumes_dir / f"{slot}{IMAGE_SUFFIX}"
    await asyncio.to_thread(release, settings.workspaces_dir / slot, image)
    runlog.remove_log(settings.runlogs_dir, slot)  # its runs, before the record
    records.remove_record(settings.sessions_dir, slot)


def _sweep_volumes(settings: Settings) -> None:
    """Delete images whose workspace directory is gone (a release cut short after it
    unmounted), what a probe killed half-way left (:func:`.workspace.volume.probe`), and
    a dead server's spare images (:mod:`.workspace.spares`)."""
    spares.sweep(settings.volumes_dir, lambda other: alive(settings.run_dir / f"{other}.pid"))
    if settings.volumes_dir.is_dir():
        for image in settings.volumes_dir.glob(f"*{IMAGE_SUFFIX}"):
            slot = image.name.removesuffix(IMAGE_SUFFIX)
            if not (settings.workspaces_dir / slot).exists():
                log.info("removing a leftover workspace image", slot=slot)
                image.unlink(missing_ok=True)
    stale = time.time() - _STALE_PROBE_S
    for probe in settings.run_dir.glob(f"{PROBE_PREFIX}*"):
        if probe.name.endswith(IMAGE_SUFFIX) or probe.lstat().st_mtime > stale:
            continue
        release(probe, probe.with_name(probe.name + IMAGE_SUFFIX))


async def _remove_dead_instances(settings: Settings, mine: str) -> None:
    for pidfile in settings.run_dir.glob("*.pid"):
        instance = pidfile.stem
        if instance == mine or alive(pidfile):
            continue
        # Servers before the slot layout kept workspaces under a per-process dir.
        log.info("removing workspaces of a server that is gone", instance=instance)
        await asyncio.to_thread(remove_tree, settings.workspaces_dir / instance)
        pidfile.unlink(missing_ok=True)


def alive(pidfile: Path) -> bool:
    """Does ``pidfile`` name a live server? False when there is no file (see
    :func:`.holder.pid_file_alive`)."""
    try:
        return pid_file_alive(pidfile)
    except OSError:
        return False
