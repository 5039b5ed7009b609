"""How the workspace quota binds the sandbox here, and the watch kept over runs without it.

Two modes (``Settings.workspace_quota_mode``; :func:`choose` decides ``auto`` at start):

- ``filesystem``: every workspace is a filesystem of its own, as large as the quota
  (:mod:`.workspace.volume`). The kernel refuses writes past it (``ENOSPC``), for every
  backend, whatever the code does. Needs a root server that can mount loop devices, and
  a Docker engine that sees the server's mounts (same host, same paths).
- ``checked``: the workspace is a plain directory on the host's filesystem. A single file
  is capped by ``RLIMIT_FSIZE`` (the quota); the total is watched: :func:`guarded` walks
  the workspace in a worker thread while a run goes on and stops the run as soon as the
  workspace holds more than its quota (or, when a run starts over its quota, more than
  it held then: a run may always delete). A run can overshoot by what it writes between
  two walks. Uploads are refused while the workspace is over its quota.

After every run, in both modes, :mod:`run.execute` checks the workspace and says how much to
delete when it is over its quota.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from mcp_code_sandbox.errors import BackendUnavailable, SandboxError
from mcp_code_sandbox.workspace import volume

if TYPE_CHECKING:
    from mcp_code_sandbox.backends.base import Backend
    from mcp_code_sandbox.settings import Settings
    from mcp_code_sandbox.workspace import Workspace

__all__ = ["QuotaMode", "choose", "guarded", "over_quota_message"]

log = structlog.get_logger("mcp_code_sandbox.sessions.manager")

#: Shortest pause between two walks of a running session's workspace, and how many times
#: the last walk's duration the pause is at least (a walk of a huge tree costs a worker
#: thread at most a fifth of its time).
WATCH_MIN_S = 0.2
WATCH_FACTOR = 4.0
_T = TypeVar("_T")


@dataclass(frozen=True)
class QuotaMode:
    """How this server enforces the workspace quota: ``filesystem`` true, or checked
    (``why`` then says why not a filesystem)."""

    filesystem: bool
    why: str | None = None

    def describe(self) -> str:
        """One line for ``doctor`` and the start-up log."""
        if self.filesystem:
            return "filesystem (a loop-mounted ext4 image per session, the quota's size)"
        return (
            f"checked during and after runs ({self.why}): a run can overshoot by what it "
            f"writes in about {WATCH_MIN_S:g} s (longer in workspaces of many files; a "
            "write is capped at the quota by RLIMIT_FSIZE, fallocate with KEEP_SIZE is not)"
        )


def choose(settings: Settings, backend: Backend) -> QuotaMode:
    """The mode for ``settings`` and ``backend`` on this host. Blocks (a real mount is
    tried): call it in a worker thread. Raises ``BackendUnavailable`` when
    ``filesystem`` is asked for and cannot be had."""
    if settings.workspace_quota_mode == "checked":
        return QuotaMode(False, "SANDBOX_WORKSPACE_QUOTA_MODE=checked")
    why = backend.workspace_mounts_unseen or volume.probe(settings.run_dir)
    if why is None:
        return QuotaMode(True)
    if settings.workspace_quota_mode == "filesystem":
        raise BackendUnavailable(
            f"SANDBOX_WORKSPACE_QUOTA_MODE=filesystem, but {why}; run the server as root "
            "on the sandboxes' host, or set SANDBOX_WORKSPACE_QUOTA_MODE=checked"
        )
    return QuotaMode(False, why)


def over_quota_message(used: int, quota: int) -> str:
    """What a model can act on: how much is in use and how much to delete."""
    return (
        f"the workspace holds {used} bytes, more than its quota of {quota}: delete at least "
        f"{used - quota} bytes of files in /mnt/data (or packages in /mnt/data/.packages) "
        "with run_code; uploads are refused until then"
    )


async def guarded(
    workspace: Workspace, start: Callable[[], Awaitable[_T]]
) -> tuple[_T | None, str | None]:
    """Await ``start()`` (a run) while watching ``workspace``'s size; stop the run once
    the workspace grows past its limit: the quota, or what it held when the run started
    if that was more (so a run may always delete).

    Returns the run's result and ``None``, or ``None`` and why the run was stopped.

    The run stays in the caller's task and is stopped the way a client's cancellation
    stops it (the agent interrupts the code, then the cancellation is taken back), so
    the agent is left ready for the next call exactly as after a cancelled call. A
    cancellation of the caller's own is never swallowed."""
    limit = max(workspace.quota_bytes, await asyncio.to_thread(_usage, workspace))
    caller = asyncio.current_task()
    if caller is None:
        raise RuntimeError("guarded() runs in a task: it stops the run by cancelling it")
    watch = _Watch(workspace, limit, caller)
    watcher = asyncio.create_task(watch.run())
    try:
        result = await start()
        watch.finished = True  # same step as the return: the watch cancels no more
        return result, None
    except asyncio.CancelledError:
        if watch.stopped is not None and caller.cancelling() == 1:
            caller.uncancel()  # ours alone: the run is over, the call goes on
            return None, watch.stopped
        raise
    finally:
        watch.finished = True
        watcher.cancel()


class _Watch:
    def __init__(self, workspace: Workspace, limit: int, caller: asyncio.Task[Any]) -> None:
        self.workspace = workspace
        self.limit = limit
        self.caller = caller
        #: Set once the run returned or raised: from then on the caller is not cancelled.
        self.finished = False
        #: Why the run was stopped, once it was.
        self.stopped: str | None = None

    async def run(self) -> None:
        while not self.finished:
            began = time.monotonic()
            used = await asyncio.to_thread(_usage, self.workspace)
            if used > self.limit and not self.finished:
                log.info("run stopped over the workspace quota", used=used, limit=self.limit)
                self.stopped = (
                    "the run was stopped: it wrote past the workspace quota of "
                    f"{self.workspace.quota_bytes} bytes ({used} in use)"
                )
                self.caller.cancel()
                return
            await asyncio.sleep(max(WATCH_MIN_S, WATCH_FACTOR * (time.monotonic() - began)))


def _usage(workspace: Workspace) -> int:
    try:
        return workspace.usage_bytes()
    except SandboxError:  # the workspace went away (the session closed): nothing to watch
        return 0
