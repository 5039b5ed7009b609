"""Worker threads for the server's blocking work, shared fairly between owners.

The event loop serves every client, so nothing that can take longer than a millisecond
runs on it: workspace walks (snapshots, quota checks, listings), file reads and writes,
image decoding. That work goes to threads, and the threads are bounded twice:

- server-wide, ``total`` at once (each may hold a decoded image of up to
  ``images.MAX_PIXELS`` pixels, so memory is bounded too);
- per owner, at most half of them: one tenant keeping the server busy (150,000 files in a
  workspace, images to decode in every result) waits for its own threads, and any other
  owner always finds the other half. Calls to one session are serialized already (its
  lock), so an owner needs more than one thread only for several sessions at once.

The owner's share is taken before a server-wide slot, so an owner waiting for its share
holds nothing the others need. A cancelled call waits for its thread to finish (a thread
cannot be stopped), so a slot is never free while its work still runs.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

import anyio
import anyio.to_thread

from mcp_code_sandbox.workspace.seam import Blocking

__all__ = ["WorkerThreads"]

P = ParamSpec("P")
T = TypeVar("T")


#: Threads for the server's blocking work on sessions' files (walks, file I/O, images).
#: The work is short and mostly disk-bound, so a few threads keep the event loop free;
#: eight let four owners' work run at once with each held to half.
THREADS = 8


class WorkerThreads:
    """``await threads.run(owner, fn, *args, **kwargs)``: ``fn`` in a worker thread."""

    def __init__(self, total: int = THREADS) -> None:
        if total < 2:
            raise ValueError(f"at least 2 worker threads are needed, not {total}")
        self.total = total
        #: Threads one owner may use at once.
        self.per_owner = total // 2
        self._all = anyio.CapacityLimiter(total)
        #: Each owner's share while it has work queued or running (then dropped, so
        #: owners that come and go leave nothing behind).
        self._shares: dict[str, anyio.CapacityLimiter] = {}

    async def run(self, owner: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        share = self._shares.get(owner)
        if share is None:
            share = self._shares[owner] = anyio.CapacityLimiter(self.per_owner)
        call = functools.partial(fn, *args, **kwargs)
        try:
            async with share:
                return await anyio.to_thread.run_sync(call, limiter=self._all)
        finally:
            idle = share.borrowed_tokens == 0 and share.statistics().tasks_waiting == 0
            if idle and self._shares.get(owner) is share:
                del self._shares[owner]

    def of(self, owner: str) -> Blocking:
        """``owner``'s share as the workspace seam takes it (``blocking(fn, *args)``)."""

        def run(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Awaitable[T]:
            return self.run(owner, fn, *args, **kwargs)

        return run

    def busy(self, owner: str) -> int:
        """Threads ``owner`` holds now (for tests and metrics)."""
        share = self._shares.get(owner)
        return 0 if share is None else int(share.borrowed_tokens)
