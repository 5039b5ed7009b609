"""The egress proxies (``sessions.egress``): what a server's first sweep of their
directories removes, and what it must leave to the replicas beside it; behind the gate
(kubernetes), a proxy reached by its credential, which the run's env carries, until it
is closed."""

from __future__ import annotations

from pathlib import Path

import httpx

from mcp_code_sandbox.backends.unix_sockets import SocketDir
from mcp_code_sandbox.metrics import Metrics
from mcp_code_sandbox.sessions import records
from mcp_code_sandbox.sessions.egress import SOCKET_NAME, EgressProxies
from tests.egress_lab import upstream
from tests.fakes import fake_settings


def _dir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(parents=True)
    return path


def test_the_sweep_leaves_live_proxies_and_those_a_record_names(tmp_path: Path) -> None:
    settings = fake_settings(tmp_path)
    proxies = EgressProxies(settings, Metrics("fake"))
    key = "s" + "0" * 31
    gone = _dir(proxies.root, f"{key}-00000001")  # a dead server's: nothing listens
    (gone / SOCKET_NAME).touch()
    named = _dir(proxies.root, f"{key}-00000002")  # between two replicas: on record
    live = _dir(proxies.root, f"{key}-00000003")  # another live server's proxy
    record = records.SessionRecord(
        owner="alice",
        session_id="net",
        key=key,
        slot=f"{key}-0000000a",
        instance="1-aa",
        created_at=1.0,
        last_active=1.0,
        egress={"dir": named.name, "hosts": None},
    )
    records.write_record(settings.sessions_dir, record)
    with SocketDir(live) as sockets, sockets.listen(SOCKET_NAME, mode=0o600):
        proxies._sweep()
    assert sorted(p.name for p in proxies.root.iterdir()) == [named.name, live.name]


async def test_behind_the_gate_a_proxy_is_reached_by_its_credential_until_closed(
    tmp_path: Path,
) -> None:
    settings = fake_settings(
        tmp_path,
        allow_network=True,
        network_allow=["allowed.test", "127.0.0.1/32"],
        network_resolve="allowed.test=127.0.0.1",
    )
    proxies = EgressProxies(settings, Metrics("fake"), ("127.0.0.1", 0))
    assert proxies.gated
    async with upstream() as up:
        egress, spec_env = await proxies.open("s" + "0" * 31, "alice", "net", ())
        try:
            assert spec_env == {}  # nothing for the spec: a pod would show it
            env = proxies.run_env(egress)
            assert env["HTTPS_PROXY"] == env["HTTP_PROXY"] == env["http_proxy"]
            assert "@127.0.0.1:" in env["HTTP_PROXY"]
            assert not egress.host_dir.exists()  # no socket directory behind the gate
            async with httpx.AsyncClient(proxy=env["HTTP_PROXY"]) as client:
                reply = await client.get(f"http://allowed.test:{up.port}/")
                assert reply.status_code == 200
        finally:
            await proxies.close(egress)
        assert proxies.run_env(egress) == {}
        async with httpx.AsyncClient(proxy=env["HTTP_PROXY"]) as client:
            assert (await client.get(f"http://allowed.test:{up.port}/")).status_code == 407
        await proxies.aclose()


def test_without_the_gate_no_run_gets_proxy_variables(tmp_path: Path) -> None:
    proxies = EgressProxies(fake_settings(tmp_path), Metrics("fake"))
    assert not proxies.gated
    assert proxies.run_env(None) == {}
