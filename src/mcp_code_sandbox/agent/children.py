"""Processes the supervisor starts (the kernel, per-call programs) and how they end.

Every child runs in its own session and process group, with stdin from /dev/null and
fd 1 / fd 2 on pipes the supervisor reads without blocking. A child's exit is noticed
by SIGCHLD (the supervisor's wake-up socket), not by a pidfd: the sandbox's seccomp filter
denies ``pidfd_open``, since a pidfd is what ``pidfd_getfd`` steals fds with.

``subprocess`` is imported where it is used, not with this module: the agent imports this
before it forks its first kernel, which never needs ``subprocess`` (nor ``locale``, which
it brings), and a module imported before the fork is on every sandbox's start.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import signal
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import subprocess

__all__ = [
    "CHUNK_BYTES",
    "Child",
    "OutputPipe",
    "Process",
    "describe_exit",
    "kill_strays",
    "reap_orphans",
    "spawn",
]

#: One read from a pipe, and so at most one ``stream`` message's worth of bytes.
CHUNK_BYTES = 64 * 1024
#: Bytes read from one pipe by a final drain; a background writer cannot stall ``done``.
DRAIN_LIMIT_BYTES = 4 * 1024 * 1024


class OutputPipe:
    """The read end of a child's stdout or stderr, decoded as UTF-8 incrementally."""

    def __init__(self, fd: int, name: str) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self.name = name
        self.closed = False
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def read(self) -> str | None:
        """One chunk as text ("" when nothing is waiting); ``None`` at EOF."""
        try:
            data = os.read(self.fd, CHUNK_BYTES)
        except BlockingIOError:
            return ""
        if not data:
            return None
        return self._decoder.decode(data)

    def drain(self, sink: Callable[[str], None], final: bool = True) -> None:
        """Everything already written, up to ``DRAIN_LIMIT_BYTES``; when ``final`` (the
        run ends) also the decoder's held-back bytes of an unfinished character."""
        total = 0
        while not self.closed and total < DRAIN_LIMIT_BYTES:
            text = self.read()
            if not text:
                break
            total += len(text)
            sink(text)
        tail = self._decoder.decode(b"", final=True) if final else ""
        if tail:
            sink(tail)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)


class Process(Protocol):
    """What a child needs of its process: ``subprocess.Popen``, or a forked kernel's
    (:class:`.forked.ForkedProcess`)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class Child:
    def __init__(self, proc: Process, stdout: int, stderr: int) -> None:
        """``stdout``, ``stderr``: the read ends of the child's pipes, now the child's to
        close (:meth:`of_popen` for a ``Popen``)."""
        self.proc = proc
        self.pid = proc.pid
        self.stdout = OutputPipe(stdout, "stdout")
        self.stderr = OutputPipe(stderr, "stderr")

    @classmethod
    def of_popen(cls, proc: subprocess.Popen[bytes]) -> Child:
        assert proc.stdout is not None and proc.stderr is not None
        # Popen's file objects would close the fds when collected: take the fds over.
        child = cls(proc, os.dup(proc.stdout.fileno()), os.dup(proc.stderr.fileno()))
        proc.stdout.close()
        proc.stderr.close()
        return child

    @property
    def pipes(self) -> tuple[OutputPipe, OutputPipe]:
        return (self.stdout, self.stderr)

    def returncode(self) -> int | None:
        return self.proc.poll()

    def signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    def kill_and_reap(self) -> int:
        import subprocess  # see the module docstring

        self.signal_group(signal.SIGKILL)
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # unkillable (D state): do not hang the agent
            return -signal.SIGKILL

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.close()


def spawn(
    argv: list[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    pass_fds: Iterable[int] = (),
    preexec_fn: Callable[[], None] | None = None,
) -> Child:
    import subprocess  # see the module docstring

    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=tuple(pass_fds),
        start_new_session=True,
        preexec_fn=preexec_fn,  # safe: the supervisor has no threads
    )
    return Child.of_popen(proc)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} ({-returncode})"
    return f"exited with code {returncode}"


def kill_strays(spare_sessions: Iterable[int] = ()) -> None:
    """SIGKILL every process in /proc but this one, pid 1 and the ``spare_sessions``.

    Only meaningful inside the sandbox's own pid namespace, where every such process is
    the user's (including children that called setsid to escape their process group).
    """
    me, spare = os.getpid(), set(spare_sessions)
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (me, 1):
            continue
        pid = int(entry)
        if spare and _session_of(pid) in spare:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def reap_orphans(keep: Iterable[int]) -> None:
    """As pid 1 (e.g. a container without an init), collect exited orphans by pid.

    Never ``waitpid(-1)``: that would steal the exit status of the kernel or a program,
    which ``keep`` lists and ``Popen`` reaps itself.
    """
    kept = set(keep)
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in kept:
            continue
        fields = _stat_fields(int(entry))
        if fields and fields[0] == b"Z" and fields[1] == b"1":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(entry), os.WNOHANG)


def _session_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[3]) if len(fields) > 3 else None


def _stat_fields(pid: int) -> list[bytes]:
    """``state ppid pgrp session ...`` of ``/proc/<pid>/stat``; empty when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return []
    # "pid (comm) state ...": comm may hold spaces and parentheses.
    return stat[stat.rfind(b")") + 2 :].split()
