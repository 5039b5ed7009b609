"""Network by permission on a (fake) Kubernetes cluster: through the egress proxy beside
the server, on its pod's IP.

Two real servers (``SANDBOX_BACKEND=kubernetes``) against the fake API and the fake
kubelet (``tests/kube_api.py``, ``tests/kubelet.py``), which runs the real agent in each
pod as a local process: 127/8 addresses stand in for the pod network, each server's
"pod IP" one of them (``SANDBOX_KUBERNETES_POD_IP``). Names resolve by
``SANDBOX_NETWORK_RESOLVE`` to an upstream on this host. What a user sees: a run with
network reaches an allowed host through its proxy, a host outside the allowlist gets
the policy's 403, the proxy port refuses a connection without the sandbox's credential,
a run without network has no proxy at all, and a session adopted by the other replica
gets its proxy there, variables kept.
"""

from __future__ import annotations

import contextlib
import http.server
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from .kube_harness import FakeCluster, Server, fake_cluster, scratch_dir
from .tenants import client_as, structured

pytestmark = pytest.mark.timeout(300)

ALICE = "alice-0123456789abcdef0"
NAMESPACE = "sandboxes"

#: Code that fetches ``url`` with urllib (which takes the proxy from the env) and says
#: the status and the first bytes of the body.
FETCH = """
import urllib.request, urllib.error
def fetch(url):
    try:
        with urllib.request.urlopen(url, timeout=20) as r:
            return f"{r.status} {r.read(40).decode()}"
    except urllib.error.HTTPError as e:
        return f"{e.code} {e.read(120).decode()}"
    except OSError as e:
        return f"error {e!r}"
"""

#: Code that asks the proxy of ``HTTP_PROXY`` for ``target`` without its credential.
BARE = """
import os, socket, urllib.parse
def bare(target):
    proxy = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
    with socket.create_connection((proxy.hostname, proxy.port), timeout=20) as s:
        s.sendall(f"GET http://{target}/ HTTP/1.1\\r\\nHost: {target}\\r\\n\\r\\n".encode())
        return s.recv(200).split(b"\\r\\n")[0].decode()
"""


class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"hello from upstream"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class Replica(Server):
    """A replica and the "pod IP" its egress gate listens on."""

    def __init__(self, state: Path, name: str, env: dict[str, str], pod_ip: str) -> None:
        self.pod_ip = pod_ip
        super().__init__(state, name, {**env, "SANDBOX_KUBERNETES_POD_IP": pod_ip})


@pytest.fixture
def upstream() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def servers() -> Iterator[tuple[Replica, Replica, FakeCluster]]:
    with fake_cluster(NAMESPACE) as cluster, scratch_dir() as state:
        env = {
            **cluster.server_env(),
            "SANDBOX_POOL_SIZE": "1",
            "SANDBOX_API_TOKENS": f"alice:{ALICE}",
            "SANDBOX_ALLOW_NETWORK": "true",
            "SANDBOX_NETWORK_ALLOW": "allowed.test,127.0.0.1/32",
            "SANDBOX_NETWORK_RESOLVE": "allowed.test=127.0.0.1,blocked.test=127.0.0.1",
        }
        # Each its own, not 127.0.0.1 (the port is fixed; 127.0.0.0/24 is never a pod's).
        pod_ips = [f"127.0.0.{x}" for x in random.sample(range(2, 255), 2)]
        with contextlib.ExitStack() as stack:
            a = stack.enter_context(Replica(state, "a", env, pod_ips[0]))
            b = stack.enter_context(Replica(state, "b", env, pod_ips[1]))
            yield a, b, cluster


async def run(client: Client, code: str, **args: Any) -> dict[str, Any]:
    return structured(await client.call_tool("run_code", {"code": code, **args}))


def pod_labels(cluster: FakeCluster) -> list[dict[str, str]]:
    pods = cluster.list()
    return [
        p["metadata"].get("labels", {})
        for p in pods
        if p["metadata"].get("labels", {}).get("mcp-code-sandbox/pool") == "claimed"
    ]


async def test_a_run_with_network_goes_through_its_proxy_on_the_servers_pod(
    servers: tuple[Replica, Replica, FakeCluster], upstream: int
) -> None:
    a, _, cluster = servers
    async with client_as(a.base, ALICE) as client:
        await run(client, FETCH + BARE, session_id="net")  # no network yet
        out = await run(
            client, f"fetch('http://allowed.test:{upstream}/')", session_id="net", network=True
        )
        assert out["result"] == "'200 hello from upstream'"
        assert not out.get("state_lost")  # fetch() was defined without network
        out = await run(
            client, f"fetch('http://blocked.test:{upstream}/')", session_id="net", network=True
        )
        assert "403 blocked by sandbox network policy: blocked.test is not in the allowlist" in (
            out["result"] or ""
        )
        assert out.get("blocked_hosts") == ["blocked.test"]
        out = await run(
            client,
            "import os; os.environ['HTTP_PROXY'].rsplit('@')[-1]",
            session_id="net",
            network=True,
        )
        assert out["result"] == f"'{a.pod_ip}:3128'"  # the server's pod, not the bridge
        out = await run(client, f"bare('allowed.test:{upstream}')", session_id="net", network=True)
        assert out["result"] == "'HTTP/1.1 407 Proxy Authentication Required'"
    assert [labels.get("mcp-code-sandbox/network") for labels in pod_labels(cluster)] == ["on"]


async def test_a_run_without_network_has_no_proxy(
    servers: tuple[Replica, Replica, FakeCluster],
) -> None:
    a, _, cluster = servers
    async with client_as(a.base, ALICE) as client:
        out = await run(
            client,
            "import os; sorted(k for k in os.environ if 'proxy' in k.lower())",
            session_id="quiet",
        )
    assert out["result"] == "[]"
    assert [labels.get("mcp-code-sandbox/network") for labels in pod_labels(cluster)] == [None]


async def test_an_adopted_session_gets_its_proxy_on_the_other_replica(
    servers: tuple[Replica, Replica, FakeCluster], upstream: int
) -> None:
    a, b, _ = servers
    url = f"http://allowed.test:{upstream}/"
    async with client_as(a.base, ALICE) as via_a, client_as(b.base, ALICE) as via_b:
        out = await run(via_a, FETCH + f"first = fetch('{url}')", session_id="n", network=True)
        out = await run(via_b, f"first, fetch('{url}')", session_id="n", network=True)
        assert not out.get("state_lost")
        assert out["result"] == "('200 hello from upstream', '200 hello from upstream')"
        out = await run(via_b, "import os; os.environ['HTTP_PROXY']", session_id="n", network=True)
        assert f"@{b.pod_ip}:3128" in out["result"]
