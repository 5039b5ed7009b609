"""The appliance as a Mac runs it, minus the VM: the server image started by the client
with ``docker run -i --rm``, its state in a named volume of the engine, the engine's
socket its only other mount, driven over stdio by the official MCP client, its sandboxes
sibling containers of the same engine; on runc and runsc.

One server container per runtime serves the whole workflow (upload, pandas, a chart,
files, JavaScript, a pause and a resume, close). Each test has a volume of its own and
removes it. The images are not built here (``.ci/run`` builds them; ``MCS_SERVER_IMAGE``
names another tag of the server image): with ``SANDBOX_REQUIRE_DOCKER=1`` a missing one
fails.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import secrets
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, StdioServerParameters
from mcp_types import ImageContent

from mcp_code_sandbox.backends.docker.spec import LABEL_INSTANCE
from mcp_code_sandbox.settings import docker_environ

from ..conftest import docker_image, require_docker
from .test_deployment import SERVER_IMAGE, _missing, docker_client, upload_and_chart
from .test_workflow import structured

pytestmark = [pytest.mark.e2e, pytest.mark.docker]

STATE = "/var/lib/mcp-code-sandbox"
SOCKET = "/var/run/docker.sock"
#: About three seconds idle before a session is paused (the reaper looks every 0.5 s).
PAUSE_AFTER_M = "0.05"
#: Generous bounds for 2 shared cores (gVisor's checkpoint, a container's start): never
#: a speed claim.
PAUSE_WAIT_S = 120.0
GONE_WAIT_S = 60.0
FENCED = """
import urllib.request, urllib.error
try:
    urllib.request.urlopen("http://10.255.255.1/", timeout=20)
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode()[:200])
"""


def appliance_args(volume: str, **env: str) -> list[str]:
    """The README's line (``docker run -i --rm``, the engine's socket, the named volume,
    the image), with this engine's socket path and the test's settings as ``-e``."""
    socket_path = docker_environ().get("DOCKER_HOST", "").removeprefix("unix://") or SOCKET
    settings = [f"--env={name}={value}" for name, value in env.items()]
    return [
        "run", "-i", "--rm",
        "-v", f"{socket_path}:{SOCKET}",
        "-v", f"{volume}:{STATE}",
        *settings,
        SERVER_IMAGE,
    ]  # fmt: skip


def params(volume: str, **env: str) -> StdioServerParameters:
    return StdioServerParameters(
        command="docker",
        args=appliance_args(volume, **env),
        env={**os.environ, **docker_environ()},
    )


@pytest.fixture
def volume() -> Iterator[str]:
    """A named volume of the test's own, removed (with anything left on it) at the end."""
    require_docker("runc")
    client = docker_client()
    try:
        client.images.get(SERVER_IMAGE)
    except Exception:
        _missing(
            f"the server image {SERVER_IMAGE} is missing (mcp-code-sandbox image build --server)"
        )
    name = f"mcse2e-{secrets.token_hex(4)}"
    client.volumes.create(name)
    try:
        yield name
    finally:
        for container in client.containers.list(all=True, filters={"volume": name}):
            with contextlib.suppress(Exception):
                container.remove(force=True)
        with contextlib.suppress(Exception):
            client.volumes.get(name).remove(force=True)
        client.close()


def sandbox_containers(prefix: str) -> list[Any]:
    """The sandbox containers whose server's instance label starts with ``prefix``,
    inspected (the list is sparse: other tests' containers come and go meanwhile)."""
    client = docker_client()
    try:
        found = client.containers.list(all=True, sparse=True, filters={"label": LABEL_INSTANCE})
        ours = []
        for sparse in found:
            if (sparse.attrs.get("Labels") or {}).get(LABEL_INSTANCE, "").startswith(prefix):
                with contextlib.suppress(Exception):
                    ours.append(client.containers.get(sparse.id))
        return ours
    finally:
        client.close()


def server_containers(volume: str) -> list[Any]:
    client = docker_client()
    try:
        found = client.containers.list(all=True, filters={"volume": volume})
        return [c for c in found if c.attrs["Config"]["Image"] == SERVER_IMAGE]
    finally:
        client.close()


def mountpoint(volume: str) -> Path:
    client = docker_client()
    try:
        return Path(client.volumes.get(volume).attrs["Mountpoint"])
    finally:
        client.close()


def check_mounts(server: Any, volume: str) -> None:
    """No path of the client's machine: the server mounts the engine's socket and the
    volume; each of its sandboxes only sub-directories of that volume (as the volume, by
    subpath, or, on an engine before API 1.45, bound from the volume's own directory in
    the engine)."""
    server_mounts = {(m["Type"], m.get("Name") or m["Source"], m["Destination"]) for m in
                     server.attrs["Mounts"]}  # fmt: skip
    socket_path = docker_environ().get("DOCKER_HOST", "").removeprefix("unix://") or SOCKET
    assert server_mounts == {("bind", socket_path, SOCKET), ("volume", volume, STATE)}
    sandboxes = sandbox_containers(f"{server.attrs['Config']['Hostname']}-")
    assert sandboxes, "no sandbox of the appliance's"
    data = mountpoint(volume)
    for container in sandboxes:
        for mount in container.attrs["Mounts"]:
            if mount["Type"] == "volume":
                assert mount["Name"] == volume, mount
            else:
                assert mount["Type"] == "bind", mount
                assert data in Path(mount["Source"]).parents, mount


@contextlib.asynccontextmanager
async def appliance(volume: str, **env: str) -> AsyncIterator[Client]:
    async with Client(params(volume, **env), mode="legacy") as client:
        yield client


