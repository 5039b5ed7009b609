"""The egress proxy with real sockets on this host: upstream servers on 127.0.0.1 (plain
and TLS with the test's own CA), the proxy on a Unix socket, clients through a TCP bridge
as the sandbox has. Names resolve through an injected resolver (no ``/etc/hosts``), and
127.0.0.1 is opened by an explicit address entry where a test needs to reach it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import ssl
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
from cryptography import x509

from mcp_code_sandbox.egress import (
    EgressProxy,
    Policy,
    Secret,
    limits,
    open_proxy,
    placeholder,
    static_resolver,
)
from mcp_code_sandbox.egress import proxy as proxy_module
from mcp_code_sandbox.egress.limits import ConnectionBudget
from mcp_code_sandbox.egress.secrets import parse_secrets
from mcp_code_sandbox.errors import SandboxFailed
from mcp_code_sandbox.metrics import Metrics

from ..conftest import shared_runtime_dir
from ..egress_lab import LabCA, Upstream, bridge, naive_upstream, upstream

VALUE = "sk-live-NEVER-IN-THE-SANDBOX-42"
NAMES = ("api.test", "other.test", "plain.test", "blocked.test")
BLOCKED = "blocked by sandbox network policy: {} is not in the allowlist"


@dataclass
class Lab:
    tmp: Path
    ca: LabCA
    plain: Upstream
    api: Upstream  # TLS, certificate for api.test
    other: Upstream  # TLS, certificate for other.test
    secrets: tuple[Secret, ...]

    async def proxy(
        self,
        allow: Sequence[str] = ("api.test", "other.test", "plain.test", "127.0.0.1/32"),
        deny: Sequence[str] = (),
        *,
        secrets: bool = True,
        upstream_ca: bool = True,
        resolve: dict[str, list[str]] | None = None,
        metrics: Metrics | None = None,
    ) -> EgressProxy:
        table: dict[str, list[str]] = {name: ["127.0.0.1"] for name in NAMES}
        return await open_proxy(
            self.tmp / "egress.sock",
            Policy.parse(allow, deny),
            self.secrets if secrets else (),
            owner="alice",
            session="sess_test",
            metrics=metrics,
            upstream_ca=self.ca.path if upstream_ca else None,
            resolver=static_resolver(resolve or table),
        )


@pytest.fixture
async def lab(tmp_path: Path) -> AsyncIterator[Lab]:
    ca = LabCA(tmp_path)
    secrets = parse_secrets(
        {"secrets": {"API_KEY": {"value": VALUE, "hosts": ["api.test"]}}}, key=b"t" * 32
    )
    async with (
        upstream() as plain,
        upstream(ca.server_context("api.test")) as api,
        upstream(ca.server_context("other.test")) as other,
    ):
        yield Lab(tmp_path, ca, plain, api, other, secrets)


def client_context(proxy: EgressProxy, lab: Lab) -> ssl.SSLContext:
    """What the sandbox trusts: the proxy's bundle, or (no bundle) the test's CA."""
    bundle = proxy.ca_bundle()
    if bundle is None:
        return lab.ca.client_context()
    path = lab.tmp / "bundle.pem"
    path.write_bytes(bundle)
    return ssl.create_default_context(cafile=str(path))


async def connect_raw(
    proxy: EgressProxy, target: str
) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    """A CONNECT by hand: (the response head, reader, writer)."""
    reader, writer = await asyncio.open_unix_connection(str(proxy.socket_path))
    writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    return head, reader, writer


async def read_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    length = int(
        next(
            line.split(b":")[1]
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
    )
    return await reader.readexactly(length)


# -- allowed -------------------------------------------------------------------------


async def test_allowed_plain_http_reaches_the_upstream(lab: Lab) -> None:
    metrics = Metrics("test")
    proxy = await lab.proxy(metrics=metrics)
    try:
        async with (
            bridge(proxy.socket_path) as port,
            httpx.AsyncClient(proxy=f"http://127.0.0.1:{port}") as client,
        ):
            with structlog.testing.capture_logs() as logs:
                for _ in range(2):  # keep-alive: two requests, two audit lines
                    reply = await client.get(f"http://plain.test:{lab.plain.port}/hello?x=1")
                    assert reply.status_code == 200
                    assert reply.json()["target"] == "/hello?x=1"
                    assert reply.json()["headers"]["host"] == f"plain.test:{lab.plain.port}"
                    assert "proxy-connection" not in reply.json()["headers"]
                await client.aclose()
                await asyncio.sleep(0.2)
    finally:
        await proxy.aclose()
    audits = [entry for entry in logs if entry["event"] == "egress"]
    assert len(audits) == 2
    assert dict(audits[0]) | {"bytes_up": 0, "bytes_down": 0, "duration_ms": 0} == {
        "event": "egress", "log_level": "info", "session": "sess_test", "owner": "alice",
        "kind": "http", "host": "plain.test", "port": lab.plain.port, "allowed": True,
        "rule": "allow:plain.test", "bytes_up": 0, "bytes_down": 0, "intercepted": False,
        "secrets": [], "duration_ms": 0,
    }  # fmt: skip
    assert audits[0]["bytes_down"] > 100 and audits[0]["bytes_up"] > 50
    text = metrics.render(None)[0].decode()
    assert 'mcp_sandbox_egress_connections_total{host="plain.test",outcome="allowed"} 2.0' in text
    assert not proxy.socket_path.exists()


async def test_allowed_https_is_tunnelled_untouched(lab: Lab) -> None:
    """No secret for other.test: the client sees the upstream's own certificate (the
    test CA's), not one of the proxy's, and its headers arrive as sent."""
    proxy = await lab.proxy()
    try:
        head, reader, writer = await connect_raw(proxy, f"other.test:{lab.other.port}")
        assert head.startswith(b"HTTP/1.1 200 ")
        await writer.start_tls(lab.ca.client_context(), server_hostname="other.test")
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        issuer = x509.load_der_x509_certificate(der).issuer.rfc4514_string()
        assert "tests upstream" in issuer
        token = placeholder(lab.secrets[0])
        writer.write(
            b"GET /x HTTP/1.1\r\nHost: other.test\r\nConnection: close\r\n"
            + f"Authorization: Bearer {token}\r\n\r\n".encode()
        )
        reply = await reader.read()
        writer.close()
    finally:
        await proxy.aclose()
    echoed = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    # A placeholder sent to a host the secret is not for stays a placeholder.
    assert echoed["headers"]["authorization"] == f"Bearer {token}"
    assert VALUE not in reply.decode()


async def test_https_through_httpx_with_the_proxy_bundle(lab: Lab) -> None:
    proxy = await lab.proxy()
    bundle = proxy.ca_bundle()
    assert bundle is not None and b"sandbox egress CA" not in bundle  # PEM, not names
    assert bundle.count(b"BEGIN CERTIFICATE") > 2  # the proxy's CA, the roots, the test CA
    try:
        async with (
            bridge(proxy.socket_path) as port,
            httpx.AsyncClient(
                proxy=f"http://127.0.0.1:{port}", verify=client_context(proxy, lab)
            ) as client,
        ):
            reply = await client.get(f"https://other.test:{lab.other.port}/tunnel")
            assert reply.status_code == 200 and reply.json()["target"] == "/tunnel"
    finally:
        await proxy.aclose()


async def test_without_secrets_or_extra_ca_there_is_no_bundle(lab: Lab) -> None:
    proxy = await lab.proxy(secrets=False, upstream_ca=False)
    try:
        assert proxy.ca_bundle() is None
    finally:
        await proxy.aclose()


# -- refused -------------------------------------------------------------------------


async def test_a_blocked_host_gets_a_403_it_can_read(lab: Lab) -> None:
    metrics = Metrics("test")
    proxy = await lab.proxy(metrics=metrics)
    try:
        async with (
            bridge(proxy.socket_path) as port,
            httpx.AsyncClient(proxy=f"http://127.0.0.1:{port}") as client,
        ):
            reply = await client.get(f"http://blocked.test:{lab.plain.port}/")
            assert reply.status_code == 403
            assert reply.text.strip() == BLOCKED.format("blocked.test")
        head, reader, writer = await connect_raw(proxy, f"blocked.test:{lab.api.port}")
        assert head.startswith(b"HTTP/1.1 403 Forbidden")
        assert (await read_body(reader, head)).decode().strip() == BLOCKED.format("blocked.test")
        writer.close()
        head, reader, writer = await connect_raw(proxy, "evil.test:443")
        writer.close()
        assert proxy.take_blocked() == ["blocked.test", "evil.test"]
        assert proxy.take_blocked() == []
    finally:
        await proxy.aclose()
    await asyncio.sleep(0)
    text = metrics.render(None)[0].decode()
    assert 'mcp_sandbox_egress_connections_total{host="blocked.test",outcome="blocked"} 2.0' in text
    assert lab.plain.requests == [] and lab.api.connections == 0


async def test_deny_beats_a_wildcard(lab: Lab) -> None:
    proxy = await lab.proxy(allow=["*", "127.0.0.1/32"], deny=["other.test"])
    try:
        head, _, writer = await connect_raw(proxy, f"other.test:{lab.other.port}")
        writer.close()
        assert head.startswith(b"HTTP/1.1 403 ")
        head, _, writer = await connect_raw(proxy, f"api.test:{lab.api.port}")
        writer.close()
        assert head.startswith(b"HTTP/1.1 200 ")
    finally:
        await proxy.aclose()


async def test_an_sni_other_than_the_connect_host_is_refused(lab: Lab) -> None:
    """Domain fronting: CONNECT to an allowed name, then a ClientHello for another."""
    proxy = await lab.proxy(secrets=False)
    try:
        with structlog.testing.capture_logs() as logs:
            head, _, writer = await connect_raw(proxy, f"other.test:{lab.other.port}")
            assert head.startswith(b"HTTP/1.1 200 ")
            with pytest.raises(ssl.SSLError, match=r"ACCESS_DENIED|access denied"):
                await writer.start_tls(lab.ca.client_context(), server_hostname="api.test")
            writer.close()
            await asyncio.sleep(0.2)
        assert proxy.take_blocked() == ["api.test"]
    finally:
        await proxy.aclose()
    audit = next(entry for entry in logs if entry["event"] == "egress")
    assert (audit["allowed"], audit["rule"]) == (False, "sni-mismatch:api.test")
    assert lab.other.connections == 0 and lab.api.connections == 0


async def test_a_tunnel_without_sni_or_without_tls_is_refused(lab: Lab) -> None:
    proxy = await lab.proxy(secrets=False)
    try:
        _, _, writer = await connect_raw(proxy, f"other.test:{lab.other.port}")
        context = ssl.create_default_context(cafile=str(lab.ca.path))
        context.check_hostname = False
        with pytest.raises(ssl.SSLError, match=r"ACCESS_DENIED|access denied"):
            await writer.start_tls(context, server_hostname=None)
        writer.close()
        with structlog.testing.capture_logs() as logs:
            _, reader, writer = await connect_raw(proxy, f"other.test:{lab.other.port}")
            writer.write(b"SSH-2.0-OpenSSH_9.6\r\n" * 4000)  # neither TLS nor HTTP
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 15)
            writer.close()
            await asyncio.sleep(0.1)
    finally:
        await proxy.aclose()
    assert answer.startswith(b"HTTP/1.1 400 ") and b"a tunnel carries TLS or HTTP/1.1" in answer
    audit = [(a["allowed"], a["rule"]) for a in logs if a["event"] == "egress"]
    assert (False, "not-tls-or-http") in audit  # (the first tunnel's line may come late)
    assert lab.other.connections == 0


async def test_ip_literals_need_an_address_entry(lab: Lab) -> None:
    proxy = await lab.proxy(allow=["*"])
    try:
        for target in (f"127.0.0.1:{lab.api.port}", "93.184.216.34:443", "[::1]:443"):
            head, reader, writer = await connect_raw(proxy, target)
            body = (await read_body(reader, head)).decode()
            writer.close()
            assert head.startswith(b"HTTP/1.1 403 "), target
            assert "is not in the allowlist" in body
        assert proxy.take_blocked() == ["127.0.0.1", "93.184.216.34", "::1"]
    finally:
        await proxy.aclose()


@pytest.mark.parametrize(
    ("address", "opened", "rule"),
    [
        ("127.0.0.1", [], "private-address"),  # DNS rebinding to loopback
        ("10.1.2.3", [], "private-address"),
        ("169.254.10.10", [], "private-address"),  # link-local
        ("169.254.169.254", [], "metadata-address"),
        ("169.254.169.254", ["169.254.0.0/16", "0.0.0.0/0"], "metadata-address"),
        ("fd00:ec2::254", ["fd00::/8"], "metadata-address"),
        # IPv4 inside IPv6: NAT64, local-use NAT64, IPv4-compatible, 6to4, Teredo.
        ("64:ff9b::a9fe:a9fe", [], "metadata-address (embedded 169.254.169.254)"),
        ("64:ff9b::7f00:1", [], "private-address (embedded 127.0.0.1)"),
        ("64:ff9b::a00:1", ["64:ff9b::/96"], "private-address (embedded 10.0.0.1)"),
        ("64:ff9b:1::7f00:1", [], "private-address (embedded 0.0.0.0)"),
        ("::7f00:1", [], "private-address (embedded 127.0.0.1)"),
        ("2002:7f00:1::1", [], "private-address (embedded 127.0.0.1)"),
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", [], "private-address (embedded 127.0.0.1)"),
    ],
)
async def test_a_name_resolving_to_a_private_address_is_refused(
    lab: Lab, address: str, opened: list[str], rule: str
) -> None:
    """The name is allowed; what it resolves to is not (and is never connected to).
    Metadata addresses stay refused under broad address entries."""
    proxy = await lab.proxy(allow=["*.test", *opened], resolve={"rebind.test": [address]})
    try:
        with structlog.testing.capture_logs() as logs:
            head, reader, writer = await connect_raw(proxy, f"rebind.test:{lab.api.port}")
            body = (await read_body(reader, head)).decode()
            writer.close()
            await asyncio.sleep(0.1)
    finally:
        await proxy.aclose()
    assert head.startswith(b"HTTP/1.1 403 ")
    assert body.strip() == BLOCKED.format("rebind.test")
    audit = next(entry for entry in logs if entry["event"] == "egress")
    assert (audit["allowed"], audit["rule"]) == (False, rule)
    assert lab.api.connections == 0


async def test_the_host_header_must_match_the_request_line(lab: Lab) -> None:
    proxy = await lab.proxy()
    try:
        reader, writer = await asyncio.open_unix_connection(str(proxy.socket_path))
        writer.write(
            f"GET http://plain.test:{lab.plain.port}/ HTTP/1.1\r\n".encode()
            + b"Host: blocked.test\r\n\r\n"
        )
        head = await reader.readuntil(b"\r\n\r\n")
        writer.close()
        assert head.startswith(b"HTTP/1.1 400 ")
        reader, writer = await asyncio.open_unix_connection(str(proxy.socket_path))
        writer.write(b"GET /relative HTTP/1.1\r\nHost: plain.test\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        writer.close()
        assert head.startswith(b"HTTP/1.1 400 ")
    finally:
        await proxy.aclose()
    assert lab.plain.requests == []


async def _tunnel_request(
    proxy: EgressProxy, target: str, requests: Sequence[bytes]
) -> tuple[bytes, list[bytes]]:
    """CONNECT to ``target``, then plain HTTP/1.1 ``requests`` (keep-alive) inside the
    tunnel, as undici does for http:// URLs: (the CONNECT's head, each answer)."""
    head, reader, writer = await connect_raw(proxy, target)
    answers: list[bytes] = []
    try:
        for request in requests:
            try:
                writer.write(request)
                await writer.drain()
                answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 15)
            except (ConnectionError, asyncio.IncompleteReadError):
                break  # the proxy closed the tunnel
            answers.append(answer + await read_body(reader, answer))
    finally:
        writer.close()
    return head, answers


