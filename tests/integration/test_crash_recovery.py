"""Crash recovery with the docker backend: a server killed with SIGKILL and started again
re-attaches the sessions whose containers still run (same id, owner, files, variables);
one shut down with ``SANDBOX_KEEP_SESSIONS_ON_SHUTDOWN`` pauses them for the next one;
what cannot or must not be re-attached is removed; a container killed from outside is
replaced on the next call with the files kept and ``state_lost``.

Skipped, with the reason shown, without an engine or the image; failing instead when
``SANDBOX_REQUIRE_DOCKER=1`` (the ``settings`` fixture of ``test_docker_backend``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import docker
import httpx
import pytest
from mcp import Client

from mcp_code_sandbox.backends.base import SandboxSpec
from mcp_code_sandbox.backends.docker.backend import DockerBackend, DockerSandbox
from mcp_code_sandbox.backends.docker.spec import LABEL_KEY, LABEL_UID
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.sessions.holder import Role
from mcp_code_sandbox.sessions.uids import uid_pool
from mcp_code_sandbox.settings import Settings, docker_environ
from tests.conftest import sandbox_owner
from tests.e2e.conftest import http_server_process
from tests.integration.test_docker_backend import LIMITS, gone
from tests.integration.test_docker_backend import settings as settings

pytestmark = pytest.mark.docker


@pytest.fixture
def engine() -> Any:
    client = docker.from_env(environment=docker_environ())
    yield client
    client.close()


def structured(result: Any) -> dict[str, Any]:
    assert not result.is_error, result
    data = result.structured_content
    assert isinstance(data, dict)
    return data


def records(settings: Settings) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in settings.sessions_dir.glob("*.json")]


def ours(engine: Any, settings: Settings) -> list[Any]:
    """Containers whose workspace is in this test's state dir."""
    # Sparse: other tests may remove their containers between a list and an inspect.
    found = engine.containers.list(all=True, sparse=True, filters={"label": LABEL_KEY})
    return [
        c
        for c in found
        if any(
            str(m.get("Source", "")).startswith(str(settings.state_dir)) for m in c.attrs["Mounts"]
        )
    ]


async def test_sigkilled_server_reattaches_on_restart(settings: Settings, engine: Any) -> None:
    with http_server_process(settings) as (base, proc):
        async with Client(f"{base}/mcp", mode="legacy") as client:
            first = structured(
                await client.call_tool(
                    "run_code",
                    {"session_id": "survivor", "code": "x = 41\nopen('kept.txt','w').write('hi')"},
                )
            )
            assert first["session_created"] is True and first["status"] == "ok"
        [before] = records(settings)
        # The session's runs are recorded on the host, under its slot.
        assert [p.name for p in settings.runlogs_dir.iterdir()] == [f"{before['slot']}.jsonl"]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    [container] = ours(engine, settings)
    assert container.status == "running"  # the container outlived its server
    container.reload()
    # Its uid is reserved for it while the dead server's record exists: no one else's.
    uid = before["uid"]
    assert container.labels[LABEL_UID] == str(uid) and container.attrs["Config"]["User"] == (
        f"{uid}:{uid}"
    )
    other = uid_pool(settings).lease("/elsewhere/another-session.json")
    assert other.uid != uid
    other.release()
    with http_server_process(settings) as (base, proc):
        async with Client(f"{base}/mcp", mode="legacy") as client:
            again = structured(
                await client.call_tool(
                    "run_code",
                    {"session_id": "survivor", "code": "print(open('kept.txt').read())\nx + 1"},
                )
            )
            # A re-attached session keeps its runs: the notebook has both.
            exported = structured(
                await client.call_tool("export_notebook", {"session_id": "survivor"})
            )
            assert exported["runs"] == 2, exported
        [after] = records(settings)
        assert again["session_created"] is False
        assert again["state_lost"] is False, again
        assert again["result"] == "42" and again["stdout"].strip() == "hi"
        assert again["execution_count"] == 2
        assert (after["owner"], after["session_id"], after["slot"], after["uid"]) == (
            before["owner"],
            before["session_id"],
            before["slot"],
            uid,
        )
        # The new server holds the uid again: no one else can lease it.
        assert uid_pool(settings).reclaim(uid, "/elsewhere/another-session.json") is None
        assert after["instance"] != before["instance"]
        assert [c.id for c in ours(engine, settings)] == [container.id]  # the same one
    # A clean shutdown is not a crash: nothing of the session remains.
    assert ours(engine, settings) == [] and records(settings) == []
    assert not any(settings.workspaces_dir.iterdir())
    assert not any(settings.runlogs_dir.iterdir())


