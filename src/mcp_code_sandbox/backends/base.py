"""The backend seam: how the session manager gets a sandbox with an agent in it.

A backend only starts, connects to, stops and lists sandboxes. It knows nothing of MCP,
of files (the session manager and :mod:`mcp_code_sandbox.workspace` own those) or of the
agent's messages (:mod:`mcp_code_sandbox.sessions.agent_client` speaks them over the channel a
backend hands back). Each backend maps its own foreign errors (``OSError``, docker-py's
exceptions) to :class:`~mcp_code_sandbox.errors.BackendUnavailable` or
:class:`~mcp_code_sandbox.errors.SandboxFailed`, and lets nothing else out.

Every backend lays the sandbox out the same way, so the agent and the tool descriptions
can rely on it: the workspace at ``WORKSPACE_DIR`` (the working directory), the runtime
environment's interpreter at ``SANDBOX_PYTHON``, the agent package at ``AGENT_LIB_DIR``,
``/tmp`` a size-limited tmpfs, everything else read-only, no capabilities, uid/gid 1000
inside where the backend can map ids (bwrap), else the sandbox's host uid itself (docker).

Host uids: a backend that can run each sandbox as a host uid of its own says so with
``per_sandbox_uids``; the session manager then leases one per session (:mod:`..uids`)
and passes it in ``SandboxSpec.uid``, so per-user kernel limits (inotify instances and
the like) are per sandbox. Otherwise every sandbox has the same one
(``workspace_owner``).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mcp_code_sandbox.agent.packages import PACKAGES_DIR
from mcp_code_sandbox.agent.protocol import (
    HEADER,
    MAX_FRAME_BYTES,
    ProtocolError,
    decode_body,
    encode_frame,
)
from mcp_code_sandbox.errors import SandboxFailed

__all__ = [
    "AGENT_LIB_DIR",
    "AGENT_MODULE",
    "SANDBOX_GID",
    "SANDBOX_NODE",
    "SANDBOX_NODE_MODULES_LINK",
    "SANDBOX_PYTHON",
    "SANDBOX_UID",
    "SANDBOX_VENV",
    "SESSION_NODE_MODULES_LINK",
    "WORKSPACE_DIR",
    "Backend",
    "Channel",
    "Enforcement",
    "ExecResult",
    "Leftover",
    "Limits",
    "RunnerImage",
    "RunnerSandbox",
    "Sandbox",
    "SandboxSpec",
    "agent_argv",
    "sandbox_env",
    "stop_step",
]

WORKSPACE_DIR = "/mnt/data"
SANDBOX_VENV = "/opt/sandbox/venv"
SANDBOX_PYTHON = f"{SANDBOX_VENV}/bin/python"
#: Node.js and bun in ``bin/``, the npm packages of DESIGN.md §3 in ``node_modules/``,
#: ``versions.json`` (:mod:`mcp_code_sandbox.provision.node`). Absent when not provisioned.
SANDBOX_NODE = "/opt/sandbox/node"
#: A symlink to ``SANDBOX_NODE/node_modules``: Node's ESM resolver (``import``) ignores
#: ``NODE_PATH`` and only walks up from the importing file, so from ``/mnt/data`` or
#: ``/tmp`` it ends at ``/node_modules``.
SANDBOX_NODE_MODULES_LINK = "/node_modules"
#: ``/mnt/node_modules``, a symlink to the session's own npm/bun packages (in the
#: workspace: ``agent.packages``), so that ``import`` in a file anywhere in the workspace
#: finds them before the walk up ends at the preinstalled ones.
SESSION_NODE_MODULES_LINK = (
    "/mnt/node_modules",
    f"{WORKSPACE_DIR}/{PACKAGES_DIR}/node/node_modules",
)
#: Parent directory of the agent package inside the sandbox; the package is ``mcs_agent``.
AGENT_LIB_DIR = "/opt/sandbox/lib"
AGENT_MODULE = "mcs_agent"
SANDBOX_UID = 1000
SANDBOX_GID = 1000

#: How a limit is enforced in one sandbox, as reported by ``doctor`` and ``list_runtimes``.
#: ``kernel``: by how the sandbox is built (a tmpfs ``size=``, an empty network namespace).
Enforcement = Literal["cgroup", "rlimit", "kernel", "checked", "none"]


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox. Every field is a hard cap; none is optional."""

    memory_bytes: int
    cpu: float
    pids: int
    tmp_bytes: int
    #: The largest single file the sandbox may write (RLIMIT_FSIZE); the workspace's total
    #: is bound by its own filesystem, or watched by the session manager (:mod:`..quota`).
    file_bytes: int


