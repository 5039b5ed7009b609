"""Two tenants against one real HTTP server: the harness of the hostile-tenant tests.

Issue 10 asks every attack to be performed the way a tenant would: hostile code and a
hostile client under one API token (``mallory``), and an ordinary user under another
(``victim``), both talking to the real server over streamable HTTP with the official MCP
client. ``async with two_tenants(settings) as t`` starts that server on this test's
backend (``make_settings`` chose it) and yields a :class:`Tenants` with a connected client
for each, the base URL, the server process and its log.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from mcp_code_sandbox.settings import Settings

from .conftest import http_server_process

MALLORY = "mallory-0123456789abcdef"
VICTIM = "victim-0123456789abcdef0"
TOKENS = f"mallory:{MALLORY},victim:{VICTIM}"


@contextlib.asynccontextmanager
async def client_as(base: str, token: str, mode: str = "legacy") -> AsyncIterator[Client]:
    """The official client, sending ``Authorization: Bearer <token>`` on every request."""
    async with create_mcp_http_client(headers={"Authorization": f"Bearer {token}"}) as http:
        transport = streamable_http_client(f"{base}/mcp", http_client=http)
        async with Client(transport, mode=mode) as client:
            yield client


def structured(result: Any) -> dict[str, Any]:
    """A tool result's structured content; fails the test on a tool error."""
    assert not result.is_error, result.content
    data = result.structured_content
    assert isinstance(data, dict)
    return data


@dataclass
class Tenants:
    base: str
    proc: subprocess.Popen[bytes]
    settings: Settings
    mallory: Client
    victim: Client

    @property
    def log_path(self) -> Path:
        return self.settings.state_dir / "server.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def run(self, who: Client, code: str, **args: Any) -> dict[str, Any]:
        """``run_code`` as ``who``; the structured result (a tool error fails the test)."""
        return structured(await who.call_tool("run_code", {"code": code, **args}))

    async def victim_is_fine(self, session_id: str = "victim-canary") -> None:
        """The other tenant still gets work done: a run, a file, a listing."""
        ran = await self.run(self.victim, "print(6 * 7)", session_id=session_id)
        assert ran["status"] == "ok" and ran["stdout"] == "42\n", ran
        listed = structured(await self.victim.call_tool("list_files", {"session_id": session_id}))
        assert isinstance(listed["entries"], list)
        assert self.proc.poll() is None, "the server died"


@contextlib.asynccontextmanager
async def two_tenants(settings: Settings, **env: str) -> AsyncIterator[Tenants]:
    """A real HTTP server with two API tokens, and a client for each tenant."""
    with http_server_process(settings, SANDBOX_API_TOKENS=TOKENS, **env) as (base, proc):
        async with client_as(base, MALLORY) as mallory, client_as(base, VICTIM) as victim:
            yield Tenants(base, proc, settings, mallory, victim)
