"""Hostile code in a real sandbox against its egress proxy (issue 27): request smuggling,
IPv4 hidden in IPv6, a flood of connections. The sandbox reaches its proxy as in
production: through the agent's bridge on 127.0.0.1:3128, or its socket directly.

Upstreams run on 127.0.0.1 in this process, opened to the proxies by an address entry;
names resolve through ``SANDBOX_NETWORK_RESOLVE``. The proxy is host-side and the same
for every backend, but each binds its socket in its own way (gVisor passes the
connections through its gofer), so every attack runs on bwrap, runc and runsc.
"""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
from collections.abc import AsyncIterator
from typing import Any

import pytest

from mcp_code_sandbox.egress import proxy as proxy_module
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService

from ..conftest import MakeService, each_runtime
from ..egress_lab import ASK_PROXY, Naive, flood_proxy, naive_upstream

HELPERS = ASK_PROXY


@pytest.fixture
async def naive() -> AsyncIterator[Naive]:
    async with naive_upstream() as up:
        yield up


@pytest.fixture
async def svc(make_service: MakeService) -> AsyncIterator[SandboxService]:
    settings = {
        "allow_network": True,
        "network_allow": "smuggle.test,nat64.test,sixtofour.test,127.0.0.1/32",
        "network_resolve": ",".join(
            [
                "smuggle.test=127.0.0.1",
                "nat64.test=64:ff9b::a9fe:a9fe",
                "sixtofour.test=2002:a00:1::1",
            ]
        ),
        "exec_timeout_s": 60,
    }
    async with make_service(**settings) as service:
        yield service


async def run(svc: SandboxService, owner: str, body: str) -> dict[str, Any]:
    code = HELPERS + "\nout = {}\n" + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    report = await svc.run_code(owner, RunRequest(code, network=True), f"sess_{owner}")
    assert report.status == "ok", (report.stdout, report.stderr, report.error)
    return dict(json.loads(report.stdout.strip().splitlines()[-1]))


@each_runtime
async def test_smuggling_and_embedded_ipv4_from_a_sandbox(
    svc: SandboxService, naive: Naive
) -> None:
    found = await run(
        svc,
        "alice",
        f"""
        where = b"smuggle.test:{naive.port}"
        smuggled = b"GET /smuggled HTTP/1.1\\r\\nHost: internal.corp\\r\\n\\r\\n"
        body = b"%x\\r\\n%s\\r\\n0\\r\\n\\r\\n" % (len(smuggled), smuggled)
        out["smuggled"] = ask(
            b"POST http://" + where + b"/ HTTP/1.1\\r\\nHost: " + where + b"\\r\\n"
            b"Content-Length: 4\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n" + body
        )
        for name in ("nat64.test", "sixtofour.test"):
            target = f"{{name}}:{naive.port}".encode()
            head = b" HTTP/1.1\\r\\nHost: " + target + b"\\r\\n\\r\\n"
            out[name] = ask(b"CONNECT " + target + head)
        """,
    )
    assert found["smuggled"] == "HTTP/1.1 400 Bad Request"
    assert naive.requests == []  # neither the request nor the one hidden in it
    assert found["nat64.test"] == "HTTP/1.1 403 Forbidden"  # 64:ff9b::169.254.169.254
    assert found["sixtofour.test"] == "HTTP/1.1 403 Forbidden"  # 6to4 of 10.0.0.1


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@each_runtime
async def test_a_flood_of_connections_leaves_the_server_its_descriptors(
    svc: SandboxService, naive: Naive
) -> None:
    """Alice's sandbox connects to its proxy's socket hundreds of times and holds them;
    the server (this process) holds no more for it than the proxy's cap, and Bob's
    session runs meanwhile."""
    await run(svc, "alice", "out['up'] = 1")
    await run(svc, "bob", "out['up'] = 1")
    before = _fds()
    peak = [before]

    async def watch() -> None:
        while True:
            peak[0] = max(peak[0], _fds())
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    try:
        flood = asyncio.create_task(
            run(
                svc,
                "alice",
                flood_proxy(1),
            )
        )
        while not flood.done() and peak[0] - before < proxy_module.MAX_CONNECTIONS:
            await asyncio.sleep(0.05)
        bob = await run(
            svc,
            "bob",
            f"out['bob'] = ask(b'GET http://smuggle.test:{naive.port}/ HTTP/1.1\\r\\n"
            f"Host: smuggle.test:{naive.port}\\r\\nConnection: close\\r\\n\\r\\n')",
        )
        found = await flood
    finally:
        watcher.cancel()
    assert found["held"] > proxy_module.MAX_CONNECTIONS + proxy_module.REFUSING
    assert bob["bob"] == "HTTP/1.1 200 OK"
    # Slack: Bob's run and connection, and the run's own pipes.
    assert peak[0] - before <= proxy_module.MAX_CONNECTIONS + proxy_module.REFUSING + 16, peak
