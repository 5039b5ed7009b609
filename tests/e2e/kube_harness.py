"""The real server on the kubernetes backend, for ``test_kubernetes.py`` (the fake cluster),
``test_kubernetes_cluster.py`` (a real one) and ``bench/kubernetes.py``.

:class:`FakeCluster` serves the fake API (``tests/kube_api.py``) and the fake kubelet
(``tests/kubelet.py``) from threads of their own, makes the namespace and the CA
ConfigMap from certificates written by the CLI (``mcp-code-sandbox kubernetes certs``) and
writes a kubeconfig for them. :class:`KubectlPods` reads and deletes pods of a real
cluster with ``kubectl`` (whatever credentials KUBECONFIG carries). :class:`Server` is
``mcp-code-sandbox serve --transport http`` as a subprocess pointing at either.

No lightkube here: the test process reaches the fake API with httpx, so that its one
lightkube-free thread layout holds (lightkube's decoder, msgspec, can crash a process when
two threads first decode a Pod at once)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, Self

import anyio
import httpx
from mcp import Client
from mcp_types import TextContent

from mcp_code_sandbox.backends.kubernetes.spec import (
    AGENT_PORT,
    ANNOTATION_OWNER,
    ANNOTATION_SESSION,
    CA_CONFIGMAP,
    CA_KEY,
    LABEL_POOL,
    WARM,
)
from tests.kube_api import KubeApi, in_thread
from tests.kubelet import Kubelet

from .conftest import free_port, http_server_argv
from .tenants import structured

#: How long a server may take to answer /healthz (it reaches the API first).
START_WAIT_S = 60.0
STOP_WAIT_S = 30.0
#: Bounded waits on the cluster: a pod to go, the pool to fill, a lost pod's next call.
CLUSTER_WAIT_S = 120.0

Obj = dict[str, Any]


class Pods(Protocol):
    """The sandbox namespace's pods, as the tests look at them behind the server's back."""

    namespace: str

    def list(self) -> list[Obj]: ...

    def delete(self, name: str) -> None:
        """Delete a pod and wait until its container is gone (its agent dead)."""


class FakeCluster:
    """The fake API and kubelet (see the module doc); ``pods`` through the API's HTTP."""

    def __init__(self, api: KubeApi, kubelet: Kubelet, namespace: str, root: Path) -> None:
        self.api = api
        self.kubelet = kubelet
        self.namespace = namespace
        self.certs = root / "certs"
        self.kubeconfig = api.kubeconfig(root / "kubeconfig", namespace)
        self._http = httpx.Client(base_url=api.url, timeout=30, trust_env=False)

    def setup(self) -> None:
        """The namespace, and the CA ConfigMap the sandbox pods mount (an operator's)."""
        write_certs_with_cli(self.certs)
        self._post("/api/v1/namespaces", {"metadata": {"name": self.namespace}})
        ca = (self.certs / "ca.crt").read_text()
        self._post(
            f"/api/v1/namespaces/{self.namespace}/configmaps",
            {"metadata": {"name": CA_CONFIGMAP}, "data": {CA_KEY: ca}},
        )

    def server_env(self) -> dict[str, str]:
        """What a server needs to use this cluster."""
        return {
            "KUBECONFIG": str(self.kubeconfig),
            "SANDBOX_KUBERNETES_NAMESPACE": self.namespace,
            "SANDBOX_KUBERNETES_AGENT_TLS_DIR": str(self.certs),
        }

    def list(self) -> list[Obj]:
        response = self._http.get(f"/api/v1/namespaces/{self.namespace}/pods")
        response.raise_for_status()
        items: list[Obj] = response.json()["items"]
        return items

    def delete(self, name: str) -> None:
        response = self._http.delete(f"/api/v1/namespaces/{self.namespace}/pods/{name}")
        if response.status_code != 404:
            response.raise_for_status()
        deadline = time.monotonic() + CLUSTER_WAIT_S
        while name in self.kubelet.pods:  # the kubelet ends its process
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fake kubelet did not end pod {name}")
            time.sleep(0.05)

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, body: Obj) -> None:
        self._http.post(path, json=body).raise_for_status()


