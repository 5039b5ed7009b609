"""Server replicas on one (fake) Kubernetes cluster serve the same sessions.

Two real servers (``serve --transport http``, ``SANDBOX_BACKEND=kubernetes``), each with
a state directory of its own as the Deployment's pods have, against the fake API and
the fake kubelet (``tests/kube_api.py``, ``tests/kubelet.py``) that runs the real agent
in each pod; the official MCP client with two owners' tokens. A client sends its calls
to either replica, as a Service without affinity would: one session, its variables and
call order; another owner sees nothing of it through either; a replica killed with
SIGKILL loses no session.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client

from mcp_code_sandbox.backends.kubernetes.certs import write_certs
from mcp_code_sandbox.backends.kubernetes.spec import CA_CONFIGMAP, CA_KEY
from tests.kube_api import KubeApi, in_thread
from tests.kubelet import Kubelet

from .conftest import free_port, http_server_argv, server_env
from .tenants import client_as, structured

pytestmark = pytest.mark.timeout(300)

ALICE = "alice-0123456789abcdef0"
BOB = "bob-0123456789abcdef0123"
TOKENS = f"alice:{ALICE},bob:{BOB}"
NAMESPACE = "sandboxes"


class Server:
    """One replica's process and base URL."""

    def __init__(self, root: Path, name: str, kubeconfig: Path, certs: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = root / f"{name}.log"
        env = server_env(
            root / name / "state",
            root / name / "runtime",
            SANDBOX_BACKEND="kubernetes",
            SANDBOX_KUBERNETES_NAMESPACE=NAMESPACE,
            SANDBOX_KUBERNETES_AGENT_TLS_DIR=str(certs),
            SANDBOX_POOL_SIZE="2",
            SANDBOX_PRELOAD="",
            SANDBOX_API_TOKENS=TOKENS,
            KUBECONFIG=str(kubeconfig),
            PYTHONPATH=os.environ.get("PYTHONPATH", ""),
        )
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                http_server_argv(self.port), env=env, stdout=subprocess.DEVNULL, stderr=log
            )
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.base}/healthz", timeout=1).status_code == 200:
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"server {name} did not start: {self.log()[-3000:]}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[Server, Server, KubeApi]]:
    files = write_certs(tmp_path / "certs")
    with in_thread(KubeApi()) as api, in_thread(Kubelet(api.url, NAMESPACE)):
        kubeconfig = api.kubeconfig(tmp_path / "kubeconfig", NAMESPACE)
        httpx.post(f"{api.url}/api/v1/namespaces", json={
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE},
        }).raise_for_status()  # fmt: skip
        httpx.post(f"{api.url}/api/v1/namespaces/{NAMESPACE}/configmaps", json={
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CA_CONFIGMAP},
            "data": {CA_KEY: files.ca_cert.read_text()},
        }).raise_for_status()  # fmt: skip
        started: list[Server] = []
        try:
            for name in ("a", "b"):
                started.append(Server(tmp_path, name, kubeconfig, tmp_path / "certs"))
            yield started[0], started[1], api
        finally:
            for server in started:
                with contextlib.suppress(Exception):
                    server.stop()


async def run(client: Client, code: str, **args: Any) -> dict[str, Any]:
    return structured(await client.call_tool("run_code", {"code": code, **args}))


def claimed_pods(api: KubeApi) -> list[str]:
    pods = httpx.get(f"{api.url}/api/v1/namespaces/{NAMESPACE}/pods").json()["items"]
    return [
        p["metadata"]["name"]
        for p in pods
        if p["metadata"].get("labels", {}).get("mcp-code-sandbox/pool") == "claimed"
    ]


async def test_either_replica_serves_one_session_in_order(
    servers: tuple[Server, Server, KubeApi],
) -> None:
    a, b, api = servers
    async with client_as(a.base, ALICE) as via_a, client_as(b.base, ALICE) as via_b:
        first = await run(via_a, "calls = []", session_id="conv")
        assert first["session_created"]
        for i in range(50):
            out = await run(
                (via_a, via_b)[i % 2], f"calls.append({i}); len(calls)", session_id="conv"
            )
            assert out["result"] == str(i + 1) and not out.get("state_lost")
        assert (await run(via_b, "calls == list(range(50))", session_id="conv"))["result"] == "True"
    assert len(claimed_pods(api)) == 1


async def test_another_owner_sees_nothing_through_either(
    servers: tuple[Server, Server, KubeApi],
) -> None:
    a, b, _ = servers
    async with client_as(a.base, ALICE) as alice, client_as(b.base, BOB) as bob_b:
        await run(alice, "secret = 'alice only'", session_id="conv")
        listed = structured(await bob_b.call_tool("list_sessions", {}))
        assert listed["sessions"] == []
        read = await bob_b.call_tool("read_file", {"session_id": "conv", "path": "x"})
        assert read.is_error and (read.meta or {}).get("error_code") == "session_not_found"
        mine = await run(bob_b, "'secret' in dir()", session_id="conv")
        assert mine["session_created"] and mine["result"] == "False"
        async with client_as(b.base, ALICE) as alice_b:
            listed = structured(await alice_b.call_tool("list_sessions", {}))
            assert [s["session_id"] for s in listed["sessions"]] == ["conv"]


async def test_a_replica_killed_loses_no_session(
    servers: tuple[Server, Server, KubeApi],
) -> None:
    a, b, _ = servers
    async with client_as(a.base, ALICE) as via_a:
        await run(via_a, "x = 41", session_id="conv")
    a.kill()  # SIGKILL: no cleanup at all
    async with client_as(b.base, ALICE) as via_b:
        out = await run(via_b, "x + 1", session_id="conv")
    assert out["result"] == "42" and not out.get("state_lost") and not out["session_created"]
