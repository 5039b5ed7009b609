"""The warm pool's rules, on the fake backend (the real agent, no walls): which calls use
it, that it counts toward no limit, that a start that fails backs off and the pool then
fills, that an aged sandbox is replaced and never handed out, and that a session from the
pool is left for the next server while the pool itself is not.

The same behaviour on real sandboxes is in ``tests/integration/test_pool.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from mcp_code_sandbox.errors import MaxSessions
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.server.hosts import transport_security
from mcp_code_sandbox.server.ui.pages import ui_routes
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.sessions import demand, pool, records
from tests.fakes import FakeBackend, fake_service, fake_settings


async def full(svc: SandboxService, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        status = svc.pool_status()
        if status["ready"] == status["size"] and status["starting"] == 0:
            return
        assert time.monotonic() < deadline, status
        await asyncio.sleep(0.02)


def claims(svc: SandboxService) -> tuple[float, float]:
    def get(result: str) -> float:
        sample = svc.metrics.registry.get_sample_value(
            "mcp_sandbox_pool_claims_total", {"result": result}
        )
        return sample or 0.0

    return get("hit"), get("miss")


def pooled_keys(svc: SandboxService) -> set[str]:
    return {p.key for p in svc.sessions.pool.ready_sandboxes()}


async def test_a_network_call_bypasses_the_pool(state_dir: Path) -> None:
    backend = FakeBackend()
    # The fake has no network; say it has, so that the call gets as far as its sandbox.
    described = backend.describe()
    backend.describe = lambda: dataclasses.replace(  # type: ignore[method-assign]
        described, network_unavailable=None
    )
    async with fake_service(state_dir, backend, pool_size=1, allow_network=True) as svc:
        await full(svc)
        warm = pooled_keys(svc)
        r = await svc.run_code("local", RunRequest("1", network=True))
        assert r.status == "ok", r
        assert backend.created[-1].network is True and backend.created[-1].key not in warm
        assert pooled_keys(svc) == warm and claims(svc) == (0, 0)
        plain = await svc.run_code("local", RunRequest("2"))
        assert plain.status == "ok" and claims(svc) == (1, 0)
        [session] = svc.sessions.with_id(plain.session_id)
        assert session.key in warm  # the warm one became this session


async def test_pooled_sandboxes_count_toward_no_limit(state_dir: Path) -> None:
    # Pausing off: a second session is refused rather than making room.
    async with fake_service(state_dir, pool_size=2, max_sessions=1, pause_after_m=0) as svc:
        await full(svc)
        assert svc.session_count() == 0
        first = await svc.run_code("local", RunRequest("1"))
        assert first.status == "ok"
        await full(svc)
        with pytest.raises(MaxSessions):
            await svc.run_code("local", RunRequest("1"))
        assert svc.pool_status()["ready"] == 2  # the refused call took nothing


async def test_a_failed_start_backs_off_then_the_pool_fills(state_dir: Path) -> None:
    backend = FakeBackend()
    backend.fail_creates = 1
    async with fake_service(state_dir, backend, pool_size=1) as svc:
        await full(svc)  # after the back-off (2 s), the next start succeeded
        assert len(backend.created) == 2
        # The failed start left no record or workspace behind.
        saved = records.load_records(svc.settings.sessions_dir)
        assert [r.pool for r in saved] == [True]
        assert len(list(svc.settings.workspaces_dir.iterdir())) == 1


async def test_an_aged_pooled_sandbox_is_replaced_never_handed_out(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pool, "MAX_AGE_S", 0.3)
    backend = FakeBackend()
    async with fake_service(state_dir, backend, pool_size=1) as svc:
        await full(svc)
        [old] = pooled_keys(svc)
        await asyncio.sleep(0.4)
        r = await svc.run_code("local", RunRequest("1"))
        assert r.status == "ok"
        [session] = svc.sessions.with_id(r.session_id)
        assert session.key != old
        deadline = time.monotonic() + 30
        while old not in backend.stopped:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)


async def test_a_session_from_the_pool_is_left_for_the_next_server_and_the_pool_is_not(
    state_dir: Path,
) -> None:
    backend = FakeBackend()
    try:
        async with fake_service(
            state_dir, backend, pool_size=2, keep_sessions_on_shutdown=True
        ) as svc:
            await full(svc)
            r = await svc.run_code("alice", RunRequest("x = 41"), "kept")
            assert r.status == "ok"
            await full(svc)
            pooled = pooled_keys(svc)
        # The pool's sandboxes were stopped and their files and records removed.
        assert pooled <= set(backend.stopped)
        saved = records.load_records(svc.settings.sessions_dir)
        assert [(r.owner, r.session_id, r.pool) for r in saved] == [("alice", "kept", False)]
        async with fake_service(state_dir, backend, keep_sessions_on_shutdown=True) as svc:
            again = await svc.run_code("alice", RunRequest("x + 1"), "kept")
            assert again.result == "42" and not again.session_created, again
    finally:
        await backend.end_all()


async def test_a_dead_servers_pool_is_removed_and_nobody_is_told_of_a_loss(
    state_dir: Path,
) -> None:
    settings = fake_settings(state_dir)
    key = "s" + "1" * 31
    slot = f"{key}-00000001"
    now = time.time()
    dead = records.SessionRecord("", "", key, slot, "1-dead", now, now, pool=True)
    records.write_record(settings.sessions_dir, dead)
    (settings.workspaces_dir / slot).mkdir(parents=True)
    async with fake_service(state_dir) as svc:
        assert records.load_records(settings.sessions_dir) == []
        assert list(settings.workspaces_dir.iterdir()) == []
        assert svc.sessions.count() == 0
        assert not svc.sessions.tombstones()  # nobody's session was lost


def test_a_record_says_whether_it_is_the_pools(tmp_path: Path) -> None:
    key = "s" + "0" * 31
    record = records.SessionRecord("", "", key, f"{key}-00000000", "i", 1, 1, pool=True)
    records.write_record(tmp_path, record)
    assert records.load_records(tmp_path) == [record]


async def ui_page(svc: SandboxService) -> str:
    """The operator's ``/ui`` page of ``svc`` (no tokens: the local operator)."""
    routes = ui_routes(svc, None, transport_security(svc.settings), b"k" * 32)
    transport = httpx.ASGITransport(app=Starlette(routes=routes))
    base = f"http://127.0.0.1:{svc.settings.http_port}"
    async with httpx.AsyncClient(transport=transport, base_url=base) as client:
        response = await client.get("/ui")
    assert response.status_code == 200, response.text
    return response.text


