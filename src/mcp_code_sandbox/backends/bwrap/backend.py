"""The bubblewrap backend: one bwrap process per sandbox, no daemon.

How a sandbox starts (the launcher is one ``/bin/bash`` process that ``exec``s into bwrap,
so the pid the server holds is bwrap's and bwrap's parent is the server, which
``--die-with-parent`` relies on):

1. ``bash`` moves the agent channel to fd 3 and writes its own pid into the sandbox's
   ``cgroup.procs`` files *before* bwrap exists, so bwrap and everything below it are born
   inside the cgroup: no window where a process runs unlimited, no extra handshake (the
   ``--info-fd``/``--block-fd`` dance would place bwrap only after it forked).
2. As root: the launcher runs under ``unshare --mount --propagation private`` and
   bind-mounts the workspace, the venv, the node directory (when ``setup`` built one), the
   agent package and the base interpreter onto a
   private tmpfs at ``/tmp``, then drops to the session's own host uid (``spec.uid``,
   leased from :mod:`sessions.uids`) with ``setpriv``. The unprivileged bwrap could not reach
   them at their real paths (``/root`` is 0700), and ``--bind-fd`` fails once the uid
   changed. The mounts die with that namespace. Not root, every sandbox runs as the
   server's uid: an unprivileged user namespace can map no other, so per-user limits
   (inotify instances) are then shared by all sandboxes (``doctor`` says so).
3. bwrap builds the sandbox (:func:`.argv.build_bwrap_argv`; both command lines are built
   purely in :mod:`.argv`) and starts the agent, which says ``ready`` on fd 3 (a
   socketpair; bwrap's stdout is /dev/null because in stdio mode the server's stdout is
   the MCP protocol; its stderr is logged, bounded).

Environment values go to bwrap as ``--setenv`` arguments read from a memfd
(``--args FD``), never onto a command line (any host user can read those in ``ps``) nor
into the launcher's own environment (the host-side processes run as root and must not
see ``LD_PRELOAD`` & co. from a client).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import logging
import os
import shutil
import signal
import socket
import subprocess
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mcp_code_sandbox.agent.protocol import ProtocolError
from mcp_code_sandbox.backends import streams
from mcp_code_sandbox.backends.base import (
    Backend,
    Channel,
    Description,
    Enforcement,
    Leftover,
    Sandbox,
    SandboxSpec,
    Usage,
    stop_step,
    wait_ready,
)
from mcp_code_sandbox.backends.bwrap import cgroups
from mcp_code_sandbox.backends.bwrap.argv import (
    GROUP,
    PASSWD,
    STAGE,
    HostLayout,
    Mounts,
    build_bwrap_argv,
    build_launcher_argv,
    env_args,
)
from mcp_code_sandbox.backends.bwrap.runtime import runtime_status
from mcp_code_sandbox.backends.bwrap.userns import userns_problem
from mcp_code_sandbox.backends.seccomp import build_seccomp_bpf
from mcp_code_sandbox.errors import BackendUnavailable, SandboxFailed
from mcp_code_sandbox.settings import Settings

__all__ = ["BWRAP_MISSING", "BwrapBackend", "BwrapSandbox", "bwrap_missing"]

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 30.0
#: Said (once at start, then by every call) when the one system program this backend
#: cannot do without is missing: what it is and the command that installs it.
BWRAP_MISSING = (
    "bubblewrap (bwrap) is not installed, and every sandbox needs it. Install it, then "
    "restart the server: `sudo apt install bubblewrap` (Debian, Ubuntu) or "
    "`sudo dnf install bubblewrap` (Fedora)"
)
_STDERR_TAIL = 20
_STDERR_LOG_LINES = 200
#: The longest stderr line logged (longer ones are cut, and the rest of them dropped).
_STDERR_LINE_BYTES = 500


def bwrap_missing() -> str | None:
    """:data:`BWRAP_MISSING` when no ``bwrap`` is on PATH; ``None`` when there is one.
    Asked by the first-run build (``server.first_run``) before a call waits for it."""
    return BWRAP_MISSING if shutil.which("bwrap") is None else None


def _high_fd(fd: int) -> int:
    """Move ``fd`` above 9 (the launcher's fd 3 and the shell's own use), inheritable."""
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    os.set_inheritable(new, True)
    return new


def _data_fd(data: bytes) -> int:
    """A file holding ``data``, read by bwrap from its start: a memfd, so no size bound
    (a pipe would block a write past 64 KiB, and pass-through values may be long)."""
    fd = os.memfd_create("mcs-data", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return _high_fd(fd)


class BwrapSandbox(Sandbox):
    def __init__(
        self,
        spec: SandboxSpec,
        channel: Channel,
        proc: asyncio.subprocess.Process,
        cgroup: cgroups.CgroupHandle | None,
        stderr: deque[bytes],
        stderr_task: asyncio.Task[None],
    ) -> None:
        super().__init__(spec, channel, backend_id=str(proc.pid))
        self.proc = proc
        self.cgroup = cgroup
        self.stderr_tail = stderr
        self._stderr_task = stderr_task

    def is_alive(self) -> bool:
        return self.proc.returncode is None


async def _log_stderr(stream: asyncio.StreamReader, key: str, tail: deque[bytes]) -> None:
    """Log the sandbox's stderr, bounded and escaped (see :mod:`.streams`), and keep its
    tail (raw, escaped when used) for the error of a failed start. Never raises: anything
    in the sandbox that holds this fd can write to it, and a dead reader would fail the
    sandbox's ``stop``."""
    logged = 0

    def on_line(line: bytes, cut: bool) -> None:
        nonlocal logged
        tail.append(line + b" [line cut]" if cut else line)
        logged += 1
        # One bounded line per record, named as the sandbox's: escaped, it cannot end the
        # record and start one that looks like the server's own.
        if logged <= _STDERR_LOG_LINES:
            log.warning("sandbox %s stderr: %s", key, streams.escape_line(tail[-1]))
        elif logged == _STDERR_LOG_LINES + 1:
            log.warning("sandbox %s stderr: further lines are not logged", key)

    await streams.read_lines(stream, _STDERR_LINE_BYTES, on_line)