async def test_plain_http_inside_a_connect_tunnel_is_served_like_plain_http(lab: Lab) -> None:
    """Two requests on one tunnel reach the CONNECT host, one audit line each, with no
    secret added (api.test has one; this is plain HTTP to its plain port)."""
    token = placeholder(lab.secrets[0])
    metrics = Metrics("test")
    proxy = await lab.proxy(metrics=metrics)
    get = (
        f"GET /in-tunnel HTTP/1.1\r\nHost: api.test:{lab.plain.port}\r\n"
        f"Authorization: Bearer {token}\r\n\r\n"
    ).encode()
    try:
        with structlog.testing.capture_logs() as logs:
            head, answers = await _tunnel_request(proxy, f"api.test:{lab.plain.port}", [get, get])
            await asyncio.sleep(0.2)
    finally:
        await proxy.aclose()
    assert head.startswith(b"HTTP/1.1 200 ")
    assert len(answers) == 2 and all(a.startswith(b"HTTP/1.1 200 ") for a in answers)
    echoed = json.loads(answers[0].split(b"\r\n\r\n", 1)[1])
    assert echoed["target"] == "/in-tunnel"
    assert echoed["headers"]["authorization"] == f"Bearer {token}"  # never the value
    assert VALUE not in repr(logs)
    audits = [entry for entry in logs if entry["event"] == "egress"]
    assert [(a["kind"], a["host"], a["allowed"], a["rule"]) for a in audits] == [
        ("http", "api.test", True, "allow:api.test")
    ] * 2
    assert audits[0]["bytes_down"] > 100
    text = metrics.render(None)[0].decode()
    assert 'mcp_sandbox_egress_connections_total{host="api.test",outcome="allowed"} 2.0' in text


