"""The egress proxy's own cost, on this host, beside the same transfers made directly.

Run by hand from the repository root::

    .venv/bin/python bench/egress.py [--runs 7] [--json out.json]

Upstreams are local (``tests/egress_lab.py``: HTTP/1.1 servers on 127.0.0.1, TLS with a
certificate of a test CA). The client is httpx. "via proxy" goes client -> TCP bridge on
127.0.0.1 (the sandbox side's, in Python here) -> the proxy's Unix socket -> upstream;
"tunnel" is a CONNECT the proxy does not decrypt, "intercepted" one to a host with a
secret (TLS terminated by the proxy, the secret's header added, a new verified TLS
connection upstream per request). Rows, each measured in the same loop as its baseline
(so both see the same load): one 10 MB download (HTTPS, and plain HTTP); 100 small HTTPS
GETs on one kept-alive client; 100 small HTTPS GETs each on a new connection. Median and
p90 of ``--runs`` samples after one warm-up. The sandbox's own share (its bridge inside
the sandbox, the bind-mounted socket) is measured by the server bench, not here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcp_code_sandbox.egress import Policy, open_proxy, static_resolver
from mcp_code_sandbox.egress.secrets import parse_secrets
from tests.egress_lab import LabCA, bridge, upstream

MB10 = 10 * 1024 * 1024


async def _download(client: httpx.AsyncClient, url: str) -> None:
    got = 0
    async with client.stream("GET", url) as reply:
        async for chunk in reply.aiter_raw():
            got += len(chunk)
    assert got == MB10, got


async def _small(client: httpx.AsyncClient, url: str, n: int = 100) -> None:
    for _ in range(n):
        reply = await client.get(url)
        assert reply.status_code == 200


async def _small_new(make: Callable[[], httpx.AsyncClient], url: str, n: int = 100) -> None:
    for _ in range(n):
        async with make() as client:
            assert (await client.get(url)).status_code == 200


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p90 = (
        statistics.quantiles(ordered, n=10, method="inclusive")[-1]
        if len(ordered) > 1
        else ordered[0]
    )
    return {"median_ms": statistics.median(ordered) * 1000, "p90_ms": p90 * 1000}


async def _time(job: Callable[[], Awaitable[None]]) -> float:
    start = time.perf_counter()
    await job()
    return time.perf_counter() - start


NAMES = ("open.test", "secret.test", "plain.test")


async def _serve_upstreams(where: Path) -> None:
    """Child process 1: the upstreams (the test CA's key stays here)."""
    ca = LabCA(where)
    async with (
        upstream() as plain,
        upstream(ca.server_context("open.test")) as open_tls,
        upstream(ca.server_context("secret.test")) as secret_tls,
    ):
        ports = {"plain": plain.port, "open": open_tls.port, "secret": secret_tls.port}
        (where / "upstreams.json").write_text(json.dumps(ports))
        await asyncio.Event().wait()


async def _serve_proxy(where: Path) -> None:
    """Child process 2: the proxy (as in the server) and the bridge (as in the sandbox)."""
    secrets = parse_secrets(
        {"secrets": {"KEY": {"value": "bench-value", "hosts": ["secret.test"]}}}
    )
    proxy = await open_proxy(
        where / "egress.sock",
        Policy.parse([*NAMES, "127.0.0.1/32"]),
        secrets,
        owner="bench",
        session="bench",
        metrics=None,
        upstream_ca=where / "upstream-ca.pem",
        resolver=static_resolver({name: ["127.0.0.1"] for name in NAMES}),
    )
    bundle = proxy.ca_bundle()
    assert bundle is not None
    (where / "bundle.pem").write_bytes(bundle)
    async with bridge(proxy.socket_path) as port:
        (where / "proxy.json").write_text(json.dumps({"port": port}))
        await asyncio.Event().wait()


def _wait_for(path: Path, child: subprocess.Popen[bytes]) -> dict[str, int]:
    deadline = time.monotonic() + 60
    while not path.exists():
        if child.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{path.name} never appeared (child exit {child.poll()})")
        time.sleep(0.05)
    return json.loads(path.read_text())  # type: ignore[no-any-return]


@contextlib.contextmanager
def _lab(where: Path) -> Iterator[dict[str, Any]]:
    """Upstreams and proxy in their own processes (as in production: neither shares the
    client's CPU time slice or event loop), their logs to files in ``where``."""
    children: list[subprocess.Popen[bytes]] = []
    try:
        for role in ("upstreams", "proxy"):
            log = (where / f"{role}.log").open("wb")
            argv = [sys.executable, __file__, "--role", role, "--dir", str(where)]
            children.append(subprocess.Popen(argv, stdout=log, stderr=log))
            info = _wait_for(where / f"{role}.json", children[-1])
            if role == "upstreams":
                ports = info
        yield {
            **ports,
            "port": info["port"],
            "ca": where / "upstream-ca.pem",
            "bundle": where / "bundle.pem",
        }
    finally:
        for child in children:
            child.kill()
            child.wait(10)


async def main(runs: int) -> list[dict[str, object]]:
    with tempfile.TemporaryDirectory() as tmp, _lab(Path(tmp)) as lab:
        direct_ctx = ssl.create_default_context(cafile=str(lab["ca"]))
        bundle = ssl.create_default_context(cafile=str(lab["bundle"]))
        via = f"http://127.0.0.1:{lab['port']}"

        def direct() -> httpx.AsyncClient:
            return httpx.AsyncClient(transport=_Pinned(direct_ctx))

        def proxied() -> httpx.AsyncClient:
            return httpx.AsyncClient(proxy=via, verify=bundle)

        open_url = f"https://open.test:{lab['open']}"
        secret_url = f"https://secret.test:{lab['secret']}"
        plain_url = f"http://plain.test:{lab['plain']}"
        big = f"/bytes/{MB10}"
        rows: dict[str, dict[str, Callable[[], Awaitable[None]]]] = {
            "10 MB HTTPS download": {
                "direct": lambda: _with(direct, open_url + big, _download),
                "via proxy (tunnel)": lambda: _with(proxied, open_url + big, _download),
                "via proxy (intercepted)": lambda: _with(proxied, secret_url + big, _download),
            },
            "10 MB plain HTTP download": {
                "direct": lambda: _with(direct, plain_url + big, _download),
                "via proxy": lambda: _with(proxied, plain_url + big, _download),
            },
            "100 small HTTPS GETs, one client": {
                "direct": lambda: _with(direct, open_url + "/small", _small),
                "via proxy (tunnel)": lambda: _with(proxied, open_url + "/small", _small),
                "via proxy (intercepted)": lambda: _with(proxied, secret_url + "/small", _small),
            },
            "100 small HTTPS GETs, new connection each": {
                "direct": lambda: _small_new(direct, open_url + "/small"),
                "via proxy (tunnel)": lambda: _small_new(proxied, open_url + "/small"),
                "via proxy (intercepted)": lambda: _small_new(proxied, secret_url + "/small"),
            },
        }
        results: list[dict[str, object]] = []
        for row, variants in rows.items():
            samples: dict[str, list[float]] = {name: [] for name in variants}
            for job in variants.values():  # warm-up
                await job()
            for _ in range(runs):
                for name, job in variants.items():
                    samples[name].append(await _time(job))
            for name, taken in samples.items():
                results.append({"row": row, "variant": name, **_stats(taken), "samples_s": taken})
            print(f"done: {row}", file=sys.stderr)
        return results


class _Pinned(httpx.AsyncHTTPTransport):
    """Sends requests for a name to 127.0.0.1 while TLS still checks the name (httpx's
    ``sni_hostname`` extension): the direct baseline, with the same certificate checks
    and no resolver (the proxied path resolves by a static table too)."""

    def __init__(self, verify: ssl.SSLContext) -> None:
        super().__init__(verify=verify)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        request.url = request.url.copy_with(host="127.0.0.1")
        request.extensions = {**request.extensions, "sni_hostname": host}
        request.headers["host"] = f"{host}:{request.url.port}"
        return await super().handle_async_request(request)


async def _with(
    make: Callable[[], httpx.AsyncClient],
    url: str,
    job: Callable[[httpx.AsyncClient, str], Awaitable[None]],
) -> None:
    async with make() as client:
        await job(client, url)


def _table(results: list[dict[str, object]]) -> str:
    lines = ["| row | variant | median ms | p90 ms |", "|---|---|---:|---:|"]
    for r in results:
        lines.append(f"| {r['row']} | {r['variant']} | {r['median_ms']:.1f} | {r['p90_ms']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--role", choices=["upstreams", "proxy"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "upstreams":
        asyncio.run(_serve_upstreams(args.dir))
    if args.role == "proxy":
        asyncio.run(_serve_proxy(args.dir))
    load = os.getloadavg()
    found = asyncio.run(main(args.runs))
    print(
        f"load average at start: {load[0]:.2f}, at end: {os.getloadavg()[0]:.2f}; runs: {args.runs}"
    )
    print(_table(found))
    if args.json:
        args.json.write_text(json.dumps(found, indent=2))
