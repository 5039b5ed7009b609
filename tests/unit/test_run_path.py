"""The run path's pure parts, without a sandbox: which languages are offered (one place
decides), how a run's notices are joined, and a runner's container replaced once."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.backends.runner_images import ExecResult, RunnerImage, RunnerSandbox
from mcp_code_sandbox.errors import SandboxFailed, UnsupportedLanguage
from mcp_code_sandbox.run.execute import join_notices
from mcp_code_sandbox.run.languages import RUNTIMES, Languages
from mcp_code_sandbox.run.probe import RuntimeProbe
from mcp_code_sandbox.sessions.executor import Cell, Executor, Guarded, Outcome, lost
from mcp_code_sandbox.sessions.runner_client import RunnerClient
from mcp_code_sandbox.settings import load_settings

PERL = RunnerImage("perl", "perl:5", "sha256:1", ("perl", "{file}"))


def languages(tmp_path: Path) -> Languages:
    settings = load_settings({"state_dir": str(tmp_path)}, environ={})
    probe = RuntimeProbe(settings, None, lambda: None, RUNTIMES)  # type: ignore[arg-type, return-value]
    return Languages(probe)


def test_languages_decides_what_is_offered_and_refuses_the_rest(tmp_path: Path) -> None:
    offer = languages(tmp_path)
    assert offer.offered() == list(RUNTIMES)  # nothing said yet: all offered
    offer.info = {"typescript": {"available": False}}
    offer.probe.languages = {"python": "3", "typescript": "1", "bash": "5"}
    offer.set_runners({"perl": PERL, "python": PERL})  # an image cannot take python's name
    assert offer.offered() == ["python", "bash", "perl"]
    assert offer.runner("perl") == PERL and offer.runner("python") is None
    offer.check("perl")
    with pytest.raises(UnsupportedLanguage, match="available: bash, perl, python"):
        offer.check("typescript")


def test_a_sandbox_without_the_interpreter_is_refused(tmp_path: Path) -> None:
    offer = languages(tmp_path)
    ready = {"languages": {"python": "3.12", "bash": "5.2"}}
    offer.check_sandbox(ready, "bash")
    offer.check_sandbox(None, "javascript")  # a backend that keeps no ready message
    offer.check_sandbox(ready, "perl")  # a runner's language: not the agent's to say
    with pytest.raises(UnsupportedLanguage, match="no interpreter for 'javascript'"):
        offer.check_sandbox(ready, "javascript")


def test_notices_are_joined_one_way() -> None:
    assert join_notices([None, "", None]) is None
    assert join_notices(["a", None, "b", "c"]) == "a; b; c"


class _Container(RunnerSandbox):
    def __init__(self, fails: bool) -> None:
        super().__init__(None, PERL, "c")  # type: ignore[arg-type]
        self.fails = fails
        self.calls = 0

    async def execute(
        self,
        code: bytes,
        *,
        timeout_s: float,
        env: Mapping[str, str],
        on_output: Callable[[str, str], None],
    ) -> ExecResult:
        self.calls += 1
        if self.fails:
            raise SandboxFailed("the container is gone")
        on_output("stdout", code.decode())
        return ExecResult(0)


async def _run(executor: Executor) -> tuple[Any, list[tuple[str, str]]]:
    out: list[tuple[str, str]] = []
    outcome = await executor.execute(Cell("perl", "hi", 1), lambda n, t: out.append((n, t)))
    return outcome, out


async def test_a_runner_container_that_died_is_replaced_once() -> None:
    dead, fresh = _Container(fails=True), _Container(fails=False)
    replaced: list[RunnerSandbox] = []

    async def replace() -> RunnerSandbox:
        replaced.append(fresh)
        return fresh

    outcome, out = await _run(RunnerClient(dead, replace))
    assert outcome.status == "ok" and not outcome.state_lost and out == [("stdout", "hi")]
    assert replaced == [fresh] and dead.calls == 1 and fresh.calls == 1

    async def still_dead() -> RunnerSandbox:
        return _Container(fails=True)

    with pytest.raises(SandboxFailed):  # replaced once, not in a loop
        await _run(RunnerClient(_Container(fails=True), still_dead))


async def test_a_sandbox_that_fails_under_a_run_is_its_owners_to_report() -> None:
    seen: list[str] = []

    async def failed(exc: SandboxFailed) -> Outcome:
        seen.append(exc.message)
        return lost(exc.message)

    dead = RunnerClient(_Container(fails=True), _replace_with(_Container(fails=True)))
    outcome, _ = await _run(Guarded(dead, failed))
    assert seen == ["the container is gone"]
    assert outcome.status == "error" and outcome.state_lost
    assert outcome.error == {"name": "SandboxDied", "value": seen[0], "traceback": ""}


def _replace_with(container: RunnerSandbox) -> Callable[[], Awaitable[RunnerSandbox]]:
    async def replace() -> RunnerSandbox:
        return container

    return replace
