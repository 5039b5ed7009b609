"""Formatted workspace images kept ready, so that a new workspace skips ``mkfs.ext4``.

Why: formatting a workspace's image is most of what its filesystem costs
(:mod:`.volume`), and it sits on every cold session's path (a pool miss, a burst past the
pool, any backend). A few images are formatted ahead, in one background thread, and
:meth:`SpareImages.take` hands one out by renaming it to the workspace's image name: the
workspace then only mounts it.

Layout and life cycle. Spares live in ``<volumes_dir>/.spares/<instance>/`` (a directory
of their own: they belong to no slot, so nothing that looks for a slot's image sees them;
one per server process, as several may share a state directory). They
are sparse files formatted exactly as :meth:`.volume.Volume.create` formats one, never
mounted until taken, and all of one size (the server's quota). ``mkfs`` runs at a lower
CPU priority (``nice``), and while a spare is left it waits :data:`REFILL_AFTER_S` after
a take: the session that took one is starting then, and a format beside it (a process
started from the server, taking CPU on the other core) made its mount and its engine's
create slower. With none left, a refill starts at once.
:meth:`SpareImages.close` (the session manager's shutdown) stops the thread and deletes
them; a server killed with spares leaves files that the next start's recovery deletes
(:func:`sweep`), as it deletes other stray images.

Semantics: ``keep`` 0 makes nothing and :meth:`take` always says ``False`` (the caller
formats its own). A spare that is gone when taken (deleted by another process) is
skipped; a failed refill is logged and retried after :data:`RETRY_S`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

import structlog

from mcp_code_sandbox.errors import InternalError
from mcp_code_sandbox.workspace.fs import remove_tree
from mcp_code_sandbox.workspace.volume import IMAGE_SUFFIX, format_image

__all__ = ["REFILL_AFTER_S", "RETRY_S", "SPARES_DIR", "SpareImages", "sweep"]

log = structlog.get_logger(__name__)

#: The spares' directory, under the volumes directory.
SPARES_DIR = ".spares"
#: After a failed format, the thread waits this long before it tries again.
RETRY_S = 30.0
#: While a spare is left, a refill waits this long after a take (see above): about a cold
#: sandbox's start.
REFILL_AFTER_S = 0.25
#: How long :meth:`SpareImages.close` waits for a format under way (one takes far less).
_JOIN_S = 10.0


#: Spares kept by default: one for the next cold session and one for a second right after
#: it (a burst past the pool), while the first's replacement is formatted; more would
#: only hold disk, since one thread refills them one at a time.
KEEP = 2


class SpareImages:
    """Up to ``keep`` formatted images of ``size_bytes`` in ``directory``, refilled in a
    daemon thread. Owned by the session manager: made and started in its ``start``,
    closed in its ``aclose``; :meth:`take` is called from worker threads (a workspace's
    ``create``)."""

    def __init__(self, directory: Path, size_bytes: int, keep: int | None = None) -> None:
        self.directory = directory
        self.size_bytes = size_bytes
        #: ``None``: :data:`KEEP`, read when made (tests change it).
        self.keep = KEEP if keep is None else keep
        self._ready: deque[Path] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the refill thread (nothing when ``keep`` is 0). Blocks for a ``mkdir``."""
        if self.keep <= 0:
            return
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._refill, name="spare-images", daemon=True)
        self._thread.start()

    def ready(self) -> int:
        """Spares formatted and not yet taken."""
        with self._cond:
            return len(self._ready)

    def take(self, image: Path, size_bytes: int) -> bool:
        """Move a spare to ``image`` (in the same filesystem); ``False`` when there is none
        of ``size_bytes`` ready, and the caller formats its own."""
        if size_bytes != self.size_bytes:
            return False
        while True:
            with self._cond:
                if not self._ready:
                    return False
                spare = self._ready.popleft()
                self._cond.notify()  # one to make
            try:
                os.rename(spare, image)
            except FileNotFoundError:
                continue  # swept by another process: try the next one
            return True

    def close(self) -> None:
        """Stop the thread (waiting for a format under way, bounded) and delete every
        spare and the directory. Idempotent; blocks: call it in a worker thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(_JOIN_S)
        with self._cond:
            self._ready.clear()
        with contextlib.suppress(FileNotFoundError):  # its parent is gone: so is it
            remove_tree(self.directory)
        with contextlib.suppress(OSError):  # the last server's leaves none behind
            self.directory.parent.rmdir()

    def _refill(self) -> None:
        while True:
            with self._cond:
                while not self._closed and len(self._ready) >= self.keep:
                    self._cond.wait()
                # One left: its taker is starting now. None left: a refill is due now.
                self._cond.wait_for(lambda: self._closed or not self._ready, REFILL_AFTER_S)
                if self._closed:
                    return
            spare = self.directory / f"{os.urandom(8).hex()}{IMAGE_SUFFIX}"
            try:
                format_image(spare, self.size_bytes, background=True)
            except (InternalError, OSError) as exc:
                spare.unlink(missing_ok=True)
                log.warning("could not format a spare workspace image", error=str(exc))
                with self._cond:
                    self._cond.wait_for(lambda: self._closed, RETRY_S)
                continue
            with self._cond:
                if self._closed:
                    spare.unlink(missing_ok=True)
                    return
                self._ready.append(spare)


def sweep(volumes_dir: Path, alive: Callable[[str], bool]) -> None:
    """Delete what is in the spares directory under ``volumes_dir`` but the directories of
    live servers (``alive(instance)``); called by recovery (a killed server's spares)."""
    directory = volumes_dir / SPARES_DIR
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if not (entry.is_dir() and not entry.is_symlink() and alive(entry.name)):
            remove_tree(entry)
    with contextlib.suppress(OSError):
        directory.rmdir()
