"""The egress proxies' directories (``sessions.egress``): what a server's first sweep
removes, and what it must leave to the replicas beside it."""

from __future__ import annotations

from pathlib import Path

from mcp_code_sandbox.backends.unix_sockets import SocketDir
from mcp_code_sandbox.metrics import Metrics
from mcp_code_sandbox.sessions import records
from mcp_code_sandbox.sessions.egress import SOCKET_NAME, EgressProxies
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
