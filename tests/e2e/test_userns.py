"""A host where bwrap cannot make user namespaces (Ubuntu >= 23.10's AppArmor default,
``user.max_user_namespaces=0``, some containers), as an MCP client sees the server there.

Simulated for real: the server runs in a user namespace of its own in which
``user.max_user_namespaces`` is lowered to 0, so no namespace can be made below it.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters

from mcp_code_sandbox.settings import Settings

from .conftest import server_env

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap]

SAID = "this host does not let bubblewrap create user namespaces"


def without_userns(settings: Settings, tmp_path: Path, *args: str) -> StdioServerParameters:
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is needed to simulate the host")
    env = server_env(
        settings.state_dir,
        settings.runtime_dir,
        SANDBOX_LOG_FILE=str(tmp_path / "server.log"),
        SANDBOX_POOL_SIZE="2",  # must not be retried every few seconds
    )
    server = " ".join([sys.executable, "-m", "mcp_code_sandbox", *args])
    script = f"echo 0 > /proc/sys/user/max_user_namespaces && exec {server}"
    return StdioServerParameters(
        command="unshare", args=["-U", "-r", "sh", "-c", script], env=env, cwd=tmp_path
    )


async def test_run_code_says_what_is_wrong_and_the_fix_for_this_host(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    async with Client(without_userns(make_settings(), tmp_path, "serve"), mode="legacy") as c:
        for _ in range(2):
            result = await c.call_tool("run_code", {"code": "1", "timeout_s": 60})
            assert result.is_error
            text = result.content[0].text  # type: ignore[union-attr]
            assert text.startswith(f"backend_unavailable: {SAID}"), text
            assert "`sudo sysctl user.max_user_namespaces=15000`" in text
            assert "sandbox_failed" not in text and str(tmp_path) not in text
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert log.count(SAID) >= 1, log[-3000:]
    assert "pooled sandbox did not start" not in log, log[-3000:]


def test_doctor_says_the_same(make_settings: Callable[..., Settings], tmp_path: Path) -> None:
    import subprocess

    params = without_userns(make_settings(), tmp_path, "doctor", "--backend", "bwrap")
    done = subprocess.run(
        [params.command, *params.args], env=params.env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert SAID in done.stdout, done.stdout + done.stderr
    assert "`sudo sysctl user.max_user_namespaces=15000`" in done.stdout
