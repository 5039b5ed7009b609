"""What a starting server does with what dead servers left: re-attach or remove.

Called once by :meth:`.sessions.SessionManager.start`. The decision is the pure
:func:`.records.plan_recovery`; this module gathers its inputs (workspace dirs, records,
the backend's leftovers) and carries it out. It holds an exclusive ``flock`` on
``run_dir/recovery.lock`` throughout, so two servers starting on one state dir never both
re-attach, or both remove, one session: the second sees the first's rewritten records.

Which servers are dead: those whose pid file (``run_dir/<instance>.pid``) names no live
process (by pid and start time, see :mod:`.liveness`). A live server's records,
workspaces and sandboxes are never touched, including sandboxes it re-attached (their
labels still name the server that made them).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from mcp_code_sandbox.backends.base import Leftover
from mcp_code_sandbox.errors import SandboxError
from mcp_code_sandbox.host import process_alive, read_mark
from mcp_code_sandbox.sessions import records
from mcp_code_sandbox.settings import Settings
from mcp_code_sandbox.workspace import remove_tree
from mcp_code_sandbox.workspace.volume import IMAGE_SUFFIX, PROBE_PREFIX, release

if TYPE_CHECKING:
    from mcp_code_sandbox.sessions.manager import SessionManager

__all__ = ["alive", "recover"]

log = structlog.get_logger("mcp_code_sandbox.sessions.manager")

#: A probe's mount older than this is a dead server's (a probe takes ~0.1 s).
_STALE_PROBE_S = 600.0


async def recover(manager: SessionManager) -> None:
    settings = manager.settings
    lock_fd = os.open(settings.run_dir / "recovery.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        await asyncio.to_thread(fcntl.flock, lock_fd, fcntl.LOCK_EX)
        await _remove_dead_instances(manager)
        # Slots before records: a live server writes a record before making its workspace.
        slots = await asyncio.to_thread(records.list_slots, settings.workspaces_dir)
        saved = await asyncio.to_thread(records.load_records, settings.sessions_dir)
        plan = records.plan_recovery(
            saved,
            await manager.backend.list_leftovers(),
            slots,
            workspaces_dir=settings.workspaces_dir,
            alive=lambda instance: alive(settings.run_dir / f"{instance}.pid"),
            now=time.time(),
            ttl_s=settings.session_ttl_m * 60,
            lifetime_s=settings.session_max_lifetime_h * 3600,
            max_sessions=settings.max_sessions,
        )
        await _carry_out(manager, plan)
    finally:
        os.close(lock_fd)  # releases the lock


async def _carry_out(manager: SessionManager, plan: records.Plan) -> None:
    for leftover in plan.remove_leftovers:
        log.info("removing leftover sandbox", backend_id=leftover.backend_id)
        await manager.backend.remove_leftover(leftover)
    # Concurrently: each waits (bounded) for its agent to reconnect.
    results = await asyncio.gather(*(_reattach(manager, r, lo) for r, lo in plan.reattach))
    drop = list(plan.drop)
    for (record, leftover), ok in zip(plan.reattach, results, strict=True):
        if not ok:
            await manager.backend.remove_leftover(leftover)
            drop.append((record, f"session {record.session_id} was lost in a server restart"))
    for record, why in drop:
        log.info("removing a session of a server that is gone", session=record.session_id)
        await _forget(manager, record.slot)
        manager.tombstone(record.owner, record.session_id, why)
    for slot in plan.stray_slots:
        await _forget(manager, slot)
    await asyncio.to_thread(_sweep_volumes, manager.settings)


async def _reattach(
    manager: SessionManager, record: records.SessionRecord, leftover: Leftover
) -> bool:
    lease = None
    try:
        lease = await manager.reclaim_uid(record)
        sandbox = await manager.backend.reattach(leftover, manager.spec_for(record))
    except SandboxError as exc:
        log.warning("re-attach failed", session=record.session_id, error=exc.message)
        sandbox = None
    if sandbox is None:
        if lease is not None:
            lease.release()  # the record goes next (``_forget``), and the uid is free
        return False
    manager.adopt(record, sandbox, lease)
    return True


async def _forget(manager: SessionManager, slot: str) -> None:
    """Delete a workspace (unmounting its filesystem, deleting its image), then its
    record (that order: see ``registry``)."""
    settings = manager.settings
    image = settings.volumes_dir / f"{slot}{IMAGE_SUFFIX}"
    await asyncio.to_thread(release, settings.workspaces_dir / slot, image)
    records.remove_record(settings.sessions_dir, slot)


def _sweep_volumes(settings: Settings) -> None:
    """Delete images whose workspace directory is gone (a release cut short after it
    unmounted), and what a probe killed half-way left (:func:`.workspace.volume.probe`)."""
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


async def _remove_dead_instances(manager: SessionManager) -> None:
    run_dir = manager.settings.run_dir
    for pidfile in run_dir.glob("*.pid"):
        instance = pidfile.stem
        if instance == manager.instance or alive(pidfile):
            continue
        # Servers before the slot layout kept workspaces under a per-process dir.
        log.info("removing workspaces of a server that is gone", instance=instance)
        await asyncio.to_thread(remove_tree, manager.settings.workspaces_dir / instance)
        pidfile.unlink(missing_ok=True)


def alive(pidfile: Path) -> bool:
    """Does ``pidfile`` name a live process? False when there is no file."""
    try:
        mark = read_mark(pidfile.read_text())
    except OSError:
        return False
    return mark is not None and process_alive(*mark)
