"""The operator's HTTP surface, through the real server: ``/healthz``, ``/readyz`` (ready,
and not ready for real reasons), ``/metrics`` (what it counts, how it is protected),
Host/Origin checks, and the legacy HTTP+SSE transport."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client
from prometheus_client.parser import text_string_to_metric_families

from mcp_code_sandbox.server.transports import build_http_app
from mcp_code_sandbox.settings import Settings

from ..conftest import MakeService
from .conftest import http_server, http_server_process, initialize_request

pytestmark = [pytest.mark.e2e, pytest.mark.bwrap]

TOKEN = "metrics-token-0123456789abcdef"
MODERN = "2026-07-28"


def scrape(base: str, **headers: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    response = httpx.get(f"{base}/metrics", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def sample(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_healthz_and_readyz_when_ready(make_settings: Callable[..., Settings]) -> None:
    with http_server(make_settings()) as base:
        health = httpx.get(f"{base}/healthz")
        assert health.status_code == 200
        assert health.json() == {"status": "ok", "sessions": 0}
        ready = httpx.get(f"{base}/readyz")
        assert ready.status_code == 200
        assert ready.json() == {
            "status": "ready",
            "backend": "bwrap",
            "pool": {
                "size": 0, "ready": 0, "starting": 0, "preload": [],
                # The pool follows demand between its floor and ceiling (both 0: off).
                "floor": 0, "ceiling": 0, "trend": "resting", "decision": None,
            },
        }  # fmt: skip


async def test_not_ready_without_the_runtime_env(
    make_settings: Callable[..., Settings], state_dir: Path
) -> None:
    # A real failure: the runtime env `setup` builds is not there (bwrap cannot run code),
    # and the server's own build of it fails (a package no index has).
    settings = make_settings(runtime_dir=str(state_dir / "no-runtime"))
    with http_server(settings, SANDBOX_RUNTIME_PACKAGES="no-such-pkg-zq7x") as base:
        assert httpx.get(f"{base}/healthz").status_code == 200  # alive, not ready
        ready = httpx.get(f"{base}/readyz")
        assert ready.status_code == 503
        body = ready.json()
        assert body["status"] == "not ready" and body["backend"] == "bwrap"
        assert body["reason"].startswith("building the sandbox runtime")
        # What a client then gets is a backend failure, and the metrics count it.
        async with Client(f"{base}/mcp", mode=MODERN) as client:
            result = await client.call_tool("run_code", {"code": "1"})
        assert result.is_error and (result.meta or {}).get("error_code") == "backend_unavailable"
        samples = scrape(base)
        assert sample(samples, "mcp_sandbox_backend_errors_total", code="backend_unavailable") == 1
        assert sample(samples, "mcp_sandbox_tool_errors_total", code="backend_unavailable") == 1


@pytest.mark.parametrize(
    "backend", [pytest.param("docker", marks=pytest.mark.docker)], indirect=True
)
def test_docker_not_ready_without_its_image(make_settings: Callable[..., Settings]) -> None:
    with http_server(make_settings(image="mcp-code-sandbox-missing:never-built")) as base:
        ready = httpx.get(f"{base}/readyz")
        assert ready.status_code == 503
        assert ready.json()["backend"] == "docker"
        assert "mcp-code-sandbox-missing:never-built is missing" in ready.json()["reason"]


async def test_metrics_count_sessions_runs_durations_and_errors(
    make_settings: Callable[..., Settings],
) -> None:
    with http_server(make_settings()) as base:
        before = scrape(base)
        assert sample(before, "mcp_sandbox_runs_total", language="python", status="ok") == 0
        assert sample(before, "mcp_sandbox_tool_errors_total", code="session_not_found") == 0
        async with Client(f"{base}/mcp", mode=MODERN) as client:
            ok = await client.call_tool("run_code", {"code": "1 + 1"})
            sid = ok.structured_content["session_id"]
            failed = await client.call_tool("run_code", {"code": "1/0", "session_id": sid})
            assert failed.structured_content["status"] == "error"
            during = scrape(base)
            missing = await client.call_tool("read_file", {"session_id": "nope", "path": "a"})
            assert missing.is_error
            await client.call_tool("close_session", {"session_id": sid})
        after = scrape(base)
    assert sample(during, "mcp_sandbox_sessions_active") == 1
    assert sample(after, "mcp_sandbox_sessions_active") == 0
    assert sample(after, "mcp_sandbox_sessions_created_total") == 1
    assert sample(after, "mcp_sandbox_sessions_ended_total", reason="closed") == 1
    assert sample(after, "mcp_sandbox_runs_total", language="python", status="ok") == 1
    assert sample(after, "mcp_sandbox_runs_total", language="python", status="error") == 1
    assert sample(after, "mcp_sandbox_run_duration_seconds_count", language="python") == 2
    assert sample(after, "mcp_sandbox_run_duration_seconds_sum", language="python") > 0
    assert sample(after, "mcp_sandbox_tool_errors_total", code="session_not_found") == 1
    assert sample(after, "mcp_sandbox_tool_errors_total", code="internal_error") == 0
    # Never a session id (or anything a client chose) as a label.
    assert not any(sid in value for (_, labels) in after for _, value in labels)


async def test_expired_sessions_are_counted(make_service: MakeService) -> None:
    async with make_service(session_ttl_m=0.01) as svc:
        await svc.upload_file("local", "a.txt", b"a", session_id=None, overwrite=False)
        registry = svc.metrics.registry
        assert registry.get_sample_value("mcp_sandbox_sessions_active") == 1
        await asyncio.sleep(1.0)  # past the 0.6 s TTL
        await svc.sessions.reap()
        assert registry.get_sample_value("mcp_sandbox_sessions_active") == 0
        ended = registry.get_sample_value("mcp_sandbox_sessions_ended_total", {"reason": "idle"})
        assert ended == 1


def test_metrics_token(make_settings: Callable[..., Settings]) -> None:
    with http_server(make_settings(), SANDBOX_METRICS_TOKEN=TOKEN) as base:
        bare = httpx.get(f"{base}/metrics")
        assert bare.status_code == 401
        assert bare.headers["www-authenticate"].startswith("Bearer")
        assert "mcp_sandbox" not in bare.text
        wrong = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {TOKEN}x"})
        assert wrong.status_code == 401
        basic = httpx.get(f"{base}/metrics", headers={"Authorization": f"Basic {TOKEN}"})
        assert basic.status_code == 401
        samples = scrape(base, Authorization=f"Bearer {TOKEN}")
        assert sample(samples, "mcp_sandbox_sessions_active") == 0
        # Probes stay open: orchestrators call them without credentials.
        assert httpx.get(f"{base}/healthz").status_code == 200
        assert httpx.get(f"{base}/readyz").status_code == 200


async def test_metrics_beyond_loopback_need_the_token(
    make_settings: Callable[..., Settings],
) -> None:
    # In process (no lifespan: /metrics needs no started service), so nothing listens on
    # a public address during the test.
    from mcp_code_sandbox.backends import create_backend
    from mcp_code_sandbox.service import SandboxService

    for token, expected in ((None, 403), (TOKEN, 200)):
        settings = make_settings(
            http_host="0.0.0.0", api_tokens="ops:" + "x" * 24, metrics_token=token
        )
        app = build_http_app(SandboxService(settings, create_backend(settings)))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://10.0.0.5:8080") as http:
            got = await http.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert got.status_code == expected, got.text
        if expected == 403:
            assert "SANDBOX_METRICS_TOKEN" in got.text


def _rpc_initialize() -> dict[str, Any]:
    return initialize_request("probe")


def test_host_and_origin_checks(make_settings: Callable[..., Settings]) -> None:
    extra = {
        "SANDBOX_ALLOWED_HOSTS": "sandbox.internal:*",
        "SANDBOX_ALLOWED_ORIGINS": "https://chat.example.com",
        "SANDBOX_PUBLIC_BASE_URL": "https://sandbox.example.com",
    }
    with http_server(make_settings(), **extra) as base:
        port = base.rsplit(":", 1)[1]
        headers = {"Accept": "application/json, text/event-stream"}

        def post(**more: str) -> httpx.Response:
            return httpx.post(f"{base}/mcp", json=_rpc_initialize(), headers={**headers, **more})

        assert post().status_code == 200  # 127.0.0.1:<port>
        assert post(Host=f"localhost:{port}").status_code == 200
        assert post(Host="evil.example").status_code == 421  # a rebinding page's Host
        assert post(Host=f"evil.example:{port}").status_code == 421
        assert post(Host=f"sandbox.internal:{port}").status_code == 200  # ALLOWED_HOSTS
        assert post(Host="sandbox.example.com").status_code == 200  # PUBLIC_BASE_URL
        assert post(Origin="https://evil.example").status_code == 403
        assert post(Origin="https://chat.example.com").status_code == 200
        assert post(Origin="https://sandbox.example.com").status_code == 200
        assert post(Origin=f"http://localhost:{port}").status_code == 200
        # The legacy transport and unauthenticated /metrics are checked the same way.
        assert httpx.get(f"{base}/sse", headers={"Host": "evil.example"}).status_code == 421
        assert httpx.get(f"{base}/metrics", headers={"Host": "evil.example"}).status_code == 421


async def test_a_reverse_proxy_host_reaches_the_tools(
    make_settings: Callable[..., Settings],
) -> None:
    # A proxy that keeps the public Host header: the real client, with that header.
    with http_server(make_settings(), SANDBOX_ALLOWED_HOSTS="sandbox.internal") as base:
        proxied = httpx2.AsyncClient(headers={"Host": "sandbox.internal"})
        async with (
            proxied,
            Client(
                streamable_http_client(f"{base}/mcp", http_client=proxied), mode=MODERN
            ) as client,
        ):
            tools = await client.list_tools()
        assert any(tool.name == "run_code" for tool in tools.tools)


async def test_legacy_sse_transport_round_trip(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings()
    with http_server_process(settings) as (base, proc):
        async with Client(sse_client(f"{base}/sse"), mode="legacy") as client:
            tools = {tool.name for tool in (await client.list_tools()).tools}
            assert {"run_code", "upload_file", "read_file"} <= tools
            run = await client.call_tool("run_code", {"code": "x = 6 * 7\nx"})
            assert run.structured_content["result"] == "42"
            sid = run.structured_content["session_id"]
            again = await client.call_tool("run_code", {"code": "x + 1", "session_id": sid})
            assert again.structured_content["result"] == "43"
        samples = scrape(base)
        assert sample(samples, "mcp_sandbox_runs_total", language="python", status="ok") == 2
        # A stream still open at shutdown ends without an ASGI error in the log (a raw
        # connection: an HTTP client closes a stream it stops reading).
        host, port = base.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET /sse HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        await asyncio.wait_for(reader.readuntil(b"data: /messages/"), 10)
        proc.terminate()
        await asyncio.to_thread(proc.wait, 30)
        writer.close()
    log = (settings.state_dir / "server.log").read_text()
    assert "Exception in ASGI application" not in log
