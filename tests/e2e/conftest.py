"""The real server, driven by the official MCP client: in process (the tool layer), as a
stdio subprocess and as an HTTP service, in both protocol eras."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client, StdioServerParameters

from mcp_code_sandbox.settings import Settings, docker_environ

ERAS = ["legacy", "2026-07-28"]


def initialize_request(client: str = "plain-http") -> dict[str, Any]:
    """An MCP ``initialize`` request (handshake era), for tests that speak raw JSON-RPC."""
    return {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": client, "version": "0"},
        },
    }


def server_env(state_dir: Path, runtime_dir: Path, **extra: str) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SANDBOX_STATE_DIR": str(state_dir),
        "SANDBOX_RUNTIME_DIR": str(runtime_dir),
        "SANDBOX_BACKEND": "bwrap",
        "SANDBOX_LOG_LEVEL": "DEBUG",
        "SANDBOX_POOL_SIZE": "0",  # on where a test says so (test_pool.py)
        # HTTP servers keep (pause) sessions at a clean stop by default; tests that
        # count what a stop leaves say so where they want it (test_pause.py). "":
        # the server's own default.
        "SANDBOX_KEEP_SESSIONS_ON_SHUTDOWN": "false",
    }
    env.update(extra)
    return {name: value for name, value in env.items() if value != ""}


def settings_env(settings: Settings, **extra: str) -> dict[str, str]:
    """The server's env for ``settings``' backend (``make_settings`` chose it)."""
    backend: dict[str, str] = {"SANDBOX_BACKEND": settings.backend}
    if settings.backend == "docker":
        backend |= {
            "SANDBOX_DOCKER_RUNTIME": settings.docker_runtime,
            "SANDBOX_IMAGE": settings.image,
            **docker_environ(),
        }
    return server_env(settings.state_dir, settings.runtime_dir, **backend, **extra)


@pytest.fixture
def stdio_params(make_settings: Callable[..., Settings]) -> StdioServerParameters:
    settings = make_settings()
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "mcp_code_sandbox", "serve"],
        env=settings_env(settings),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def http_server(settings: Settings, **extra: str) -> Iterator[str]:
    with http_server_process(settings, **extra) as (base, _proc):
        yield base


def http_server_argv(port: int) -> list[str]:
    """The command line of an HTTP server on ``port``."""
    serve = ["serve", "--transport", "http", "--port", str(port)]
    return [sys.executable, "-m", "mcp_code_sandbox", *serve]


@contextlib.contextmanager
def http_server_process(
    settings: Settings, **extra: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    env = settings_env(settings, **extra)
    # The log goes to a file: an unread pipe fills up at DEBUG and blocks the server.
    log_path = settings.state_dir / "server.log"
    log = open(log_path, "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        http_server_argv(port),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def http_base(make_settings: Callable[..., Settings]) -> Iterator[str]:
    with http_server(make_settings()) as base:
        yield base


@contextlib.asynccontextmanager
async def held(factory: Callable[[], Any]) -> AsyncIterator[Any]:
    """Enter an async context manager in a task of its own and hand its value out.

    pytest-asyncio runs an async fixture's setup and teardown in different tasks, while an
    MCP client's task group must be entered and left in the same one."""
    ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    done = asyncio.Event()

    async def owner() -> None:
        try:
            async with factory() as value:
                ready.set_result(value)
                await done.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    task = asyncio.create_task(owner())
    try:
        yield await ready
    finally:
        done.set()
        await task


@pytest.fixture
async def inproc(service: Any) -> AsyncIterator[Client]:
    """The tool layer over the SDK's in-memory transport, with the real backend."""
    from mcp_code_sandbox.server.app import build_server

    async with held(lambda: Client(build_server(service), mode="legacy")) as client:
        yield client
