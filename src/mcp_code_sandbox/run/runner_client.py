"""The host's side of a runner language: one call, as :class:`.agent_client.AgentClient`
runs one for the agent's languages, so :mod:`.runs` treats both alike.

A runner (see :mod:`.backends.docker_runner`) keeps no state between calls but the
workspace's files, so a container that had to be replaced loses nothing a result must
report: ``state_lost`` stays false.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mcp_code_sandbox.agent.budget import Budget
from mcp_code_sandbox.backends.runner_images import ExecResult, RunnerImage
from mcp_code_sandbox.errors import SandboxFailed
from mcp_code_sandbox.run.agent_client import Outcome

if TYPE_CHECKING:
    from mcp_code_sandbox.sessions.manager import Session, SessionManager

__all__ = ["RunnerClient"]


class RunnerClient:
    def __init__(
        self, manager: SessionManager, session: Session, runner: RunnerImage, network: bool = False
    ) -> None:
        self._manager = manager
        self._session = session
        self._runner = runner
        self._network = network

    async def execute(
        self,
        *,
        language: str,
        code: str,
        timeout_s: float,
        env: dict[str, str],
        on_stream: Callable[[str, str], None],
        budget: Budget | None = None,
    ) -> Outcome:
        """Run ``code`` in the session's container of the runner; a container that died
        since the last call (``docker kill``, an engine restart) is replaced once.
        (``budget`` has nothing to bound here: a runner's output is only streams.)"""
        data = code.encode("utf-8")
        sandbox = await self._manager.ensure_runner(
            self._session, self._runner, network=self._network
        )
        try:
            result = await sandbox.execute(data, timeout_s=timeout_s, env=env, on_output=on_stream)
        except SandboxFailed:
            await self._manager.drop_runner(self._session, language)
            sandbox = await self._manager.ensure_runner(
                self._session, self._runner, network=self._network
            )
            result = await sandbox.execute(data, timeout_s=timeout_s, env=env, on_output=on_stream)
        return outcome_of(result, timeout_s)


def outcome_of(result: ExecResult, timeout_s: float) -> Outcome:
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
