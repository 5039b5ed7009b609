"""The sandbox side of network by policy, per backend, beside its baselines in the same run.

Run by hand from the repository root (root, as the server runs on the reference machine)::

    .venv/bin/python bench/network_sandbox.py [--backend bwrap|docker|runsc|all] [--runs 7]
        [--image mcs-...:latest]

Through the service in-process (``SandboxService``, the layer the MCP tools call), on a
fresh state directory. Rows, each measured in the same loop as its baseline:

- ``new session``: a new session's first ``print(1)``, with ``network=true`` (its egress
  proxy opened, its socket bound in, the agent's bridge started) and without.
- ``10 MB over HTTP``: one download inside a networked sandbox (urllib -> the agent's
  bridge on 127.0.0.1 -> the proxy's Unix socket -> the upstream) beside the same download
  made by the host's Python directly (no sandbox, no proxy).
- ``100 small GETs``: 100 plain-HTTP GETs, each a new connection, the same way.

The upstream is an HTTP server on the host's 127.0.0.1 (allowed by an address entry, the
only way a proxy reaches loopback). Medians and p90 of ``--runs`` samples after a warm-up;
the load average is printed: nothing is isolated from other load on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcp_code_sandbox.backends import create_backend
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.settings import load_settings

MB10 = 10 * 1024 * 1024
_BIG = b"x" * MB10


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = _BIG if self.path == "/big" else b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def _upstream() -> int:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return int(server.server_address[1])


def _sandbox_code(port: int, what: str) -> str:
    if what == "big":
        return (
            "import urllib.request, time\nt = time.perf_counter()\n"
            f"n = len(urllib.request.urlopen('http://upstream.test:{port}/big').read())\n"
            "print(n, time.perf_counter() - t)"
        )
    return (
        "import urllib.request, time\nt = time.perf_counter()\n"
        "for _ in range(100):\n"
        f"    urllib.request.urlopen('http://upstream.test:{port}/').read()\n"
        "print(100, time.perf_counter() - t)"
    )


def _host(port: int, what: str) -> float:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    start = time.perf_counter()
    if what == "big":
        opener.open(f"http://127.0.0.1:{port}/big").read()
    else:
        for _ in range(100):
            opener.open(f"http://127.0.0.1:{port}/").read()
    return time.perf_counter() - start


async def _sample(fn: Callable[[], Awaitable[float]], runs: int) -> list[float]:
    await fn()  # warm-up
    return [await fn() for _ in range(runs)]


def _row(name: str, samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=10, method="inclusive") if len(samples) > 1 else samples
    return f"| {name} | {statistics.median(samples) * 1000:.1f} | {q[-1] * 1000:.1f} |"


def _state_dir() -> Path:
    state = Path(tempfile.mkdtemp(prefix="mcs-bench-net-", dir="/var/tmp"))
    state.chmod(0o711)  # a sandbox uid must traverse it to its workspace
    return state


async def bench(backend: str, runs: int, image: str | None) -> list[str]:
    state = _state_dir()
    port = _upstream()
    values: dict[str, Any] = {
        "state_dir": str(state),
        "backend": "bwrap" if backend == "bwrap" else "docker",
        "allow_network": True,
        "network_allow": "upstream.test,127.0.0.1/32",
        "network_resolve": "upstream.test=127.0.0.1",
        "max_sessions": 100,
        "runtime_dir": os.environ.get("SANDBOX_RUNTIME_DIR", "/var/lib/mcp-code-sandbox/runtime"),
    }
    if backend != "bwrap":
        values["docker_runtime"] = "runsc" if backend == "runsc" else "runc"
        if image:
            values["image"] = image
    settings = load_settings(values, environ={})
    svc = SandboxService(settings, create_backend(settings))
    await svc.start()
    rows: list[str] = []
    counter = 0
    try:

        async def new_session(network: bool) -> float:
            nonlocal counter
            counter += 1
            sid = f"b{counter}"
            start = time.perf_counter()
            report = await svc.run_code("local", RunRequest("print(1)", network=network), sid)
            took = time.perf_counter() - start
            assert report.status == "ok", report.error
            await svc.close_session("local", sid)
            return took

        with_net, without = await _sample(lambda: new_session(True), runs), []
        without = await _sample(lambda: new_session(False), runs)
        rows += [_row(f"{backend}: new session, network=true", with_net)]
        rows += [_row(f"{backend}: new session, network=false", without)]
        await svc.run_code("local", RunRequest("1", network=True), "net")
        for what, label in (("big", "10 MB over HTTP"), ("small", "100 small GETs")):

            async def inside(what: str = what) -> float:
                code = _sandbox_code(port, what)
                report = await svc.run_code("local", RunRequest(code, network=True), "net")
                assert report.status == "ok", (report.stdout, report.stderr, report.error)
                return float(report.stdout.split()[-1])

            async def direct(what: str = what) -> float:
                return await asyncio.to_thread(_host, port, what)

            rows += [_row(f"{backend}: {label}, sandbox via proxy", await _sample(inside, runs))]
            rows += [_row(f"{backend}: {label}, host directly", await _sample(direct, runs))]
    finally:
        await svc.aclose()
        shutil.rmtree(state, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="all", choices=["bwrap", "docker", "runsc", "all"])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--image", default=None)
    args = parser.parse_args()
    backends = ["bwrap", "docker", "runsc"] if args.backend == "all" else [args.backend]
    print(f"load average at start: {os.getloadavg()}")
    print("| row | median ms | p90 ms |\n|---|---|---|")
    for backend in backends:
        for row in asyncio.run(bench(backend, args.runs, args.image)):
            print(row, flush=True)
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