async def test_a_clean_shutdown_can_leave_sessions_for_the_next_server(
    settings: Settings, engine: Any
) -> None:
    """With SANDBOX_KEEP_SESSIONS_ON_SHUTDOWN a stop pauses every session: under runc its
    variables are saved in its workspace and its container goes (no RAM held while no
    server runs); the next server resumes it on its first call."""
    keep = {"SANDBOX_KEEP_SESSIONS_ON_SHUTDOWN": "true"}
    with http_server_process(settings, **keep) as (base, proc):
        async with Client(f"{base}/mcp", mode="legacy") as client:
            first = structured(
                await client.call_tool("run_code", {"session_id": "deploy", "code": "y = 6"})
            )
            assert first["status"] == "ok"
    assert proc.returncode is not None  # SIGTERM: uvicorn's graceful shutdown ran
    assert ours(engine, settings) == []
    [record] = records(settings)
    assert record["paused"]["kind"] == "variables"
    with http_server_process(settings) as (base, proc):  # the tests' default: end them
        async with Client(f"{base}/mcp", mode="legacy") as client:
            again = structured(
                await client.call_tool("run_code", {"session_id": "deploy", "code": "y * 7"})
            )
        assert again["session_created"] is False and again["state_lost"] is False, again
        assert (again["result"], again["resumed"]) == ("42", "variables")
    assert ours(engine, settings) == [] and records(settings) == []
    assert not any(settings.workspaces_dir.iterdir())


class _DeadServer:
    """A service whose server then "dies": its channels close, its containers run on, and
    its pid file and labels name processes that are gone."""

    def __init__(self, settings: Settings) -> None:
        backend = DockerBackend(settings, docker_environ(), instance="gone-host-1-ab")
        self.service = SandboxService(settings, backend, role=Role.SERVICE)

    async def __aenter__(self) -> SandboxService:
        await self.service.start()
        return self.service

    async def __aexit__(self, *exc: object) -> None:
        manager = self.service.sessions
        for session in manager.table:
            assert isinstance(session.sandbox, DockerSandbox)
            session.sandbox.close()  # what the kernel does to a killed server's sockets
            if session.uid_lease is not None:
                session.uid_lease.release()  # and to its locks
        if manager._service_lock is not None:
            manager._service_lock.release()  # and its service lock
        if manager._pid_file is not None:
            manager._pid_file.release(keep=True)  # and the lock on its pid file
        pidfile = manager.settings.run_dir / f"{manager.instance}.pid"
        pidfile.write_text("999999999")
        await manager.backend.aclose()
        if manager.reaper.task is not None:
            manager.reaper.task.cancel()


@pytest.fixture
async def restarted(settings: Settings) -> AsyncIterator[list[SandboxService]]:
    started: list[SandboxService] = []
    yield started
    for service in started:
        await service.aclose()


async def _start(settings: Settings, started: list[SandboxService]) -> SandboxService:
    service = SandboxService(settings, DockerBackend(settings, docker_environ()), role=Role.SERVICE)
    await service.start()
    started.append(service)
    return service


