"""The first kernel, forked from the agent instead of started as a new interpreter.

A sandbox's start is CPU-bound in a one-CPU container: two interpreters start (the agent,
then its kernel), and both import much of the same standard library. Forked, the kernel
begins as a copy of the agent as it is early in ``main`` (the interpreter up, the few
modules the agent imported so far), so one interpreter start and those imports are paid
once instead of twice; the kernel then imports itself and IPython while the agent, in the
parent, imports its supervisor.

Only the first kernel is forked, and only from an agent that runs no thread (the egress
bridge of a sandbox with network is one): ``fork`` copies one thread, and a lock another
thread held would stay held in the child. Every later kernel (a restart after a timeout,
a crash, ``restart_kernel``) is a fresh interpreter (:func:`.kernelproc.spawn_kernel`): the
supervisor by then holds far more than a kernel should inherit.

What the child undoes before it is a kernel, so that it looks like the one
:func:`.kernelproc.spawn_kernel` starts: every fd but 0-2 and its control socket closed
(the host channel above all), fd 0 ``/dev/null`` and fds 1-2 the pipes the supervisor
reads, its own session, the environment it is given and the site directories' ``.pth``
files run again with it (the session's packages), ``sys.argv`` a kernel's, and the
dumpable flag set again (the agent cleared it for itself; an exec would have reset it).
What it keeps: the agent's hash seed and address layout (a fork-server's known trade:
user code learns nothing it could use from outside the agent's memory, which stays
unreadable to it), and ``random``'s state is reseeded by ``random`` itself at fork.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import site
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping

from .children import Child
from .config import AgentConfig
from .hostlink import bare_fd
from .kernelproc import KernelProcess, kernel_argv

__all__ = ["ForkedProcess", "can_fork", "fork_kernel"]

_PR_SET_DUMPABLE = 4
#: How often :meth:`ForkedProcess.wait` looks again (``subprocess.Popen.wait`` polls too).
_POLL_S = 0.005


class ForkedProcess:
    """What :class:`.children.Child` needs of a ``subprocess.Popen``, for a forked child:
    its pid, ``poll``, ``wait`` (raising ``subprocess.TimeoutExpired``) and
    ``returncode`` (``-N`` for a signal, as Popen says it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, status unknown
                self.returncode = 255
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                import subprocess  # not before the fork (see .children)

                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(_POLL_S)
        return code


def can_fork() -> bool:
    """Only a single-threaded agent forks its kernel (see the module docstring)."""
    return threading.active_count() == 1


def fork_kernel(
    workdir: str, config: AgentConfig, plain: bool, env: Mapping[str, str]
) -> KernelProcess:
    """Fork the first kernel (the caller checked :func:`can_fork`) with ``env`` as its
    environment, and return at once, as :func:`.kernelproc.spawn_kernel` does.
    Called by the agent's ``main`` before it imports its supervisor."""
    ours, theirs = socket.socketpair()
    stdout_r, stdout_w = os.pipe()
    stderr_r, stderr_w = os.pipe()
    try:
        pid = os.fork()
    except BaseException:
        for fd in (stdout_r, stdout_w, stderr_r, stderr_w):
            os.close(fd)
        ours.close()
        theirs.close()
        raise
    if pid == 0:  # the child: never returns
        ours.close()  # the parent's end; now, so that its object cannot close a reused fd
        _become_kernel(bare_fd(theirs), stdout_w, stderr_w, workdir, config, plain, env)
    theirs.close()
    os.close(stdout_w)
    os.close(stderr_w)
    return KernelProcess(Child(ForkedProcess(pid), stdout_r, stderr_r), ours)


def _become_kernel(
    control: int,
    stdout: int,
    stderr: int,
    workdir: str,
    config: AgentConfig,
    plain: bool,
    env: Mapping[str, str],
) -> None:
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        _close_fds_but(control)
        os.environ.clear()
        os.environ.update(env)
        _site_again()
        ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
        argv = kernel_argv(control, workdir, config, plain)
        sys.argv = [os.path.join(os.path.dirname(__file__), "kernel.py"), *argv]
        from .kernel import main  # the kernel's imports are the child's, not the agent's

        main(argv)
        code = 0
    except SystemExit as exit_:
        code = 0 if exit_.code is None else exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()  # on fd 2: the supervisor's KernelStartError shows it
    finally:
        # Never back into the agent's ``main``, whose frames are below this one. What the
        # streams hold is flushed; atexit handlers are not run, as in multiprocessing's
        # forked children: the kernel's end is the supervisor's kill in practice, and an
        # interpreter's exit would not run them then either.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)


def _site_again() -> None:
    """The ``site`` module's start, run again with the kernel's environment, as a new
    interpreter runs it: the runtime's ``.pth`` file (``provision.venv.SESSION_SITE_PTH``)
    puts the session's packages on ``sys.path`` from ``MCS_PYTHON_SITE``, which the
    agent had not set yet when its own ``site`` ran. What the agent's run added already
    is not added twice; what a new interpreter adds twice (a site directory that does not
    exist yet), this adds twice too."""
    site.main()


def _close_fds_but(keep: int) -> None:
    """Close every fd above 2 but ``keep``: the host channel, the agent's ends of the
    pipes and sockets. Listed from ``/proc/self/fd``: a range up to RLIMIT_NOFILE may be
    a million closes where ``close_range`` is denied."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != keep:
            with contextlib.suppress(OSError):  # the listing's own fd, already closed
                os.close(fd)