class BwrapBackend(Backend):
    name = "bwrap"

    def __init__(
        self,
        settings: Settings,
        cgroup_root: Path = Path("/sys/fs/cgroup"),
        agent_dir: Path | None = None,
    ) -> None:
        """``cgroup_root`` and ``agent_dir`` (the ``mcs_agent`` package) are for tests."""
        self.settings = settings
        self._agent_dir = agent_dir
        self._cgroup_root = cgroup_root
        self._cgroups: cgroups.CgroupSupport | None = None
        self._layout: HostLayout | None = None
        self._root = os.geteuid() == 0
        # As root each sandbox drops to its session's own host uid, mapped to 1000 inside;
        # otherwise all run as the server's uid, the only one its user namespaces can map.
        self.per_sandbox_uids = self._root
        self._compiled = False
        self._probed = False

    @property
    def cgroups(self) -> cgroups.CgroupSupport:
        if self._cgroups is None:
            self._cgroups = cgroups.detect(self._cgroup_root)
        return self._cgroups

    def describe(self) -> Description:
        """Limits by this host's cgroups (or rlimits), languages from the runtime
        environment's manifest and the host's bash; network everywhere, as it is only
        the egress proxy's socket bound in (see :meth:`Backend.describe` for who calls it)."""
        return Description(
            enforcement=self._enforcement(),
            runtimes=self._runtimes(),
            network_unavailable=None,
        )

    def _enforcement(self) -> dict[str, Enforcement]:
        enforced = self.cgroups.enforceable
        return {
            "memory": "cgroup" if "memory" in enforced else "rlimit",
            "cpu": "cgroup" if "cpu" in enforced else "none",
            "pids": "cgroup" if "pids" in enforced else "rlimit",
            "tmp": "kernel",
            "file_size": "rlimit",
            "network": "kernel",
        }

    def _runtimes(self) -> dict[str, dict[str, Any]]:
        status = runtime_status(self.settings)
        info: dict[str, dict[str, Any]] = {
            "python": {
                "version": status.python_version,
                "packages": dict(status.packages),
                "image": None,
            }
        }
        # From versions.json, without starting anything; none there: not offered.
        node = status.node
        for language in ("javascript", "typescript"):
            if node is None:
                info[language] = {"available": False}
                continue
            version = node.node if language == "javascript" else node.bun
            info[language] = {"version": version, "packages": dict(node.packages), "image": None}
        if (bash := _system_bash_version()) is not None:
            info["bash"] = {"version": bash, "packages": {}, "image": None}
        return info

    def _bwrap(self) -> str:
        path = shutil.which("bwrap")
        if path is None:
            raise BackendUnavailable(BWRAP_MISSING)
        return path

    def find_host_problem(self) -> str | None:
        """Probe once whether this host lets bwrap make user namespaces, and keep the
        answer in :attr:`host_problem`. Runs one short process: called before the event
        loop by ``serve`` (which logs the answer), else by the first :meth:`create`."""
        if not self._probed:
            self._probed = True
            self.host_problem = userns_problem(shutil.which("bwrap"))
        return self.host_problem

    def _agent_package(self) -> Path:
        from mcp_code_sandbox import agent

        return self._agent_dir or Path(agent.__file__).parent

    def _mounts(self, spec: SandboxSpec) -> tuple[Mounts, list[tuple[str, str]] | None]:
        status = runtime_status(self.settings)
        if not status.ok:
            log.warning("sandbox runtime unavailable: %s", status.detail)
            raise status.unavailable()
        agent_dir = self._agent_package()
        sources = {"ws": str(spec.workspace), "venv": str(status.venv_dir), "agent": str(agent_dir)}
        if status.base_prefix is not None:
            sources["base"] = str(status.base_prefix)
        if status.node_dir is not None:
            sources["node"] = str(status.node_dir)
        if spec.egress is not None:
            sources["egress"] = str(spec.egress.host_dir)
        stage = [(src, name) for name, src in sources.items()] if self._root else None
        seen = {name: f"{STAGE}/{name}" if self._root else src for name, src in sources.items()}
        base = (seen["base"], sources["base"]) if "base" in seen else None
        mounts = Mounts(
            seen["ws"],
            seen["venv"],
            seen["agent"],
            base,
            node=seen.get("node"),
            egress=seen.get("egress"),
            seccomp_fd=_data_fd(build_seccomp_bpf()),
            passwd_fd=_data_fd(PASSWD.encode()),
            group_fd=_data_fd(GROUP.encode()),
        )
        return mounts, stage

    async def check_ready(self) -> None:
        """bwrap on PATH, user namespaces (when probed) and the runtime environment on
        disk (manifest, venv's python)."""
        self._bwrap()
        if self.host_problem is not None:
            raise BackendUnavailable(self.host_problem)
        status = await asyncio.to_thread(runtime_status, self.settings)
        if not status.ok:
            log.warning("sandbox runtime unavailable: %s", status.detail)
            raise status.unavailable()

    async def create(self, spec: SandboxSpec, *, mounted: Awaitable[None] | None = None) -> Sandbox:
        bwrap = self._bwrap()
        if not self._probed:
            await asyncio.to_thread(self.find_host_problem)
        if self.host_problem is not None:
            raise BackendUnavailable(self.host_problem)
        if self._root and spec.uid is None:  # never a sandbox as root
            raise SandboxFailed("a sandbox of a server run as root needs a host uid of its own")
        if not self._compiled:
            self._compiled = True
            await asyncio.to_thread(_precompile, self._agent_package())
        if self._layout is None:
            self._layout = HostLayout.probe()
        if mounted is not None:  # before anything that must be freed
            await mounted
        mounts, stage = self._mounts(spec)
        env_fd = _data_fd(env_args(spec))
        data_fds = [mounts.seccomp_fd, mounts.passwd_fd, mounts.group_fd, env_fd]
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with child:  # its connection goes on as the launcher's high fd alone
            child_fd = _high_fd(os.dup(child.fileno()))
        cgroup: cgroups.CgroupHandle | None = None
        try:
            cgroup = await asyncio.to_thread(self.cgroups.create, spec.key, spec.limits)
            rlimit_memory = "memory" not in self.cgroups.enforceable
            argv = build_launcher_argv(
                child_fd,
                [str(f) for f in cgroup.procs_files] if cgroup else [],
                stage,
                spec.uid if self._root else None,
            ) + build_bwrap_argv(
                bwrap,
                spec,
                mounts,
                self._layout,
                rlimit_memory=rlimit_memory,
                env_fd=env_fd,
            )
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=[child_fd, *data_fds],
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "STAGE": STAGE},
                start_new_session=True,
            )
        except OSError as exc:
            parent.close()
            if cgroup is not None:
                await asyncio.to_thread(cgroup.remove)
            log.error("cannot start the sandbox %s: %s", spec.key, exc)
            raise SandboxFailed(
                f"cannot start the sandbox ({exc.strerror or exc}; the server's log says "
                "more): try again; if it persists, `mcp-code-sandbox doctor` checks bubblewrap"
            ) from None
        except BaseException:
            parent.close()
            raise
        finally:
            for fd in (child_fd, *data_fds):
                os.close(fd)
        reader, writer = await asyncio.open_connection(sock=parent)
        tail: deque[bytes] = deque(maxlen=_STDERR_TAIL)
        assert proc.stderr is not None
        task = asyncio.create_task(_log_stderr(proc.stderr, spec.key, tail))
        sandbox = BwrapSandbox(spec, Channel(reader, writer), proc, cgroup, tail, task)
        try:
            sandbox.ready = await wait_ready(
                sandbox, READY_TIMEOUT_S, functools.partial(self._not_ready, sandbox)
            )
        except BaseException:
            await self.stop(sandbox)
            raise
        return sandbox

    async def _not_ready(
        self, sandbox: BwrapSandbox, message: dict[str, Any] | None, timed_out: bool
    ) -> str:
        """Why ``sandbox``'s agent did not say ``ready`` (for :func:`wait_ready`), with
        the tail of its stderr: after a timeout as it is, else once the sandbox exited."""
        if timed_out:
            return f"the sandbox agent did not start within {READY_TIMEOUT_S:.0f} s" + _tail(
                sandbox
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(sandbox.proc.wait()), 2)
            await asyncio.wait_for(asyncio.shield(sandbox._stderr_task), 1)
        return "the sandbox exited before its agent was ready" + _tail(sandbox)

    async def stop(self, sandbox: Sandbox) -> None:
        """Every step is tried, whatever the one before did: a step that fails is logged
        and the rest still free what they can (the session manager must be able to close
        any number of sessions, whatever one sandbox did to its own host-side parts)."""
        assert isinstance(sandbox, BwrapSandbox)
        key = sandbox.spec.key
        await stop_step(key, "end its processes", _end_process(sandbox))
        await stop_step(key, "close its channel", _sync(sandbox.channel.close))
        if sandbox.cgroup is not None:
            await stop_step(key, "remove its cgroup", _remove_cgroup(key, sandbox.cgroup))
        sandbox._stderr_task.cancel()
        await stop_step(key, "end its stderr reader", _reaped(sandbox._stderr_task))

    async def usage(self, sandbox: Sandbox) -> Usage | None:
        """From the sandbox's cgroup (see :meth:`.cgroups.CgroupHandle.usage`); ``None``
        without one (rlimits only: nothing counts a sandbox's processes together)."""
        if not isinstance(sandbox, BwrapSandbox) or sandbox.cgroup is None:
            return None
        return await asyncio.to_thread(sandbox.cgroup.usage)

    async def list_leftovers(self, *, live_too: bool = False) -> list[Leftover]:
        # bwrap sandboxes die with their server (--die-with-parent): what a dead server
        # leaves behind is its cgroup directories, with any process that escaped.
        handles = await asyncio.to_thread(self.cgroups.list_leftovers)
        return [
            Leftover(
                backend_id=h.dirs[0].name,
                key=h.dirs[0].name.split("-", 2)[-1],
                owner=None,
                session_id=None,
                running=bool(h.pids()),
            )
            for h in handles
        ]

    async def remove_leftover(self, leftover: Leftover) -> None:
        for handle in await asyncio.to_thread(self.cgroups.list_leftovers):
            if handle.dirs[0].name == leftover.backend_id:
                await asyncio.to_thread(handle.remove)


