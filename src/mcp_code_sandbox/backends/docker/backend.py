"""The Docker backend: one long-running container per sandbox, via docker-py.

The engine is whatever ``DOCKER_HOST`` names (Docker, Podman's compatible socket); the
runtime is ``runc`` or ``runsc`` (gVisor). The container's main process is the agent, as
pid 1 (no engine init: the agent reaps what user code orphans, and unlike tini it is not
dumpable), so the interpreter lives exactly as long as the container. Under runc the
container runs under our seccomp profile (``seccomp.docker_seccomp_profile``).
:func:`container_kwargs` builds the whole ``containers.create`` call and is unit-tested
without an engine.

The channel is a Unix socket, not the container's stdin/stdout. Per sandbox the server
makes a run dir (``<state_dir>/run/<key>-<random>/``) holding a socket it listens on,
bind-mounts that dir read-only at ``/run/mcs`` and starts the agent with ``--connect``;
the first connection is the agent's (no user code runs before it), then the listener
closes. Why not ``attach_socket``: its stdout is multiplexed with 8-byte headers, passes
through dockerd, and lands in the container log (every frame, every PNG, on the
engine's disk); the agent's stdout is a pipe that user code can reopen through
``/proc/<pid>/fd/1``, while a socket cannot be reopened that way. Why the server listens
and the agent connects, not the other way round: under gVisor a socket made inside the
sandbox is not visible on the host unless runsc runs with ``--host-uds=create``, while
connecting out needs only ``--host-uds=open`` (runsc's runtime args must carry it). A
restarted server can bind the same path again, so re-attaching to a running container
needs only the agent to reconnect (see ``mcs_agent.hostlink``, which retries for 10 min):
:meth:`DockerBackend.reattach` does that for the session manager at start.

A server in a container drives its engine through the engine's socket. The engine
resolves mount sources in its own file system, so the workspace and run dir are named to
it as it sees them: by their host paths when the state dir is a bind mount of a host dir
(``deploy/compose.yaml``), or as sub-directories of the named volume the state dir is
(the appliance, ``docker run -i -v mcp-code-sandbox:/var/lib/mcp-code-sandbox ...``);
:mod:`.statedir` decides which from the server's own container, once, and mount sources
the engine reports are mapped back before they are compared with ours. Either way the
socket the server binds in a run dir is the very file the agent connects to.

Uids. A server that can chown (root, or CAP_CHOWN as in ``deploy/compose.yaml``) runs
each session's containers as the session's own host uid (``SandboxSpec.uid``, leased by
the session manager from ``sessions.uids``; gid the same number), not the image's 1000: under
runc the container's uids are the host's, and per-user kernel counters (inotify
instances...) would otherwise be shared by every container and by the host's user 1000.
Nothing in the sandbox needs a passwd entry (HOME is /tmp). The uid is recorded in the
container's ``LABEL_UID``, so a re-attach or a leftover knows it. Under gVisor (runsc)
per-user counters are the sandbox kernel's own anyway; its containers get their own uid
all the same, so that no workspace file on the host belongs to a real user (uid 1000 is
the first user on most hosts). A server that cannot chown runs every container as its
own uid (shared counters; ``doctor`` says so). A rootless or userns-remapped engine maps
uids elsewhere; that is not supported (the server's files would not be the sandbox's).

The socket is owned by the sandbox's uid and mode 0600: only the sandbox may connect,
and on the host only root too.

Every engine call goes through :class:`.engine.Engine`, where docker-py's exceptions (and
the ``requests`` ones it lets through when the engine goes away mid-call) are translated,
and nowhere else; the pure half (container kwargs, labels) is :mod:`.spec` and
:mod:`.labels`. Runner images (:mod:`.runners`) and checkpoints (pausing with the whole
memory, under gVisor) are this backend's optional capabilities
(:class:`~mcp_code_sandbox.backends.runner_images.RunnerImages`,
:class:`~mcp_code_sandbox.backends.checkpoints.Checkpoints`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import socket
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from mcp_code_sandbox.agent.protocol import ProtocolError
from mcp_code_sandbox.backends.base import (
    Backend,
    Description,
    Enforcement,
    Leftover,
    Sandbox,
    SandboxSpec,
    Usage,
    stop_step,
)
from mcp_code_sandbox.backends.checkpoints import Checkpoint, Checkpoints
from mcp_code_sandbox.backends.docker.derived import sandbox_image
from mcp_code_sandbox.backends.docker.engine import (
    Engine,
    checkpoint_copy_left,
    create_container,
    engine_ready,
    instance_alive,
)
from mcp_code_sandbox.backends.docker.labels import RUNNER_FILTER, info_from_labels
from mcp_code_sandbox.backends.docker.runners import (
    DockerRunner,
    choose_runners,
    listed_images,
    runner_kwargs,
    tagged_id,
)
from mcp_code_sandbox.backends.docker.sandbox import (
    DockerSandbox,
    accept_agent,
    bind_listener,
    make_run_dir,
    run_dir_from_label,
    wait_ready,
)
from mcp_code_sandbox.backends.docker.spec import (
    CHANNEL_DIR,
    LABEL_INSTANCE,
    LABEL_KEY,
    LABEL_OWNER,
    LABEL_RUN_DIR,
    LABEL_RUNNER,
    LABEL_SESSION,
    LABEL_UID,
    LABEL_WORKSPACE,
    container_kwargs,
    sandbox_ids,
    uid_from_label,
)
from mcp_code_sandbox.backends.docker.statedir import StateDir, locate, own_container_id
from mcp_code_sandbox.backends.runner_images import RunnerImage, RunnerImages, RunnerSandbox
from mcp_code_sandbox.errors import SandboxError, SandboxFailed
from mcp_code_sandbox.host import can_chown, process_mark
from mcp_code_sandbox.layout import WORKSPACE_DIR
from mcp_code_sandbox.settings import Settings

__all__ = ["DockerBackend", "DockerSandbox", "engine_ready", "no_checkpoints"]

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 30.0
#: How long a restarted server waits for a surviving agent to reconnect: several of the
#: agent's longest pauses between attempts (``hostlink.BACKOFF_MAX_S``, 1 s).
REATTACH_WAIT_S = 10.0
#: The name of a paused container's checkpoint (one per container at most).
CHECKPOINT_NAME = "mcs-pause"
#: Attempts at a checkpoint: a parked agent tries to reconnect every ``PARK_RETRY_S``
#: (``agent.hostlink``), and a checkpoint taken in the middle of a connect attempt fails
#: (a host socket is open).
_CHECKPOINT_TRIES = 3
#: How long a restore waits for containerd to drop its own copy of the checkpoint
#: (:func:`.engine.checkpoint_copy_left`). containerd spaces its garbage collections
#: by fifty times their average length (its 2% pause threshold), and a collection on a
#: busy engine with many images takes tens of milliseconds: seconds between them.
_CHECKPOINT_COPY_WAIT_S = 20.0
#: The longest pause between two tries in that wait.
_CHECKPOINT_COPY_RETRY_S = 1.0


class DockerBackend(Backend, RunnerImages, Checkpoints):
    name = "docker"

    def __init__(
        self,
        settings: Settings,
        environment: Mapping[str, str] | None = None,
        instance: str | None = None,
    ) -> None:
        """``environment``: the ``DOCKER_*`` variables (:func:`settings.docker_environ`).

        ``instance`` names this server process in the containers' labels; containers of
        any other instance are leftovers.
        """
        self.settings = settings
        #: ``SANDBOX_IMAGE``, or the image with ``SANDBOX_RUNTIME_PACKAGES`` (:mod:`.derived`).
        self.image = sandbox_image(settings)
        # Handing a workspace to a session's uid takes CAP_CHOWN; without it, every
        # container runs as the server's uid (``workspace_owner`` None: its own).
        self.per_sandbox_uids = can_chown()
        self.instance = instance or (
            f"{socket.gethostname()}-{process_mark()}-{secrets.token_hex(4)}"
        )
        self.engine = Engine(
            environment or {},
            image=self.image,
            runtime=settings.docker_runtime,
            exec_timeout_s=settings.max_exec_timeout_s,
        )
        #: The container this server runs in, when its engine may know it (see
        #: :mod:`.statedir`); ``None`` on a host, or when the settings map the state dir.
        self.own_container = _own_container() if settings.docker_host_state_dir is None else None
        self.workspace_mounts_unseen = _mounts_unseen(
            settings, self.engine.environment, in_container=self.own_container is not None
        )
        self._state: StateDir | None = None
        self._state_lock = asyncio.Lock()
        self._runtime_info: dict[str, dict[str, Any]] | None = None
        #: Why this engine cannot checkpoint (``None``: it can), once asked.
        self._checkpoint_support: tuple[str | None] | None = None
        #: The engine's data dir (its checkpoint images are under it), read with the above.
        self._engine_root = Path()
        #: Why labelled images were left out, as last logged (logged again on a change).
        self._skipped: list[str] = []

    async def client(self) -> Any:
        """The engine's client (made on first use). Called by this backend and tests."""
        return await self.engine.client()

    # -- the seam ------------------------------------------------------------------------

    def describe(self) -> Description:
        """Limits by the engine's cgroups, languages from the image's labels (read once:
        never what a sandbox's agent said, that is its tenant's, see ``probe``); network
        everywhere, as it is only the egress proxy's socket bound in (see
        :meth:`Backend.describe`)."""
        return Description(
            enforcement=self._enforcement(),
            runtimes=self._runtimes(),
            network_unavailable=None,
        )

    def _enforcement(self) -> dict[str, Enforcement]:
        return {
            "memory": "cgroup",
            "cpu": "cgroup",
            "pids": "cgroup",
            "tmp": "kernel",
            "file_size": "rlimit",
            "network": "kernel",
        }

    def _runtimes(self) -> dict[str, dict[str, Any]]:
        if self._runtime_info is None:
            labels = self.engine.image_labels(self.image)
            if labels is None:
                return {}  # not cached: the engine or the image may come later
            self._runtime_info = info_from_labels(labels, self.image)
        return {lang: dict(entry) for lang, entry in self._runtime_info.items()}

    async def state_dir(self) -> StateDir:
        """How the engine sees the state dir (asked of the engine once, in a container).
        Raises ``BackendUnavailable`` when sandboxes could not see it at all."""
        async with self._state_lock:
            if self._state is None:
                attrs = None
                api = ""
                if self.own_container is not None:
                    client = await self.client()
                    try:
                        found = await self.engine.call(client.containers.get, self.own_container)
                        attrs = found.attrs
                        api = str((await self.engine.call(client.version)).get("ApiVersion", ""))
                    except SandboxError as exc:  # another engine's container: a host view
                        log.info("this server's container is not the engine's: %s", exc.message)
                        attrs = None
                self._state = locate(self.settings, attrs, api)
                if self._state.mapped:
                    log.info("state dir for the engine: %s", self._state.describe())
            return self._state

    def _view(self) -> StateDir:
        return self._state or StateDir.of_settings(self.settings)

    async def check_ready(self) -> None:
        """The engine answers a ping and has the sandbox image."""
        client = await self.client()
        await self.engine.call(client.ping)
        await self.engine.call(client.images.get, self.image)

    async def create(self, spec: SandboxSpec, *, mounted: Awaitable[None] | None = None) -> Sandbox:
        sandbox_ids(spec)  # refuses, before anything is made, to run a sandbox as root
        client = await self.client()
        # No look at the image first: a create without it fails with ImageNotFound, which
        # says the same (``map_docker_error``), and a new session pays one round trip less.
        await self.engine.require_runtime(client)
        state = await self.state_dir()
        run_dir, listener = await asyncio.to_thread(self._listen, spec)
        kwargs = container_kwargs(
            spec,
            self.settings,
            self.image,
            instance=self.instance,
            run_dir=run_dir,
            state=state,
        )
        container: Any = None
        try:
            container = await self.engine.call(create_container, client, kwargs)
            if mounted is not None:  # the create binds the directory; the start, its mount
                await mounted
            await self.engine.call(container.start)
            channel, reader, peer = await accept_agent(
                listener, container, self.engine.call, READY_TIMEOUT_S, self._runsc_hint()
            )
        except BaseException:
            listener.close()
            await self._discard(container, run_dir)
            raise
        listener.close()
        sandbox = DockerSandbox(spec, channel, container, run_dir)
        sandbox.reader, sandbox.peer = reader, peer
        try:
            sandbox.ready = await wait_ready(sandbox, self.engine.call, READY_TIMEOUT_S)
        except BaseException:
            await self.stop(sandbox)
            raise
        return sandbox

    def _listen(self, spec: SandboxSpec) -> tuple[Path, socket.socket]:
        run_dir = make_run_dir(self.settings.run_dir, spec.key)
        return run_dir, bind_listener(run_dir, sandbox_ids(spec))

    def _runsc_hint(self) -> str:
        if self.settings.docker_runtime != "runsc":
            return ""
        # gVisor refuses host Unix sockets unless told otherwise (see the module docstring).
        return (
            "\n(under gVisor the agent can reach the server's socket only when the engine "
            "registers runsc with the runtime argument --host-uds=open)"
        )

    async def stop(self, sandbox: Sandbox) -> None:
        # Each step is tried whatever the one before did (see ``stop_step``).
        assert isinstance(sandbox, DockerSandbox)
        key = sandbox.spec.key
        await stop_step(key, "ask its agent to exit", self._ask_exit(sandbox))
        await stop_step(key, "close its channel", _sync(sandbox.close))
        await stop_step(
            key,
            "stop its container",
            self.engine.call_unless_gone(sandbox.container.stop, timeout=2),
        )
        await stop_step(key, "remove it", self._discard(sandbox.container, sandbox.run_dir))

    async def _ask_exit(self, sandbox: DockerSandbox) -> None:
        if sandbox.is_alive():
            with contextlib.suppress(OSError, ProtocolError, RuntimeError, TimeoutError):
                await asyncio.wait_for(sandbox.channel.send({"op": "shutdown"}), 0.5)
            with contextlib.suppress(SandboxError):
                await self.engine.call(sandbox.container.wait, timeout=1)

    async def _discard(self, container: Any, run_dir: Path | None) -> None:
        """Remove a container and its run dir; never raises (it may be gone already)."""
        if container is not None:
            await self.engine.call_unless_gone(container.remove, force=True)
        if run_dir is not None:
            await asyncio.to_thread(shutil.rmtree, run_dir, True)

    # -- pausing with the whole memory (gVisor) ------------------------------------------
    #
    # Docker's checkpoint API (experimental: the engine must run with "experimental":
    # true) drives ``runsc checkpoint`` and ``runsc restore`` under gVisor. The container
    # is checkpointed with exit (it stops; its memory is an image in the engine's
    # container dir), kept, and restored by starting it from the checkpoint: the same
    # container, so the same bind mounts (workspace, run dir) as gVisor requires. runc
    # would need CRIU, which Debian's 3.17 cannot run on kernels >= 6.13: not offered.
    # gVisor cannot save a connected host Unix socket, so the agent lets go of its
    # channel first (``park``) and reconnects to the run dir's socket after the restore,
    # as after a server restart (:meth:`reattach`). docker-py has no checkpoint calls:
    # its low-level client's own request helpers send them (the engine's REST API).

    async def cannot_checkpoint(self) -> str | None:
        if self._checkpoint_support is not None:
            return self._checkpoint_support[0]
        info: Mapping[str, Any] = {}
        if self.settings.docker_runtime == "runsc":
            try:
                client = await self.client()
                info = await self.engine.call(client.info)
            except SandboxError as exc:  # not a fact of the engine: asked again next time
                return f"the Docker engine did not answer ({exc.message})"
        why = no_checkpoints(self.settings, info)
        self._engine_root = Path(str(info.get("DockerRootDir") or ""))
        self._checkpoint_support = (why,)
        return why

    def refuses_checkpoint(self, sandbox: Sandbox) -> str | None:
        # gVisor (runsc 2022-12-19, Debian 12's) leaves the state of a restored sandbox
        # behind when that sandbox is checkpointed again, and the next restore under the
        # same container id then fails ("id already in use"); Docker restores only into
        # the same container. So a restored container is paused by its variables, and
        # the fresh container its resume starts can be checkpointed again.
        assert isinstance(sandbox, DockerSandbox)
        if sandbox.restored:
            return "gVisor here restores a sandbox from a checkpoint once only"
        return None

    async def checkpoint(self, sandbox: Sandbox) -> Checkpoint:
        assert isinstance(sandbox, DockerSandbox)
        why = await self.cannot_checkpoint() or self.refuses_checkpoint(sandbox)
        if why is not None:
            raise SandboxFailed(why)
        sandbox.close()  # the agent let go of its end (park); ours goes too
        client = await self.client()
        container_id = str(sandbox.container.id)
        for attempt in range(_CHECKPOINT_TRIES):
            try:
                await self.engine.call(_create_checkpoint, client.api, container_id)
                break
            except SandboxError:
                if attempt == _CHECKPOINT_TRIES - 1:
                    raise
                await asyncio.sleep(0.05)
        root = self._engine_root  # read by cannot_checkpoint(), which said yes above
        image = root / "containers" / container_id / "checkpoints" / CHECKPOINT_NAME
        size = await asyncio.to_thread(_tree_bytes, image) if root.is_absolute() else None
        return Checkpoint(backend_id=container_id, bytes=size)

    async def unpark(self, sandbox: Sandbox) -> Sandbox:
        assert isinstance(sandbox, DockerSandbox)
        back = await self._take_back(
            sandbox.container, sandbox.run_dir, sandbox.spec, REATTACH_WAIT_S
        )
        back.restored = sandbox.restored
        return back

    async def restore(self, checkpoint: Checkpoint, spec: SandboxSpec) -> Sandbox:
        client = await self.client()
        try:
            container = await self.engine.call(client.containers.get, checkpoint.backend_id)
        except SandboxError as exc:
            raise SandboxFailed(f"the paused sandbox is gone ({exc.message})") from None
        run_dir = run_dir_from_label(
            self.settings.run_dir, (container.labels or {}).get(LABEL_RUN_DIR)
        )
        if run_dir is None or not run_dir.is_dir():
            raise SandboxFailed("the paused sandbox's run dir is gone")

        async def start() -> None:
            await self._start_from_checkpoint(client.api, checkpoint.backend_id)

        try:
            sandbox = await self._take_back(container, run_dir, spec, READY_TIMEOUT_S, start)
        except BaseException:
            await self._discard(container, run_dir)
            raise
        sandbox.restored = True
        # The image has served: it is not kept beside a running container.
        await self.engine.call_unless_gone(_delete_checkpoint, client.api, checkpoint.backend_id)
        return sandbox

    async def _start_from_checkpoint(self, api: Any, container_id: str) -> None:
        """Start ``container_id`` from its checkpoint, waiting out containerd's copy of it
        (:data:`_CHECKPOINT_COPY_WAIT_S`); any other failure is raised at once."""
        deadline = time.monotonic() + _CHECKPOINT_COPY_WAIT_S
        pause = 0.1
        while True:
            try:
                await self.engine.call(_start_from_checkpoint, api, container_id)
                return
            except SandboxError as exc:
                if not checkpoint_copy_left(exc) or time.monotonic() + pause > deadline:
                    raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, _CHECKPOINT_COPY_RETRY_S)

    async def _take_back(
        self,
        container: Any,
        run_dir: Path,
        spec: SandboxSpec,
        wait_s: float,
        start: Callable[[], Awaitable[None]] | None = None,
    ) -> DockerSandbox:
        """Listen again on ``run_dir``'s socket (replacing the old one), ``start`` the
        container if asked, and take its agent's reconnection: the sandbox, once its agent
        said ``ready`` with ``reattached`` (its interpreter kept), within ``wait_s`` of
        the start. For a re-attach after a restart, a restore and a parked agent taken back. Raises
        ``SandboxError`` (its channel closed) otherwise."""
        listener = await asyncio.to_thread(bind_listener, run_dir, sandbox_ids(spec), replace=True)
        try:
            if start is not None:
                await start()
            deadline = time.monotonic() + wait_s
            channel, reader, peer = await accept_agent(
                listener, container, self.engine.call, wait_s
            )
        finally:
            listener.close()
        sandbox = DockerSandbox(spec, channel, container, run_dir)
        sandbox.reader, sandbox.peer = reader, peer
        try:
            ready = await wait_ready(
                sandbox, self.engine.call, max(1.0, deadline - time.monotonic())
            )
            if not ready.get("reattached"):  # a fresh agent: the interpreter is gone
                raise SandboxFailed("the sandbox's agent came back afresh")
        except BaseException:
            sandbox.close()
            raise
        sandbox.ready = ready
        return sandbox

    async def discard(self, checkpoint: Checkpoint) -> None:
        client = await self.client()
        try:
            container = await self.engine.call(client.containers.get, checkpoint.backend_id)
        except SandboxError:
            return  # gone already
        name = (container.labels or {}).get(LABEL_RUN_DIR)
        await self._discard(container, run_dir_from_label(self.settings.run_dir, name))

    async def list_leftovers(self, *, live_too: bool = False) -> list[Leftover]:
        client = await self.client()
        await self.state_dir()  # the view _bound_dir maps sources with
        # Sparse: the list endpoint's data only. Not sparse, docker-py inspects each
        # container after listing, and one removed in between (by another server, or a
        # test) would fail the whole start with "No such container".
        found = await self.engine.call(
            client.containers.list, all=True, sparse=True, filters={"label": LABEL_INSTANCE}
        )
        leftovers = []
        for container in found:
            labels: dict[str, str] = container.attrs.get("Labels") or {}
            creator_alive = instance_alive(labels.get(LABEL_INSTANCE, ""), self.instance)
            if creator_alive and not live_too:
                continue
            if (creator_alive or container.status in ("created", "running")) and (
                not self._same_state_dir(container.attrs)
            ):
                # Another state dir's: its own server re-attaches it or removes it. Its
                # agent exits after 10 min without a host, and then any server may.
                continue
            leftovers.append(
                Leftover(
                    backend_id=str(container.id),
                    key=labels.get(LABEL_KEY),
                    owner=labels.get(LABEL_OWNER),
                    session_id=labels.get(LABEL_SESSION),
                    running=container.status == "running",
                    workspace=self._bound_dir(container.attrs, WORKSPACE_DIR),
                    runner=labels.get(LABEL_RUNNER),
                    uid=uid_from_label(labels.get(LABEL_UID)),
                    creator_alive=creator_alive,
                )
            )
        return leftovers

    def _same_state_dir(self, attrs: Mapping[str, Any]) -> bool:
        """Is the container's run dir in this server's state dir? (Unknown: yes.)"""
        if _mount_source(attrs, CHANNEL_DIR) is None:
            return True
        channel_dir = self._bound_dir(attrs, CHANNEL_DIR)
        base = self.settings.run_dir
        return channel_dir is not None and channel_dir.parent in (base, base.resolve())

    def _bound_dir(self, attrs: Mapping[str, Any], destination: str) -> Path | None:
        """The directory mounted at ``destination``, as this server sees it (see
        :meth:`.statedir.StateDir.server_path`); ``None`` when there is none or it is not
        ours. A sub-directory of our volume is named by the container's labels: the
        engine's list of mounts names the volume only."""
        view = self._view()
        volume = _volume_name(attrs, destination)
        if volume is not None:
            if volume != view.volume:
                return None
            labels: Mapping[str, str] = attrs.get("Labels") or {}
            if destination == CHANNEL_DIR:
                return run_dir_from_label(self.settings.run_dir, labels.get(LABEL_RUN_DIR))
            return _in_state_dir(view.server_dir, labels.get(LABEL_WORKSPACE))
        source = _mount_source(attrs, destination)
        return None if source is None else view.server_path(source)

    async def reattach(
        self,
        leftover: Leftover,
        spec: SandboxSpec,
        *,
        bound: Callable[[], Awaitable[None]] | None = None,
    ) -> Sandbox | None:
        """Listen again on the leftover's socket path and take its agent's reconnection.

        The old socket file (of the dead server) is replaced; the agent, retrying since
        its channel reached EOF, connects within a second and says ``ready`` with
        ``reattached``. ``None`` when the container is gone or stopped, its run dir is
        not there, or its agent does not come back within ``REATTACH_WAIT_S``.
        """
        client = await self.client()
        try:
            container = await self.engine.call(client.containers.get, leftover.backend_id)
        except SandboxError:
            return None
        run_dir = run_dir_from_label(
            self.settings.run_dir, (container.labels or {}).get(LABEL_RUN_DIR)
        )
        if container.status != "running" or run_dir is None:
            return None
        try:
            sandbox = await self._take_back(container, run_dir, spec, REATTACH_WAIT_S, bound)
        except SandboxError as exc:
            log.warning("cannot re-attach to %s: %s", leftover.backend_id, exc.message)
            return None
        # One that had network keeps none: its egress proxy died with its server (the
        # socket it has bound refuses), so it is taken back as without network, and a
        # call with network=true starts a new sandbox with a new proxy.
        return sandbox

    async def remove_leftover(self, leftover: Leftover) -> None:
        client = await self.client()
        try:
            container = await self.engine.call(client.containers.get, leftover.backend_id)
        except SandboxError:
            return  # gone already
        name = (container.labels or {}).get(LABEL_RUN_DIR)
        await self._discard(container, run_dir_from_label(self.settings.run_dir, name))

    # -- runner images -------------------------------------------------------------------

    async def discover_runners(self, builtin: Collection[str]) -> dict[str, RunnerImage]:
        client = await self.client()
        # The list endpoint alone (docker-py's images.list inspects each image after
        # listing, and one removed in between would fail the whole discovery).
        labelled = await self.engine.call(client.api.images, filters=RUNNER_FILTER)
        # The default image is labelled as a runner too, so the list usually names it:
        # one engine call per list_runtimes, not two.
        default_id = tagged_id(labelled, self.image)
        if default_id is None:
            try:
                default_id = (await self.engine.call(client.images.get, self.image)).id
            except SandboxError:
                default_id = None  # create() says so; runners can still be offered
        runners, skipped = choose_runners(
            listed_images(labelled), default_image_id=default_id, taken=builtin
        )
        if skipped != self._skipped:
            for line in skipped:
                log.warning("runner image left out: %s", line)
            self._skipped = skipped
        return runners

    async def create_runner(self, spec: SandboxSpec, runner: RunnerImage) -> RunnerSandbox:
        sandbox_ids(spec)  # as in create
        client = await self.client()
        try:
            await self.engine.call(client.images.get, runner.image_id)
        except SandboxError:
            raise SandboxFailed(
                f"the image {runner.image} that offered {runner.language!r} is gone; "
                "list_runtimes shows what is offered now"
            ) from None
        await self.engine.require_runtime(client)
        state = await self.state_dir()
        run_dir = await asyncio.to_thread(
            make_run_dir, self.settings.run_dir, f"{spec.key}-{runner.language}"
        )
        kwargs = runner_kwargs(
            spec, self.settings, runner, instance=self.instance, run_dir=run_dir, state=state
        )
        container: Any = None
        try:
            container = await self.engine.call(client.containers.create, **kwargs)
            await self.engine.call(container.start)
        except BaseException:
            await self._discard(container, run_dir)
            raise
        api = (await self.engine.exec_client()).api
        return DockerRunner(spec, runner, container, run_dir, api=api, call=self.engine.call)

    async def stop_runner(self, sandbox: RunnerSandbox) -> None:
        assert isinstance(sandbox, DockerRunner)
        await stop_step(
            sandbox.spec.key, "remove its runner", self._discard(sandbox.container, sandbox.run_dir)
        )

    async def usage(self, sandbox: Sandbox) -> Usage | None:
        """The engine's one-shot stats of the container (memory in use, CPU time);
        ``None`` when the engine does not answer (never raises: a page view)."""
        if not isinstance(sandbox, DockerSandbox):
            return None
        try:
            stats = await self.engine.call(sandbox.container.stats, stream=False, one_shot=True)
        except SandboxError:
            return None
        return _usage_of(stats if isinstance(stats, dict) else {})

    async def aclose(self) -> None:
        await self.engine.aclose()


