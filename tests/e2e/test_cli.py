"""The command line as a person uses it: doctor, exec, setup, serve's guards, logging."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import pytest

from mcp_code_sandbox.settings import Settings

from .conftest import free_port, http_server, server_env
from .test_auth import post_mcp

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap]


def cli(
    settings: Settings, *args: str, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mcp_code_sandbox", *args],
        env=server_env(settings.state_dir, settings.runtime_dir, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_doctor_says_what_is_enforced(make_settings: Callable[..., Settings]) -> None:
    proc = cli(make_settings(), "doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.lower()
    for word in ("namespace", "seccomp", "memory", "pids", "cpu", "network", "runtime"):
        assert word in out, word
    if os.geteuid() == 0:  # root with loop devices (CI, this suite's hosts)
        assert "workspace quota: filesystem (a loop-mounted ext4 image" in proc.stdout
    checked = cli(make_settings(), "doctor", SANDBOX_WORKSPACE_QUOTA_MODE="checked")
    assert "workspace quota: checked during and after runs" in checked.stdout


def test_doctor_fails_without_a_backend(make_settings: Callable[..., Settings]) -> None:
    proc = cli(make_settings(), "doctor", PATH="/nonexistent", DOCKER_HOST="unix:///nonexistent")
    assert proc.returncode != 0
    assert "bubblewrap" in proc.stdout + proc.stderr
    assert "no engine answers at unix:///nonexistent" in proc.stdout
    assert "backend in use (bwrap): bwrap, NOT usable" in proc.stdout


def test_exec_runs_code_once(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings()
    proc = cli(
        settings,
        "exec",
        "import pandas as pd\nprint('rows', len(pd.DataFrame({'a': [1, 2]})))\n6*7",
    )
    assert proc.returncode == 0, proc.stderr
    assert "rows 2" in proc.stdout and "42" in proc.stdout
    failing = cli(settings, "exec", "raise ValueError('nope')")
    assert failing.returncode == 1
    assert "ValueError" in failing.stderr
    assert not any(settings.workspaces_dir.rglob("*"))  # nothing left behind


def test_setup_is_fast_when_done(make_settings: Callable[..., Settings]) -> None:
    start = time.monotonic()
    proc = cli(make_settings(), "setup")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""  # progress goes to stderr
    assert time.monotonic() - start < 30  # no rebuild (a rebuild installs for minutes)


def test_http_refuses_an_open_bind_without_tokens(make_settings: Callable[..., Settings]) -> None:
    proc = cli(
        make_settings(),
        "serve",
        "--transport",
        "http",
        "--host",
        "0.0.0.0",
        "--port",
        str(free_port()),
        timeout=60,
    )
    assert proc.returncode == 2
    assert "refusing to listen on 0.0.0.0" in proc.stderr
    assert "SANDBOX_API_TOKENS" in proc.stderr and "SANDBOX_ALLOW_UNAUTHENTICATED" in proc.stderr


def test_http_open_bind_on_purpose_says_so_loudly(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings()
    extra = {"SANDBOX_HTTP_HOST": "0.0.0.0", "SANDBOX_ALLOW_UNAUTHENTICATED": "true"}
    with http_server(settings, **extra) as base:
        assert httpx.get(f"{base}/healthz").status_code == 200
    log = (settings.state_dir / "server.log").read_text()
    assert "warning" in log and "SERVING WITHOUT AUTHENTICATION on 0.0.0.0" in log


def test_http_open_bind_with_tokens_requires_them(make_settings: Callable[..., Settings]) -> None:
    token = "ops-0123456789abcdef"
    extra = {"SANDBOX_HTTP_HOST": "0.0.0.0", "SANDBOX_API_TOKENS": f"ops:{token}"}
    with http_server(make_settings(), **extra) as base:
        assert post_mcp(base, None).status_code == 401
        assert post_mcp(base, f"Bearer {token}").status_code == 200


def test_bad_tokens_stop_the_server_with_one_line_each(
    make_settings: Callable[..., Settings],
) -> None:
    proc = cli(
        make_settings(),
        "serve",
        "--transport",
        "http",
        "--port",
        str(free_port()),
        SANDBOX_API_TOKENS="ok:ok-0123456789abcdef,weak:hunter2,ok:other-0123456789abcd",
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "invalid configuration: SANDBOX_API_TOKENS entry 2: token 'weak' is shorter than 16 "
        "characters; make one with `openssl rand -hex 32`",
        "invalid configuration: SANDBOX_API_TOKENS entry 3: token name 'ok' is given twice",
    ]


def test_a_port_in_use_is_one_clear_line_and_a_failed_exit(
    make_settings: Callable[..., Settings],
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = cli(make_settings(), "serve", "--transport", "http", "--http-port", str(port))
    assert proc.returncode != 0
    assert proc.stderr.splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port}: the port is in use (another server?); "
        "stop it or choose another port with --http-port or SANDBOX_HTTP_PORT"
    ]


def test_the_start_line_names_the_backend_and_why_and_warns_of_typos(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    with http_server(settings, SANDBOX_MEMORY_LIMT="1g") as base:
        assert httpx.get(f"{base}/healthz").status_code == 200
    log = (settings.state_dir / "server.log").read_text()
    assert (
        "unknown setting SANDBOX_MEMORY_LIMT is ignored; did you mean SANDBOX_MEMORY_LIMIT?" in log
    )
    started = [line for line in log.splitlines() if "serving MCP on http://" in line]
    assert len(started) == 1, log[-3000:]
    assert "backend bwrap, because SANDBOX_BACKEND=bwrap" in started[0]


def test_healthz_and_host_checks(make_settings: Callable[..., Settings]) -> None:
    with http_server(make_settings()) as base:
        assert httpx.get(f"{base}/healthz").json()["status"] == "ok"
        evil = httpx.post(f"{base}/mcp", headers={"Origin": "http://evil.example"}, json={})
        assert evil.status_code == 403  # DNS-rebinding protection (Origin check)


def test_audit_lines_never_hold_code_or_output(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings()
    log_file = settings.state_dir / "audit.log"
    secret = "TOPSECRET-4242"
    proc = cli(
        settings,
        "exec",
        f"x = '{secret}'\nprint(x)",
        SANDBOX_LOG_FILE=str(log_file),
        SANDBOX_LOG_FORMAT="json",
        SANDBOX_LOG_LEVEL="DEBUG",
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in log_file.read_text().splitlines()]
    runs = [line for line in lines if line.get("event") == "run"]
    assert len(runs) == 1
    assert runs[0]["status"] == "ok" and runs[0]["language"] == "python"
    assert {"owner", "session", "duration_ms", "code_bytes", "output_bytes"} <= set(runs[0])
    assert secret not in log_file.read_text()


async def test_http_server_cleans_up_on_sigterm(make_settings: Callable[..., Settings]) -> None:
    from mcp import Client

    from ..procs import descendants, wait_gone
    from .conftest import http_server_process

    settings = make_settings()
    with http_server_process(settings) as (base, proc):
        async with Client(f"{base}/mcp", mode="2026-07-28") as client:
            result = await client.call_tool(
                "run_code", {"code": "import subprocess; subprocess.Popen(['sleep', '600'])"}
            )
            assert not result.is_error
        sandbox = descendants(proc.pid)
        assert len(sandbox) >= 3
        proc.terminate()
        # uvicorn shuts down gracefully (lifespan cleanup), then re-raises the signal.
        assert proc.wait(timeout=30) in (0, -15)
    assert wait_gone(sandbox) == set()
    assert not any(settings.workspaces_dir.rglob("*"))
