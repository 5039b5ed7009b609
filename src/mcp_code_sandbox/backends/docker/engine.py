"""The Docker engine as the backend talks to it: every engine call, and docker-py's errors.

docker-py's exceptions (and the ``requests`` ones it lets through when the engine goes
away mid-call) are translated in :func:`map_docker_error`, and nowhere else; every
blocking docker-py call of the backend goes through :meth:`Engine.call`, which runs it in
a worker thread and maps what it raises. What the backend asks of the engine is built
by the pure :mod:`.spec` (container kwargs) and :mod:`.labels` (what images say).

Also here: :func:`engine_ready` (``auto``'s question) and :func:`instance_alive`, which
tells whether the server that labelled a container still lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

import docker
import docker.errors
import requests.exceptions
from docker.models.containers import RUN_CREATE_KWARGS, RUN_HOST_CONFIG_KWARGS

from mcp_code_sandbox.errors import BackendUnavailable, SandboxError, SandboxFailed
from mcp_code_sandbox.host import process_alive, read_mark

__all__ = [
    "API_TIMEOUT_S",
    "Engine",
    "checkpoint_copy_left",
    "create_container",
    "engine_missing",
    "engine_ready",
    "foreign",
    "instance_alive",
    "map_docker_error",
    "probe_engine",
    "runtime_missing",
    "same_host",
]

log = logging.getLogger(__name__)

#: docker-py's HTTP timeout: an engine that hangs is as good as down.
API_TIMEOUT_S = 30
_T = TypeVar("_T")


def create_container(client: Any, kwargs: Mapping[str, Any]) -> Any:
    """``client.containers.create(**kwargs)`` without the inspect that docker-py sends
    after the create to fill in the model: one engine round trip less on every new
    sandbox. The model holds the id only; ``reload`` fills it in, as every caller that
    reads more than the id already does. Blocking: call it through :meth:`Engine.call`.

    The kwargs are split as ``containers.create`` splits them, by docker-py's own
    lists; one it does not know is a ``TypeError``, as there."""
    create = {key: value for key, value in kwargs.items() if key in RUN_CREATE_KWARGS}
    host = {key: value for key, value in kwargs.items() if key in RUN_HOST_CONFIG_KWARGS}
    unknown = set(kwargs) - set(create) - set(host)
    if unknown:
        raise TypeError(f"unexpected container arguments: {sorted(unknown)}")
    created = client.api.create_container(
        host_config=client.api.create_host_config(**host), **create
    )
    return client.containers.prepare_model({"Id": created["Id"]})


class Engine:
    """The docker-py clients of one backend, made on first use, and the one way to call
    them (:meth:`call`). Called by the docker backend, its sandboxes, runners and
    networks; never by anything above the backend."""

    def __init__(
        self,
        environment: Mapping[str, str],
        *,
        image: str,
        runtime: str,
        exec_timeout_s: float,
    ) -> None:
        """``environment``: the ``DOCKER_*`` variables (``settings.docker_environ``);
        ``image`` and ``runtime`` name the sandbox image and the runtime in errors;
        ``exec_timeout_s`` is the longest a runner's exec may run."""
        self.environment = dict(environment)
        self.image = image
        self.runtime = runtime
        self._exec_timeout_s = exec_timeout_s
        self._client: Any = None
        #: For runners' execs, whose output may pause as long as a run may last: the
        #: main client's timeout would end them.
        self._exec_client: Any = None
        #: The engine said it has ``runtime`` (asked until it does).
        self._runtime_ok = False

    async def call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run one blocking docker-py call in a thread, mapping its errors."""
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except Exception as exc:
            if foreign(exc):
                raise self.map(exc) from None
            raise

    async def call_unless_gone(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> None:
        """Like :meth:`call` for a cleanup step: a container that is gone is fine."""
        try:
            await self.call(fn, *args, **kwargs)
        except SandboxError as exc:
            if not isinstance(exc.__context__, docker.errors.NotFound):
                log.warning("docker cleanup step failed: %s", exc.message)

    def map(self, exc: BaseException) -> SandboxError:
        return map_docker_error(exc, image=self.image, runtime=self.runtime)

    def connect(self) -> Any:
        """The main client (blocking: call it in a thread, or through :meth:`client`)."""
        if self._client is None:
            probe_engine(self.environment)
            self._client = docker.from_env(environment=self.environment, timeout=API_TIMEOUT_S)
        return self._client

    @property
    def connected(self) -> Any:
        """The main client if one was made, else ``None`` (for shutdown's cleanup)."""
        return self._client

    async def client(self) -> Any:
        return await self.call(self.connect)

    async def exec_client(self) -> Any:
        """The client for runners' execs, with a timeout past the longest run."""
        if self._exec_client is None:
            self._exec_client = await self.call(
                docker.from_env,
                environment=self.environment,
                timeout=int(self._exec_timeout_s) + API_TIMEOUT_S,
            )
        return self._exec_client

    async def require_runtime(self, client: Any) -> None:
        """Raise ``BackendUnavailable`` when the engine lacks the configured runtime.

        Asked of the engine (its info lists the registered runtimes), because a create
        without it fails with a message that cannot be told apart, except by its words,
        from a container that failed in the runtime (see ``map_docker_error``). An engine
        whose info lists no runtimes at all is not second-guessed."""
        if self._runtime_ok:
            return
        info = await self.call(client.info)
        registered = info.get("Runtimes") if isinstance(info, dict) else None
        if isinstance(registered, dict):
            missing = runtime_missing(self.runtime, registered)
            if missing is not None:
                raise missing
        self._runtime_ok = True

    def image_labels(self, image: str) -> Mapping[str, str] | None:
        """``image``'s labels, or ``None`` when the engine or the image is not there.
        Blocking: for :meth:`DockerBackend.describe`, which runs in a worker thread."""
        try:
            labels = self.connect().images.get(image).attrs["Config"]["Labels"]
        except Exception as exc:
            if not foreign(exc):
                raise
            return None
        return labels or {}

    def close(self) -> None:
        """Close both clients; never raises. Blocking: see :meth:`aclose`. Called directly
        by ``doctor``, which uses a backend without an event loop."""
        for client in (self._client, self._exec_client):
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()
        self._client = self._exec_client = None

    async def aclose(self) -> None:
        """:meth:`close` in a worker thread (at the backend's ``aclose``)."""
        await asyncio.to_thread(self.close)


def map_docker_error(exc: BaseException, *, image: str, runtime: str) -> SandboxError:
    """docker-py's (and requests') exceptions → our tree. The one place that does it.

    By type and HTTP status, never by words in the engine's message: that text is the
    engine's (and, for a container that fails to start, partly the sandbox's), and the
    same words appear in unrelated errors ("OCI runtime create failed: runc create
    failed: ..." is not a missing runtime). Whether the engine has ``runtime`` at all is
    asked of the engine instead (:func:`runtime_missing`, before a create)."""
    if isinstance(exc, docker.errors.ImageNotFound):
        return BackendUnavailable(
            f"the sandbox image {image} is missing: build it: mcp-code-sandbox image build"
        )
    if isinstance(exc, docker.errors.NotFound):
        return SandboxFailed(f"the Docker engine has no such object: {_short(exc)}")
    if isinstance(exc, docker.errors.APIError):
        status = exc.status_code
        if status is not None and status >= 500:
            return SandboxFailed(f"the Docker engine failed (HTTP {status}): {_short(exc)}")
        return SandboxFailed(f"the Docker engine refused (HTTP {status}): {_short(exc)}")
    if _unreachable(exc):
        return BackendUnavailable(
            f"the Docker engine does not answer ({_short(exc)}): start Docker, "
            "or set SANDBOX_BACKEND=bwrap"
        )
    if isinstance(exc, docker.errors.DockerException):
        return SandboxFailed(f"docker: {_short(exc)}")
    return SandboxFailed(f"docker: {type(exc).__name__}: {_short(exc)}")


def checkpoint_copy_left(exc: SandboxError) -> bool:
    """Whether a start from a checkpoint failed only because containerd still holds the
    copy of that checkpoint it made when the checkpoint was taken (moby/moby#42900).

    Docker hands a checkpoint to containerd as a tar in its content store, both to take
    it and to restore from it; the two tars have one digest, and containerd deletes the
    first at its next garbage collection, not at once. A restore before that is refused
    with "already exists" before anything starts, and the same restore succeeds once
    the collection has run. The engine says so in no status of its own: its words are
    the one sign, read here beside the other readings of docker-py's errors."""
    cause = exc.__context__
    if not isinstance(cause, docker.errors.APIError) or cause.status_code != 500:
        return False
    said = str(cause.explanation or "")
    return "upload checkpoint" in said and said.endswith("already exists")


def _unreachable(exc: BaseException) -> bool:
    """No engine at the other end: a connection or timeout error of requests, an
    ``OSError`` (from :func:`probe_engine`), or docker-py's wrapper of one of those
    (``docker.from_env`` raises ``DockerException`` "from" the connection error)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, docker.errors.APIError):
            return False  # the engine answered (an APIError is an OSError too: first)
        if isinstance(
            current,
            requests.exceptions.ConnectionError | requests.exceptions.Timeout | OSError,
        ):
            return True
        current = current.__cause__ or current.__context__
    return False


def runtime_missing(runtime: str, registered: Collection[str]) -> BackendUnavailable | None:
    """The error for an engine whose ``info()["Runtimes"]`` (``registered``) lacks
    ``runtime``; ``None`` when it has it."""
    if runtime in registered:
        return None
    return BackendUnavailable(
        f"the Docker engine has no runtime {runtime!r} (it has: "
        f"{', '.join(sorted(registered)) or 'none'}): register it in "
        "/etc/docker/daemon.json, or set SANDBOX_DOCKER_RUNTIME=runc"
    )


def _short(exc: BaseException) -> str:
    explanation = getattr(exc, "explanation", None)
    text = str(explanation or exc).strip().replace("\n", " ")
    return text[:300]


def foreign(exc: BaseException) -> bool:
    return isinstance(
        exc, docker.errors.DockerException | requests.exceptions.RequestException | OSError
    )


def probe_engine(environment: Mapping[str, str]) -> None:
    """Raise ``OSError`` when nothing listens on a Unix-socket ``DOCKER_HOST``.

    docker-py leaks its socket when the connect fails (a ResourceWarning per attempt), so
    the common case, no daemon, is answered before docker-py is asked.
    """
    host = environment.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if host.startswith("unix://"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(3)
            probe.connect(host.removeprefix("unix://"))


def engine_ready(environment: Mapping[str, str], image: str) -> bool:
    """For ``auto``: does an engine answer at ``environment``'s DOCKER_HOST, with ``image``?"""
    return engine_missing(environment, image) is None


def engine_missing(environment: Mapping[str, str], image: str) -> str | None:
    """Why ``auto`` cannot use Docker (no engine answers, or it lacks ``image``), in words
    for the start log line; ``None`` when it can."""
    host = environment.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    try:
        probe_engine(environment)
        client = docker.from_env(environment=dict(environment), timeout=3)
    except Exception as exc:
        if not foreign(exc):
            raise
        return f"no Docker engine answers at {host}"
    try:
        client.images.get(image)
    except Exception as exc:
        if not foreign(exc):
            raise
        return f"the Docker engine at {host} has no image {image}"
    finally:
        client.close()
    return None


def same_host(instance: str) -> bool:
    """Was ``instance`` a server on this host (so :func:`instance_alive` can tell)?"""
    return instance.rsplit("-", 2)[0] == socket.gethostname()


def instance_alive(instance: str, ours: str) -> bool:
    """Is ``instance`` (``host-<pid>.<start>-random``, see :mod:`mcp_code_sandbox.host`) this server
    or another live one on this host?

    Servers sharing an engine must not remove each other's sandboxes. The start time
    tells a server from a later process with its pid: a server in a container has the
    same pid at every start of the container, whose host name stays the same too.
    """
    if instance == ours:
        return True
    parts = instance.rsplit("-", 2)
    if len(parts) != 3 or parts[0] != socket.gethostname():
        return False
    mark = read_mark(parts[1])
    return mark is not None and process_alive(*mark)