def _usage_of(stats: Mapping[str, Any]) -> Usage:
    """Docker's stats JSON → :class:`Usage` (``memory_stats.usage``,
    ``cpu_stats.cpu_usage.total_usage`` in ns); what is missing stays unknown."""
    memory = (stats.get("memory_stats") or {}).get("usage")
    cpu_ns = ((stats.get("cpu_stats") or {}).get("cpu_usage") or {}).get("total_usage")
    return Usage(
        memory_bytes=memory if isinstance(memory, int) else None,
        cpu_seconds=cpu_ns / 1e9 if isinstance(cpu_ns, int) else None,
    )


def _mounts_unseen(
    settings: Settings, environment: Mapping[str, str], *, in_container: bool = False
) -> str | None:
    """``Backend.workspace_mounts_unseen``: the engine resolves a bind's source in its own
    mount namespace, so a mount made by a server in a container, or on another host, is
    not there."""
    if settings.docker_host_state_dir is not None:
        return "the server runs in a container (SANDBOX_DOCKER_HOST_STATE_DIR is set)"
    if in_container:
        return "the server runs in a container, whose mounts the engine does not see"
    host = environment.get("DOCKER_HOST", "")
    if host and not host.startswith("unix://"):
        return f"the Docker engine may be on another host (DOCKER_HOST={host})"
    return None


