"""Replicas on one state directory (``sessions.replicas``), on the fake backend in one
process: a call that lands on a replica that does not hold its session takes it over,
with its variables. The fake backend's agents reconnect (``FakeBackend(reconnect=True)``),
as Docker's do; the real thing, servers and containers, is tests/e2e/test_replicas.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from mcp_code_sandbox.errors import SessionBusy
from mcp_code_sandbox.host import process_mark
from mcp_code_sandbox.run.execute import RunReport
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.sessions import records
from mcp_code_sandbox.sessions.holder import Role
from mcp_code_sandbox.sessions.ids import session_key
from tests.fakes import FakeBackend, fake_settings


@contextlib.asynccontextmanager
async def replica(state_dir: Path, backend: FakeBackend) -> AsyncIterator[SandboxService]:
    service = SandboxService(
        fake_settings(state_dir, replica=True), backend, role=Role.SERVICE, replica=True
    )
    try:
        await service.start()
        yield service
    finally:
        await service.aclose()


async def run(svc: SandboxService, code: str, sid: str, owner: str = "alice") -> RunReport:
    return await svc.run_code(owner, RunRequest(code), sid)


def holder_of(svc: SandboxService, sid: str, owner: str = "alice") -> str:
    [record] = records.records_of(svc.settings.sessions_dir, session_key(owner, sid))
    return record.instance


async def test_a_call_on_another_replica_takes_the_session_over_with_its_variables(
    state_dir: Path,
) -> None:
    backend = FakeBackend(reconnect=True)
    try:
        async with replica(state_dir, backend) as a, replica(state_dir, backend) as b:
            first = await run(a, "x = 41\nopen('f.txt', 'w').write('kept')", "conv")
            assert first.session_created and holder_of(a, "conv") == a.sessions.instance
            assert [r.session_id for r in b.sessions.elsewhere("alice")] == ["conv"]
            assert b.sessions.elsewhere("bob") == [] and a.sessions.elsewhere() == []

            report = await run(b, "x + 1", "conv")
            assert (report.result, report.session_created) == ("42", False)
            assert (report.state_lost, report.notice) == (False, None)
            assert holder_of(b, "conv") == b.sessions.instance
            assert a.sessions.with_id("conv") == [] and len(b.sessions.with_id("conv")) == 1
            assert len(backend.running()) == 1  # the same sandbox, not a new one
            assert [r.session_id for r in a.sessions.elsewhere("alice")] == ["conv"]
            assert b.sessions.elsewhere() == []

            back = await run(a, "x += 1; x", "conv")  # and back again
            assert (back.result, back.session_created) == ("42", False)
            listing = await a.list_files("alice", "conv", ".", recursive=True)
            assert [e.path for e in listing.entries] == ["f.txt"]
            assert holder_of(a, "conv") == a.sessions.instance
    finally:
        await backend.end_all()


async def test_a_replica_gives_up_only_a_session_it_holds(state_dir: Path) -> None:
    backend = FakeBackend(reconnect=True)
    try:
        async with replica(state_dir, backend) as a:
            await run(a, "1", "conv")
            replicas = a.sessions.replicas
            assert replicas is not None
            assert not await replicas.give_up("alice", "other")
            assert not await replicas.give_up("bob", "conv")  # owners never share one
            assert a.sessions.with_id("conv") != []
            assert await replicas.give_up("alice", "conv")
            assert a.sessions.with_id("conv") == []
            assert not await replicas.give_up("alice", "conv")
            [left] = backend.running()  # let go of, not stopped: the next holder takes it
            assert left.is_alive()
    finally:
        await backend.end_all()


async def test_calls_on_two_replicas_at_once_run_one_after_the_other(state_dir: Path) -> None:
    backend = FakeBackend(reconnect=True)
    try:
        async with replica(state_dir, backend) as a, replica(state_dir, backend) as b:
            await run(a, "n = 0", "conv")
            reports = await asyncio.gather(
                *(run(svc, "n += 1; n", "conv") for svc in (a, b, a, b, b, a))
            )
            assert sorted(int(r.result or "0") for r in reports) == [1, 2, 3, 4, 5, 6]
            assert not any(r.state_lost or r.session_created for r in reports)
            assert len(backend.running()) == 1
    finally:
        await backend.end_all()


async def test_a_session_let_go_to_a_taker_that_gave_up_comes_back_with_its_variables(
    state_dir: Path,
) -> None:
    # The holder lets go (its queued call done) after the asking replica stopped waiting:
    # its record still names the holder, and nobody holds it. The next call takes it back.
    backend = FakeBackend(reconnect=True)
    try:
        async with replica(state_dir, backend) as a:
            await run(a, "x = 41", "conv")
            assert await a.sessions.replicas.give_up("alice", "conv")  # type: ignore[union-attr]
            assert a.sessions.with_id("conv") == [] and holder_of(a, "conv") == a.sessions.instance
            report = await run(a, "x + 1", "conv")
            assert (report.result, report.session_created, report.notice) == ("42", False, None)
            assert len(backend.running()) == 1
    finally:
        await backend.end_all()


async def test_a_session_held_by_a_replica_that_does_not_answer_is_busy_not_remade(
    state_dir: Path,
) -> None:
    # A live holder (its pid file names a process that runs) with no control socket: a
    # replica shutting down. The call is told to try again; nothing is made or removed.
    backend = FakeBackend(reconnect=True)
    try:
        async with replica(state_dir, backend) as a:
            key = session_key("alice", "held")
            record = records.SessionRecord(
                owner="alice",
                session_id="held",
                key=key,
                slot=records.new_slot(key),
                instance="1-stopping",
                created_at=1.0,
                last_active=1.0,
            )
            records.write_record(a.settings.sessions_dir, record)
            (a.settings.run_dir / "1-stopping.pid").write_text(process_mark())
            with pytest.raises(SessionBusy, match="held by a replica that does not answer"):
                await run(a, "1", "held")
            assert records.records_of(a.settings.sessions_dir, key) == [record]
            assert a.sessions.with_id("held") == []
    finally:
        await backend.end_all()
