"""Runner images: more languages from images labelled ``sandbox.runner=true``.

An image offers a language with labels, and needs nothing of ours inside::

    LABEL sandbox.runner="true" \\
          sandbox.language="ruby" \\
          sandbox.command='["ruby", "{file}"]' \\
          sandbox.extension=".rb" \\
          sandbox.version="3.3"

``sandbox.command`` (a JSON array; default ``["<language>", "{file}"]``) is run once per
call, with ``{file}`` replaced by the path of a file holding the code. The image needs
``/bin/sh`` and ``sleep``: its container's main process is a shell that waits, and every
call is a ``docker exec`` into it. The container gets everything a session's main
container gets (no network unless allowed, no capabilities, read-only root, the same
limits, the session's host uid) and the session's workspace at ``/mnt/data``, so the
languages of one session share its files. The code file is written by the server into
the runner's own run dir, bound read-only at ``/run/mcs``: never into the workspace.

A timeout or a cancellation kills the container (an exec'd process cannot be signalled
through the engine's API); the next call starts a new one. Runner languages keep no
state between calls but files, so nothing is lost that the result must report.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import os
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from mcp_code_sandbox.backends.base import SandboxSpec
from mcp_code_sandbox.backends.docker.labels import runner_from_labels
from mcp_code_sandbox.backends.docker.spec import (
    CHANNEL_DIR,
    LABEL_RUNNER,
    container_kwargs,
    sandbox_ids,
)
from mcp_code_sandbox.backends.docker.statedir import StateDir
from mcp_code_sandbox.backends.runner_images import ExecResult, RunnerImage, RunnerSandbox
from mcp_code_sandbox.layout import WORKSPACE_DIR
from mcp_code_sandbox.settings import Settings

__all__ = [
    "DockerRunner",
    "choose_runners",
    "listed_images",
    "runner_kwargs",
    "tagged_id",
]

#: The runner container's main process: wait, doing nothing, until stopped.
KEEPALIVE = ("/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done")
#: How long the engine's output thread waits for the event loop to take one chunk.
_DELIVER_WAIT_S = 5.0

Call = Callable[..., Awaitable[Any]]


def listed_images(
    listed: Iterable[Mapping[str, Any]],
) -> list[tuple[str, str, float, Mapping[str, str]]]:
    """``(name, id, created, labels)`` of the engine's image list (``client.api.images``);
    the name is the first real tag, or "" (untagged images list ``<none>:<none>``)."""
    out = []
    for image in listed:
        tags = image.get("RepoTags") or []
        name = next((tag for tag in tags if not tag.startswith("<none>")), "")
        created = image.get("Created")
        out.append(
            (
                name,
                str(image.get("Id")),
                float(created) if isinstance(created, int | float) else 0.0,
                image.get("Labels") or {},
            )
        )
    return out


def tagged_id(listed: Iterable[Mapping[str, Any]], image: str) -> str | None:
    """The id of the image tagged ``image`` in the engine's image list, or ``None`` when
    no listed image carries that very tag (then ask the engine: ``image`` may be an id, a
    digest, or an image the list left out). A name without a tag means ``:latest``, as
    the engine reads it. Saves :meth:`DockerBackend.discover_runners` an inspect."""
    last = image.rsplit("/", 1)[-1]
    tag = image if ":" in last or "@" in last else f"{image}:latest"
    for entry in listed:
        if tag in (entry.get("RepoTags") or []):
            return str(entry.get("Id"))
    return None


def choose_runners(
    images: Iterable[tuple[str, str, float, Mapping[str, str]]],
    *,
    default_image_id: str | None,
    taken: Iterable[str],
) -> tuple[dict[str, RunnerImage], list[str]]:
    """Runners by language from ``(name, id, created, labels)`` of labelled images
    (``created`` in seconds since the epoch, as the engine lists it).

    The default image is not a runner (its agent serves its languages), nor is an image
    without a tag (``name`` empty: a dangling old build) or one claiming a language in
    ``taken``. When two images claim one language, the newest
    wins. Returns the runners and one line per image left out, for the log and doctor.
    """
    taken = set(taken)
    chosen: dict[str, tuple[float, RunnerImage]] = {}
    skipped: list[str] = []
    for name, image_id, created, labels in images:
        if image_id == default_image_id or not name:
            continue  # the default image, or an untagged (dangling) one
        runner, why = runner_from_labels(labels, name, image_id)
        if runner is None:
            skipped.append(f"{name}: {why}")
            continue
        if runner.language in taken:
            skipped.append(f"{name}: language {runner.language!r} is built in")
            continue
        previous = chosen.get(runner.language)
        if previous is not None:
            older, newer = sorted([previous, (created, runner)], key=lambda pair: pair[0])
            skipped.append(f"{older[1].image}: {runner.language!r} is offered by a newer image")
            chosen[runner.language] = newer
        else:
            chosen[runner.language] = (created, runner)
    return {lang: runner for lang, (_, runner) in sorted(chosen.items())}, skipped


def runner_kwargs(
    spec: SandboxSpec,
    settings: Settings,
    runner: RunnerImage,
    *,
    instance: str,
    run_dir: Path,
    state: StateDir | None = None,
) -> dict[str, Any]:
    """``containers.create`` kwargs for a runner: a session's sandbox, another main process."""
    kwargs = container_kwargs(
        spec, settings, runner.image_id, instance=instance, run_dir=run_dir, state=state
    )
    kwargs["entrypoint"] = list(KEEPALIVE[:1])
    kwargs["command"] = list(KEEPALIVE[1:])
    kwargs["working_dir"] = WORKSPACE_DIR
    kwargs["init"] = True  # the keep-alive shell reaps nothing: tini does
    kwargs["labels"] = {**kwargs["labels"], LABEL_RUNNER: runner.language}
    return kwargs