def no_checkpoints(settings: Settings, info: Mapping[str, Any]) -> str | None:
    """Why this engine cannot checkpoint sandboxes (``None``: it can), from its
    ``info``. Also for ``doctor``."""
    if settings.docker_runtime != "runsc":
        return (
            "only gVisor (SANDBOX_DOCKER_RUNTIME=runsc) can checkpoint here: runc needs "
            "CRIU, which does not run on this kernel generation"
        )
    if info.get("ExperimentalBuild"):
        return None
    return (
        'the Docker engine does not offer checkpoints: set "experimental": true in '
        "/etc/docker/daemon.json and restart dockerd (scripts/docker-engine.sh does)"
    )


def _create_checkpoint(api: Any, container_id: str) -> None:
    url = api._url("/containers/{0}/checkpoints", container_id)
    api._raise_for_status(api._post_json(url, data={"CheckpointID": CHECKPOINT_NAME, "Exit": True}))


def _start_from_checkpoint(api: Any, container_id: str) -> None:
    url = api._url("/containers/{0}/start", container_id)
    api._raise_for_status(api._post(url, params={"checkpoint": CHECKPOINT_NAME}))


def _delete_checkpoint(api: Any, container_id: str) -> None:
    url = api._url("/containers/{0}/checkpoints/{1}", container_id, CHECKPOINT_NAME)
    api._raise_for_status(api._delete(url))


