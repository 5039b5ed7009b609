"""Forking a session: a new session of the same owner with a copy of the source's files
and of its interpreter's variables, while the source runs on untouched.

The steps, in the manager's :meth:`.manager.SessionManager.fork`, which holds the locks:

1. With the source's lock held (its next call waits), its variables are kept as a pause
   keeps them, without pausing it (:func:`keep_state`): a running source's agent saves
   them into its workspace's ``.session/`` and its interpreter goes on as it was; a
   paused source saved them at its pause (it is not resumed). A checkpoint's memory is
   not copied, and neither is a running interpreter's: the fork gets its variables.
2. The fork is made like any new session of the owner (room, limits, a warm sandbox of
   the pool when one is ready), under its own lock, and the source's files are copied
   into its workspace (:func:`copy_files`). The source's lock is let go then.
3. The fork's interpreter loads the copied ``.session/``, inside its sandbox (the host
   never unpickles anything), started for it when no warm sandbox was ready
   (:func:`load_state`).

Semantics:
- The copy is :func:`..workspace.transfer.copy_tree`'s: entries opened ``O_NOFOLLOW``
  relative to their directory, never anything outside the source's workspace; symlinks
  copied as links (never followed); files with hard links, FIFOs, sockets and devices
  left out and named; within the workspace quota by the sizes files claim (a sparse
  file counts whole, as its copy would be), at most :data:`FORK_MAX_ENTRIES` entries.
  A copy refused, or a disk that fills, ends the fork (``quota_exceeded``,
  ``invalid_argument`` or ``sandbox_failed``); the source is as it was.
- The fork is ``FORKING`` (:mod:`.lifecycle`) from before its copy until its variables
  are loaded, and its record says so: a server that dies meanwhile leaves a half copy
  that the next one removes (:func:`.records.plan_recovery`), never a session.
- Once its files are copied the fork exists: variables that cannot be saved or loaded
  make it a fork of files only, and the result's ``notice`` says why (as a resume's).
- The source keeps the saved state in its ``.session/`` (as after a resume).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import shutil
from dataclasses import dataclass
from typing import Literal

from mcp_code_sandbox.errors import InvalidArgument, QuotaExceeded, SandboxFailed
from mcp_code_sandbox.sanitize import escape_name
from mcp_code_sandbox.sessions import runlog
from mcp_code_sandbox.sessions.sandboxes import STATE_TIMEOUT_S, Sandboxes
from mcp_code_sandbox.sessions.saved import LoadReport
from mcp_code_sandbox.sessions.session import Session
from mcp_code_sandbox.sessions.workers import WorkerThreads
from mcp_code_sandbox.settings import Settings
from mcp_code_sandbox.workspace.transfer import Copied, CopyRefused, CopyTooLarge, copy_tree

__all__ = [
    "FORK_MAX_ENTRIES",
    "Forked",
    "Kept",
    "copy_files",
    "forked",
    "keep_state",
    "load_state",
    "taken",
]

#: The most entries a fork copies: more than a workspace filesystem of the default quota
#: holds inodes (ext4 at 1 GiB: 65,536), so only a tree of empty files meant to make the
#: copy slow reaches it.
FORK_MAX_ENTRIES = 100_000
#: Names a notice lists at most (the rest are counted).
_NAMED = 20
#: Characters of one left-out path a notice shows.
_PATH_CHARS = 200


@dataclass(frozen=True)
class Kept:
    """What of the source's interpreter the fork can load. ``load``: its ``.session/``
    holds the variables (saved now, or at its pause); ``dropped``: ``(name, type, why)``
    of those the save left out; ``why``: why there is nothing to load (``None`` with
    ``load`` false: nothing had run)."""

    load: bool
    dropped: tuple[tuple[str, str, str], ...] = ()
    why: str | None = None


@dataclass(frozen=True)
class Forked:
    """A fork made (``fork_session``'s result). ``state``: what of the interpreter it
    got (``files``: none; ``notice`` says why when something was lost)."""

    session_id: str
    source_id: str
    state: Literal["variables", "files"]
    files: int
    bytes: int
    #: Names restored in the fork's interpreter (modules by their bound name).
    variables: tuple[str, ...]
    notice: str | None


def taken(session_id: str) -> InvalidArgument:
    return InvalidArgument(
        f"you already have a session {session_id!r}; give new_session_id a name not in "
        "use, or omit it to get a new one"
    )


async def keep_state(sandboxes: Sandboxes, settings: Settings, source: Session) -> Kept:
    """Keep ``source``'s variables for its fork, leaving it running (or paused) as it is.
    Lock held; never raises for the sandbox's failure (``why`` says what it was)."""
    paused = source.paused
    if paused is not None:
        if paused.load:
            return Kept(True, paused.dropped)
        if paused.checkpoint is not None:
            return Kept(
                False,
                why="it is paused with its whole memory, which a fork does not copy (run "
                "code in it, then fork it, to copy its variables)",
            )
        return Kept(False, why=paused.why)
    sandbox, agent = source.sandbox, source.agent
    if sandbox is None or agent is None:
        return Kept(False)  # nothing runs in it
    if not sandbox.is_alive() or agent.broken:
        return Kept(False, why="its sandbox had stopped")
    try:
        report = await agent.save_state(settings.pause_max_bytes, STATE_TIMEOUT_S)
    except SandboxFailed as exc:
        return Kept(False, why=f"its variables could not be saved ({exc.message})")
    return Kept(True, tuple((v.name, v.type, v.why or "") for v in report.dropped))


async def copy_files(
    threads: WorkerThreads, settings: Settings, source: Session, fork: Session
) -> Copied:
    """Copy ``source``'s workspace into ``fork``'s new, empty one (both locked), given to
    the fork's uid. Raises ``QuotaExceeded``, ``InvalidArgument`` (a tree no copy takes)
    or ``SandboxFailed`` (the disk)."""
    copy = functools.partial(
        copy_tree,
        source.workspace.root,
        fork.workspace.root,
        owner=fork.workspace.owner,
        max_bytes=settings.workspace_quota_bytes,
        max_entries=FORK_MAX_ENTRIES,
        hard_links="skip",
    )
    try:
        copied = await threads.run(source.owner, copy)
    except CopyTooLarge:
        raise QuotaExceeded(
            f"the files of session {source.id} do not fit in a new session's quota of "
            f"{settings.workspace_quota_bytes} bytes (a copy counts each file at the size it "
            "claims); delete some of them, then fork it again"
        ) from None
    except CopyRefused as exc:
        raise InvalidArgument(
            f"the files of session {source.id} cannot be copied: {exc}; remove them, then "
            "fork it again"
        ) from None
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise QuotaExceeded(
                f"the files of session {source.id} do not fit in a new session's quota; "
                "delete some of them, then fork it again"
            ) from None
        raise SandboxFailed(
            f"the files of session {source.id} could not be copied: {exc}"
        ) from None
    # The record of runs, the host's own file: the fork's notebook starts with its history.
    old, new = (runlog.log_path(settings.runlogs_dir, s.slot) for s in (source, fork))
    with contextlib.suppress(OSError):  # only its notebook's history is lost
        await threads.run(source.owner, shutil.copyfile, old, new)
    fork.runs = source.runs  # numbering (and ``.outputs/<run>.txt``) goes on
    return copied


async def load_state(
    sandboxes: Sandboxes, fork: Session, kept: Kept
) -> tuple[LoadReport | None, str | None]:
    """Load the copied variables into ``fork``'s interpreter, started now if it has none:
    ``(report, None)``, or ``(None, why)`` when they could not be loaded. Lock held."""
    if not kept.load:
        return None, kept.why
    try:
        agent = await sandboxes.agent(fork)
        report = await agent.load_state(STATE_TIMEOUT_S)
    except SandboxFailed as exc:
        return None, f"its variables could not be loaded ({exc.message})"
    if not report.found:
        return None, "no complete saved state was found"
    return report, None


def forked(
    source: Session,
    fork: Session,
    kept: Kept,
    copied: Copied,
    report: LoadReport | None,
    why: str | None,
    reborn: str | None = None,
) -> Forked:
    """The result of a fork, with a notice naming what was not copied (``None``:
    nothing that was there); ``reborn``: what the fork's name was before (as a new
    session's notice says it)."""
    said: list[str] = [] if reborn is None else [f"{reborn}."]
    head = f"session {fork.id} is a fork of {source.id}"
    if report is not None:
        lost = [f"{name} ({kind}: {reason})" for name, kind, reason in kept.dropped]
        lost += [f"{v.name} ({v.type}: {v.why or 'could not be loaded'})" for v in report.failed]
        said.append(
            f"{head} with its files and variables"
            + (f"; variables not copied: {_named(lost)}" if lost else "")
            + ". Its memory is not copied: open files, threads and running processes are "
            "not in the fork"
        )
    elif why is not None:
        said.append(f"{head} with its files only: {why}. Variables and imports are not in the fork")
    if copied.skipped:
        shown = [escape_name(p[:_PATH_CHARS]) for p in copied.left_out]
        more = copied.skipped - len(shown)
        said.append(
            f"Not copied: {copied.skipped} files with more than one hard link, FIFOs, "
            "sockets or devices: " + _named(shown, more)
        )
    return Forked(
        session_id=fork.id,
        source_id=source.id,
        state="variables" if report is not None else "files",
        files=copied.files,
        bytes=copied.bytes,
        variables=() if report is None else report.restored + report.modules,
        notice=" ".join(said) or None,
    )


def _named(names: list[str], more: int = 0) -> str:
    more += max(0, len(names) - _NAMED)
    return ", ".join(names[:_NAMED]) + (f" and {more} more" if more else "")
