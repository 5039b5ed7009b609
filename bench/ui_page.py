"""What the operator's page costs: ``GET /ui`` as an admin, beside ``GET /healthz`` (the
server's cheapest answer) in the same run, with N live bwrap sessions (each has run a
cell and holds a 1,000-file workspace, so the page reads N cgroups and walks N
workspaces).

Run by hand, as root or as the user that serves (bwrap and the runtime env)::

    .venv/bin/python bench/ui_page.py [--sessions 10] [--runs 30]

Prints one Markdown table (median and p90 in ms) to stdout; the server's log goes to a
temp dir that is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

TOKEN = "bench-0123456789abcdef00"
MAKE_FILES = "import os\nfor i in range(1000):\n    open(f'f{i}.txt', 'w').write('x' * 100)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def timed(client: httpx.Client, path: str, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        answer = client.get(path)
        out.append((time.perf_counter() - start) * 1000)
        answer.raise_for_status()
    return out


async def open_sessions(base: str, count: int) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with (
        create_mcp_http_client(headers=headers) as http,
        Client(streamable_http_client(f"{base}/mcp", http_client=http)) as client,
    ):
        for i in range(count):
            args = {"session_id": f"s{i}", "code": MAKE_FILES}
            result = await client.call_tool("run_code", args)
            assert not result.is_error, result.content


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="mcs-bench-ui-", dir="/var/tmp"))
    state.chmod(0o711)
    port = free_port()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SANDBOX_STATE_DIR": str(state),
        "SANDBOX_BACKEND": "bwrap",
        "SANDBOX_API_TOKENS": f"bench:{TOKEN}:admin",
        "SANDBOX_MAX_SESSIONS": str(max(10, args.sessions)),
    }
    for name in ("SANDBOX_RUNTIME_DIR",):
        if name in os.environ:
            env[name] = os.environ[name]
    log = open(state / "server.log", "wb")  # noqa: SIM115
    cmd = [sys.executable, "-m", "mcp_code_sandbox", "serve", "--transport", "http"]
    proc = subprocess.Popen([*cmd, "--port", str(port)], env=env, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.1)
        asyncio.run(open_sessions(base, args.sessions))
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=base, headers=auth, timeout=60) as client:
            timed(client, "/ui", 3)  # warm up
            rows = [("GET /healthz", timed(client, "/healthz", args.runs))]
            rows.append((f"GET /ui ({args.sessions} sessions)", timed(client, "/ui", args.runs)))
        print("| request | median ms | p90 ms |\n|---|---|---|")
        for name, values in rows:
            p90 = statistics.quantiles(values, n=10)[-1]
            print(f"| {name} | {statistics.median(values):.1f} | {p90:.1f} |")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