async def test_session_past_its_ttl_is_removed_at_start(
    settings: Settings, engine: Any, restarted: list[SandboxService]
) -> None:
    async with _DeadServer(settings) as old:
        await old.run_code("local", RunRequest("x = 1"), "stale")
    [container] = ours(engine, settings)
    [path] = settings.sessions_dir.glob("*.json")
    record = json.loads(path.read_text())
    record["last_active"] -= settings.session_ttl_m * 60 + 60
    path.write_text(json.dumps(record))
    new = await _start(settings, restarted)
    assert gone(engine, container.id)
    assert records(settings) == [] and not any(settings.workspaces_dir.iterdir())
    assert not any(settings.runlogs_dir.iterdir())  # its runs went with it
    report = await new.run_code("local", RunRequest("'x' in globals()"), "stale")
    assert report.session_created is True and report.result == "False"
    expired = f"expired after {settings.session_ttl_m:g} min idle"
    assert report.notice is not None and expired in report.notice


async def test_container_without_a_record_is_removed_at_start(
    settings: Settings, engine: Any, restarted: list[SandboxService], host_uid: int | None
) -> None:
    dead = DockerBackend(settings, docker_environ(), instance="gone-host-1-ab")
    workspace = settings.workspaces_dir / "not-a-slot"
    workspace.mkdir(parents=True)
    if (owner := sandbox_owner(dead, host_uid)) is not None:
        os.chown(workspace, *owner)
    uid = host_uid if dead.per_sandbox_uids else None
    spec = SandboxSpec(
        key="k", owner="", session_id="", workspace=workspace, limits=LIMITS, uid=uid
    )
    box = await dead.create(spec)
    assert isinstance(box, DockerSandbox)
    box.close()
    await dead.aclose()
    await _start(settings, restarted)
    assert gone(engine, box.backend_id)


async def test_externally_killed_container_is_replaced_with_files_kept(
    settings: Settings, engine: Any, restarted: list[SandboxService]
) -> None:
    service = await _start(settings, restarted)
    await service.run_code("local", RunRequest("x = 1\nopen('f.txt','w').write('kept')"), "k")
    [container] = ours(engine, settings)
    container.kill()
    container.wait(timeout=20)
    report = await service.run_code(
        "local", RunRequest("print(open('f.txt').read())\n'x' in globals()"), "k"
    )
    assert report.session_created is False
    assert report.state_lost is True and report.status == "ok", report
    assert report.stdout.strip() == "kept" and report.result == "False"
    assert report.notice is not None and "had stopped" in report.notice
    assert gone(engine, container.id)


def _pool_full(base: str, size: int) -> None:
    deadline = time.monotonic() + 120
    while True:
        pool = httpx.get(f"{base}/readyz").json()["pool"]
        if pool["ready"] == size and pool["starting"] == 0:
            return
        assert time.monotonic() < deadline, pool
        time.sleep(0.1)


async def test_a_session_from_the_pool_is_reattached_and_the_pool_is_not(
    settings: Settings, engine: Any
) -> None:
    """The pool's containers keep the pool's labels once a session takes one: the record
    (owner and id bound at the claim) is what re-attaches it. The pool's own, never
    claimed, are removed by the next server, never adopted as sessions."""
    with http_server_process(settings, SANDBOX_POOL_SIZE="2") as (base, proc):
        _pool_full(base, 2)
        async with Client(f"{base}/mcp", mode="legacy") as client:
            first = structured(
                await client.call_tool("run_code", {"session_id": "warm", "code": "x = 41"})
            )
        assert first["session_created"] is True and first["status"] == "ok"
        _pool_full(base, 2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(ours(engine, settings)) == 3  # the session's and the pool's outlive it
    [claimed] = [r for r in records(settings) if not r.get("pool")]
    assert claimed["session_id"] == "warm"
    with http_server_process(settings) as (base, proc):
        async with Client(f"{base}/mcp", mode="legacy") as client:
            again = structured(
                await client.call_tool("run_code", {"session_id": "warm", "code": "x + 1"})
            )
        assert again["session_created"] is False and again["state_lost"] is False, again
        assert again["result"] == "42"
        assert len(ours(engine, settings)) == 1  # the pool's two are gone
        assert [r["session_id"] for r in records(settings)] == ["warm"]
        assert len(list(settings.workspaces_dir.iterdir())) == 1
    assert ours(engine, settings) == [] and records(settings) == []