def sample(svc: SandboxService, name: str, labels: dict[str, str] | None = None) -> float:
    return svc.metrics.registry.get_sample_value(name, labels or {}) or 0.0


async def settled(svc: SandboxService, size: int, timeout: float = 60) -> dict[str, Any]:
    """Wait until the pool aims at ``size`` and holds exactly that many, at rest."""
    deadline = time.monotonic() + timeout
    while True:
        status = svc.pool_status()
        if status["size"] == size and status["ready"] == size and status["starting"] == 0:
            return status
        assert time.monotonic() < deadline, status
        await asyncio.sleep(0.02)


async def test_a_burst_grows_the_pool_to_its_ceiling_then_idle_shrinks_it(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Memory for 5 sandboxes at their limit: the ceiling, below the burst and the limit
    # of sessions. Every claim of the test counts as one burst, however loaded the host.
    monkeypatch.setattr(demand, "available_memory", lambda: 5 * 512 * 1024**2)
    monkeypatch.setattr(demand, "MIN_WINDOW_S", 600.0)
    backend = FakeBackend()
    async with fake_service(
        state_dir, backend, pool_size=2, max_sessions=16, memory_limit="512m"
    ) as svc:
        await full(svc)
        assert svc.pool_status()["ceiling"] == 5
        assert sample(svc, "mcp_sandbox_pool_bounds", {"bound": "ceiling"}) == 5
        first = await asyncio.gather(*(svc.run_code("local", RunRequest("1")) for _ in range(8)))
        assert [r.status for r in first] == ["ok"] * 8
        assert claims(svc) == (2, 6)
        status = svc.pool_status()
        assert status["size"] == 5 and status["trend"] == "grown"  # above 2, not above 5
        assert "ceiling" in status["decision"]["why"]
        assert sample(svc, "mcp_sandbox_pool_target") == 5
        assert sample(svc, "mcp_sandbox_pool_decisions_total", {"decision": "grow"}) >= 1
        assert sample(svc, "mcp_sandbox_pool_trend", {"trend": "grown"}) == 1
        page = await ui_page(svc)
        assert '<dd id="pool-target">5</dd>' in page and '<dd id="pool-trend">grown</dd>' in page
        assert '<dd id="pool-bounds">2 / 5</dd>' in page and "grow to 5" in page

        # The second wave is served warm, as far as the ceiling goes.
        await settled(svc, 5)
        second = await asyncio.gather(*(svc.run_code("local", RunRequest("2")) for _ in range(5)))
        assert [r.status for r in second] == ["ok"] * 5
        assert claims(svc) == (7, 6)
        await settled(svc, 5)

        # Idle: back to SANDBOX_POOL_SIZE, the extra warm sandboxes stopped.
        monkeypatch.setattr(demand, "IDLE_S", 0.2)
        await settled(svc, 2)
        status = svc.pool_status()
        assert status["decision"]["kind"] == "shrink"
        assert sample(svc, "mcp_sandbox_pool_decisions_total", {"decision": "shrink"}) == 1
        assert sample(svc, "mcp_sandbox_pool_target") == 2
        deadline = time.monotonic() + 30
        while svc.pool_status()["trend"] != "resting":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        assert sample(svc, "mcp_sandbox_pool_trend", {"trend": "resting"}) == 1
        # The 13 sessions' sandboxes and 2 warm ones run; the 3 extra were stopped.
        while len(backend.running()) != 13 + 2:
            assert time.monotonic() < deadline, len(backend.running())
            await asyncio.sleep(0.02)
        assert svc.session_count() == 13


async def test_a_pool_of_size_0_stays_off_through_a_burst(state_dir: Path) -> None:
    async with fake_service(state_dir, pool_size=0, max_sessions=8) as svc:
        results = await asyncio.gather(*(svc.run_code("local", RunRequest("1")) for _ in range(4)))
        assert [r.status for r in results] == ["ok"] * 4
        status = svc.pool_status()
        assert status["size"] == 0 and status["ready"] == 0 and status["starting"] == 0
        assert claims(svc) == (0, 0)
