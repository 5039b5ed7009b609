"""The backend seam: how the session manager gets a sandbox with an agent in it.

A backend only starts, connects to, stops and lists sandboxes. It knows nothing of MCP,
of files (the session manager and :mod:`mcp_code_sandbox.workspace` own those) or of the
agent's messages (:mod:`mcp_code_sandbox.sessions.agent_client` speaks them over the channel
a backend hands back; only the ``ready`` handshake is read here, by :func:`wait_ready`).
Each backend maps its own foreign errors (``OSError``, docker-py's exceptions) to
:class:`~mcp_code_sandbox.errors.BackendUnavailable` or
:class:`~mcp_code_sandbox.errors.SandboxFailed`, and lets nothing else out. What a sandbox
looks like inside (paths, ids, environment, the agent's argv) is :mod:`..layout`'s.

:class:`Backend` is lifecycle only (create, stop, reattach, leftovers, readiness, usage,
close) plus :meth:`Backend.describe`, the one answer for reporting. What only some
backends can do is an optional capability that a backend implements or not: more
languages from runner images (:class:`.runner_images.RunnerImages`) and pausing with a
sandbox's whole memory (:class:`.checkpoints.Checkpoints`).

Host uids: a backend that can run each sandbox as a host uid of its own says so with
``per_sandbox_uids``; the session manager then leases one per session
(:mod:`mcp_code_sandbox.sessions.uids`) and passes it in ``SandboxSpec.uid``, so per-user
kernel limits (inotify instances and the like) are per sandbox. Otherwise every sandbox
has the same one (``workspace_owner``).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mcp_code_sandbox.agent.protocol import (
    HEADER,
    MAX_FRAME_BYTES,
    ProtocolError,
    decode_body,
    encode_frame,
)
from mcp_code_sandbox.errors import SandboxFailed

__all__ = [
    "Backend",
    "Channel",
    "Description",
    "Egress",
    "Enforcement",
    "Leftover",
    "Limits",
    "Sandbox",
    "SandboxSpec",
    "Usage",
    "stop_step",
    "wait_ready",
]

log = logging.getLogger(__name__)

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
    #: is bound by its own filesystem, or watched by the session manager (``sessions.quota``).
    file_bytes: int


@dataclass(frozen=True)
class Egress:
    """A sandbox's way out: a host directory holding the egress proxy's Unix socket (and,
    when the proxy intercepts TLS for secrets, its CA bundle), which the backend binds
    read-only at ``layout.EGRESS_DIR``. The session side opens the proxy, puts the proxy
    variables in ``SandboxSpec.env`` (``layout.egress_env``) and closes it when the
    sandbox stops; a backend only binds the directory (see ``mcp_code_sandbox.egress``)."""

    host_dir: Path
    #: The hosts the last call with network asked for: ``None`` for the server's whole
    #: policy (``network=true``), else a subset of it (its proxy judges by them).
    hosts: tuple[str, ...] | None = None


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
    #: Outbound network, only through the host's egress proxy: ``None`` for none at all.
    #: Either way the sandbox has an empty network namespace (loopback only); the session
    #: side sets it only when the server allows network and the call asks for it.
    egress: Egress | None = None
    #: Environment of every process in the sandbox, on top of the backend's base env.
    env: Mapping[str, str] = field(default_factory=dict)
    #: The host uid (and gid: the same number) the sandbox's processes run as, which owns
    #: the workspace: the session's own (see ``Backend.per_sandbox_uids``). ``None``: the
    #: backend's shared one (``Backend.workspace_owner``).
    uid: int | None = None
    #: Modules the interpreter imports before the sandbox is ready: a pooled sandbox's
    #: warm-up (``sessions.pool``); empty for a session's own.
    preload: tuple[str, ...] = ()
    #: May the sandbox outlive its server, for a successor to re-attach? False (a private
    #: server's, see ``sessions.holder``): it ends itself once its server is gone, where
    #: the backend's sandboxes can outlive a server at all (docker; bwrap's never do).
    outlives_server: bool = True

    @property
    def network(self) -> bool:
        """Does the sandbox have a way out (through its ``egress`` proxy)?"""
        return self.egress is not None


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
    #: The language of a runner's container (:class:`.runner_images.RunnerSandbox`):
    #: never re-attached, as it holds no state but the workspace's files.
    runner: str | None = None
    #: The host uid it runs as, as recorded (``SandboxSpec.uid``); ``None``: none recorded.
    uid: int | None = None
    #: The server that made it still lives (replicas: another may hold its session now,
    #: and the records say which; see ``sessions.records.plan_recovery``).
    creator_alive: bool = False
    #: Wall-clock seconds its session was made, where the backend records it
    #: (:class:`.shared.SharedSandboxes`); ``None``: not recorded.
    created_at: float | None = None
    #: Wall-clock seconds of its session's last noted activity, the same way.
    active_at: float | None = None
    #: Not ``running``, its workspace kept (:attr:`.shared.SharedSandboxes.keeps_workspaces`):
    #: how its session was paused, as the server that paused it recorded it (``{}``: not
    #: recorded). ``None``: nothing is kept of a sandbox that is not running.
    paused: dict[str, Any] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Usage:
    """What one sandbox uses now, as far as its backend can tell (for the operator's
    ``/ui`` page). Semantics: a ``None`` field is unknown here, never zero."""

    memory_bytes: int | None = None
    #: CPU time its processes used (those still running, where the backend can only see
    #: those: bwrap without a cgroup CPU counter).
    cpu_seconds: float | None = None


class Channel:
    """Framed-JSON channel to one agent over an asyncio stream pair.

    ``receive`` returns ``None`` at a clean EOF and raises :class:`ProtocolError` on a
    broken frame; callers translate both into ``SandboxFailed``.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._send_lock = asyncio.Lock()

    async def send(self, message: Mapping[str, Any]) -> None:
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

    def at_eof(self) -> bool:
        """The other end closed the channel and everything it sent was read."""
        return self._reader.at_eof()