@contextlib.contextmanager
def fake_cluster(namespace: str = "sandboxes") -> Iterator[FakeCluster]:
    """A fake cluster with the namespace and CA ConfigMap made, served from threads."""
    root = Path(tempfile.mkdtemp(prefix="mcs-kube-e2e-"))
    try:
        with in_thread(KubeApi()) as api, in_thread(Kubelet(api.url, namespace)) as kubelet:
            cluster = FakeCluster(api, kubelet, namespace, root)
            try:
                cluster.setup()
                yield cluster
            finally:
                cluster.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


class KubectlPods:
    """A real cluster's pods in ``namespace``, through ``kubectl`` and KUBECONFIG."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._kubectl = shutil.which("kubectl") or str(Path(sys.executable).parent / "kubectl")

    def kubectl(self, *args: str) -> str:
        argv = [self._kubectl, "--namespace", self.namespace, *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def list(self) -> list[Obj]:
        items: list[Obj] = json.loads(self.kubectl("get", "pods", "-o", "json"))["items"]
        return items

    def delete(self, name: str) -> None:
        # --wait: until the object is gone, which is after its containers ended.
        self.kubectl("delete", "pod", name, "--wait=true", "--ignore-not-found")


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    """A fresh directory for servers' state and logs, removed afterwards (not pytest's
    tmp_path: its clean-up of old runs trips over other tests' mounts)."""
    path = Path(tempfile.mkdtemp(prefix="mcs-kube-e2e-", dir="/var/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def write_certs_with_cli(out: Path) -> None:
    """The agent channel's certificates, as an operator makes them."""
    argv = [sys.executable, "-m", "mcp_code_sandbox", "kubernetes", "certs", "--out", str(out)]
    subprocess.run(argv, check=True, capture_output=True, timeout=60, env=_python_env())


def pod_of_session(pods: Pods, owner: str, session_id: str) -> Obj | None:
    """The pod that serves ``owner``'s session ``session_id`` (not one being deleted)."""
    for pod in pods.list():
        meta = pod["metadata"]
        notes = meta.get("annotations") or {}
        if meta.get("deletionTimestamp"):
            continue
        if notes.get(ANNOTATION_OWNER) == owner and notes.get(ANNOTATION_SESSION) == session_id:
            return pod
    return None


def ready_warm_pods(pods: Pods) -> list[Obj]:
    """Warm pods ready to be claimed."""
    found = []
    for pod in pods.list():
        labels = pod["metadata"].get("labels") or {}
        conditions = (pod.get("status") or {}).get("conditions") or []
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
        if (
            labels.get(LABEL_POOL) == WARM
            and ready
            and not pod["metadata"].get("deletionTimestamp")
        ):
            found.append(pod)
    return found


class Server:
    """``mcp-code-sandbox serve --transport http`` on the kubernetes backend."""

    def __init__(self, state_dir: Path, name: str, env: dict[str, str]) -> None:
        self.name = name
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = state_dir / f"{name}.log"
        (state_dir / name).mkdir(mode=0o700)
        environ = {
            **_python_env(),
            "SANDBOX_STATE_DIR": str(state_dir / name),
            "SANDBOX_BACKEND": "kubernetes",
            "SANDBOX_LOG_LEVEL": "DEBUG",
            "SANDBOX_PRELOAD": "",
            # Sessions closed at a stop: their pods go with the server.
            "SANDBOX_KEEP_SESSIONS_ON_SHUTDOWN": "false",
            **env,
        }
        with open(self.log_path, "wb") as log:  # a file: an unread pipe blocks the server
            argv = http_server_argv(self.port)
            self.proc = subprocess.Popen(argv, env=environ, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + START_WAIT_S
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.base}/healthz", timeout=1).status_code == 200:
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server {name} did not start: {self.log()[-3000:]}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """SIGKILL: no clean-up at all, as a node's failure or an OOM kill."""
        self.proc.kill()
        self.proc.wait(timeout=STOP_WAIT_S)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _python_env() -> dict[str, str]:
    """PATH, HOME, and the code under test when it is not the installed package's."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    for name in ("PYTHONPATH", "HOME"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    return env


# -- what a user sees: the checks both suites make ---------------------------------------

ALICE = "alice-0123456789abcdef0"
BOB = "bob-0123456789abcdef0123"
TOKENS = f"alice:{ALICE},bob:{BOB}"
#: Whose sessions the checks look for in the cluster (``owner`` of the checks that read
#: pods): the name of ALICE's token.
OWNER = "alice"
#: How long a plain TCP peer waits for the agent to close on it (its TLS handshake has a
#: few seconds; this is room for a loaded machine).
PLAIN_TCP_WAIT_S = 30.0


async def run(client: Client, code: str, **args: Any) -> dict[str, Any]:
    return structured(await client.call_tool("run_code", {"code": code, **args}))


async def check_runs_files_and_variables(alice: Client) -> None:
    """A run prints; variables persist; the workspace (in the pod) takes an upload, shows
    what a run made in its files[], reads and lists it."""
    sid = "files"
    first = await run(alice, "x = 6 * 7\nprint(x)", session_id=sid)
    assert first["status"] == "ok" and first["stdout"] == "42\n", first
    assert first["session_created"] is True
    second = await run(alice, "print(x + 1)", session_id=sid)
    assert second["stdout"] == "43\n" and second["session_created"] is False, second
    up = structured(
        await alice.call_tool(
            "upload_file", {"session_id": sid, "filename": "in/data.txt", "content_text": "abc"}
        )
    )
    assert up["path"] == "in/data.txt" and up["size_bytes"] == 3, up
    made = await run(
        alice,
        "text = open('in/data.txt').read()\nopen('out.txt', 'w').write(text.upper())\ntext",
        session_id=sid,
    )
    assert made["result"] == "'abc'", made
    assert [(f["path"], f["change"]) for f in made["files"]] == [("out.txt", "created")], made
    read = await alice.call_tool("read_file", {"session_id": sid, "path": "out.txt"})
    assert any(isinstance(b, TextContent) and b.text == "ABC" for b in read.content), read
    listed = structured(await alice.call_tool("list_files", {"session_id": sid}))
    paths = {e["path"]: e["size_bytes"] for e in listed["entries"]}
    assert paths.get("in/data.txt") == 3 and paths.get("out.txt") == 3, listed


async def check_close_deletes_the_pod(alice: Client, pods: Pods, owner: str = OWNER) -> None:
    sid = "closing"
    await run(alice, "print(1)", session_id=sid)
    pod = pod_of_session(pods, owner, sid)
    assert pod is not None, "no pod serves the session"
    closed = structured(await alice.call_tool("close_session", {"session_id": sid}))
    assert closed["status"] == "closed", closed
    name = pod["metadata"]["name"]
    with anyio.fail_after(CLUSTER_WAIT_S):
        while any(p["metadata"]["name"] == name for p in pods.list()):
            await anyio.sleep(0.2)


async def check_a_lost_pod_loses_state_not_the_session(
    alice: Client, pods: Pods, owner: str = OWNER
) -> None:
    """A pod deleted behind the server's back: the session's next call says state_lost
    (never hangs) and runs in a new pod."""
    sid = "doomed"
    await run(alice, "x = 1", session_id=sid)
    pod = pod_of_session(pods, owner, sid)
    assert pod is not None
    await anyio.to_thread.run_sync(pods.delete, pod["metadata"]["name"])
    with anyio.fail_after(CLUSTER_WAIT_S):
        after = await run(alice, "print('again')\n'x' in globals()", session_id=sid)
    assert after["state_lost"] is True, after
    assert after["stdout"] == "again\n" and after["result"] == "False", after
    again = pod_of_session(pods, owner, sid)
    assert again is not None and again["metadata"]["name"] != pod["metadata"]["name"]


async def check_plain_tcp_gets_no_frame(alice: Client, pods: Pods, owner: str = OWNER) -> None:
    """A plain TCP peer at a session's agent port gets no frame and is closed; the
    session goes on."""
    sid = "plain"
    await run(alice, "x = 'kept'", session_id=sid)
    pod = pod_of_session(pods, owner, sid)
    assert pod is not None
    ip = pod["status"]["podIP"]
    got = await anyio.to_thread.run_sync(_plain_tcp, ip, AGENT_PORT)
    # All the agent may send is its TLS ClientHello (a handshake record, 0x16): no frame.
    assert got[:1] in (b"", b"\x16"), got[:80]
    assert b"ready" not in got
    after = await run(alice, "x", session_id=sid)
    assert after["result"] == "'kept'" and after["state_lost"] is False, after


def _plain_tcp(ip: str, port: int) -> bytes:
    """Connect, send what looks like a frame, read until the agent closes."""
    frame = json.dumps({"type": "execute", "code": "print(1)"}).encode()
    got = b""
    with socket.create_connection((ip, port), timeout=PLAIN_TCP_WAIT_S) as sock:
        sock.settimeout(PLAIN_TCP_WAIT_S)
        with contextlib.suppress(OSError):  # closed before we wrote: fine
            sock.sendall(len(frame).to_bytes(4, "big") + frame)
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass  # closed with a reset: closed all the same
        except TimeoutError:
            raise AssertionError(f"the agent kept a plain TCP peer open: {got[:80]!r}") from None
    return got


async def check_sessions_are_their_owners(alice: Client, bob: Client) -> None:
    await run(alice, "print(1)", session_id="alices")
    mine = structured(await alice.call_tool("list_sessions", {}))
    assert "alices" in [s["session_id"] for s in mine["sessions"]], mine
    theirs = structured(await bob.call_tool("list_sessions", {}))
    assert "alices" not in [s["session_id"] for s in theirs["sessions"]], theirs
    seen = await bob.call_tool("list_files", {"session_id": "alices"})
    assert seen.is_error and "session_not_found" in str(seen.content), seen


async def check_the_pool_refills(alice: Client, pods: Pods, size: int, owner: str = OWNER) -> None:
    """The pool fills (before any call, on a fresh server); sessions claim warm pods
    (they keep their names); the pool is full again after."""
    await until_pool(pods, size)
    warm = {p["metadata"]["name"] for p in ready_warm_pods(pods)}
    sids = [f"pooled-{i}" for i in range(size)]
    # At once: each claims one of the pods that were warm, before any refill is ready.
    outs = await asyncio.gather(*(run(alice, "print(1)", session_id=sid) for sid in sids))
    assert [o["stdout"] for o in outs] == ["1\n"] * size, outs
    serving = [pod_of_session(pods, owner, sid) for sid in sids]
    claimed = {pod["metadata"]["name"] for pod in serving if pod is not None}
    assert len(claimed) == size, serving
    assert claimed <= warm, (claimed, warm)  # every one a warm pod, none made cold
    await until_pool(pods, size)
    assert not {p["metadata"]["name"] for p in ready_warm_pods(pods)} & claimed
    await until_listed_pool(alice, size)
    for sid in sids:
        structured(await alice.call_tool("close_session", {"session_id": sid}))


async def until_listed_pool(client: Client, size: int) -> None:
    """``list_runtimes`` (as ``/readyz`` and ``/ui``) shows the cluster's warm pods:
    ``size`` of them ready, in a pool of that size."""
    with anyio.fail_after(CLUSTER_WAIT_S):
        while True:
            pool = structured(await client.call_tool("list_runtimes", {}))["pool"]
            if pool["ready"] == size:
                break
            await anyio.sleep(0.2)
    shown = (pool["size"], pool["floor"], pool["ceiling"], pool["starting"])
    assert shown == (size, size, size, 0), pool


async def until_pool(pods: Pods, size: int) -> None:
    with anyio.fail_after(CLUSTER_WAIT_S):
        while len(ready_warm_pods(pods)) < size:
            await anyio.sleep(0.2)