@pytest.mark.parametrize(
    "stated", ["blocked.test", "other.test", "plain.test:1", "[::1]", ""], ids=repr
)
async def test_a_plain_tunnel_is_for_its_connect_host_only(lab: Lab, stated: str) -> None:
    """A Host header naming another host (even an allowed one) or port gets the policy's
    403 and ends the tunnel, after an allowed request went through on it."""
    proxy = await lab.proxy()
    target = f"plain.test:{lab.plain.port}"
    good = f"GET /ok HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()
    bad = f"GET /other HTTP/1.1\r\nHost: {stated}\r\n\r\n".encode()
    try:
        with structlog.testing.capture_logs() as logs:
            head, answers = await _tunnel_request(proxy, target, [good, bad, good])
            await asyncio.sleep(0.2)
        blocked = proxy.take_blocked()
    finally:
        await proxy.aclose()
    named = stated.rsplit(":", 1)[0].strip("[]") if stated.count(":") == 1 else stated
    named = named.strip("[]") or "(none)"
    assert head.startswith(b"HTTP/1.1 200 ") and len(answers) == 2
    assert answers[0].startswith(b"HTTP/1.1 200 ")
    assert answers[1].startswith(b"HTTP/1.1 403 ")
    assert answers[1].split(b"\r\n\r\n", 1)[1].decode().strip() == BLOCKED.format(named)
    assert [target for target, _ in lab.plain.requests] == ["/ok"]
    assert blocked == [named]
    audits = [entry for entry in logs if entry["event"] == "egress"]
    assert [(a["host"], a["allowed"], a["rule"]) for a in audits] == [
        ("plain.test", True, "allow:plain.test"),
        (named, False, "tunnel-host:plain.test"),
    ]


