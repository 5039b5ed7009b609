"""A test-only :class:`Backend`: the REAL agent as a plain subprocess of the test, no walls.

``FakeBackend`` starts ``python -m mcp_code_sandbox.agent`` (the very package the real
backends mount into their sandboxes) on the host, over a socketpair, with the session's
workspace directory as its working directory. So the host side (session manager, run path,
tools) talks the real protocol to a real agent, and tests of that logic run in a fraction of
a second, with no bubblewrap, no Docker, no runtime environment.

It isolates NOTHING: the code runs as the test's own user with the test's view of the host
(``/mnt/data`` does not exist; paths are relative to the workspace). It lives only under
``tests/`` and no setting can select it (``backends.create_backend`` does not know it).
Tests hand it to ``SandboxService`` / ``SessionManager`` directly.

What a test can steer or observe: ``fail_creates`` (the next n creates raise
``SandboxFailed``), ``created``/``stopped``/``removed`` (what the manager asked for),
``planted`` (leftovers of a "dead server" for recovery, which ``reattach`` takes over as a
fresh agent on the session's workspace), ``kill()`` (a sandbox dies under the manager).

``FakeBackend(workspace_in_sandbox=True)``: as the Kubernetes backend, the sandbox keeps
its /mnt/data to itself (a directory in its scratch, gone with it) and the server reaches
the files through the agent's ``fs`` requests only; ``spec.workspace`` stays empty.

``FakeBackend(reconnect=True)``: the agent connects to a Unix socket the backend listens
on (``--connect``, as under Docker) instead of an inherited socketpair, so it outlives its
host's end of the channel and reconnects: ``list_leftovers(live_too=True)`` reports every
live sandbox (``creator_alive``), and ``reattach`` of one listens again on its socket and
takes its agent back with its interpreter (``reattached``), as Docker does. For replicas
(``sessions.replicas``): one server lets go of a sandbox and another takes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import mcp_code_sandbox
from mcp_code_sandbox.backends.base import (
    Backend,
    Channel,
    Description,
    Enforcement,
    Leftover,
    Limits,
    Sandbox,
    SandboxSpec,
    wait_ready,
)
from mcp_code_sandbox.errors import SandboxFailed
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.sessions.agent_client import AgentClient
from mcp_code_sandbox.sessions.agent_files import AgentFiles
from mcp_code_sandbox.sessions.holder import Role
from mcp_code_sandbox.settings import Settings, load_settings
from mcp_code_sandbox.workspace.seam import Blocking

__all__ = ["FakeBackend", "FakeSandbox", "agent_files", "fake_service", "fake_settings"]

#: Generous: the machine running the tests may be loaded (an agent starts in ~0.1 s).
READY_TIMEOUT_S = 30.0
#: Where the agent looks for bash/node/bun; tests rely on python (always) and bash.
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


class FakeSandbox(Sandbox):
    """One agent process on the host; ``scratch`` is its private HOME/TMPDIR."""

    def __init__(
        self,
        spec: SandboxSpec,
        channel: Channel,
        proc: asyncio.subprocess.Process,
        scratch: Path,
        ready: dict[str, Any],
    ) -> None:
        super().__init__(spec, channel, backend_id=f"fake-{proc.pid}")
        self.proc = proc
        self.scratch = scratch
        #: The agent's ``ready`` message (languages, pid), as the real backends keep it.
        self.ready = ready
        #: ``_end`` ran: its process group is not signalled again (the pid may be reused).
        self.ended = False

    def is_alive(self) -> bool:
        return self.proc.returncode is None


class FakeBackend(Backend):
    name = "fake"

    def __init__(
        self,
        *,
        path: str = DEFAULT_PATH,
        reconnect: bool = False,
        workspace_in_sandbox: bool = False,
    ) -> None:
        self._path = path
        #: Each agent works in a directory of its own sandbox's (a pod's emptyDir), never
        #: in ``spec.workspace``: the server reaches the files through the agent only.
        self.workspace_in_sandbox = workspace_in_sandbox
        #: Agents connect to a socket and come back to a new listener (see the module doc).
        self._reconnect = reconnect
        #: The next this-many ``create`` calls raise ``SandboxFailed`` (a start that fails).
        self.fail_creates = 0
        #: What ``describe`` says of network; ``None``: the session side's egress proxies
        #: are real, so a test of them sets it (the fake sandbox never uses the socket).
        self.network_unavailable: str | None = "the fake backend has no network support"
        #: Every spec ``create`` was called with, in order (the probe's too).
        self.created: list[SandboxSpec] = []
        #: ``spec.key`` of every sandbox stopped.
        self.stopped: list[str] = []
        #: Leftovers a "dead server" left: ``list_leftovers`` reports them until removed.
        self.planted: list[Leftover] = []
        self.removed: list[Leftover] = []
        self._all: list[FakeSandbox] = []

    # -- the seam -------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec, *, mounted: Awaitable[None] | None = None) -> Sandbox:
        if mounted is not None:  # as a real backend: the workspace is seen once mounted
            await mounted
        self.created.append(spec)
        if self.fail_creates > 0:
            self.fail_creates -= 1
            raise SandboxFailed("the fake sandbox was told to fail its start")
        return await self._start(spec)

    async def stop(self, sandbox: Sandbox) -> None:
        assert isinstance(sandbox, FakeSandbox)
        self.stopped.append(sandbox.spec.key)
        await _end(sandbox)

    async def reattach(
        self,
        leftover: Leftover,
        spec: SandboxSpec,
        *,
        bound: Callable[[], Awaitable[None]] | None = None,
    ) -> Sandbox | None:
        """A planted leftover comes back as a fresh agent on the session's workspace
        (files kept); with ``reconnect``, a live sandbox's agent comes back as it is."""
        live = [s for s in self._all if s.backend_id == leftover.backend_id and s.is_alive()]
        if self._reconnect and live:
            return await self._take_back(live[0], spec, bound)
        if bound is not None:
            await bound()
        if any(p.backend_id == leftover.backend_id for p in self.planted):
            self.planted = [p for p in self.planted if p.backend_id != leftover.backend_id]
            return await self._start(spec)
        return None

    async def list_leftovers(self, *, live_too: bool = False) -> list[Leftover]:
        found = list(self.planted)
        if self._reconnect and live_too:
            found.extend(
                Leftover(s.backend_id, s.spec.key, s.spec.owner, s.spec.session_id, True,
                         s.spec.workspace, uid=s.spec.uid, creator_alive=True)
                for s in self.running()
            )  # fmt: skip
        return found

    async def remove_leftover(self, leftover: Leftover) -> None:
        self.removed.append(leftover)
        self.planted = [p for p in self.planted if p.backend_id != leftover.backend_id]

    def describe(self) -> Description:
        """Nothing enforced; languages from the agent's ``ready`` (the server's probe)."""
        none: Enforcement = "none"
        return Description(
            enforcement=dict.fromkeys(
                ("memory", "cpu", "pids", "tmp", "file_size", "network"), none
            ),
            runtimes={},
            network_unavailable=self.network_unavailable,
        )

    # -- for tests --------------------------------------------------------------------------

    async def kill(self, sandbox: Sandbox) -> None:
        """The sandbox dies under the manager (as an OOM kill would end it)."""
        assert isinstance(sandbox, FakeSandbox)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sandbox.proc.pid, signal.SIGKILL)
        await sandbox.proc.wait()

    def running(self) -> list[FakeSandbox]:
        """Sandboxes whose agent still runs (stopped ones included)."""
        return [s for s in self._all if s.is_alive()]

    async def end_all(self) -> None:
        """Test teardown: end every agent this backend started."""
        for sandbox in self._all:
            await _end(sandbox)

    # -- starting an agent ------------------------------------------------------------------

    async def _start(self, spec: SandboxSpec) -> FakeSandbox:
        scratch = Path(tempfile.mkdtemp(prefix="mcs-fake-"))
        ours, theirs = socket.socketpair()
        config = {"kill_strays": False, "pids": None, "file_bytes": spec.limits.file_bytes}
        listener = _listen(scratch / AGENT_SOCKET) if self._reconnect else None
        channel_argv = (
            ["--channel-fd", str(theirs.fileno())]
            if listener is None
            else ["--connect", str(scratch / AGENT_SOCKET), "--reconnect-s", "60"]
        )
        workdir = spec.workspace
        if self.workspace_in_sandbox:  # gone with the sandbox, as a pod's emptyDir
            workdir = scratch / "data"
            workdir.mkdir()
        argv = [sys.executable, "-B", "-m", "mcp_code_sandbox.agent", *channel_argv,
                "--workdir", str(workdir), "--config", json.dumps(config),
                "--plain"]  # fmt: skip
        env = {
            "PATH": self._path,
            "HOME": str(scratch),
            "TMPDIR": str(scratch),
            "LANG": "C.UTF-8",
            "MPLBACKEND": "Agg",
            "PYTHONUNBUFFERED": "1",
            # The agent of the source under test (the venv may hold another checkout's).
            "PYTHONPATH": _SOURCE,
            **spec.env,
        }
        try:
            with open(scratch / "agent.err", "wb") as err:
                proc = await asyncio.create_subprocess_exec(
                    *argv, pass_fds=[theirs.fileno()], env=env, cwd=workdir,
                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                    stderr=err, start_new_session=True,
                )  # fmt: skip
        except OSError as exc:
            ours.close()
            if listener is not None:
                listener.close()
            shutil.rmtree(scratch, ignore_errors=True)
            raise SandboxFailed(f"cannot start the fake agent: {exc}") from None
        finally:
            theirs.close()
        if listener is not None:
            ours.close()
            try:
                ours = await _accept(listener)
            except BaseException:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
                shutil.rmtree(scratch, ignore_errors=True)
                raise
            finally:
                listener.close()
        reader, writer = await asyncio.open_connection(sock=ours)
        channel = Channel(reader, writer)
        sandbox = FakeSandbox(spec, channel, proc, scratch, {})
        self._all.append(sandbox)

        async def not_ready(message: dict[str, Any] | None, timed_out: bool) -> str:
            stderr = (scratch / "agent.err").read_text(errors="replace")[-2000:]
            return f"the fake agent did not say ready ({timed_out=}): {message!r} {stderr}"

        try:
            sandbox.ready = await wait_ready(sandbox, READY_TIMEOUT_S, not_ready)
        except BaseException:
            await _end(sandbox)
            raise
        return sandbox

    async def _take_back(
        self,
        old: FakeSandbox,
        spec: SandboxSpec,
        bound: Callable[[], Awaitable[None]] | None,
    ) -> FakeSandbox:
        """Listen again on ``old``'s socket, let its holder go (``bound``), and take its
        agent's reconnection with its interpreter kept (Docker's ``_take_back``)."""
        listener = _listen(old.scratch / AGENT_SOCKET)
        try:
            if bound is not None:
                await bound()
            ours = await _accept(listener)
        finally:
            listener.close()
        reader, writer = await asyncio.open_connection(sock=ours)
        sandbox = FakeSandbox(spec, Channel(reader, writer), old.proc, old.scratch, {})
        self._all = [s for s in self._all if s is not old] + [sandbox]

        async def not_ready(message: dict[str, Any] | None, timed_out: bool) -> str:
            return f"the fake agent did not come back ({timed_out=}): {message!r}"

        try:
            sandbox.ready = await wait_ready(sandbox, READY_TIMEOUT_S, not_ready)
            if not sandbox.ready.get("reattached"):
                raise SandboxFailed("the fake agent came back afresh")
        except BaseException:
            sandbox.channel.close()
            raise
        return sandbox