async def _sync(fn: Callable[[], object]) -> None:
    fn()


async def _end_process(sandbox: BwrapSandbox) -> None:
    """Ask the agent, then SIGTERM, then SIGKILL, each with a bounded wait."""
    proc = sandbox.proc
    if proc.returncode is not None:
        return
    with contextlib.suppress(OSError, ProtocolError, RuntimeError, TimeoutError):
        await asyncio.wait_for(sandbox.channel.send({"op": "shutdown"}), 0.5)
    for sig, wait in ((None, 1.0), (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        if sig is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), wait)
            return


async def _remove_cgroup(key: str, cgroup: cgroups.CgroupHandle) -> None:
    if not await asyncio.to_thread(cgroup.remove):
        log.warning("sandbox %s: cgroup %s not removed", key, cgroup.dirs)


async def _reaped(task: asyncio.Task[None]) -> None:
    """Wait for a cancelled helper task and raise what it raised (for ``stop_step`` to log);
    a cancellation of the caller still goes through."""
    await asyncio.wait({task})
    if not task.cancelled() and (exc := task.exception()) is not None:
        raise exc


def _tail(sandbox: BwrapSandbox) -> str:
    lines = [streams.escape_line(line) for line in sandbox.stderr_tail]
    return (":\n" + "\n".join(lines)) if lines else " (no output on stderr)"


def _precompile(agent_dir: Path) -> None:
    """Write the agent's bytecode next to it, once per server, where we may.

    The sandbox mounts the package read-only and runs it with -B, so without this every
    sandbox start compiles the agent from source again. Best effort: a
    read-only install just starts a little slower.
    """
    import compileall

    with contextlib.suppress(OSError):
        compileall.compile_dir(str(agent_dir), quiet=2, workers=1)


@functools.cache
def _system_bash_version() -> str | None:
    """The version of the sandboxes' bash, which is the host's (the system is bound
    read-only): asked here once, so that ``list_runtimes`` needs no sandbox for it."""
    bash = shutil.which("bash", path="/usr/local/bin:/usr/bin:/bin")
    if bash is None:
        return None
    try:
        done = subprocess.run(
            [bash, "-c", 'printf %s "${BASH_VERSION%%(*}"'],
            capture_output=True,
            text=True,
            timeout=10,
            env={"PATH": "/usr/bin:/bin"},
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None