def _tree_bytes(path: Path) -> int | None:
    """Bytes the files under ``path`` take on disk (the engine's dir: readable by root
    only): their allocated blocks, not their sizes (a sparse memory image holds no disk
    for its holes); ``None`` when it cannot be read."""
    total = 0
    try:
        for entry in path.rglob("*"):
            if entry.is_file() and not entry.is_symlink():
                total += entry.lstat().st_blocks * 512
    except OSError:
        return None
    return total if path.is_dir() else None


async def _sync(fn: Callable[[], object]) -> None:
    fn()


def _own_container() -> str | None:
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            return own_container_id(f.read())
    except OSError:
        return None


def _volume_name(attrs: Mapping[str, Any], destination: str) -> str | None:
    """The named volume mounted at ``destination``, from a container's (list) attrs."""
    for mount in attrs.get("Mounts") or []:
        if mount.get("Destination") == destination and mount.get("Type") == "volume":
            return str(mount.get("Name") or "") or None
    return None


def _in_state_dir(state_dir: Path, relative: str | None) -> Path | None:
    """``state_dir / relative`` for a label's relative path; ``None`` for anything else."""
    if not relative or relative.startswith("/") or ".." in Path(relative).parts:
        return None
    return state_dir / relative


def _mount_source(attrs: Mapping[str, Any], destination: str) -> Path | None:
    """The host directory bound at ``destination``, from a container's (list) attrs."""
    for mount in attrs.get("Mounts") or []:
        if mount.get("Destination") == destination and mount.get("Source"):
            return Path(mount["Source"])
    return None
