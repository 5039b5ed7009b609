"""Who holds a session, and which server process may take over what another left.

Rule. A session is held by the server process that created it (or took it over), and
its record names that process (``SessionRecord.instance``, whose pid file says whether it
still lives). Only the holder pauses, moves, ends or deletes it. When the holder is gone,
what happens to the session depends on the holder's :class:`Role`, which its record keeps
(``SessionRecord.handover``):

- ``SERVICE``: the one service of its state directory (an HTTP server, or any server told
  to keep its sessions at shutdown). Its sessions are kept for its successor: the next
  ``SERVICE`` on the state directory re-attaches or resumes them. No other process
  touches them, dead holder or not. At most one ``SERVICE`` runs per state directory: it
  holds :class:`ServiceLock` for its whole life, and a second one refuses to start.
- ``PRIVATE``: a stdio server, ``exec``, a test harness. It never takes over anything it
  did not create; what it leaves behind when it is killed is garbage that its janitor
  (:mod:`.janitor`), or any later start on the state directory, removes.

Is a holder alive? Its pid file (``run_dir/<instance>.pid``, :class:`PidFile`) says: the
holder keeps a ``flock`` on it for its whole life, which another server on the same
state directory sees whatever pid namespace it runs in (two appliance containers on one
volume are both pid 1); a file nobody locks (a dead holder, or one from before the lock)
is judged by the mark it holds (:func:`mcp_code_sandbox.host.process_alive`).

Records written before this rule have no ``handover`` field: they count as kept for a
successor, the choice that loses nothing.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import os
from pathlib import Path

import structlog

from mcp_code_sandbox.host import process_alive, process_mark, read_mark
from mcp_code_sandbox.settings import ConfigError

__all__ = [
    "SERVICE_LOCK",
    "PidFile",
    "Role",
    "ServiceLock",
    "note_service",
    "pid_file_alive",
    "refused",
    "replicas_serve",
    "service_pid",
]

#: The lock file under ``run_dir`` that the state directory's one service holds.
SERVICE_LOCK = "service.lock"


class Role(enum.Enum):
    #: The state directory's one service: it takes over what a dead service left, and
    #: what it holds is kept for its successor.
    SERVICE = "service"
    #: A server of its own (stdio, ``exec``, tests): it holds only what it created.
    PRIVATE = "private"


class ServiceLock:
    """The exclusive ``flock`` on ``run_dir/service.lock`` that the state directory's one
    service holds while it lives; the kernel drops it when the process dies, however it
    dies. The file names the holder (:func:`mcp_code_sandbox.host.process_mark`)."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @classmethod
    def claim(cls, run_dir: Path, *, replica: bool = False) -> ServiceLock:
        """Take the lock, or raise ``ConfigError`` naming the live service that has it.

        ``replica``: one of several services that share the state directory's sessions
        (:mod:`.replicas`): they hold the lock shared, so replicas start beside each other
        while a service that is not one (exclusive) refuses to start beside any, and the
        other way round."""
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / SERVICE_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if replica else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise
            raise ConfigError([_refusal(run_dir, replica=replica)]) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, process_mark().encode(), 0)
        return cls(fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the lock; the file stays for the next one
            self._fd = None


class PidFile:
    """A server's ``run_dir/<instance>.pid``: its mark, under an exclusive ``flock`` held
    for the server's life (the kernel drops it when the process dies, however it dies)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def claim(cls, path: Path) -> PidFile:
        """Write and lock ``path``. The file is locked before it has its name: no other
        server ever sees it unlocked and empty, which would read as a dead server's."""
        draft = path.with_name(f".{path.name}.new")
        fd = os.open(draft, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, process_mark().encode())
            os.replace(draft, path)
        except BaseException:
            os.close(fd)
            draft.unlink(missing_ok=True)
            raise
        return cls(path, fd)

    def release(self, *, keep: bool = False) -> None:
        """Remove the file (``keep``: leave it, to say that a server died whose sessions
        others take over: a replica's), then let go of the lock (idempotent)."""
        if self._fd is not None:
            if not keep:
                self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None


def pid_file_alive(path: Path) -> bool:
    """Does the pid file ``path`` name a live server? False when there is no file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return True  # locked: its server lives, in whatever pid namespace
            raise
        mark = read_mark(os.pread(fd, 64, 0).decode("ascii", "replace"))
    finally:
        os.close(fd)
    return mark is not None and process_alive(*mark)


def note_service(run_dir: Path, state_dir: Path) -> None:
    """Log that a service (or replicas) runs beside this private server, if so (blocking)."""
    pid = service_pid(run_dir)
    if pid is not None or replicas_serve(run_dir):
        structlog.get_logger("mcp_code_sandbox.sessions.manager").info(
            "a service runs on this state directory: this server's sessions are its "
            "own, and it leaves the service's alone",
            service_pid=pid if pid is not None else "replicas",
            state_dir=str(state_dir),
        )


def replicas_serve(run_dir: Path) -> bool:
    """Do replicas (``SANDBOX_REPLICA``) serve this state directory now? They hold the
    service lock shared, which :func:`service_pid`'s own shared check does not see."""
    try:
        fd = os.open(run_dir / SERVICE_LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return service_pid(run_dir) is None  # held, and not by a lone service
    else:
        return False
    finally:
        os.close(fd)


def refusal(state_dir: Path, pid: int | None) -> str:
    """The one line a second service on ``state_dir`` stops with."""
    who = f"pid {pid}" if pid else "a process in another pid namespace"
    return (
        f"another mcp-code-sandbox service ({who}) already serves the state directory "
        f"{state_dir}: give this server a state directory of its own with "
        "SANDBOX_STATE_DIR (--state-dir), or stop the other one first"
    )


def refused(run_dir: Path, *, replica: bool = False) -> str | None:
    """The line a new service (``replica`` or not) would stop with on this state directory
    now, or ``None`` when it may start: asked of the lock itself, and let go at once."""
    try:
        fd = os.open(run_dir / SERVICE_LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if replica else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError:
        return _refusal(run_dir, replica=replica)
    finally:
        os.close(fd)
    return None


def _refusal(run_dir: Path, *, replica: bool) -> str:
    pid = service_pid(run_dir)
    if replica or pid is not None:
        return refusal(run_dir.parent, pid)
    state_dir = run_dir.parent  # a shared holder: replicas, which ``service_pid`` skips
    return (
        f"replicas (SANDBOX_REPLICA=true) serve the state directory {state_dir}: start this "
        "server with --replica too, give it a state directory of its own with "
        "SANDBOX_STATE_DIR (--state-dir), or stop them first"
    )


def service_pid(run_dir: Path) -> int | None:
    """The pid of the live service on this state directory; ``None`` when none runs, 0
    when one runs whose pid means nothing here (a server in a container sharing the state
    directory through a bind mount: another pid namespace).

    Asks the lock itself: a lock file left by a dead service is not held, however its
    mark reads."""
    try:
        fd = os.open(run_dir / SERVICE_LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            pass  # held: a service lives
        else:
            return None
        mark = read_mark(os.pread(fd, 64, 0).decode("ascii", "replace"))
    finally:
        os.close(fd)
    return mark[0] if mark is not None and process_alive(*mark) else 0
