"""A paused session resumed into a warm sandbox of the pool (:mod:`.pool`).

A pooled sandbox's workspace is fixed when it starts (a bind mount), so the session
cannot bring its own: it moves instead. Its files are copied into the pooled sandbox's
fresh workspace (:func:`.workspace.transfer.copy_tree`, with ``.session/``, the saved
variables the agent then loads), and the pooled slot, workspace, uid and sandbox become
the session's, as for a new session that claims one (:meth:`.manager.SessionManager._take`).
The interpreter it gets has the pool's preload imported already: the saved imports cost
nothing, and neither does the sandbox's start.

Semantics:
- Only a session paused by its variables or files alone moves (a checkpoint is restored
  into its own container), only for a call of the pool's kind (no network, runner or env
  of its own), and only when its files are at most ``MOVE_MAX_BYTES`` and
  ``MOVE_MAX_ENTRIES`` (a copy must cost less than the start it saves). Anything that
  stops the copy (too large, a file with hard links, a full disk, the session closed
  meanwhile) leaves the session as it was: it resumes in a sandbox of its own, and the
  caller discards the pooled one.
- Crash safety, in this order: the files are copied (a server that dies now leaves a
  pooled record, which recovery removes, and the session paused in its old slot); the
  run log gets the new slot's name as a hard link; the new slot's record is written as
  the session's, still paused, naming the old slot in ``replaces`` (the commit: a
  server that dies from here on resumes the session from the copy, and recovery removes
  the old slot, see :mod:`.records`); then the old workspace, run log name and record go,
  and its uid is let go.
"""

from __future__ import annotations

import contextlib
import functools
import os

import structlog

from mcp_code_sandbox.errors import SandboxError
from mcp_code_sandbox.sessions import records, runlog
from mcp_code_sandbox.sessions.pool import Pooled
from mcp_code_sandbox.sessions.session import Moved, Session
from mcp_code_sandbox.sessions.table import SessionTable
from mcp_code_sandbox.sessions.workers import WorkerThreads
from mcp_code_sandbox.settings import Settings
from mcp_code_sandbox.workspace.transfer import CopyRefused, copy_tree

__all__ = ["MOVE_MAX_BYTES", "MOVE_MAX_ENTRIES", "fits_pool", "forget_moved", "move_into"]

log = structlog.get_logger("mcp_code_sandbox.sessions.moving")

#: The most a move copies: a copy this size still costs less than the cold start it saves.
MOVE_MAX_BYTES = 64 << 20
MOVE_MAX_ENTRIES = 5000


def fits_pool(session: Session) -> bool:
    """Can this call's resume of ``session`` move it into a warm sandbox? (Lock held.)"""
    paused = session.paused
    return (
        paused is not None
        and paused.checkpoint is None
        and session.sandbox is None
        and not session.runners
        and session.workspace_made  # mounted by ``acquire``: its files can be read
        and not session.closed
        and paused.files_bytes <= MOVE_MAX_BYTES
        and paused.file_count <= MOVE_MAX_ENTRIES
    )


async def move_into(
    session: Session,
    pooled: Pooled,
    settings: Settings,
    threads: WorkerThreads,
    table: SessionTable,
) -> None:
    """Move paused ``session`` into ``pooled`` (see the module docstring). Moved, the
    session's sandbox is ``pooled.sandbox`` (with its agent, slot, workspace and uid);
    else nothing of the session changed, and the caller discards ``pooled`` (also when
    this raises, a cancellation say, before the move committed). Lock held; never raises
    for the disk's or the sandbox's files."""
    copy = functools.partial(
        copy_tree,
        session.workspace.root,
        pooled.workspace.root,
        owner=pooled.workspace.owner,
        max_bytes=MOVE_MAX_BYTES,
        max_entries=MOVE_MAX_ENTRIES,
    )
    old_log = runlog.log_path(settings.runlogs_dir, session.slot)
    new_log = runlog.log_path(settings.runlogs_dir, pooled.slot)
    try:
        copied = await threads.run(session.owner, copy)
        await threads.run(session.owner, _link, old_log, new_log)
    except (CopyRefused, OSError) as exc:
        log.info("a paused session resumes in a new sandbox", session=session.id, why=str(exc))
        return
    if session.closed:  # closed while we copied: its end removes its own slot
        await threads.run(session.owner, _unlink, new_log)
        return
    old_key, moved = session.key, Moved(session.slot, session.workspace, session.uid_lease)
    session.key, session.slot, session.workspace = pooled.key, pooled.slot, pooled.workspace
    session.uid_lease, session.replaces = pooled.uid_lease, moved
    session.sandbox, session.agent = pooled.sandbox, pooled.agent
    if not table.write(session):  # logged
        session.key, session.slot, session.workspace = old_key, moved.slot, moved.workspace
        session.uid_lease, session.replaces = moved.uid_lease, None
        session.sandbox, session.agent = None, None
        await threads.run(session.owner, _unlink, new_log)
        return
    log.info(
        "a paused session moved into a warm sandbox",
        session=session.id,
        files=copied.files,
        bytes=copied.bytes,
        skipped=copied.skipped,
    )
    if await forget_moved(settings, threads, session.owner, moved):
        session.replaces = None


async def forget_moved(
    settings: Settings, threads: WorkerThreads, owner: str, moved: Moved
) -> bool:
    """Remove the slot a session moved out of: its workspace, run log name and record,
    in that order (see ``records``), then let its uid go. False (logged): it stays, and
    the session's record names it (``replaces``); the session's end tries again
    (:mod:`.ending`), and so does the next server's
    recovery."""
    try:
        await threads.run(owner, moved.workspace.destroy)
    except (SandboxError, OSError) as exc:
        log.warning(
            "cannot remove the slot a session moved out of", slot=moved.slot, error=str(exc)
        )
        return False
    runlog.remove_log(settings.runlogs_dir, moved.slot)
    records.remove_record(settings.sessions_dir, moved.slot)
    if moved.uid_lease is not None:
        moved.uid_lease.release()  # after its record: see ``uids``
    return True


def _link(old: os.PathLike[str], new: os.PathLike[str]) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.link(old, new)


def _unlink(path: os.PathLike[str]) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
