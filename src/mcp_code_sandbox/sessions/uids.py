"""Host uids for sandboxes: one per session, from a range kept for them, leased host-wide.

Why. The kernel counts some limits per host uid, not per process or per container:
inotify instances (``fs.inotify.max_user_instances``, 128 by default), inotify watches,
POSIX message queue bytes, processes (RLIMIT_NPROC, where no user namespace separates
them). Sandboxes sharing a host uid share those counters, so one session holding all 128
inotify instances made ``inotify_init`` fail in every other one. So every session that a
backend can run as its own uid gets one (uid and gid the same number) for its whole life:
its sandbox runs as it (bwrap maps it to 1000 inside; docker runs the container as it)
and its workspace is owned by it. The session manager owns the :class:`UidPool`.

The range. By default ``1879048192`` to ``1879113727`` (``0x70000000`` + 65536). It lies
in a band that systemd documents as unused (``1879048192…2147352575``, see
https://systemd.io/UIDS-GIDS/), above what ``useradd`` hands out as subordinate ranges
(``/etc/subuid``: 100000 up to 600100000) and systemd-nspawn's container ranges, and below
2^31, which some tools take for negative. 65536 uids is far more than the sessions of all
servers on one host. Settings ``uid_range_start`` and ``uid_range_size`` move it. uids and
gids of the range that ``/etc/passwd``, ``/etc/group``, ``/etc/subuid`` or
``/etc/subgid`` name are never handed out (users known only to a directory service are
not looked up: that would put network calls on the server's event loop).

Leases. One file per uid in a host-wide directory (``/run/mcp-code-sandbox/uids`` by
default: on a tmpfs, so empty after a reboot, when no sandbox runs). A server holds uid U
while it holds an exclusive ``flock`` on ``<dir>/U``: two servers never hold one uid at
once, and the kernel drops the lock when its process dies, however it dies: no lock
outlives its server, and nothing has to clean up after a crash. The file names its
holder, the session's record (:mod:`.records`). A crash must not free a uid whose sandbox
lives on (a docker container outlives its server, and the next server on its state dir
re-attaches it): so a uid whose lock nobody holds but whose file names a record that
still exists and still says U is *reserved* for that record, and only
:meth:`UidPool.reclaim` (recovery, for that record) takes it. It is free again once that
record is gone (the session ended, or the next server dropped it); a state dir that no
server ever opens again keeps its few uids.
Allocation takes the lowest free uid, so the directory holds about as many files as the
most sessions that ever ran at once. Paths in lease files are as their server sees them:
servers in containers share leases with the host only through a bind mount of the
directory (``deploy/compose.yaml`` does), and a server that cannot see another's record
path (one in another mount namespace) does not honour its reservation: between that
server's crash and its restart, its surviving containers' uids may be leased again
(their counters are then shared until one of the two sessions ends; the restarted
server then cannot reclaim the uid, and drops that session instead of sharing it).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from mcp_code_sandbox.errors import BackendUnavailable, MaxSessions
from mcp_code_sandbox.sessions import records
from mcp_code_sandbox.settings import Settings

__all__ = [
    "Reserved",
    "UidLease",
    "UidPool",
    "taken_in",
    "uid_pool",
]

#: How long :meth:`UidPool.reclaim` retries a lock that another server holds for a moment
#: (an allocator looking at it: it takes microseconds).
RECLAIM_WAIT_S = 1.0
_MAX_HOLDER = 4096
#: Is ``uid`` reserved for the record at ``holder`` (it exists and says ``uid``)?
Reserved = Callable[[str, int], bool]


@dataclass
class UidLease:
    """One uid, held until :meth:`release` (or this process's end)."""

    uid: int
    _fd: int = field(repr=False)
    _pool: UidPool | None = field(default=None, repr=False)

    def release(self) -> None:
        """Let the uid go; idempotent. The file keeps naming the holder: while the
        holder's record exists the uid stays reserved for it (see the module doc), so
        the caller removes the record first when the session ends."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)  # the lock goes with the last fd of its open file
            if self._pool is not None:
                self._pool._mine.discard(self.uid)


class UidPool:
    """The uids ``start`` .. ``start + size - 1`` minus ``taken``, leased in ``directory``."""

    def __init__(
        self,
        directory: Path,
        start: int,
        size: int,
        *,
        reserved: Reserved,
        taken: Iterable[int] = (),
    ) -> None:
        self.directory = directory
        self.start = start
        self.size = size
        self._reserved = reserved
        self._taken = frozenset(u for u in taken if start <= u < start + size)
        self._ready = False
        #: uids this pool holds now: skipped without a system call.
        self._mine: set[int] = set()

    @property
    def skipped(self) -> int:
        """How many uids of the range are left out (real users' and groups' ids)."""
        return len(self._taken)

    def describe(self) -> str:
        return f"{self.start}-{self.start + self.size - 1}"

    def open(self) -> None:
        """Make the lease directory (0700), or check the one there. Raises
        ``BackendUnavailable`` when it cannot be used: leases anyone else could write
        are no leases."""
        if self._ready:
            return
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = os.lstat(self.directory)
        except OSError as exc:
            raise BackendUnavailable(
                f"cannot make the uid lease directory {self.directory}: {exc.strerror}; "
                "set SANDBOX_UID_LEASE_DIR to a directory of this host that only the "
                "server's user can write"
            ) from None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise BackendUnavailable(
                f"the uid lease directory {self.directory} must be a directory owned by uid "
                f"{os.geteuid()} that no one else may write to"
            )
        self._ready = True

    def lease(self, holder: str) -> UidLease:
        """The lowest free uid, leased for ``holder`` (a session record's path).

        Raises ``MaxSessions`` when every uid of the range is held or reserved."""
        self.open()
        for uid in range(self.start, self.start + self.size):
            if uid in self._taken or uid in self._mine:
                continue
            fd = self._lock(uid)
            if fd is None:
                continue
            previous = _read_holder(fd)
            if previous not in (None, holder) and self._reserved(previous, uid):
                os.close(fd)  # a dead server's session, for its state dir's next server
                continue
            return self._hold(uid, fd, holder)
        raise MaxSessions(
            f"every sandbox uid of this host ({self.describe()}, SANDBOX_UID_RANGE_START "
            "and SANDBOX_UID_RANGE_SIZE) is in use by a session; close a session, or "
            "wait for one to end"
        )

    def reclaim(self, uid: int, holder: str) -> UidLease | None:
        """``uid`` again for ``holder``, whose record says so (a re-attached session), or
        ``None`` when it is outside the range, or held or reserved by someone else.

        Blocking (it may wait up to ``RECLAIM_WAIT_S``): run it in a thread."""
        if not self.start <= uid < self.start + self.size or uid in self._taken:
            return None
        self.open()
        deadline = time.monotonic() + RECLAIM_WAIT_S
        while (fd := self._lock(uid)) is None:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        previous = _read_holder(fd)
        if previous not in (None, holder) and self._reserved(previous, uid):
            os.close(fd)
            return None
        return self._hold(uid, fd, holder)

    def _hold(self, uid: int, fd: int, holder: str) -> UidLease:
        try:
            _write_holder(fd, holder)
        except OSError as exc:
            os.close(fd)
            raise BackendUnavailable(f"cannot write a uid lease: {exc.strerror}") from None
        self._mine.add(uid)
        return UidLease(uid, fd, self)

    def _lock(self, uid: int) -> int | None:
        """An fd of ``uid``'s lease file, locked by us; ``None`` when another holds it."""
        try:
            fd = os.open(
                self.directory / str(uid),
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
            )
        except OSError as exc:
            raise BackendUnavailable(
                f"cannot open the uid lease {self.directory / str(uid)}: {exc.strerror}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise BackendUnavailable(f"cannot lock a uid lease: {exc.strerror}") from None
        return fd


def _read_holder(fd: int) -> str | None:
    data = os.pread(fd, _MAX_HOLDER, 0)
    text = data.decode("utf-8", "replace").strip()
    return text or None


def _write_holder(fd: int, holder: str) -> None:
    # Written, then cut to length: truncating to 0 first costs ~100 times as much.
    data = (holder + "\n").encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def uid_pool(settings: Settings) -> UidPool:
    """The pool of ``settings``' range: a uid is reserved for a session record that
    exists and names it."""
    start, size = settings.uid_range_start, settings.uid_range_size
    return UidPool(
        settings.uid_lease_dir,
        start,
        size,
        reserved=lambda holder, uid: (
            holder.startswith("/") and records.recorded_uid(Path(holder)) == uid
        ),
        taken=taken_in(start, size),
    )


def taken_in(start: int, size: int, etc: Path = Path("/etc")) -> set[int]:
    """The ids of ``start`` .. ``start + size - 1`` that this host's files give to someone:
    uids of ``passwd``, gids of ``group``, the ranges of ``subuid`` and ``subgid``."""
    end = start + size
    taken: set[int] = set()
    for name in ("passwd", "group"):
        for fields in _colon_lines(etc / name):
            if len(fields) > 2 and fields[2].isdigit() and start <= int(fields[2]) < end:
                taken.add(int(fields[2]))
    for name in ("subuid", "subgid"):
        for fields in _colon_lines(etc / name):
            if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
                first, count = int(fields[1]), int(fields[2])
                taken.update(range(max(start, first), min(end, first + count)))
    return taken


def _colon_lines(path: Path) -> list[list[str]]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]
