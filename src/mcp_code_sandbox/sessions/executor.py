"""What runs one cell for a session: the :class:`Executor` protocol and its one result.

The session manager hands out an executor for a session, a language and a network wish
(:meth:`.manager.SessionManager.executor`); the run path (:mod:`..run.execute`) calls it
once per ``run_code`` and never learns which kind it got. Two implement it:
:class:`.agent_client.AgentClient` (the agent's languages, in the session's sandbox) and
:class:`.runner_client.RunnerClient` (a runner image's language, in its own container).

It lives here, below the run path, because the manager makes and replaces what executes:
the run path only goes down to it (see the layering in :mod:`..sessions`).

One result shape: the agent's ``done`` message becomes an :class:`Outcome` at the agent's
side of the channel, and :class:`..run.execute.RunReport` is the whole run (output,
files, timing) built around it once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from mcp_code_sandbox.agent.budget import Budget
from mcp_code_sandbox.errors import SandboxFailed

__all__ = ["Cell", "Display", "Executor", "Guarded", "Outcome", "StreamSink", "WithEnv", "lost"]

#: Receives ``(stream name, text)`` as output arrives: ``stdout`` or ``stderr``.
StreamSink = Callable[[str, str], None]


@dataclass(frozen=True)
class Cell:
    """One cell to run: what :meth:`Executor.execute` is asked to do."""

    language: str
    code: str
    #: The run's deadline; the executor interrupts (then kills) the code past it.
    timeout_s: float
    #: The call's own environment variables (checked by the run path's request checks).
    env: dict[str, str] = field(default_factory=dict)
    #: What the cell may send back (``None``: the agent's default); runners ignore it.
    budget: Budget | None = None


@dataclass(frozen=True)
class Display:
    """One rich output of a run: a figure or a ``display()`` call."""

    source: str
    mime_type: str
    #: Decoded bytes for images (PNG); UTF-8 text for text types and SVG.
    data: bytes


@dataclass
class Outcome:
    """How one cell ended: the agent's ``done`` message (or a runner's exit), plus the
    rich outputs that came before it."""

    status: str
    exit_code: int | None
    result: str | None
    error: dict[str, str] | None
    execution_count: int | None
    state_lost: bool
    displays: list[Display] = field(default_factory=list)
    #: What the budget cut, as counts: ``result`` and ``error`` (0 or 1), and
    #: ``displays_dropped`` / ``displays_cut`` / ``images_dropped`` /
    #: ``displays_unsupported``. Empty: nothing.
    cut: dict[str, int] = field(default_factory=dict)


def lost(reason: str) -> Outcome:
    """The outcome of a run whose sandbox died under it: nothing came back, and the
    interpreter's state is gone with the sandbox."""
    error = {"name": "SandboxDied", "value": reason, "traceback": ""}
    return Outcome("error", None, None, error, None, state_lost=True)


class Executor(Protocol):
    """Runs one cell in a session's sandbox. Called by :func:`..run.execute.run` with the
    session's lock held, so at most one call is in flight per executor."""

    async def execute(self, cell: Cell, on_stream: StreamSink) -> Outcome:
        """Run ``cell`` within its deadline and budget, streaming output to ``on_stream``.
        User code that fails is an outcome, not an exception. Raises ``SandboxFailed``
        when the sandbox broke in a way this executor could not repair; a cancellation
        interrupts the code first."""
        ...


class WithEnv:
    """An executor whose every cell gets ``env`` under the call's own (the call's wins):
    a sandbox's variables that its backend keeps out of the sandbox's spec (the egress
    proxy's URL behind the gate, see :mod:`.egress`)."""

    def __init__(self, inner: Executor, env: dict[str, str]) -> None:
        self._inner = inner
        self._env = env

    async def execute(self, cell: Cell, on_stream: StreamSink) -> Outcome:
        with_env = dataclasses.replace(cell, env={**self._env, **cell.env})
        return await self._inner.execute(with_env, on_stream)


class Guarded:
    """An executor whose sandbox failing under a run (it died, broke the protocol,
    stopped answering: ``SandboxFailed``) is handed to ``failed``, which decides what
    becomes of the sandbox and returns the run's outcome. The session manager wraps the
    agent in one (:meth:`.manager.SessionManager.executor`)."""

    def __init__(
        self, inner: Executor, failed: Callable[[SandboxFailed], Awaitable[Outcome]]
    ) -> None:
        self._inner = inner
        self._failed = failed

    async def execute(self, cell: Cell, on_stream: StreamSink) -> Outcome:
        try:
            return await self._inner.execute(cell, on_stream)
        except SandboxFailed as exc:
            return await self._failed(exc)