class DockerRunner(RunnerSandbox):
    """A runner's container; each :meth:`execute` is one ``docker exec``."""

    def __init__(
        self,
        spec: SandboxSpec,
        runner: RunnerImage,
        container: Any,
        run_dir: Path,
        *,
        api: Any,
        call: Call,
    ) -> None:
        super().__init__(spec, runner, backend_id=str(container.id))
        self.container = container
        self.run_dir = run_dir
        self._api = api
        self._call = call
        self._runs = 0

    def _argv(self, path: str) -> list[str]:
        return [part.replace("{file}", path) for part in self.runner.command]

    async def execute(
        self,
        code: bytes,
        *,
        timeout_s: float,
        env: Mapping[str, str],
        on_output: Callable[[str, str], None],
    ) -> ExecResult:
        self._runs += 1
        name = f"code-{self._runs}{self.runner.suffix}"
        ids = sandbox_ids(self.spec)
        await asyncio.to_thread(_write_code, self.run_dir, name, code, ids)
        try:
            exec_id = (
                await self._call(
                    self._api.exec_create,
                    self.container.id,
                    self._argv(f"{CHANNEL_DIR}/{name}"),
                    stdout=True,
                    stderr=True,
                    stdin=False,
                    tty=False,
                    environment=dict(env),
                    workdir=WORKSPACE_DIR,
                    user="{}:{}".format(*ids),
                )
            )["Id"]
            loop = asyncio.get_running_loop()
            pump = asyncio.ensure_future(self._call(self._pump, loop, exec_id, on_output))
            try:
                await asyncio.wait_for(asyncio.shield(pump), timeout_s)
            except TimeoutError:
                await self._kill(pump)
                return ExecResult(None, "timeout")
            except asyncio.CancelledError:
                await asyncio.shield(self._kill(pump))
                raise
            info = await self._call(self._api.exec_inspect, exec_id)
        finally:
            await asyncio.to_thread(_remove_code, self.run_dir, name)
        code_ = info.get("ExitCode")
        return ExecResult(code_ if isinstance(code_, int) else None)

    def _pump(
        self,
        loop: asyncio.AbstractEventLoop,
        exec_id: str,
        on_output: Callable[[str, str], None],
    ) -> None:
        """In a thread: the exec's output, handed to the event loop chunk by chunk (and
        waiting for it, so a flood cannot pile up in memory faster than it is cut)."""
        decoders = {
            name: codecs.getincrementaldecoder("utf-8")("replace") for name in ("stdout", "stderr")
        }

        def deliver(name: str, data: bytes, final: bool = False) -> None:
            text = decoders[name].decode(data, final)
            if not text:
                return
            taken = threading.Event()

            def emit() -> None:
                try:
                    on_output(name, text)
                finally:
                    taken.set()

            loop.call_soon_threadsafe(emit)
            taken.wait(_DELIVER_WAIT_S)

        stream = self._api.exec_start(exec_id, stream=True, demux=True)
        try:
            for out, err in stream:
                if out:
                    deliver("stdout", out)
                if err:
                    deliver("stderr", err)
        finally:
            _close_stream(stream)
        deliver("stdout", b"", True)
        deliver("stderr", b"", True)

    async def _kill(self, pump: asyncio.Future[Any]) -> None:
        self.usable = False
        with contextlib.suppress(Exception):
            await self._call(self.container.kill)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(pump, 10)


def _close_stream(stream: Any) -> None:
    """Close an exec's output stream and its connection's socket.

    docker-py reads the stream from the raw socket, so urllib3 never learns that the
    response ended: neither ``CancellableStream.close`` (a no-op once the body was read)
    nor the pool closes the socket, and one leaks per exec."""
    response = getattr(stream, "_response", None)
    with contextlib.suppress(Exception):
        stream.close()
    connection = getattr(getattr(response, "raw", None), "connection", None)
    with contextlib.suppress(Exception):
        if response is not None:
            response.close()
        if connection is not None:
            connection.close()


def _write_code(run_dir: Path, name: str, code: bytes, ids: tuple[int, int]) -> None:
    fd = os.open(run_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(code)
        while view:
            view = view[os.write(fd, view) :]
        if ids != (os.geteuid(), os.getegid()):
            os.fchown(fd, *ids)
    finally:
        os.close(fd)


def _remove_code(run_dir: Path, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(run_dir / name)
