"""Issue 10, findings 1 and 4, below the HTTP layer: hostile sandbox output does not stop
the host's cleanup, one session's failure does not stop another's, and a close that
lands during a sandbox start leaves nothing running.

Real bwrap sandboxes and a real Docker engine. Where a failure cannot be provoked from
inside a sandbox any more (that is the point of the fix), the test provokes it from the
host: it writes into the very pipe the backend reads (bwrap's stderr, through
``/proc/<bwrap>/fd/2``), makes one sandbox's stop fail, or holds a start at its end.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.backends import create_backend
from mcp_code_sandbox.backends.base import Sandbox, SandboxSpec
from mcp_code_sandbox.backends.bwrap.backend import BwrapBackend, BwrapSandbox
from mcp_code_sandbox.errors import SandboxFailed, SessionNotFound
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.settings import Settings

from ..conftest import each_backend
from ..procs import containers
from .test_bwrap_backend import start

#: What a hostile line holds: terminal escapes (an OSC 52 clipboard write, a screen
#: clear), a carriage return and NUL, then a newline and a line dressed as the server's.
HOSTILE = (
    b"\x1b]52;c;SGVsbG8=\x07\x1b[2J\x1b[1;1H" + b"A" * 100_000 + b"\r\x00\n"
    b"2026-01-01T00:00:00Z [info] session ended  owner=victim\n"
)


def write_to_stderr_of(pid: int, data: bytes) -> None:
    """Write into the stderr pipe of process ``pid`` (as root: the test's stand-in for
    sandboxed code that got hold of that fd)."""
    fd = os.open(f"/proc/{pid}/fd/2", os.O_WRONLY)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


async def eventually(check: Callable[[], bool], timeout_s: float = 60) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.05)


@pytest.mark.bwrap
async def test_a_stderr_flood_neither_kills_the_reader_nor_the_stop(
    make_settings: Callable[..., Settings],
    caplog: pytest.LogCaptureFixture,
    host_uid: int | None,
) -> None:
    backend = BwrapBackend(make_settings())
    box = await start(backend, "flood", host_uid)
    caplog.set_level(logging.WARNING, logger="mcp_code_sandbox.backends.bwrap.backend")
    await asyncio.to_thread(write_to_stderr_of, box.proc.pid, HOSTILE * 3)
    await eventually(lambda: sum(b"session ended" in line for line in box.stderr_tail) == 3)
    # The reader is alive (main: it died on the first line past 64 KiB), and the stop
    # that awaits it does not raise (main: it re-raised the reader's ValueError).
    assert not box._stderr_task.done()
    await backend.stop(box)
    assert box.proc.returncode is not None
    assert box.cgroup is None or not any(d.exists() for d in box.cgroup.dirs)
    ours = [r.getMessage() for r in caplog.records if "sandbox flood stderr:" in r.getMessage()]
    assert len(ours) == 6, ours  # one record a line: cut, and the fake one
    for message in ours:
        assert message.isprintable(), repr(message[:200])  # no ESC, CR, NUL, newline
        assert len(message) < 2100  # 500 bytes, each at most 4 characters escaped
    assert "\\x1b]52;c;SGVsbG8=\\x07\\x1b[2J" in ours[0] and ours[0].endswith("[line cut]")
    assert ours[1].startswith("sandbox flood stderr: 2026-01-01T00:00:00Z [info] session")


class FailingStops:
    """Wraps a real backend so that stopping the sandboxes of chosen sessions raises, as a
    backend's stop did on main when a sandbox had broken its host-side parts."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.failing: set[str] = set()
        self.real_stop = backend.stop
        backend.stop = self.stop

    async def stop(self, sandbox: Sandbox) -> None:
        if sandbox.spec.session_id in self.failing:
            raise ValueError("Separator is not found, and chunk exceed the limit")
        await self.real_stop(sandbox)


async def run(svc: SandboxService, owner: str, sid: str, code: str = "x = 1") -> Any:
    return await svc.run_code(owner, RunRequest(code), sid)