async def test_a_plain_tunnel_takes_paths_only(lab: Lab) -> None:
    proxy = await lab.proxy()
    target = f"plain.test:{lab.plain.port}"
    absolute = f"GET http://plain.test:{lab.plain.port}/ HTTP/1.1\r\nHost: {target}\r\n\r\n"
    try:
        _, answers = await _tunnel_request(proxy, target, [absolute.encode()])
    finally:
        await proxy.aclose()
    assert answers[0].startswith(b"HTTP/1.1 400 ") and b"origin form" in answers[0]
    assert lab.plain.requests == []


# -- framing (request smuggling) ----------------------------------------------------


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One response (head and ``Content-Length`` body), or what came before the end."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    except asyncio.IncompleteReadError as exc:
        return exc.partial
    return head + await read_body(reader, head)


async def test_a_request_smuggled_past_the_host_check_never_reaches_the_upstream(
    lab: Lab,
) -> None:
    """CL.TE: an upstream that frames by ``Content-Length`` would run the chunk's data as
    a second request, for a host the proxy never judged."""
    proxy = await lab.proxy()
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: internal.corp\r\n\r\n"
    try:
        async with naive_upstream() as naive:
            reader, writer = await asyncio.open_unix_connection(str(proxy.socket_path))
            writer.write(
                f"POST http://plain.test:{naive.port}/ HTTP/1.1\r\n"
                f"Host: plain.test:{naive.port}\r\nContent-Length: 4\r\n"
                "Transfer-Encoding: chunked\r\n\r\n".encode()
                + chunked(smuggled)
            )
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            await asyncio.sleep(0.2)
    finally:
        await proxy.aclose()
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    assert b"both Content-Length and Transfer-Encoding" in answer
    assert naive.requests == []


@pytest.mark.parametrize(
    ("framing", "why"),
    [
        ("Content-Length: 4\r\nTransfer-Encoding: chunked", b"both Content-Length"),
        ("Transfer-Encoding: chunked\r\nContent-Length: 4", b"both Content-Length"),
        ("Content-Length: 4\r\nContent-Length: 4", b"several Content-Length"),
        ("Content-Length: 4\r\nContent-Length: 40", b"several Content-Length"),
        ("Content-Length: 4, 4", b"several Content-Length"),
        ("Content-Length: 4\r\nX-Note: a\r\n\tTransfer-Encoding: chunked", b"obs-fold"),
        ("Transfer-Encoding: gzip", b"other than chunked"),
        ("Transfer-Encoding: gzip, chunked", b"other than chunked"),
        ("Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked", b"several Transfer"),
        ("Content-Length: 4\r\nHost: internal.corp", b"several Host"),
    ],
)
async def test_ambiguous_framing_is_refused_with_400(lab: Lab, framing: str, why: bytes) -> None:
    proxy = await lab.proxy()
    try:
        async with naive_upstream() as naive:
            where = f"plain.test:{naive.port}"
            reader, writer = await asyncio.open_unix_connection(str(proxy.socket_path))
            # A first, clean request on the connection: the next is judged all the same.
            writer.write(f"GET http://{where}/first HTTP/1.1\r\nHost: {where}\r\n\r\n".encode())
            first = await read_response(reader)
            writer.write(
                f"POST http://{where}/ HTTP/1.1\r\nHost: {where}\r\n{framing}\r\n\r\n"
                "0\r\n\r\n".encode()
            )
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            await asyncio.sleep(0.1)
    finally:
        await proxy.aclose()
    assert first.startswith(b"HTTP/1.1 200 ")
    assert answer.startswith(b"HTTP/1.1 400 ") and why in answer, answer
    assert [line for line, _ in naive.requests] == ["GET /first HTTP/1.1"]


