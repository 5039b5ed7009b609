"""A first ``serve`` (no runtime env in its runtime dir) as an MCP client sees it, from
this checkout: a missing bwrap is said at once and plainly, a failed build once, then
retried. The whole path from a built wheel, with the build succeeding: test_wheel.py."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters

from mcp_code_sandbox.settings import Settings

from .conftest import server_env

pytestmark = [pytest.mark.e2e]


def first_run(settings: Settings, tmp_path: Path, **extra: str) -> StdioServerParameters:
    env = server_env(
        settings.state_dir,
        tmp_path / "runtime",  # empty: this server builds its own
        SANDBOX_LOG_FILE=str(tmp_path / "server.log"),
        **extra,
    )
    env |= {k: v for k, v in os.environ.items() if k.startswith(("PIP_", "SSL_", "REQUESTS_"))}
    return StdioServerParameters(
        command=sys.executable, args=["-m", "mcp_code_sandbox"], env=env, cwd=tmp_path
    )


async def test_a_missing_bwrap_is_said_at_once_with_the_commands_that_install_it(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    # A build that fails: a call that waited for it would be told that instead.
    params = first_run(
        make_settings(), tmp_path, PATH="/nonexistent", SANDBOX_RUNTIME_PACKAGES="no-such-pkg-zq7x"
    )
    async with Client(params, mode="legacy") as client:
        for _ in range(2):
            result = await client.call_tool("run_code", {"code": "1", "timeout_s": 300})
            assert result.is_error
            text = result.content[0].text  # type: ignore[union-attr]
            assert text.startswith("backend_unavailable: bubblewrap (bwrap) is not installed")
            assert "`sudo apt install bubblewrap` (Debian, Ubuntu)" in text
            assert "`sudo dnf install bubblewrap` (Fedora)" in text
            assert "retry_after_s" not in (result.meta or {})  # not a wait: a fix
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert log.count("bubblewrap (bwrap) is not installed") == 1, log[-2000:]


@pytest.mark.bwrap
async def test_a_failed_build_is_said_once_and_the_next_call_builds_again(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    # A package no index has: pip fails, quickly and every time.
    params = first_run(make_settings(), tmp_path, SANDBOX_RUNTIME_PACKAGES="no-such-pkg-zq7x")
    async with Client(params, mode="legacy") as client:
        texts = []
        for _ in range(2):
            result = await client.call_tool("run_code", {"code": "1", "timeout_s": 300})
            assert result.is_error
            texts.append(result.content[0].text)  # type: ignore[union-attr]
    for text in texts:  # each call: the build failed (the second one's is a new build)
        assert text.startswith("backend_unavailable: building the sandbox runtime failed, so")
        assert "No matching distribution found for no-such-pkg-zq7x" in text
        assert "The next call tries the build again" in text
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert log.count("building the sandbox runtime failed") == 2, log[-3000:]
    assert not (tmp_path / "runtime" / "venv").exists()


@pytest.mark.bwrap
async def test_serve_script_answers_at_once_and_builds_in_the_background(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    # scripts/serve.sh is a client's command line: it must answer `initialize` before the
    # runtime exists, never after a build (which a client's start-up timeout would not
    # wait for). A build that fails shows it: the script itself must still serve, and
    # the call is told why.
    params = first_run(make_settings(), tmp_path, SANDBOX_RUNTIME_PACKAGES="no-such-pkg-zq7x")
    script = Path(__file__).resolve().parents[2] / "scripts" / "serve.sh"
    params = params.model_copy(update={"command": str(script), "args": []})
    async with Client(params, mode="legacy") as client:
        result = await client.call_tool("run_code", {"code": "1", "timeout_s": 300})
        assert result.is_error
        text = result.content[0].text  # type: ignore[union-attr]
        assert text.startswith("backend_unavailable: building the sandbox runtime failed, so")
        assert "No matching distribution found for no-such-pkg-zq7x" in text


@pytest.mark.bwrap
async def test_while_the_runtime_builds_nothing_tells_the_user_to_run_setup(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    # The warm pool waits for the build instead of failing (and logging "run `setup`")
    # every few seconds; then it fills, and the first call runs.
    params = first_run(
        make_settings(), tmp_path, SANDBOX_RUNTIME_PACKAGES="six", SANDBOX_PRELOAD="",
        SANDBOX_POOL_SIZE="1",
    )  # fmt: skip
    async with Client(params, mode="legacy") as client:
        # The runtime has what SANDBOX_RUNTIME_PACKAGES names (on Docker:
        # tests/integration/test_docker_derived.py).
        code = "import six\n6*7"
        result = await client.call_tool("run_code", {"code": code, "timeout_s": 300})
        assert not result.is_error, result.content
        assert result.structured_content is not None
        assert result.structured_content["result"] == "42"
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert "building the sandbox runtime: installing six (1/1)" in log
    assert "run `mcp-code-sandbox setup`" not in log, log[-3000:]
    assert "pooled sandbox did not start" not in log, log[-3000:]
