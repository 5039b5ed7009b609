"""The session side of network by policy, on the fake backend (no sandbox): a call's
network wish becomes a spec with its own egress proxy, whose socket, variables and
directory exist exactly as long as that sandbox (every stop path), and a call asking for
a host outside the server's policy is refused before any session is made."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.backends.base import SandboxSpec
from mcp_code_sandbox.errors import NetworkNotAllowed, SandboxFailed
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService
from tests.fakes import FakeBackend, fake_service

ALLOW: dict[str, Any] = {"allow_network": True, "network_allow": "allowed.test,pypi"}


async def run(svc: SandboxService, sid: str, network: bool | list[str]) -> None:
    report = await svc.run_code("local", RunRequest("1", network=network), sid)
    assert report.status == "ok", report.error


def networked(backend: FakeBackend) -> list[SandboxSpec]:
    return [spec for spec in backend.created if spec.egress is not None]


def egress_dirs(svc: SandboxService) -> list[Path]:
    root = svc.sessions.sandboxes.egress.root
    return sorted(root.iterdir()) if root.exists() else []


async def test_a_networked_spec_has_its_proxy_and_the_proxy_variables(state_dir: Path) -> None:
    async with fake_service(state_dir, **ALLOW) as svc:
        svc.backend.network_unavailable = None  # type: ignore[attr-defined]
        await run(svc, "s", True)
        (spec,) = networked(svc.backend)  # type: ignore[arg-type]
        assert spec.egress is not None and spec.egress.hosts is None
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
            assert spec.env[name] == "http://127.0.0.1:3128"
        assert spec.env["NO_PROXY"].startswith("localhost,127.0.0.1")
        assert spec.env["PIP_PROXY"] == spec.env["npm_config_https_proxy"]
        assert "SSL_CERT_FILE" not in spec.env  # no secrets, no upstream CA: no bundle
        sock = spec.egress.host_dir / "proxy.sock"
        # The proxy answers on the socket the backend binds in.
        reader, writer = await asyncio.open_unix_connection(str(sock))
        writer.write(b"GET http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        writer.close()
        assert head.startswith(b"HTTP/1.1 403")
        report = await svc.run_code("local", RunRequest("2", network=True), "s")
        assert report.blocked_hosts == ["evil.test"]


async def test_the_proxy_goes_on_every_stop_path(state_dir: Path) -> None:
    async with fake_service(state_dir, **ALLOW) as svc:
        svc.backend.network_unavailable = None  # type: ignore[attr-defined]
        egress = svc.sessions.sandboxes.egress
        await run(svc, "a", True)
        await run(svc, "b", ["allowed.test"])
        assert egress.open_count == 2 and len(egress_dirs(svc)) == 2
        made = len(svc.backend.created)  # type: ignore[attr-defined]
        await run(svc, "b", ["pypi"])  # other hosts: the same sandbox and proxy, narrowed
        assert len(svc.backend.created) == made  # type: ignore[attr-defined]
        assert egress.open_count == 2 and len(egress_dirs(svc)) == 2
        await run(svc, "b", False)  # replaced without network
        assert egress.open_count == 1
        await svc.close_session("local", "a")  # session end
        assert egress.open_count == 0 and egress_dirs(svc) == []
        svc.backend.fail_creates = 1  # type: ignore[attr-defined]
        with pytest.raises(SandboxFailed):
            await svc.run_code("local", RunRequest("1", network=True), "c")
        assert egress.open_count == 0 and egress_dirs(svc) == []  # a failed start
        await run(svc, "d", True)
    assert egress.open_count == 0 and egress_dirs(svc) == []  # shutdown
    spec = networked(svc.backend)[-1]  # type: ignore[arg-type]
    assert spec.session_id == "d" and spec.egress is not None
    with pytest.raises(OSError), socket.socket(socket.AF_UNIX) as probe:
        probe.connect(str(spec.egress.host_dir / "proxy.sock"))


async def test_hosts_outside_the_policy_are_refused_before_a_session(state_dir: Path) -> None:
    async with fake_service(state_dir, **ALLOW) as svc:
        with pytest.raises(NetworkNotAllowed, match=r"evil\.test") as caught:
            await svc.run_code("local", RunRequest("1", network=["allowed.test", "evil.test"]), "s")
        assert caught.value.code == "network_not_allowed"
        assert svc.sessions.count() == 0 and svc.backend.created == []  # type: ignore[attr-defined]
        # An empty list is no network; false too: neither needs the server's permission.
    async with fake_service(state_dir) as svc:
        await run(svc, "s", [])
        assert networked(svc.backend) == []  # type: ignore[arg-type]
        with pytest.raises(NetworkNotAllowed, match="SANDBOX_ALLOW_NETWORK"):
            await svc.run_code("local", RunRequest("1", network=["allowed.test"]), "s")


async def test_a_bad_secrets_file_stops_the_start(state_dir: Path) -> None:
    from mcp_code_sandbox.egress.secrets import SecretsFileError

    bad = state_dir.parent / f"{state_dir.name}-secrets.toml"
    bad.write_text("[secrets.X]\nhosts = 'not a list'\n")
    bad.chmod(0o600)
    try:
        with pytest.raises(SecretsFileError, match="secrets"):
            async with fake_service(state_dir, secrets_file=str(bad), **ALLOW):
                pass
    finally:
        bad.unlink()
