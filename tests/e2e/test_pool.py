"""The warm pool through the real server and the official MCP client: ``list_runtimes``
and ``/readyz`` show it, a new session's first cell finds pandas imported ahead and its
namespace fresh, and a server killed with SIGKILL leaves nothing of the pool that the
next server adopts or keeps (bwrap: the sandboxes die with their server; their files and
records go at the next start, and only the session, not the pool, is said to be lost)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from mcp import Client

from mcp_code_sandbox.settings import Settings

from ..procs import descendants, wait_gone
from .conftest import http_server_process, settings_env

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap]

PRELOAD = ["numpy", "pandas", "matplotlib.pyplot"]


def structured(result: Any) -> dict[str, Any]:
    assert not result.is_error, result
    data = result.structured_content
    assert isinstance(data, dict)
    return data


def wait_full(base: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        pool: dict[str, Any] = httpx.get(f"{base}/readyz").json()["pool"]
        if pool["ready"] == pool["size"] and pool["starting"] == 0:
            return pool
        assert time.monotonic() < deadline, pool
        time.sleep(0.1)


async def test_pool_through_the_client_and_a_sigkill(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    with http_server_process(settings, SANDBOX_POOL_SIZE="2") as (base, proc):
        pool = wait_full(base)
        at_rest = {"size": 2, "ready": 2, "starting": 0, "preload": PRELOAD, "floor": 2}
        assert pool | at_rest == pool and pool["trend"] == "resting", pool
        assert pool["ceiling"] >= 2 and pool["decision"] is None
        doctor = subprocess.run(
            [sys.executable, "-m", "mcp_code_sandbox", "doctor"],
            env=settings_env(settings, SANDBOX_POOL_SIZE="2"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "warm pool: 2 sandboxes kept ready per server" in doctor.stdout, doctor.stdout
        assert "2 pooled (ready or starting) held by servers running" in doctor.stdout
        async with Client(f"{base}/mcp", mode="legacy") as client:
            runtimes = structured(await client.call_tool("list_runtimes", {}))
            assert runtimes["pool"]["size"] == 2 and runtimes["pool"]["preload"] == PRELOAD
            assert runtimes["pool"]["floor"] == 2 and runtimes["pool"]["trend"] == "resting"
            first = structured(
                await client.call_tool(
                    "run_code",
                    {
                        "session_id": "from-the-pool",
                        "code": "import sys\nloaded = 'pandas' in sys.modules\n"
                        "import pandas as pd\nprint(loaded, sorted(k for k in dir() "
                        "if not k.startswith('_')))\nint(pd.DataFrame({'a': [1, 2]}).a.sum())",
                    },
                )
            )
        assert first["session_created"] is True and first["execution_count"] == 1, first
        assert first["result"] == "3"
        assert first["stdout"].startswith("True ['In', 'Out', 'display', 'exit', 'get_ipython'")
        wait_full(base)
        sandboxes = descendants(proc.pid)
        assert len(list(settings.sessions_dir.glob("*.json"))) == 3  # a session, 2 pooled
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert wait_gone(sandboxes) == set()  # bwrap's died with their server
    assert len(list(settings.workspaces_dir.iterdir())) == 3  # until the next start
    with http_server_process(settings) as (base, _):
        # Recovery removed all three; the pool's were nobody's to report lost.
        assert list(settings.workspaces_dir.iterdir()) == []
        assert list(settings.sessions_dir.glob("*.json")) == []
        async with Client(f"{base}/mcp", mode="legacy") as client:
            gone = await client.call_tool("read_file", {"session_id": "from-the-pool", "path": "x"})
            assert gone.is_error
            text = gone.content[0].text  # type: ignore[union-attr]
            assert "session_not_found" in text and "lost when the server restarted" in text
