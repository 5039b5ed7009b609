"""Network by policy with the server NOT root: the server started by the official MCP
client (stdio) under an unprivileged uid of its own (``setpriv``), with a state dir of
that uid, on every backend. Its networked sandbox reaches an allowed host through the
egress proxy, gets the policy's 403 for another, and has no route for raw TCP. On bwrap
the sandbox is the server's uid in an empty network namespace of an unprivileged user
namespace; on Docker the server is in the engine socket's group only (no capability:
every container runs as its uid) and the container has no network at all.

Root is needed only by the test, to build the test network (:mod:`tests.labnet`) and to
drop to the uid; the server itself has no capability and no iptables.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters

from mcp_code_sandbox.settings import Settings

from .. import labnet, netlab
from ..conftest import each_runtime, shared_runtime_dir
from ..procs import descendants
from .conftest import settings_env
from .test_workflow import structured

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.bwrap,
    pytest.mark.skipif(
        os.geteuid() != 0 or not all(shutil.which(c) for c in ("ip", "setpriv", "bwrap")),
        reason="needs root (to build the test network and drop to a uid), iproute2, setpriv",
    ),
]

PROBE = """
import json, socket, urllib.request, urllib.error
def get(url):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return f"{r.status} {r.read().decode()}"
    except urllib.error.HTTPError as e:
        return f"{e.code} {e.read().decode()}"
    except Exception as e:
        return f"error {e!r}"
out = {"allowed": get(ALLOWED), "blocked": get(BLOCKED)}
try:
    socket.create_connection(TCP, timeout=3).close()
    out["tcp"] = "connected"
except OSError as e:
    out["tcp"] = f"error {e!r}"
print(json.dumps(out))
"""


def _unused_uid() -> int:
    """A uid with no process and no passwd entry: the server's alone for this test."""
    import pwd

    busy = {
        os.stat(f"/proc/{pid}").st_uid for pid in os.listdir("/proc") if pid.isdigit()
    }  # racy only against processes that appear meanwhile: fine for a free-range uid
    for _ in range(100):
        uid = 61000 + secrets.randbelow(3000)
        try:
            pwd.getpwuid(uid)
        except KeyError:
            if uid not in busy:
                return uid
    raise AssertionError("no free uid in 61000-63999")


def _engine_group() -> int | None:
    """The group of the Docker engine's socket, if there is one."""
    try:
        return os.stat("/var/run/docker.sock").st_gid
    except OSError:
        return None


@pytest.fixture
def unprivileged() -> Iterator[tuple[int, Path]]:
    """(uid, a state dir owned by it); the test is skipped, saying why, when that uid
    cannot run this checkout's interpreter (a venv under a directory others cannot
    enter)."""
    uid = _unused_uid()
    drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    check = subprocess.run(
        [*drop, sys.executable, "-c", "import mcp_code_sandbox.cli"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if check.returncode != 0:
        pytest.skip(f"uid {uid} cannot run {sys.executable}: {check.stderr.strip()[-300:]}")
    state = Path(tempfile.mkdtemp(prefix="mcs-unpriv-", dir="/var/tmp"))
    try:
        os.chown(state, uid, uid)
        state.chmod(0o700)
        yield uid, state
    finally:
        shutil.rmtree(state, ignore_errors=True)


@each_runtime
async def test_a_server_that_is_not_root_enforces_the_network_policy(
    unprivileged: tuple[int, Path], make_settings: Callable[..., Settings], backend: str
) -> None:
    uid, state = unprivileged
    groups = ["--clear-groups"]
    if backend != "bwrap":
        gid = _engine_group()
        assert gid is not None and gid != 0, "the engine's socket has no group to join"
        groups = [f"--groups={gid}"]  # the engine's socket, and nothing else
    with labnet.namespace("mcs-nr") as ns:
        token = f"tok-{secrets.token_hex(6)}"
        argv = [sys.executable, "-c", netlab.SERVER, ns.ns_ip, "8080", token, "-"]
        labnet.serve_inside(ns, argv, ns.ns_ip, 8080)
        settings = make_settings(state_dir=str(state), runtime_dir=str(shared_runtime_dir()))
        env = settings_env(
            settings,
            HOME=str(state),
            SANDBOX_ALLOW_NETWORK="true",
            # Both names land on the upstream: only the allowlist tells them apart.
            SANDBOX_NETWORK_ALLOW=f"allowed.test,{ns.ns_ip}/32",
            SANDBOX_NETWORK_RESOLVE=f"allowed.test={ns.ns_ip},other.test={ns.ns_ip}",
        )
        params = StdioServerParameters(
            command="setpriv",
            args=[
                f"--reuid={uid}", f"--regid={uid}", *groups, "--",
                sys.executable, "-m", "mcp_code_sandbox", "serve",
            ],
            env=env,
        )  # fmt: skip
        code = (
            "ALLOWED = 'http://allowed.test:8080/'\nBLOCKED = 'http://other.test:8080/'\n"
            f"TCP = ('{ns.ns_ip}', 8080)\n"
        ) + PROBE
        async with Client(params) as client:
            ran = structured(await client.call_tool("run_code", {"code": code, "network": True}))
            # While its sandbox lives: the server, bwrap and everything in the sandbox.
            tree = _server_tree(state)
            users = _container_users(state) if backend != "bwrap" else []
    assert ran["status"] == "ok", ran
    found = json.loads(ran["stdout"].strip().splitlines()[-1])
    assert found["allowed"] == f"200 {token} -", found
    assert found["blocked"].startswith("403 "), found
    assert (
        "blocked by sandbox network policy: other.test is not in the allowlist"
        in (found["blocked"])
    )
    assert found["tcp"].startswith("error"), found
    assert ran["blocked_hosts"] == ["other.test"], ran
    # It was the unprivileged server's doing: it, bwrap and the sandbox's processes held
    # that uid and no other (real, effective, saved, file system), and no capability.
    if backend == "bwrap":
        assert len(tree) >= 3, tree  # the server, bwrap, the agent at least
    else:
        assert users == [f"{uid}:{uid}"], users  # the container ran as the server's uid
    assert {ids for ids, _ in tree.values()} == {(uid,) * 4}, tree
    assert {caps for _, caps in tree.values()} == {0}, tree


def _container_users(state: Path) -> list[str]:
    """The user of each container whose workspace is under ``state``."""
    import docker

    client = docker.from_env()
    try:
        found = client.containers.list(sparse=False)
        return [
            str(c.attrs["Config"]["User"])
            for c in found
            if any(str(m.get("Source", "")).startswith(str(state)) for m in c.attrs["Mounts"])
        ]
    finally:
        client.close()


def _server_tree(state: Path) -> dict[int, tuple[tuple[int, ...], int]]:
    """pid -> (its four uids, its effective capabilities) for the server under test (the
    child of this test whose environment names ``state``) and all its descendants."""
    servers = [
        pid for pid in descendants(os.getpid())
        if f"SANDBOX_STATE_DIR={state}".encode() in _read(f"/proc/{pid}/environ")
    ]  # fmt: skip
    assert servers, "the server process was not found"
    tree: dict[int, tuple[tuple[int, ...], int]] = {}
    for pid in {*servers, *(child for server in servers for child in descendants(server))}:
        status = dict(
            line.split(":", 1) for line in _read(f"/proc/{pid}/status").decode().splitlines()
        )
        if "Uid" in status:
            uids = tuple(int(u) for u in status["Uid"].split())
            tree[pid] = (uids, int(status["CapEff"].strip(), 16))
    return tree


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""