#: Where the package under test is imported from: the agent runs from the same source.
_SOURCE = str(Path(mcp_code_sandbox.__file__).resolve().parents[1])

#: A reconnecting agent's socket, in its sandbox's scratch directory.
AGENT_SOCKET = "agent.sock"


def _listen(path: Path) -> socket.socket:
    """A non-blocking listener at ``path``, replacing a socket left there."""
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    listener.setblocking(False)
    return listener


async def _accept(listener: socket.socket) -> socket.socket:
    try:
        ours, _ = await asyncio.wait_for(
            asyncio.get_running_loop().sock_accept(listener), READY_TIMEOUT_S
        )
    except TimeoutError:
        raise SandboxFailed("the fake agent did not connect") from None
    return ours


async def _end(sandbox: FakeSandbox) -> None:
    """Ask the agent to shut down, then SIGTERM, then SIGKILL its process group, each
    with a bounded wait; then drop its channel and scratch directory. Safe to call again,
    also after a call that was cancelled half-way (a reaper pass cut short by shutdown)."""
    proc = sandbox.proc
    try:
        if proc.returncode is None:
            with contextlib.suppress(OSError, RuntimeError, TimeoutError):
                await asyncio.wait_for(sandbox.channel.send({"op": "shutdown"}), 0.5)
            for sig, wait in ((None, 2.0), (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
                if sig is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, sig)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), wait)
                    break
    finally:
        if not sandbox.ended:  # whatever it left in its group; once reaped, never again
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            sandbox.ended = proc.returncode is not None
        sandbox.channel.close()
        shutil.rmtree(sandbox.scratch, ignore_errors=True)