class Sandbox(abc.ABC):
    """A running sandbox as one backend sees it. Created only by :meth:`Backend.create`
    (or :meth:`Backend.reattach`), which hand it back once its agent said ``ready``."""

    def __init__(self, spec: SandboxSpec, channel: Channel, backend_id: str) -> None:
        self.spec = spec
        self.channel = channel
        #: The backend's own name for it (a pid, a container id): for logs and leftovers.
        self.backend_id = backend_id
        #: The agent's ``ready`` message (``languages``, ``ipython``, ``pid``; with
        #: ``reattached`` after a re-attach), set by the backend from :func:`wait_ready`.
        #: Read by the run path and the probe for the languages this sandbox has. Empty
        #: only before the backend hands the sandbox out.
        self.ready: dict[str, Any] = {}

    @abc.abstractmethod
    def is_alive(self) -> bool:
        """Called by the session manager before a run, to notice a sandbox that died."""


@dataclass(frozen=True)
class Description:
    """What a backend reports of itself: for ``list_runtimes`` (the service) and
    ``doctor``. Cheap to make: no sandbox is started (see :meth:`Backend.describe`).

    Semantics: ``runtimes`` maps a language to ``version``, ``packages`` {name: version}
    and ``image`` (``None`` for none), or to ``{"available": False}`` when the backend
    knows that language is not installed; a language missing from it is offered with an
    unknown version. ``network_unavailable`` is ``None`` when the backend can bind the
    egress proxy's socket into a sandbox here, else why not.
    """

    #: How each limit is enforced: keys ``memory``, ``cpu``, ``pids``, ``tmp``,
    #: ``file_size``, ``network`` (``list_runtimes`` adds ``workspace``: the session
    #: manager decides that one, see :mod:`mcp_code_sandbox.sessions.quota`).
    enforcement: dict[str, Enforcement]
    runtimes: dict[str, dict[str, Any]]
    network_unavailable: str | None


