"""stdio mode as a client process sees it: nothing but protocol frames on stdout, and every
sandbox gone after stdin EOF, SIGTERM or SIGINT."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from mcp_code_sandbox.settings import Settings

from ..procs import descendants, wait_gone
from .conftest import initialize_request, server_env

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap]


def start(settings: Settings) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "mcp_code_sandbox", "serve"],
        env=server_env(settings.state_dir, settings.runtime_dir),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )


def send(proc: subprocess.Popen[bytes], message: dict[str, Any]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(message).encode() + b"\n")
    proc.stdin.flush()


def receive(proc: subprocess.Popen[bytes], request_id: int) -> dict[str, Any]:
    """Read lines until the response to ``request_id``; every line must be JSON-RPC."""
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        assert line, "server closed stdout"
        message = json.loads(line)  # a stray print would fail here
        assert message.get("jsonrpc") == "2.0", line[:200]
        if message.get("id") == request_id:
            return message


def handshake(proc: subprocess.Popen[bytes]) -> None:
    send(proc, initialize_request("raw-test"))
    assert receive(proc, 1)["result"]["serverInfo"]["name"] == "mcp-code-sandbox"
    send(proc, {"jsonrpc": "2.0", "method": "notifications/initialized"})


def call(proc: subprocess.Popen[bytes], request_id: int, tool: str, **args: Any) -> Any:
    send(
        proc,
        {
            "jsonrpc": "2.0",
            "id": request_id,
            "method": "tools/call",
            "params": {"name": tool, "arguments": args},
        },
    )
    return receive(proc, request_id)["result"]


def test_stdout_carries_only_protocol_even_when_code_floods_it(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings()
    proc = start(settings)
    try:
        handshake(proc)
        flood = call(
            proc,
            2,
            "run_code",
            code=(
                "import os, sys, ctypes\n"
                "print('x' * 3_000_000)\n"
                "os.system('yes | head -c 5000000')\n"
                "ctypes.CDLL(None).write(1, b'raw fd write\\n', 13)\n"
                "sys.__stdout__.write('dunder stdout\\n')\n"
            ),
        )
        assert flood["isError"] is False
        assert flood["structuredContent"]["stdout_truncated"] is True
        again = call(
            proc,
            3,
            "run_code",
            code="print('still speaking protocol')",
            session_id=flood["structuredContent"]["session_id"],
        )
        assert again["structuredContent"]["stdout"] == "still speaking protocol\n"
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


@pytest.mark.parametrize("how", ["eof", "sigterm", "sigint"])
def test_every_way_out_removes_the_sandboxes(
    make_settings: Callable[..., Settings],
    how: str,
) -> None:
    settings = make_settings()
    proc = start(settings)
    handshake(proc)
    result = call(
        proc, 2, "run_code", code="import subprocess; subprocess.Popen(['sleep', '600']); 'started'"
    )
    assert result["structuredContent"]["result"] == "'started'"
    sandbox = descendants(proc.pid)
    assert len(sandbox) >= 3  # bwrap, its init, the agent, the kernel, sleep
    assert proc.stdin is not None
    if how == "eof":
        proc.stdin.close()
    else:
        proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGINT)
    try:
        assert proc.wait(timeout=30) == 0
    finally:
        stop(proc)
    assert wait_gone(sandbox) == set()
    assert not any(settings.workspaces_dir.rglob("*"))