@dataclass(frozen=True)
class SandboxSpec:
    """What the session manager asks a backend for."""

    #: Unique, filesystem- and label-safe name of the session (not the client's id).
    key: str
    owner: str
    session_id: str
    #: Host directory bound read-write at ``WORKSPACE_DIR``; the backend never writes to it.
    workspace: Path
    limits: Limits
    #: Outbound network through the backend's fenced network (see ``netfilter``); the
    #: manager asks for it only when the server allows it and the call wants it.
    network: bool = False
    #: Environment of every process in the sandbox, on top of the backend's base env.
    env: Mapping[str, str] = field(default_factory=dict)
    #: The host uid (and gid: the same number) the sandbox's processes run as, which owns
    #: the workspace: the session's own (see ``Backend.per_sandbox_uids``). ``None``: the
    #: backend's shared one (``Backend.workspace_owner``).
    uid: int | None = None


@dataclass(frozen=True)
class Leftover:
    """A sandbox (or its remains) that a previous server process left behind.

    Semantics: ``key``, ``owner``, ``session_id`` are what the backend recorded at create
    (labels), ``None`` when it recorded nothing; they are claims to check against the
    session manager's own records, not facts. ``workspace`` is the host directory the
    sandbox has at ``WORKSPACE_DIR``, ``None`` when the backend cannot tell. ``running``:
    the sandbox still runs (so its agent may still hold the session's variables).
    """

    backend_id: str
    key: str | None
    owner: str | None
    session_id: str | None
    running: bool
    workspace: Path | None = None
    #: The language of a runner's container (:class:`RunnerSandbox`): never re-attached,
    #: as it holds no state but the workspace's files.
    runner: str | None = None
    #: The host uid it runs as, as recorded (``SandboxSpec.uid``); ``None``: none recorded.
    uid: int | None = None


