"""The host's side of a runner language: an :class:`.executor.Executor`, as
:class:`.agent_client.AgentClient` is for the agent's languages, so the run path treats
both alike.

A runner (see :mod:`..backends.docker.runners`) keeps no state between calls but the
workspace's files, so a container that had to be replaced loses nothing a result must
report: ``state_lost`` stays false.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from mcp_code_sandbox.backends.runner_images import ExecResult, RunnerSandbox
from mcp_code_sandbox.errors import SandboxFailed
from mcp_code_sandbox.sessions.executor import Cell, Outcome, StreamSink

__all__ = ["RunnerClient", "outcome_of"]


class RunnerClient:
    """The executor of a session's container of one runner image. Made by
    :meth:`.manager.SessionManager.executor`, which gives it the container and how to
    replace it (``replace``: stop this one, start another; the manager's to decide)."""

    def __init__(
        self, sandbox: RunnerSandbox, replace: Callable[[], Awaitable[RunnerSandbox]]
    ) -> None:
        self._sandbox = sandbox
        self._replace = replace

    async def execute(self, cell: Cell, on_stream: StreamSink) -> Outcome:
        """Run ``code`` in the container; one that died since the last call (``docker
        kill``, an engine restart) is replaced once. (``budget`` has nothing to bound
        here: a runner's output is only streams.)"""
        data, timeout_s = cell.code.encode("utf-8"), cell.timeout_s
        try:
            result = await self._sandbox.execute(
                data, timeout_s=timeout_s, env=cell.env, on_output=on_stream
            )
        except SandboxFailed:
            self._sandbox = await self._replace()
            result = await self._sandbox.execute(
                data, timeout_s=timeout_s, env=cell.env, on_output=on_stream
            )
        return outcome_of(result, timeout_s)


def outcome_of(result: ExecResult, timeout_s: float) -> Outcome:
    """A runner's exit as the run's outcome: killed at its deadline is ``timeout``."""
    if result.reason is not None:  # killed at its deadline (a cancellation raises)
        error = {
            "name": "Timeout",
            "value": f"the program did not finish within {timeout_s:g} s and was killed; "
            "files in /mnt/data are kept",
            "traceback": "",
        }
        return Outcome("timeout", None, None, error, None, state_lost=False)
    status = "ok" if result.exit_code == 0 else "error"
    return Outcome(status, result.exit_code, None, None, None, state_lost=False)