class Backend(abc.ABC):
    """One way of running sandboxes. Called only by the session manager, and for
    :meth:`describe` and :meth:`check_ready` by the service (and ``doctor``)."""

    name: str
    #: Whether each sandbox can run as a host uid of its own (``SandboxSpec.uid``, which
    #: the session manager then always sets). Semantics: true means the backend uses that
    #: uid for the sandbox's processes and everything it hands them (sockets, files).
    per_sandbox_uids: bool = False
    #: Without ``per_sandbox_uids``: the host uid/gid all sandboxes share, which must own
    #: the workspaces and every file the server writes into them; ``None`` when that is
    #: the server's own uid.
    workspace_owner: tuple[int, int] | None = None
    #: Why a filesystem the server mounts on a workspace directory would not be what the
    #: sandbox sees there, or ``None`` when it would (the sandbox is made from this host's
    #: view of the directory). Fixed at construction; read once at start by
    #: :func:`mcp_code_sandbox.sessions.quota.choose`.
    workspace_mounts_unseen: str | None = None
    #: Whether the sandbox's /mnt/data lives in the sandbox only (a Kubernetes pod's
    #: emptyDir), so that the server reaches its files through the agent
    #: (:mod:`mcp_code_sandbox.sessions.agent_files`); False: the host directory
    #: ``SandboxSpec.workspace`` is what the sandbox sees, and the server opens it.
    workspace_in_sandbox: bool = False
    #: Why no sandbox can start on this host at all, whatever is retried (bwrap: the
    #: kernel refuses user namespaces), with the fix; ``None`` when none was found. Set
    #: by the backend once it knows (at start, or at its first ``create``, which then
    #: raises ``BackendUnavailable`` with it); read by the warm pool, which then stops
    #: starting sandboxes instead of failing every few seconds.
    host_problem: str | None = None

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec, *, mounted: Awaitable[None] | None = None) -> Sandbox:
        """Start a sandbox for ``spec`` and return it once its agent said ``ready``.

        Called by the session manager for a new session, and again for an existing one
        whose sandbox died. Raises ``BackendUnavailable`` when the backend cannot run at
        all and ``SandboxFailed`` when this one sandbox could not start.

        ``mounted``: the workspace's filesystem, which the session manager is still
        mounting on ``spec.workspace`` (a directory already). The backend awaits it before
        the sandbox can see the workspace, after what it can do without it (docker: the
        container's create), so that the two overlap; what it raises, ``create`` raises,
        having freed what it made.
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

    async def reattach(
        self,
        leftover: Leftover,
        spec: SandboxSpec,
        *,
        bound: Callable[[], Awaitable[None]] | None = None,
    ) -> Sandbox | None:
        """Take over a running leftover as the sandbox of ``spec``'s session, or ``None``.
        ``bound`` is awaited once the backend waits for the agent (a replica taking a
        session over asks its holder to let go then); what it raises is raised.

        Called by the session manager at start (its recovery), once per leftover that
        matches a session record (owner, id, key, workspace) still within its lifetime;
        the manager removes the leftover when this returns ``None``. A backend that can
        re-attach waits, bounded, for the sandbox's agent to come back and say ``ready``
        (with ``reattached``), so the session keeps its variables. Never raises for a
        leftover that turns out to be gone or broken: that is ``None`` too.

        The default cannot: sandboxes that die with their server (bwrap's
        ``--die-with-parent``) leave nothing to re-attach to.
        """
        return None

    @abc.abstractmethod
    async def list_leftovers(self, *, live_too: bool = False) -> list[Leftover]:
        """Sandboxes of this backend that no live server owns (``live_too``: those of live
        servers on this state directory too, marked ``creator_alive``: a replica may have
        taken one over). Called by the session manager's recovery."""

    @abc.abstractmethod
    async def remove_leftover(self, leftover: Leftover) -> None:
        """Remove one leftover for good. Called at start by the session manager's
        recovery, for those not re-attached."""

    async def check_ready(self) -> None:  # noqa: B027 - a backend with nothing to ask
        """Raise ``BackendUnavailable`` (saying what to fix) when this backend could not
        start a sandbox now; return when it could.

        Called by the service for the server's ``/readyz`` probe, under a short timeout,
        every few seconds: cheap and real (ask the engine, look for the runtime on disk),
        never a sandbox."""

    @abc.abstractmethod
    def describe(self) -> Description:
        """What this backend enforces, offers and lacks here (see :class:`Description`).

        Called by the service (in a worker thread: it may read a manifest or ask the
        engine once) at start, for ``list_runtimes`` and before a ``network=true`` run
        (whose refusal, ``network_not_allowed``, gives ``network_unavailable``), and by
        ``doctor``. Never starts a sandbox; never raises for an engine that does not
        answer (what it cannot read is left out, and read again on the next call)."""

    async def usage(self, sandbox: Sandbox) -> Usage | None:
        """What ``sandbox`` uses now (memory, CPU time); ``None``: this backend cannot
        tell. Called by the service for the operator's ``/ui`` page, under a short
        timeout; read-only and cheap (a cgroup file, one engine call). Never raises."""
        return None

    async def aclose(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release backend-wide resources. Called by the session manager at server
        shutdown, after every session was ended or paused."""


async def wait_ready(
    sandbox: Sandbox,
    wait_s: float,
    not_ready: Callable[[dict[str, Any] | None, bool], Awaitable[str]],
) -> dict[str, Any]:
    """The agent's ``ready`` message on ``sandbox``'s channel, within ``wait_s``.

    Called by every backend's ``create`` (and Docker's ``reattach``), which then set
    ``sandbox.ready``. When something else comes (a frame that is not ``ready``, EOF, a
    broken frame: ``None``), or nothing within ``wait_s`` (the flag is true), raises
    ``SandboxFailed`` with the text ``not_ready`` makes of it: the backend knows where
    the sandbox's own last words are (a stderr tail, the container's log).
    """
    timed_out = False
    try:
        message = await asyncio.wait_for(sandbox.channel.receive(), wait_s)
    except TimeoutError:
        message, timed_out = None, True
    except (ProtocolError, OSError) as exc:
        message = None
        log.warning("sandbox %s: broken ready frame: %s", sandbox.spec.key, exc)
    if message is not None and message.get("ev") == "ready":
        return message
    raise SandboxFailed(await not_ready(message, timed_out))


async def stop_step(key: str, what: str, step: Awaitable[None]) -> None:
    """Await one step of a backend's ``stop``, logging (never raising) what goes wrong, so
    that the steps after it still free what they can."""
    try:
        await step
    except Exception:
        logging.getLogger(__name__).exception("sandbox %s: cannot %s", key, what)