def fake_settings(state_dir: Path, **overrides: Any) -> Settings:
    """Settings for a server on the fake backend: the quota ``checked`` (no loop mounts,
    which need root and take tens of milliseconds a session)."""
    values: dict[str, Any] = {
        "state_dir": str(state_dir),
        "workspace_quota_mode": "checked",
        "exec_timeout_s": 20,
        "pool_size": 0,
    }
    values.update(overrides)
    return load_settings(values, environ={})


@contextlib.asynccontextmanager
async def fake_service(
    state_dir: Path,
    backend: FakeBackend | None = None,
    *,
    role: Role | None = None,
    **overrides: Any,
) -> AsyncIterator[SandboxService]:
    """``async with fake_service(state_dir, **settings) as svc``: a started service on a
    fake backend (``svc.backend``), closed on the way out. A backend made here has every
    agent it started ended then too; one passed in is the caller's to end (``end_all``),
    so that it can outlive the service (a server restart). ``role``: the manager's
    (default: by ``keep_sessions_on_shutdown``); a restarted service that must take over
    what the last one left says ``Role.SERVICE``."""
    owned = backend is None
    backend = backend or FakeBackend()
    service = SandboxService(fake_settings(state_dir, **overrides), backend, role=role)
    try:
        await service.start()
        yield service
    finally:
        await service.aclose()
        if owned:
            await backend.end_all()


#: Limits of a fake sandbox made outside a session manager (nothing enforces them).
FAKE_LIMITS = Limits(memory_bytes=1 << 30, cpu=1.0, pids=256, tmp_bytes=1 << 30, file_bytes=1 << 30)


@contextlib.asynccontextmanager
async def agent_files(
    root: Path, quota_bytes: int, blocking: Blocking
) -> AsyncIterator[AgentFiles]:
    """``async with agent_files(root, quota, blocking) as files``: the seam's agent-backed
    files of a real agent whose /mnt/data is ``root`` (the workspace of a backend that
    keeps it in the sandbox), ended on the way out."""
    backend = FakeBackend()
    sandbox = await backend.create(SandboxSpec("files", "local", "files", root, FAKE_LIMITS))
    client = AgentClient(sandbox.channel)

    async def agent() -> AgentClient:
        return client

    try:
        yield AgentFiles(agent, quota_bytes=quota_bytes, blocking=blocking)
    finally:
        await backend.end_all()