async def _intercepted(
    proxy: EgressProxy, lab: Lab, port: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A CONNECT to api.test (which has a secret: intercepted), TLS trusting the proxy."""
    head, reader, writer = await connect_raw(proxy, f"api.test:{port}")
    assert head.startswith(b"HTTP/1.1 200 ")
    await writer.start_tls(client_context(proxy, lab), server_hostname="api.test")
    return reader, writer


async def test_a_smuggled_request_cannot_read_back_an_injected_secret(lab: Lab) -> None:
    """On a kept-alive intercepted connection, a smuggled ``POST /store`` would swallow
    the next request, the one the proxy adds the secret to, and ``GET /store`` would
    hand the secret to the sandbox."""
    proxy = await lab.proxy()
    token = placeholder(lab.secrets[0])
    store = b"POST /store HTTP/1.1\r\nHost: api.test\r\nContent-Length: 150\r\n\r\n"
    seen = b""
    try:
        async with naive_upstream(lab.ca.server_context("api.test")) as naive:
            reader, writer = await _intercepted(proxy, lab, naive.port)
            writer.write(
                b"POST /x HTTP/1.1\r\nHost: api.test\r\nContent-Length: 4\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" + chunked(store)
            )
            seen += await read_response(reader)
            with contextlib.suppress(OSError):
                writer.write(
                    f"POST /y HTTP/1.1\r\nHost: api.test\r\nAuthorization: Bearer {token}\r\n"
                    "Content-Length: 300\r\n\r\n".encode()
                    + b"x" * 300
                )
                seen += await read_response(reader)
            writer.close()
            reader, writer = await _intercepted(proxy, lab, naive.port)
            writer.write(b"GET /store HTTP/1.1\r\nHost: api.test\r\n\r\n")
            seen += await read_response(reader)
            writer.close()
            await asyncio.sleep(0.1)
    finally:
        await proxy.aclose()
    assert seen.startswith(b"HTTP/1.1 400 "), seen
    assert VALUE.encode() not in seen
    assert all(not line.startswith("POST /store") for line, _ in naive.requests)


async def test_a_kept_alive_intercepted_connection_is_judged_at_every_request(lab: Lab) -> None:
    """A call that narrows the hosts applies to connections an earlier call opened: the
    next request on a kept-alive intercepted connection gets no secret, no upstream."""
    proxy = await lab.proxy()
    try:
        async with naive_upstream(lab.ca.server_context("api.test")) as naive:
            reader, writer = await _intercepted(proxy, lab, naive.port)
            writer.write(b"GET /one HTTP/1.1\r\nHost: api.test\r\n\r\n")
            first = await read_response(reader)
            proxy.use_policy(proxy.policy.narrowed(["other.test"]))
            writer.write(b"GET /two HTTP/1.1\r\nHost: api.test\r\n\r\n")
            second = await read_response(reader)
            writer.close()
            await asyncio.sleep(0.1)
    finally:
        await proxy.aclose()
    assert first.startswith(b"HTTP/1.1 200 ")
    assert second.startswith(b"HTTP/1.1 403 ") and BLOCKED.format("api.test").encode() in second
    assert [line for line, _ in naive.requests] == ["GET /one HTTP/1.1"]


async def test_an_absolute_url_in_an_intercepted_tunnel_is_refused(lab: Lab) -> None:
    """An upstream prefers the absolute URL's host to ``Host``: a second host, refused."""
    proxy = await lab.proxy()
    try:
        async with naive_upstream(lab.ca.server_context("api.test")) as naive:
            reader, writer = await _intercepted(proxy, lab, naive.port)
            writer.write(b"GET http://internal.corp/ HTTP/1.1\r\nHost: api.test\r\n\r\n")
            answer = await read_response(reader)
            writer.close()
    finally:
        await proxy.aclose()
    assert answer.startswith(b"HTTP/1.1 403 ") and b"origin form" in answer
    assert naive.requests == []


# -- secrets -------------------------------------------------------------------------


async def _get_api(client: httpx.AsyncClient, lab: Lab, headers: dict[str, str]) -> dict[str, Any]:
    reply = await client.get(f"https://api.test:{lab.api.port}/v1", headers=headers)
    assert reply.status_code == 200, reply.text
    return dict(reply.json()["headers"])


async def test_a_secret_is_injected_for_its_host_and_never_logged(lab: Lab) -> None:
    proxy = await lab.proxy()
    token = placeholder(lab.secrets[0])
    try:
        with structlog.testing.capture_logs() as logs:
            async with (
                bridge(proxy.socket_path) as port,
                httpx.AsyncClient(
                    proxy=f"http://127.0.0.1:{port}", verify=client_context(proxy, lab)
                ) as client,
            ):
                sent = await _get_api(client, lab, {"Authorization": f"Bearer {token}"})
                absent = await _get_api(client, lab, {})
                own = await _get_api(client, lab, {"Authorization": "Bearer mine"})
                sent_again = await _get_api(client, lab, {"Authorization": f"Bearer {token}"})
            await asyncio.sleep(0.2)
    finally:
        await proxy.aclose()
    assert sent["authorization"] == f"Bearer {VALUE}"
    assert absent["authorization"] == f"Bearer {VALUE}"
    assert own["authorization"] == "Bearer mine"  # the code's own credential, untouched
    assert sent_again["authorization"] == f"Bearer {VALUE}"  # every request on the connection
    # One CONNECT, one intercepted session, one kept-alive upstream connection.
    assert lab.api.connections == 1
    audits = [entry for entry in logs if entry["event"] == "egress"]
    assert len(audits) == 1
    assert (audits[0]["secrets"], audits[0]["intercepted"]) == (["API_KEY"], True)
    assert VALUE not in repr(logs)


async def test_a_secret_never_goes_over_plain_http_or_to_another_host(lab: Lab) -> None:
    proxy = await lab.proxy(allow=["api.test", "other.test", "127.0.0.1/32"])
    token = placeholder(lab.secrets[0])
    try:
        async with (
            bridge(proxy.socket_path) as port,
            httpx.AsyncClient(
                proxy=f"http://127.0.0.1:{port}", verify=client_context(proxy, lab)
            ) as client,
        ):
            plain = await client.get(
                f"http://api.test:{lab.plain.port}/", headers={"Authorization": f"Bearer {token}"}
            )
            other = await client.get(
                f"https://other.test:{lab.other.port}/",
                headers={"Authorization": f"Bearer {token}"},
            )
    finally:
        await proxy.aclose()
    assert plain.json()["headers"]["authorization"] == f"Bearer {token}"
    assert other.json()["headers"]["authorization"] == f"Bearer {token}"


async def test_the_proxy_verifies_the_upstream_it_terminates_for(lab: Lab) -> None:
    """Without the test CA among its roots, the proxy refuses the upstream (502)."""
    proxy = await lab.proxy(upstream_ca=False)
    try:
        async with (
            bridge(proxy.socket_path) as port,
            httpx.AsyncClient(
                proxy=f"http://127.0.0.1:{port}", verify=client_context(proxy, lab)
            ) as client,
        ):
            reply = await client.get(f"https://api.test:{lab.api.port}/v1")
    finally:
        await proxy.aclose()
    assert reply.status_code == 502
    assert "CERTIFICATE_VERIFY_FAILED" in reply.text or "certificate verify failed" in reply.text
    assert lab.api.requests == []


async def test_the_interception_certificate_is_for_the_host_only(lab: Lab) -> None:
    proxy = await lab.proxy()
    try:
        _, _, writer = await connect_raw(proxy, f"api.test:{lab.api.port}")
        await writer.start_tls(client_context(proxy, lab), server_hostname="api.test")
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
    finally:
        await proxy.aclose()
    cert = x509.load_der_x509_certificate(der)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["api.test"]
    assert "sandbox egress CA" in cert.issuer.rfc4514_string()


# -- bounds --------------------------------------------------------------------------


async def test_connections_past_the_limit_get_503(
    lab: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(proxy_module, "MAX_CONNECTIONS", 1)
    proxy = await lab.proxy()
    try:
        head, _, held = await connect_raw(proxy, f"other.test:{lab.other.port}")
        assert head.startswith(b"HTTP/1.1 200 ")
        second, _, writer = await connect_raw(proxy, f"other.test:{lab.other.port}")
        writer.close()
        held.close()
    finally:
        await proxy.aclose()
    assert second.startswith(b"HTTP/1.1 503 ")


#: Run apart (its descriptors are not the server's): open connections to the proxy's
#: socket without a byte, say how many, print when one of them gets an answer, then
#: hold them all until stdin closes.
FLOOD = """
import select, socket, sys, time
held = []
while len(held) < int(sys.argv[2]):
    s = socket.socket(socket.AF_UNIX)
    s.setblocking(False)
    waited = time.monotonic()
    while True:
        try:
            s.connect(sys.argv[1])
            break
        except BlockingIOError:  # the backlog is full: the proxy takes no more now
            time.sleep(0.005)
        if time.monotonic() - waited > 1:
            break
    else:
        continue
    if time.monotonic() - waited > 1:
        s.close()
        break
    held.append(s)
print(len(held), flush=True)
select.select(held, [], [], 60)
print("answered", flush=True)
sys.stdin.read()
"""


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_flood_of_connections_holds_at_the_cap(lab: Lab) -> None:
    """A sandbox opening hundreds of idle connections (20,000 ate the server's whole
    RLIMIT_NOFILE once): the proxy holds at most its cap, and a few being refused."""
    proxy = await lab.proxy()
    before = _fds()
    flood = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FLOOD, str(proxy.socket_path), "400",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert flood.stdin is not None and flood.stdout is not None
    try:
        opened = int(await asyncio.wait_for(flood.stdout.readline(), 30))
        # The first answer is a refusal past the cap: by then the proxy took all it takes.
        assert await asyncio.wait_for(flood.stdout.readline(), 30) == b"answered\n"
        held = _fds() - before
        flood.stdin.close()
        await asyncio.wait_for(flood.wait(), 10)
    finally:
        if flood.returncode is None:
            flood.kill()
            await flood.wait()
        await proxy.aclose()
    assert opened > proxy_module.MAX_CONNECTIONS + proxy_module.REFUSING
    # Slack: the pipes to the flooding process are this process's too.
    assert held <= proxy_module.MAX_CONNECTIONS + proxy_module.REFUSING + 4, held


async def test_an_owners_sandboxes_share_a_bounded_part_of_the_servers_connections(
    lab: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sandboxes of one owner hold its share together; another owner still gets in."""
    monkeypatch.setattr(proxy_module, "MAX_CONNECTIONS", 2)
    budget = ConnectionBudget(total=10, share=3)
    proxies = [
        await open_proxy(
            lab.tmp / f"{owner}-{n}.sock",
            Policy.parse(["other.test", "127.0.0.1/32"]),
            (),
            owner=owner,
            session=f"sess_{owner}_{n}",
            metrics=None,
            budget=budget,
            resolver=static_resolver({"other.test": ["127.0.0.1"]}),
        )
        for owner, n in (("alice", 1), ("alice", 2), ("bob", 1))
    ]
    target = f"other.test:{lab.other.port}"
    try:
        opened = [await connect_raw(proxies[i], target) for i in (0, 0, 1, 1, 2)]
        heads = [head for head, _, _ in opened]
        for _, _, writer in opened:
            writer.close()
    finally:
        for proxy in proxies:
            await proxy.aclose()
    assert [head.split(b" ")[1] for head in heads] == [b"200", b"200", b"200", b"503", b"200"]


async def test_refusals_in_a_loop_are_slowed_and_summarised(
    lab: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,000 refusals a second once flooded the log: past a burst, refusals wait their
    turn, their lines are left out and one summary counts them."""
    monkeypatch.setattr(limits, "REFUSAL_BURST", 5)
    monkeypatch.setattr(limits, "REFUSALS_PER_S", 100.0)
    metrics = Metrics("test")
    proxy = await lab.proxy(metrics=metrics)
    request = b"GET http://blocked.test/ HTTP/1.1\r\nHost: blocked.test\r\n\r\n"
    try:
        with structlog.testing.capture_logs() as logs:
            started = asyncio.get_running_loop().time()
            for _ in range(60):  # a refusal ends its connection: a flood opens new ones
                reader, writer = await asyncio.open_unix_connection(str(proxy.socket_path))
                writer.write(request)
                assert (await read_response(reader)).startswith(b"HTTP/1.1 403 ")
                writer.close()
            elapsed = asyncio.get_running_loop().time() - started
            await asyncio.sleep(0.1)
            await proxy.aclose()
    finally:
        await proxy.aclose()
    lines = [entry for entry in logs if entry["event"] == "egress"]
    summary = [entry for entry in logs if entry["event"] == "egress refusals throttled"]
    assert elapsed >= 0.5  # slowed to the rate: 55 refusals past the burst
    assert len(lines) <= 5 + elapsed * 100 + 1
    assert sum(entry["refusals_without_line"] for entry in summary) == 60 - len(lines)
    text = metrics.render(None)[0].decode()
    assert (
        'mcp_sandbox_egress_connections_total{host="blocked.test",outcome="blocked"} 60.0' in text
    )


async def test_an_oversized_head_or_garbage_ends_that_connection_only(lab: Lab) -> None:
    proxy = await lab.proxy()
    try:
        reader, writer = await asyncio.open_unix_connection(str(proxy.socket_path))
        writer.write(b"GET http://plain.test/ HTTP/1.1\r\nX: " + b"a" * 200_000)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)  # a 400, then the end
        assert answer.startswith(b"HTTP/1.1 400 ") and answer.count(b"HTTP/1.1") == 1
        writer.close()
        reader, writer = await asyncio.open_unix_connection(str(proxy.socket_path))
        writer.write(b"\x16\x03\x01\x00\xff\x00garbage\r\n\r\n")
        assert b"200" not in await asyncio.wait_for(reader.read(), 10)
        writer.close()
        async with (
            bridge(proxy.socket_path) as port,
            httpx.AsyncClient(proxy=f"http://127.0.0.1:{port}") as client,
        ):
            reply = await client.get(f"http://plain.test:{lab.plain.port}/after")
        assert reply.status_code == 200
    finally:
        await proxy.aclose()


async def test_a_call_narrows_the_policy_of_a_running_proxy(lab: Lab) -> None:
    proxy = await lab.proxy()
    server = proxy.policy
    try:
        proxy.use_policy(server.narrowed(["other.test"]))
        head, _, writer = await connect_raw(proxy, f"api.test:{lab.api.port}")
        writer.close()
        assert head.startswith(b"HTTP/1.1 403 ")
        head, _, writer = await connect_raw(proxy, f"other.test:{lab.other.port}")
        writer.close()
        assert head.startswith(b"HTTP/1.1 200 ")
        proxy.use_policy(Policy())  # a call without network in a networked session
        head, _, writer = await connect_raw(proxy, f"other.test:{lab.other.port}")
        writer.close()
        assert head.startswith(b"HTTP/1.1 403 ")
    finally:
        await proxy.aclose()


async def test_a_socket_that_cannot_be_made_is_sandbox_failed(lab: Lab) -> None:
    with pytest.raises(SandboxFailed, match="egress proxy"):
        await open_proxy(
            lab.tmp / "missing" / "egress.sock", Policy(), (), owner="a", session="s", metrics=None
        )


# -- real clients --------------------------------------------------------------------


async def _run(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_through_the_proxy(lab: Lab) -> None:
    """curl offers HTTP/2 by ALPN; the intercepting side answers HTTP/1.1 and curl follows."""
    proxy = await lab.proxy()
    bundle = lab.tmp / "bundle.pem"
    bundle.write_bytes(proxy.ca_bundle() or b"")
    token = placeholder(lab.secrets[0])
    try:
        async with bridge(proxy.socket_path) as port:
            via = ["curl", "-sS", "--proxy", f"http://127.0.0.1:{port}", "--cacert", str(bundle)]
            code, out, err = await _run(
                *via, "-H", f"Authorization: Bearer {token}", f"https://api.test:{lab.api.port}/c"
            )
            assert code == 0, err
            assert json.loads(out)["headers"]["authorization"] == f"Bearer {VALUE}"
            code, out, err = await _run(*via, f"https://other.test:{lab.other.port}/c")
            assert code == 0, err
            code, out, err = await _run(*via, f"http://plain.test:{lab.plain.port}/c")
            assert code == 0 and json.loads(out)["target"] == "/c", err
            code, out, err = await _run(*via, f"https://blocked.test:{lab.api.port}/c")
            assert code != 0 and "403" in err
    finally:
        await proxy.aclose()


#: The sandbox's Node.js (24: its fetch follows HTTPS_PROXY under NODE_USE_ENV_PROXY).
NODE = shared_runtime_dir() / "node" / "bin" / "node"


@pytest.mark.skipif(not NODE.exists(), reason="no runtime env: run mcp-code-sandbox setup")
async def test_node_fetch_through_the_proxy(lab: Lab) -> None:
    """Node's fetch with NODE_USE_ENV_PROXY and the bundle as NODE_EXTRA_CA_CERTS: the
    secret arrives upstream while node only ever held the placeholder."""
    proxy = await lab.proxy()
    bundle = lab.tmp / "bundle.pem"
    bundle.write_bytes(proxy.ca_bundle() or b"")
    token = placeholder(lab.secrets[0])
    script = (
        f"fetch('https://api.test:{lab.api.port}/n', {{headers: {{authorization: "
        f"'Bearer ' + process.env.API_KEY}}}}).then(r => r.text()).then(t => console.log(t))"
    )
    try:
        async with bridge(proxy.socket_path) as port:
            env = {
                "PATH": "/usr/bin:/bin",
                "HTTPS_PROXY": f"http://127.0.0.1:{port}",
                "HTTP_PROXY": f"http://127.0.0.1:{port}",
                "NODE_USE_ENV_PROXY": "1",
                "NODE_EXTRA_CA_CERTS": str(bundle),
                "API_KEY": token,
            }
            code, out, err = await _run(str(NODE), "-e", script, env=env)
    finally:
        await proxy.aclose()
    assert code == 0, err
    assert json.loads(out)["headers"]["authorization"] == f"Bearer {VALUE}"


@pytest.mark.skipif(not NODE.exists(), reason="no runtime env: run mcp-code-sandbox setup")
async def test_node_fetch_of_plain_http_through_the_proxy(lab: Lab) -> None:
    """Node's fetch (undici) tunnels http:// URLs through CONNECT too: an allowed host
    answers, a blocked one fails (its CONNECT got the 403), and the placeholder sent to
    a secret's host over plain HTTP stays a placeholder."""
    proxy = await lab.proxy()
    token = placeholder(lab.secrets[0])
    urls = [
        f"http://plain.test:{lab.plain.port}/n",
        f"http://api.test:{lab.plain.port}/s",
        f"http://blocked.test:{lab.plain.port}/b",
    ]
    script = (
        f"(async () => {{ for (const url of {json.dumps(urls)}) {{ try {{\n"
        "  const r = await fetch(url, {headers: {authorization: 'Bearer ' + process.env.API_KEY}});"
        "\n  console.log(r.status, await r.text());\n"
        "} catch (e) { console.log('error', e.message, e.cause && e.cause.message); } } })()"
    )
    try:
        with structlog.testing.capture_logs() as logs:
            async with bridge(proxy.socket_path) as port:
                env = {
                    "PATH": "/usr/bin:/bin",
                    "HTTP_PROXY": f"http://127.0.0.1:{port}",
                    "HTTPS_PROXY": f"http://127.0.0.1:{port}",
                    "NODE_USE_ENV_PROXY": "1",
                    "API_KEY": token,
                }
                code, out, err = await _run(str(NODE), "-e", script, env=env)
            await asyncio.sleep(0.2)
    finally:
        await proxy.aclose()
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 3, out
    status, body = lines[0].split(" ", 1)
    assert status == "200" and json.loads(body)["target"] == "/n", lines
    status, body = lines[1].split(" ", 1)
    assert status == "200" and json.loads(body)["headers"]["authorization"] == f"Bearer {token}"
    assert lines[2].startswith("error"), lines
    assert [target for target, _ in lab.plain.requests] == ["/n", "/s"]
    audits = [entry for entry in logs if entry["event"] == "egress"]
    assert {(a["host"], a["allowed"]) for a in audits} == {
        ("plain.test", True), ("api.test", True), ("blocked.test", False),
    }  # fmt: skip
    assert VALUE not in out + repr(logs)


async def test_two_sandboxes_proxies_share_nothing(lab: Lab) -> None:
    """One proxy closing, blocking or failing leaves another's connections, blocked list
    and CA alone."""
    first = await lab.proxy()
    second = await open_proxy(
        lab.tmp / "second.sock", Policy.parse(["other.test", "127.0.0.1/32"]), lab.secrets,
        owner="bob", session="sess_two", metrics=None, upstream_ca=lab.ca.path,
        resolver=static_resolver({"other.test": ["127.0.0.1"]}),
    )  # fmt: skip
    try:
        _, _, writer = await connect_raw(first, "evil.test:443")
        writer.close()
        await first.aclose()
        head, _, writer = await connect_raw(second, f"other.test:{lab.other.port}")
        writer.close()
        assert head.startswith(b"HTTP/1.1 200 ")
        assert second.take_blocked() == []
        assert first.ca_bundle() != second.ca_bundle()  # a CA of its own each
    finally:
        await second.aclose()


async def test_framing_is_the_proxys_own_both_ways(lab: Lab) -> None:
    """A chunked body goes on chunked and a sized one sized, each with that one header;
    a head sent a byte at a time is judged like one sent whole."""
    proxy = await lab.proxy()
    where = f"plain.test:{lab.plain.port}"
    try:
        async with (
            bridge(proxy.socket_path) as port,
            httpx.AsyncClient(proxy=f"http://127.0.0.1:{port}") as client,
        ):

            async def stream() -> AsyncIterator[bytes]:
                yield b"a" * 10

            chunked_reply = await client.post(f"http://{where}/c", content=stream())
            sized_reply = await client.post(f"http://{where}/s", content=b"b" * 10)
        reader, writer = await asyncio.open_unix_connection(str(proxy.socket_path))
        head = (
            f"POST http://{where}/ HTTP/1.1\r\nHost: {where}\r\nContent-Length: 1\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        ).encode()
        for byte in head:
            writer.write(bytes([byte]))
            await writer.drain()
        dripped = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    finally:
        await proxy.aclose()
    chunked_headers = chunked_reply.json()["headers"]
    assert chunked_headers["transfer-encoding"] == "chunked"
    assert "content-length" not in chunked_headers
    sized_headers = sized_reply.json()["headers"]
    assert sized_headers["content-length"] == "10" and "transfer-encoding" not in sized_headers
    assert dripped.startswith(b"HTTP/1.1 400 ")


async def test_an_upstreams_ambiguous_response_is_not_relayed(lab: Lab) -> None:
    """An upstream answering with both framing headers gets the sandbox a 502."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n0\r\n\r\n"
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proxy = await lab.proxy()
    try:
        reader, writer = await asyncio.open_unix_connection(str(proxy.socket_path))
        writer.write(
            f"GET http://plain.test:{port}/ HTTP/1.1\r\nHost: plain.test:{port}\r\n\r\n".encode()
        )
        reply = await read_response(reader)
        writer.close()
    finally:
        await proxy.aclose()
        server.close()
    assert reply.startswith(b"HTTP/1.1 502 ") and b"ambiguous message framing" in reply