class Channel:
    """Framed-JSON channel to one agent over an asyncio stream pair.

    ``receive`` returns ``None`` at a clean EOF and raises :class:`ProtocolError` on a
    broken frame; callers translate both into ``SandboxFailed``.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._send_lock = asyncio.Lock()

    async def send(self, message: dict[str, Any]) -> None:
        async with self._send_lock:
            self._writer.write(encode_frame(message))
            await self._writer.drain()

    async def receive(self) -> dict[str, Any] | None:
        try:
            header = await self._reader.readexactly(HEADER.size)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise ProtocolError("unexpected EOF inside a frame header") from None
            return None
        (length,) = HEADER.unpack(header)
        if length > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
        try:
            body = await self._reader.readexactly(length)
        except asyncio.IncompleteReadError:
            raise ProtocolError("unexpected EOF inside a frame") from None
        return decode_body(body)

    def close(self) -> None:
        self._writer.close()


class Sandbox(abc.ABC):
    """A running sandbox as one backend sees it. Created only by :meth:`Backend.create`."""

    def __init__(self, spec: SandboxSpec, channel: Channel, backend_id: str) -> None:
        self.spec = spec
        self.channel = channel
        #: The backend's own name for it (a pid, a container id): for logs and leftovers.
        self.backend_id = backend_id

    @abc.abstractmethod
    def is_alive(self) -> bool:
        """Called by the session manager before a run, to notice a sandbox that died."""


@dataclass(frozen=True)
class RunnerImage:
    """An image that offers one more language (labels ``sandbox.runner=true``,
    ``sandbox.language=<name>``), found by :meth:`Backend.discover_runners`.

    It needs no agent: each call writes the code to a file and runs ``command`` (with
    ``{file}`` replaced by that file's path) as one process in a container of the image
    that shares the session's workspace.
    """

    language: str
    #: The image's first tag, or its id when it has none.
    image: str
    image_id: str
    command: tuple[str, ...]
    #: Suffix of the code file (``.rb``): some interpreters go by it.
    suffix: str = ""
    version: str | None = None
    packages: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ExecResult:
    """How one process of a runner ended: its exit code, or ``None`` when it was killed
    (``reason`` then says why: ``timeout``; a cancellation raises instead)."""

    exit_code: int | None
    reason: str | None = None


class RunnerSandbox(abc.ABC):
    """A running container of a :class:`RunnerImage` for one session. Created only by
    :meth:`Backend.create_runner`; stopped by :meth:`Backend.stop_runner`."""

    def __init__(self, spec: SandboxSpec, runner: RunnerImage, backend_id: str) -> None:
        self.spec = spec
        self.runner = runner
        self.backend_id = backend_id
        #: False once a run had to kill it (a timeout): the next call starts a new one.
        self.usable = True

    @abc.abstractmethod
    async def execute(
        self,
        code: bytes,
        *,
        timeout_s: float,
        env: Mapping[str, str],
        on_output: Callable[[str, str], None],
    ) -> ExecResult:
        """Run ``code`` once, streaming ``(stream name, text)`` to ``on_output``.

        On timeout or cancellation the process is killed (with the container, when the
        backend can kill nothing smaller; ``usable`` is then false). Raises
        ``SandboxFailed`` when the process cannot be started."""


class Backend(abc.ABC):
    """One way of running sandboxes. Called only by the session manager (and ``doctor``)."""

    name: str
    #: Whether :meth:`reattach` can take over a previous server's running sandboxes.
    reattaches: bool = False
    #: Whether each sandbox can run as a host uid of its own (``SandboxSpec.uid``, which
    #: the session manager then always sets). Semantics: true means the backend uses that
    #: uid for the sandbox's processes and everything it hands them (sockets, files).
    per_sandbox_uids: bool = False
    #: Without ``per_sandbox_uids``: the host uid/gid all sandboxes share, which must own
    #: the workspaces and every file the server writes into them; ``None`` when that is
    #: the server's own uid.
    workspace_owner: tuple[int, int] | None = None

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> Sandbox:
        """Start a sandbox for ``spec`` and return it once its agent said ``ready``.

        Called by the session manager for a new session, and again for an existing one
        whose sandbox died. Raises ``BackendUnavailable`` when the backend cannot run at
        all and ``SandboxFailed`` when this one sandbox could not start.
        """

    @abc.abstractmethod
    async def stop(self, sandbox: Sandbox) -> None:
        """Stop ``sandbox`` and free what the backend holds for it (processes, cgroups).

        Called by the session manager on close, expiry and shutdown. Escalates (ask the
        agent, SIGTERM, SIGKILL) with bounded waits. Never raises for one sandbox's
        failure (whatever its code did to its host-side parts, or a sandbox already
        gone): each step runs under :func:`stop_step`, which logs what fails, so the
        steps after it still free what they can.
        """

    @abc.abstractmethod
    async def list_leftovers(self) -> list[Leftover]:
        """Sandboxes of this backend that no live server owns. Called once at start."""

    @abc.abstractmethod
    async def remove_leftover(self, leftover: Leftover) -> None:
        """Remove one leftover for good. Called at start for those not re-attached."""

    async def detach(self, sandbox: Sandbox) -> None:
        """Let go of ``sandbox`` at a clean shutdown, leaving it running for a later
        server's :meth:`reattach` (``keep_sessions_on_shutdown``). Backends that cannot
        re-attach stop it instead: that is the default."""
        await self.stop(sandbox)

    async def reattach(self, leftover: Leftover, spec: SandboxSpec) -> Sandbox | None:
        """Take over a running leftover as the sandbox of ``spec``'s session, or ``None``.

        Called by the session manager at start, once per leftover that matches a session
        record (owner, id, key, workspace) still within its lifetime; the manager removes
        the leftover when this returns ``None``. A backend that can re-attach waits,
        bounded, for the sandbox's agent to come back and say ``ready`` (with
        ``reattached``), so the session keeps its variables. Never raises for a leftover
        that turns out to be gone or broken: that is ``None`` too.

        The default cannot: sandboxes that die with their server (bwrap's
        ``--die-with-parent``) leave nothing to re-attach to.
        """
        return None

    async def check_ready(self) -> None:  # noqa: B027 - a backend with nothing to ask
        """Raise ``BackendUnavailable`` (saying what to fix) when this backend could not
        start a sandbox now; return when it could.

        Called by the server's ``/readyz`` probe, under a short timeout, every few seconds:
        cheap and real (ask the engine, look for the runtime on disk), never a sandbox."""

    def network_unavailable(self) -> str | None:
        """Why this backend cannot give a sandbox a fenced network here, or ``None``.

        Called by the service before a ``network=true`` run (the answer becomes
        ``network_not_allowed``) and by ``doctor``. Cheap: no sandbox is started. A
        backend that says ``None`` still fails closed in :meth:`create` when it cannot set
        up the fence after all."""
        return f"the {self.name} backend has no network support"

    def workspace_mounts_unseen(self) -> str | None:
        """Why a filesystem the server mounts on a workspace directory would not be what
        the sandbox sees there, or ``None`` when it would (the sandbox is made from this
        host's view of the directory). Called once at start, by :func:`..quota.choose`."""
        return None

    @abc.abstractmethod
    def enforcement(self) -> dict[str, Enforcement]:
        """How each limit is enforced: keys ``memory``, ``cpu``, ``pids``, ``tmp``,
        ``file_size``, ``network``. For ``doctor`` and ``list_runtimes`` (which adds
        ``workspace``: the session manager decides that one, see :mod:`..quota`)."""

    def runtime_info(self) -> dict[str, dict[str, Any]]:
        """Per language: ``version``, ``packages`` {name: version}, ``image`` (or None).

        Called by ``list_runtimes``; cheap (read from a manifest or cached), never starts
        a sandbox. Languages missing here are offered with unknown versions.
        """
        return {}

    async def discover_runners(self, builtin: Collection[str]) -> dict[str, RunnerImage]:
        """Runner images by language, asked of the backend anew on every call (cheap).

        Called at start, on ``list_runtimes`` and for a language not known yet. The
        default image is not a runner, nor is an image claiming one of the ``builtin``
        languages (the agent's); the backend logs why it left an image out. Backends
        without images have none."""
        return {}

    async def create_runner(self, spec: SandboxSpec, runner: RunnerImage) -> RunnerSandbox:
        """Start a container of ``runner`` for ``spec``'s session, sharing its workspace."""
        raise SandboxFailed(f"the {self.name} backend has no runner images")

    async def stop_runner(self, sandbox: RunnerSandbox) -> None:  # noqa: B027 - none to stop
        """Stop and remove a runner's container; never raises for one already gone."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release backend-wide resources at server shutdown, after every sandbox stopped."""


def sandbox_env(extra: Mapping[str, str]) -> dict[str, str]:
    """The environment of the agent and every process it starts, for every backend."""
    env = {
        # shims/: npm, npx and bun as node_env.SHIMS wraps them (installs go to the
        # session's packages); the agent adds those packages' bin dirs in front.
        "PATH": f"{SANDBOX_VENV}/bin:{SANDBOX_NODE}/shims:{SANDBOX_NODE}/bin:"
        "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",  # noqa: S108 - the sandbox's own private tmpfs
        "USER": "sandbox",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TERM": "dumb",
        "MPLBACKEND": "Agg",
        "MPLCONFIGDIR": "/tmp/.matplotlib",  # noqa: S108 - inside the sandbox
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "VIRTUAL_ENV": SANDBOX_VENV,
        # require() (node and bun) and bun's import; node's import uses the /node_modules link.
        "NODE_PATH": f"{SANDBOX_NODE}/node_modules",
    }
    env.update(extra)
    return env


def agent_argv(
    limits: Limits,
    rlimit_memory: bool,
    *,
    channel: tuple[str, ...] = ("--channel-fd", "3"),
    rlimit_pids: bool = True,
) -> list[str]:
    """Command line of the agent inside the sandbox (run with cwd ``AGENT_LIB_DIR``).

    ``rlimit_memory`` asks the agent to cap the interpreter's data segment with
    RLIMIT_DATA, for backends that could not set a cgroup memory limit. ``channel`` says
    how the agent reaches the host (an inherited fd, or ``--connect PATH``).
    ``rlimit_pids`` false leaves RLIMIT_NPROC unset, for backends whose sandboxes share
    one user namespace: that rlimit counts every process of uid 1000 in it, across
    sandboxes, so there the cgroup's pids limit is the only per-sandbox one.
    """
    import json

    config = {
        # The agent is alone in its pid namespace: on a kill it may end every process but
        # itself and pid 1, so a child that escaped into its own session dies too.
        "kill_strays": True,
        "pids": limits.pids if rlimit_pids else None,
        "file_bytes": limits.file_bytes,
        "memory_bytes": limits.memory_bytes if rlimit_memory else None,
    }
    return [
        SANDBOX_PYTHON,
        "-s",
        "-B",
        "-m",
        AGENT_MODULE,
        *channel,
        "--config",
        json.dumps(config, separators=(",", ":")),
    ]


async def stop_step(key: str, what: str, step: Awaitable[None]) -> None:
    """Await one step of a backend's ``stop``, logging (never raising) what goes wrong, so
    that the steps after it still free what they can."""
    try:
        await step
    except Exception:
        logging.getLogger(__name__).exception("sandbox %s: cannot %s", key, what)
