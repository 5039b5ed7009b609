"""The egress proxies' TCP gate with real sockets on this host: each sandbox's proxy is
reached on one port with its own credential in the proxy URL, as a Kubernetes pod
reaches the server's; the proxy's policy, DNS and TLS handling are the proxy's own.
Names resolve through an injected resolver; upstreams listen on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from mcp_code_sandbox.egress import Policy, open_proxy, static_resolver
from mcp_code_sandbox.egress.gate import Credential, ProxyGate
from mcp_code_sandbox.egress.proxy import EgressProxy

from ..egress_lab import LabCA, upstream

pytestmark = pytest.mark.timeout(60)

NAMES = {"plain.test": ["127.0.0.1"], "api.test": ["127.0.0.1"], "blocked.test": ["127.0.0.1"]}


async def a_proxy(*allow: str) -> EgressProxy:
    return await open_proxy(
        None,
        Policy.parse([*allow, "127.0.0.1/32"], []),
        (),
        owner="alice",
        session="sess_gate",
        metrics=None,
        resolver=static_resolver(NAMES),
    )


@contextlib.asynccontextmanager
async def a_gate() -> AsyncIterator[ProxyGate]:
    gate = ProxyGate("127.0.0.1", 0)
    await gate.start()
    try:
        yield gate
    finally:
        await gate.aclose()


async def ask(gate: ProxyGate, head: str) -> bytes:
    """The status line the gate answers ``head`` with (a raw request)."""
    reader, writer = await asyncio.open_connection(gate.host, gate.port)
    try:
        writer.write(head.encode())
        await writer.drain()
        return (await reader.readuntil(b"\r\n")).strip()
    finally:
        writer.close()


async def test_a_credential_reaches_an_allowed_host_through_its_proxy() -> None:
    async with upstream() as plain, a_gate() as gate:
        proxy = await a_proxy("plain.test")
        try:
            credential = gate.admit(proxy)
            url = credential.url(gate.host, gate.port)
            async with httpx.AsyncClient(proxy=url) as client:
                reply = await client.get(f"http://plain.test:{plain.port}/hi")
                assert reply.status_code == 200
                refused = await client.get(f"http://blocked.test:{plain.port}/hi")
                assert refused.status_code == 403
                assert b"blocked.test is not in the allowlist" in refused.content
            # The credential is the proxy's, never forwarded upstream.
            [(_, headers)] = plain.requests
            assert "proxy-authorization" not in {name.lower() for name in headers}
            assert proxy.take_blocked() == ["blocked.test"]
        finally:
            await proxy.aclose()


async def test_https_is_tunnelled_through_the_gate(tmp_path: Path) -> None:
    ca = LabCA(tmp_path)
    async with upstream(ca.server_context("api.test")) as api, a_gate() as gate:
        proxy = await a_proxy("api.test")
        try:
            url = gate.admit(proxy).url(gate.host, gate.port)
            async with httpx.AsyncClient(proxy=url, verify=ca.client_context()) as client:
                reply = await client.get(f"https://api.test:{api.port}/x")
                assert reply.status_code == 200
        finally:
            await proxy.aclose()


@pytest.mark.parametrize(
    "authorization",
    [
        None,  # no credential at all: another pod that reaches the port
        "Basic bm9ib2R5OnRva2Vu",  # nobody:token
        "Bearer abc",
    ],
)
async def test_a_connection_without_the_credential_gets_407(authorization: str | None) -> None:
    async with upstream() as plain, a_gate() as gate:
        proxy = await a_proxy("plain.test")
        try:
            gate.admit(proxy)
            extra = "" if authorization is None else f"Proxy-Authorization: {authorization}\r\n"
            target = f"plain.test:{plain.port}"
            for request in (
                f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{extra}\r\n",
                f"GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\n{extra}\r\n",
            ):
                assert await ask(gate, request) == b"HTTP/1.1 407 Proxy Authentication Required"
            assert plain.connections == 0
        finally:
            await proxy.aclose()


async def test_a_wrong_token_or_a_forgotten_credential_opens_nothing() -> None:
    async with upstream() as plain, a_gate() as gate:
        proxy = await a_proxy("plain.test")
        try:
            credential = gate.admit(proxy)
            wrong = Credential(credential.user, credential.token[:-1] + "x")
            forgotten = gate.admit(proxy)
            gate.forget(forgotten)
            for used in (wrong, forgotten):
                async with httpx.AsyncClient(proxy=used.url(gate.host, gate.port)) as client:
                    reply = await client.get(f"http://plain.test:{plain.port}/hi")
                    assert reply.status_code == 407
            assert plain.connections == 0
        finally:
            await proxy.aclose()


async def test_each_credential_gets_its_own_proxys_policy() -> None:
    async with upstream() as plain, a_gate() as gate:
        mine, theirs = await a_proxy("plain.test"), await a_proxy("api.test")
        try:
            mine_url = gate.admit(mine).url(gate.host, gate.port)
            theirs_url = gate.admit(theirs).url(gate.host, gate.port)
            async with httpx.AsyncClient(proxy=mine_url) as client:
                assert (await client.get(f"http://plain.test:{plain.port}/")).status_code == 200
            async with httpx.AsyncClient(proxy=theirs_url) as client:
                assert (await client.get(f"http://plain.test:{plain.port}/")).status_code == 403
        finally:
            await mine.aclose()
            await theirs.aclose()