async def wait_paused(client: Client, session_id: str) -> None:
    deadline = time.monotonic() + PAUSE_WAIT_S
    while True:
        listed = structured(await client.call_tool("list_sessions", {}))
        states = {s["session_id"]: s["state"] for s in listed["sessions"]}
        if states.get(session_id) == "paused":
            return
        assert time.monotonic() < deadline, states
        await asyncio.sleep(0.3)


def wait_gone(volume: str, instance_prefix: str) -> float:
    """Seconds until the server container and every sandbox of it are gone."""
    started = time.monotonic()
    while server_containers(volume) or sandbox_containers(instance_prefix):
        assert time.monotonic() - started < GONE_WAIT_S, "the appliance left containers"
        time.sleep(0.2)
    return time.monotonic() - started


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
async def test_the_appliance_over_stdio(volume: str, runtime: str) -> None:
    require_docker(runtime)
    env = {
        "SANDBOX_DOCKER_RUNTIME": runtime,
        "SANDBOX_IMAGE": docker_image(),
        "SANDBOX_PAUSE_AFTER_M": PAUSE_AFTER_M,
        "SANDBOX_ALLOW_NETWORK": "true",
    }
    async with appliance(volume, **env) as client:
        sid = await upload_and_chart(client)
        chart = await client.call_tool("read_file", {"session_id": sid, "path": "chart.png"})
        (image,) = [b for b in chart.content if isinstance(b, ImageContent)]
        assert base64.b64decode(image.data).startswith(b"\x89PNG")
        listing = structured(await client.call_tool("list_files", {"session_id": sid}))
        assert {e["path"] for e in listing["entries"]} == {"sales.csv", "chart.png"}
        js = structured(
            await client.call_tool(
                "run_code",
                {"session_id": sid, "language": "javascript", "code": "console.log(6 * 7)"},
            )
        )
        assert (js["status"], js["stdout"]) == ("ok", "42\n"), js

        (server,) = server_containers(volume)
        check_mounts(server, volume)
        assert server.attrs["HostConfig"]["AutoRemove"] is True

        structured(await client.call_tool("run_code", {"session_id": sid, "code": "x = 41"}))
        await wait_paused(client, sid)
        back = structured(await client.call_tool("run_code", {"session_id": sid, "code": "x + 1"}))
        assert (back["result"], back["session_created"]) == ("42", False), back
        assert back["resumed"] in ("variables", "memory"), back

        if runtime == "runc":  # the same topology under runsc: once is enough
            await a_second_client_beside_it(volume, env)
            again = structured(
                await client.call_tool("run_code", {"session_id": sid, "code": "x + 2"})
            )
            assert (again["result"], again["state_lost"]) == ("43", False), again

        # The egress proxy's socket crosses the volume too: a private address is refused
        # by the proxy (its 403), not unreachable.
        fenced = structured(await client.call_tool("run_code", {"code": FENCED, "network": True}))
        assert "403" in fenced["stdout"] and fenced["blocked_hosts"] == ["10.255.255.1"], fenced

        closed = structured(await client.call_tool("close_session", {"session_id": sid}))
        assert closed == {"session_id": sid, "status": "closed"}
        structured(await client.call_tool("run_code", {"code": "y = 1"}))  # left open
    hostname = server.attrs["Config"]["Hostname"]
    took = wait_gone(volume, f"{hostname}-")
    print(f"appliance ({runtime}) gone {took:.1f} s after the client left")
    data = mountpoint(volume)
    if data.is_dir():  # the engine's own directory: readable when it runs on this host
        assert not list((data / "workspaces").iterdir())


async def a_second_client_beside_it(volume: str, env: dict[str, str]) -> None:
    """The same command started by another client on the same volume: it serves its own
    session and leaves the first appliance's alone, during its life and at its end."""
    before = server_containers(volume)
    async with appliance(volume, **env) as other:
        mine = structured(await other.call_tool("run_code", {"code": "1 + 1"}))
        assert (mine["result"], mine["session_created"]) == ("2", True), mine
        listed = structured(await other.call_tool("list_sessions", {}))
        assert [s["session_id"] for s in listed["sessions"]] == [mine["session_id"]]
        (second,) = [c for c in server_containers(volume) if c.id not in {b.id for b in before}]
    wait_gone_one(second)


def wait_gone_one(container: Any) -> None:
    prefix = f"{container.attrs['Config']['Hostname']}-"
    started = time.monotonic()
    while sandbox_containers(prefix) or _exists(container):
        assert time.monotonic() - started < GONE_WAIT_S, "the second appliance left containers"
        time.sleep(0.2)


def _exists(container: Any) -> bool:
    try:
        container.reload()
    except Exception:
        return False
    return True


async def test_a_killed_appliances_leftovers_go_at_the_next_start(volume: str) -> None:
    """SIGKILL (``docker kill``): ``--rm`` removes the server's container at once, with
    the janitor in it; its sandbox's agent exits with its channel; the next appliance on
    the volume removes what is left (container, workspace, record) as it starts."""
    env = {"SANDBOX_IMAGE": docker_image()}
    async with appliance(volume, **env) as client:
        first = structured(await client.call_tool("run_code", {"code": "41"}))
        (server,) = server_containers(volume)
        prefix = f"{server.attrs['Config']['Hostname']}-"
        assert sandbox_containers(prefix)
        subprocess.run(["docker", "kill", server.id], check=True, capture_output=True)
        with contextlib.suppress(Exception):
            await client.call_tool("list_sessions", {})
    async with appliance(volume, **env) as client:
        listed = structured(await client.call_tool("list_sessions", {}))
        assert first["session_id"] not in [s["session_id"] for s in listed["sessions"]]
        assert not sandbox_containers(prefix), "the dead appliance's sandbox is still there"
    data = mountpoint(volume)
    if data.is_dir():
        assert not list((data / "workspaces").iterdir())