@pytest.mark.bwrap
async def test_one_failing_stop_neither_stops_the_reaper_nor_close_nor_shutdown(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings(session_ttl_m=0.05)  # 3 s idle; the reaper looks every 0.75 s
    svc = SandboxService(settings, create_backend(settings))
    stops = FailingStops(svc.backend)
    stops.failing = {"m-ttl", "m-close", "m-shut"}
    await svc.start()
    closed = False
    try:
        for owner, sid in [("mallory", "m-ttl"), ("victim", "v-ttl")]:
            await run(svc, owner, sid)
        mallory_ttl = svc.sessions.table.get("mallory", "m-ttl")
        assert mallory_ttl is not None
        manager = svc.sessions
        # Mallory's expires first and fails; the victim's must expire all the same (main:
        # the reaper task died on the failure, and no session expired again).
        await eventually(lambda: manager.count() == 0)
        assert manager.reaper.task is not None and not manager.reaper.task.done()
        assert not mallory_ttl.workspace.root.exists()  # files go even if the stop failed
        assert mallory_ttl.slot in manager.ending.unfinished  # and the stop is tried again
        stops.failing.discard("m-ttl")
        await eventually(lambda: mallory_ttl.slot not in manager.ending.unfinished)
        assert mallory_ttl.sandbox is None and mallory_ttl.unstopped == []
        # Later sessions still expire: the reaper lives.
        await run(svc, "victim", "v-later")
        await eventually(lambda: manager.count() == 0)

        # close_session: the session is closed and its files removed; the error says
        # exactly what remains (main: internal_error, and the workspace stayed).
        await run(svc, "mallory", "m-close")
        session = manager.table.get("mallory", "m-close")
        assert session is not None
        with pytest.raises(SandboxFailed, match=r"is closed, but its sandbox .* could not be"):
            await svc.close_session("mallory", "m-close")
        assert not session.workspace.root.exists()
        with pytest.raises(SessionNotFound, match="already closed"):
            await svc.sessions.close("mallory", "m-close")

        # Shutdown: every other session is cleaned up although one fails.
        await run(svc, "mallory", "m-shut")
        await run(svc, "victim", "v-shut")
        victim = manager.table.get("victim", "v-shut")
        assert victim is not None
        victim_box = victim.sandbox
        assert isinstance(victim_box, BwrapSandbox)
        closed = True
        await svc.aclose()
        assert victim_box.proc.returncode is not None
        assert not victim.workspace.root.exists()
    finally:
        if not closed:
            await svc.aclose()
        stops.failing.clear()
        # What the failing stops left: stop it for real now.
        for session in list(svc.sessions.ending.unfinished.values()):
            for thing in session.unstopped:
                await stops.real_stop(thing)


@pytest.mark.bwrap
async def test_the_reaper_is_started_again_if_it_dies(
    make_settings: Callable[..., Settings],
) -> None:
    class Unforeseen(BaseException):
        """Not an Exception: the reaper's own guard does not catch it."""

    settings = make_settings(session_ttl_m=0.01)
    svc = SandboxService(settings, create_backend(settings))
    passes: list[int] = []
    real_reap = svc.sessions.reap

    async def reap() -> None:
        passes.append(1)
        if len(passes) == 1:
            raise Unforeseen
        await real_reap()

    svc.sessions.reap = reap  # type: ignore[method-assign]
    await svc.start()
    try:
        first = svc.sessions.reaper.task
        await eventually(lambda: len(passes) >= 3, timeout_s=30)
        reaper = svc.sessions.reaper.task
        assert reaper is not None and reaper is not first and not reaper.done()
    finally:
        try:
            await svc.aclose()
        except Unforeseen:  # main: shutdown re-raised what killed the reaper
            pytest.fail("shutdown failed on what killed the reaper")


class GatedStarts:
    """Wraps a real backend so that each sandbox start, once done, waits for ``gate``:
    a start made as slow as the test needs, to land a close in it for certain."""

    def __init__(self, backend: Any) -> None:
        self.gate = asyncio.Event()
        self.started: list[Any] = []
        self.at_gate = asyncio.Event()
        self._create = backend.create
        backend.create = self.create

    async def create(self, spec: SandboxSpec, **kwargs: Any) -> Sandbox:
        sandbox = await self._create(spec, **kwargs)
        self.started.append(sandbox)
        self.at_gate.set()
        await self.gate.wait()
        return sandbox


def sandbox_gone(backend: str, sandbox: Any, instance: str | None) -> bool:
    if backend == "bwrap":
        dirs = sandbox.cgroup.dirs if sandbox.cgroup is not None else []
        return sandbox.proc.returncode is not None and not any(Path(d).exists() for d in dirs)
    assert instance is not None
    return containers(instance) == []


async def landed_in_a_start(
    make_settings: Callable[..., Settings],
    backend: str,
    race: Callable[[SandboxService, asyncio.Task[Any]], Awaitable[None]],
) -> None:
    """Start a run in a new session, hold its sandbox start at its end, do ``race``,
    then let the start finish: nothing of that session may survive."""
    settings = make_settings()
    svc = SandboxService(settings, create_backend(settings))
    gated = GatedStarts(svc.backend)
    await svc.start()
    instance = getattr(svc.backend, "instance", None)
    try:
        call = asyncio.create_task(run(svc, "mallory", "m-race", "print('ran')"))
        await asyncio.wait_for(gated.at_gate.wait(), 120)
        await race(svc, call)
        # Nothing of the session is left, and the run says what happened.
        (sandbox,) = gated.started
        await eventually(lambda: sandbox_gone(backend, sandbox, instance))
        assert svc.sessions.count() == 0
        # The victim is fine, and later starts are not held.
        gated.gate.set()
        report = await run(svc, "victim", "v", "print(6 * 7)")
        assert report.stdout == "42\n"
    finally:
        gated.gate.set()
        await svc.aclose()


@each_backend
async def test_a_close_during_a_sandbox_start_leaves_nothing_running(
    make_settings: Callable[..., Settings], backend: str
) -> None:
    async def close_during_start(svc: SandboxService, call: asyncio.Task[Any]) -> None:
        closing = asyncio.create_task(svc.close_session("mallory", "m-race"))
        await asyncio.sleep(0.5)
        # Close waits for the start in flight (main: it returned at once, and the
        # sandbox then started for a session that no longer existed).
        assert not closing.done()
        gated = svc.backend.create.__self__  # type: ignore[attr-defined]
        gated.gate.set()
        await asyncio.wait_for(closing, 120)  # ok
        with pytest.raises(SessionNotFound, match="was closed while its sandbox started"):
            await asyncio.wait_for(call, 120)

    await landed_in_a_start(make_settings, backend, close_during_start)


@each_backend
async def test_a_start_outliving_its_cancelled_call_is_stopped(
    make_settings: Callable[..., Settings], backend: str
) -> None:
    async def cancel_then_close(svc: SandboxService, call: asyncio.Task[Any]) -> None:
        call.cancel()  # the client went away: the start goes on, unwanted
        with pytest.raises(asyncio.CancelledError):
            await call
        closing = asyncio.create_task(svc.close_session("mallory", "m-race"))
        await asyncio.sleep(0.5)
        assert not closing.done()  # it waits for the start the cancelled call left
        gated = svc.backend.create.__self__  # type: ignore[attr-defined]
        gated.gate.set()
        await asyncio.wait_for(closing, 120)

    await landed_in_a_start(make_settings, backend, cancel_then_close)
