"""Runner images: an optional capability of a backend, more languages from images.

A backend that can run a language's own image (Docker: images labelled
``sandbox.runner=true``, see :mod:`.docker.runners`) implements :class:`RunnerImages`
besides :class:`~.base.Backend`; one that cannot (bwrap) does not, and callers ask with
``isinstance(backend, RunnerImages)`` instead of catching an error. A runner needs no
agent: it shares the session's workspace and runs each call as one process.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from mcp_code_sandbox.backends.base import Backend, SandboxSpec
from mcp_code_sandbox.errors import SandboxFailed

__all__ = ["ExecResult", "RunnerImage", "RunnerImages", "RunnerSandbox", "runner_images_of"]


@dataclass(frozen=True)
class RunnerImage:
    """An image that offers one more language (labels ``sandbox.runner=true``,
    ``sandbox.language=<name>``), found by :meth:`RunnerImages.discover_runners`.

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
    :meth:`RunnerImages.create_runner`; stopped by :meth:`RunnerImages.stop_runner`."""

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
        """Run ``code`` once, streaming ``(stream name, text)`` to ``on_output``. Called
        by the run path's runner client, once per call, with the session's lock held.

        On timeout or cancellation the process is killed (with the container, when the
        backend can kill nothing smaller; ``usable`` is then false). Raises
        ``SandboxFailed`` when the process cannot be started."""


@runtime_checkable
class RunnerImages(Protocol):
    """The capability: a backend that offers languages from runner images."""

    async def discover_runners(self, builtin: Collection[str]) -> dict[str, RunnerImage]:
        """Runner images by language, asked of the backend anew on every call (cheap).

        Called by the service at start, on ``list_runtimes`` and for a language not known
        yet. The default image is not a runner, nor is an image claiming one of the
        ``builtin`` languages (the agent's); the backend logs why it left an image out."""
        ...

    async def create_runner(self, spec: SandboxSpec, runner: RunnerImage) -> RunnerSandbox:
        """Start a container of ``runner`` for ``spec``'s session, sharing its workspace.

        Called by the session manager on a session's first call in that language (and
        after a timeout killed the last one). Raises ``SandboxFailed`` or
        ``BackendUnavailable`` like :meth:`Backend.create`."""
        ...

    async def stop_runner(self, sandbox: RunnerSandbox) -> None:
        """Stop and remove a runner's container; never raises for one already gone.
        Called by the session manager when it drops the runner or ends the session."""
        ...


def runner_images_of(backend: Backend) -> RunnerImages:
    """``backend`` as :class:`RunnerImages`. Called by the session manager for a runner's
    language, which only a backend with the capability offers; raises ``SandboxFailed``
    for one without (a caller's slip, said plainly rather than as an AttributeError)."""
    if not isinstance(backend, RunnerImages):
        raise SandboxFailed(f"the {backend.name} backend has no runner images")
    return backend
