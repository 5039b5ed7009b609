"""The deployment: the server image run by deploy/compose.yaml beside this host's engine,
driven over streamable HTTP by the official MCP client, with a bearer token.

Each test copies deploy/compose.yaml into a project dir of its own with a generated .env
(a free port, a token, a host state dir under /var/tmp, which the server sees at
/var/lib/mcp-code-sandbox: the path mapping is exercised) and brings it up with
docker-compose, as a user would. The images are not built here (``.ci/run`` builds them):
with ``SANDBOX_REQUIRE_DOCKER=1`` a missing server image or compose command fails.
"""

from __future__ import annotations

import base64
import contextlib
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp_types import ImageContent

from mcp_code_sandbox.backends.docker.spec import LABEL_INSTANCE, LABEL_SESSION
from mcp_code_sandbox.provision.server_image import SERVER_TAG
from mcp_code_sandbox.settings import docker_environ

from ..conftest import REPO, REQUIRE_DOCKER, docker_image, require_docker
from .conftest import free_port
from .test_workflow import SALES, structured

pytestmark = [pytest.mark.e2e, pytest.mark.docker]

SERVER_IMAGE = os.environ.get("MCS_SERVER_IMAGE") or SERVER_TAG
CHART = """
import pandas as pd
import matplotlib.pyplot as plt
df = pd.read_csv("sales.csv")
by_region = df.groupby("region")["revenue"].sum()
by_region.plot.bar()
plt.savefig("/mnt/data/chart.png")
by_region.to_dict()
"""


def _missing(why: str) -> None:
    if REQUIRE_DOCKER:
        pytest.fail(f"SANDBOX_REQUIRE_DOCKER=1 but {why}", pytrace=False)
    pytest.skip(why)


def compose_command() -> list[str] | None:
    """docker-compose (Debian's, v1), or the v2 plugin; ``None`` when neither is there."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        done = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
        if done.returncode == 0:
            return ["docker", "compose"]
    return None


def docker_client() -> Any:
    import docker

    return docker.from_env(environment=docker_environ(), timeout=30)


@dataclass
class Deployment:
    base: str
    token: str
    host_state_dir: Path
    project: str
    compose: list[str]

    def run(self, *args: str, timeout: float = 120) -> str:
        done = subprocess.run(
            [*self.compose, "-p", self.project, *args],
            cwd=self.compose_dir,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert done.returncode == 0, f"{' '.join(args)}: {done.stdout}{done.stderr}"
        return done.stdout

    @property
    def compose_dir(self) -> Path:
        return self.host_state_dir.parent / f"{self.host_state_dir.name}-compose"

    def container(self) -> Any:
        client = docker_client()
        try:
            found = client.containers.list(
                all=True, filters={"label": f"com.docker.compose.project={self.project}"}
            )
            assert len(found) == 1, found
            return found[0]
        finally:
            client.close()

    def logs(self) -> str:
        with contextlib.suppress(Exception):
            return self.run("logs", "--no-color", "--tail", "60")[-6000:]
        return "(no logs)"

    def wait_healthy(self, timeout: float = 60) -> None:
        """``/healthz`` answers on the published port (the engine's own healthcheck runs
        every 10 s: :func:`test_workflow_through_compose` checks its verdict later)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.base}/healthz", timeout=2).status_code == 200:
                    return
            time.sleep(0.3)
        raise AssertionError(f"the server did not answer /healthz:\n{self.logs()}")

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[Client]:
        # The transport leaves a client it was given open: closed here.
        headers = {"Authorization": f"Bearer {self.token}"}
        async with create_mcp_http_client(headers=headers) as http:
            transport = streamable_http_client(f"{self.base}/mcp", http_client=http)
            async with Client(transport) as client:
                yield client


def sandbox_containers(prefix: str) -> list[Any]:
    """The sandbox containers whose server's instance label starts with ``prefix``."""
    client = docker_client()
    try:
        found = client.containers.list(all=True, filters={"label": LABEL_INSTANCE})
        return [c for c in found if c.labels.get(LABEL_INSTANCE, "").startswith(prefix)]
    finally:
        client.close()


@pytest.fixture
def deploy(request: pytest.FixtureRequest) -> Iterator[Any]:
    """``deploy(**env)``: the compose project up (with these extra .env lines), healthy."""
    require_docker("runc")
    compose = compose_command()
    if compose is None:
        _missing("neither docker-compose nor `docker compose` is installed")
    assert compose is not None
    client = docker_client()
    try:
        client.images.get(SERVER_IMAGE)
    except Exception:
        _missing(
            f"the server image {SERVER_IMAGE} is missing (mcp-code-sandbox image build --server)"
        )
    finally:
        client.close()
    made: list[Deployment] = []

    def up(files: dict[str, bytes] | None = None, **env: str) -> Deployment:
        """``files``: written (mode 600) into the state dir before the server starts, by
        their path in it; the server sees them under /var/lib/mcp-code-sandbox."""
        host_dir = Path(tempfile.mkdtemp(prefix="mcs-deploy-", dir="/var/tmp"))
        host_dir.chmod(0o711)
        for name, data in (files or {}).items():
            (host_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (host_dir / name).write_bytes(data)
            (host_dir / name).chmod(0o600)
        deployment = Deployment(
            base="",
            token=secrets.token_urlsafe(24),
            host_state_dir=host_dir,
            project=f"mcse2e{secrets.token_hex(4)}",
            compose=compose,
        )
        made.append(deployment)
        port = free_port()
        deployment.base = f"http://127.0.0.1:{port}"
        lines = {
            "MCS_SERVER_IMAGE": SERVER_IMAGE,
            "MCS_PORT": str(port),
            "MCS_HOST_STATE_DIR": str(host_dir),
            "SANDBOX_API_TOKENS": f"ci:{deployment.token}",
            "SANDBOX_IMAGE": docker_image(),
            "SANDBOX_LOG_LEVEL": "DEBUG",
            **env,
        }
        socket_path = docker_environ().get("DOCKER_HOST", "").removeprefix("unix://")
        if socket_path.startswith("/"):
            lines["MCS_DOCKER_SOCKET"] = socket_path
        project_dir = deployment.compose_dir
        project_dir.mkdir()
        shutil.copyfile(REPO / "deploy" / "compose.yaml", project_dir / "compose.yaml")
        (project_dir / ".env").write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
        deployment.run("-f", "compose.yaml", "config", "-q")  # the file is valid
        deployment.run("-f", "compose.yaml", "up", "-d")
        deployment.wait_healthy()
        return deployment

    try:
        yield up
    finally:
        for deployment in made:
            with contextlib.suppress(Exception):
                deployment.run("-f", "compose.yaml", "down", "-t", "30", "--remove-orphans")
            shutil.rmtree(deployment.compose_dir, ignore_errors=True)
            shutil.rmtree(deployment.host_state_dir, ignore_errors=True)


async def upload_and_chart(client: Client) -> str:
    """Upload sales.csv and chart it with pandas and matplotlib; the session's id."""
    up = structured(
        await client.call_tool("upload_file", {"filename": "sales.csv", "content_text": SALES})
    )
    sid = str(up["session_id"])
    ran = structured(await client.call_tool("run_code", {"session_id": sid, "code": CHART}))
    assert ran["status"] == "ok", ran
    assert ran["result"] == str({"east": 135, "north": 270, "south": 170})
    assert [f["path"] for f in ran["files"]] == ["chart.png"]
    return sid


async def chart_workflow(deployment: Deployment) -> None:
    async with deployment.client() as client:
        sid = await upload_and_chart(client)

        # The server wrote the workspace under its /var/lib/mcp-code-sandbox; the engine
        # bound it into the sandbox by its host path, where the sandbox's chart is.
        (container,) = [c for c in sandbox_containers("") if c.labels[LABEL_SESSION] == sid]
        sources = {m["Destination"]: m["Source"] for m in container.attrs["Mounts"]}
        state = str(deployment.host_state_dir)
        assert sources["/mnt/data"].startswith(f"{state}/workspaces/"), sources
        assert sources["/run/mcs"].startswith(f"{state}/run/"), sources
        assert (Path(sources["/mnt/data"]) / "chart.png").read_bytes().startswith(b"\x89PNG")

        chart = await client.call_tool("read_file", {"session_id": sid, "path": "chart.png"})
        assert structured(chart)["encoding"] == "image"
        (image,) = [b for b in chart.content if isinstance(b, ImageContent)]
        assert base64.b64decode(image.data).startswith(b"\x89PNG")

        listing = structured(await client.call_tool("list_files", {"session_id": sid}))
        assert {e["path"] for e in listing["entries"]} == {"sales.csv", "chart.png"}

        closed = structured(await client.call_tool("close_session", {"session_id": sid}))
        assert closed == {"session_id": sid, "status": "closed"}
        assert not [c for c in sandbox_containers("") if c.labels[LABEL_SESSION] == sid]


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
async def test_workflow_through_compose(deploy: Any, runtime: str) -> None:
    require_docker(runtime)
    deployment: Deployment = deploy(SANDBOX_DOCKER_RUNTIME=runtime)
    await chart_workflow(deployment)

    server = deployment.container()
    assert server.attrs["HostConfig"]["ReadonlyRootfs"] is True
    assert server.attrs["HostConfig"]["CapDrop"] == ["ALL"]
    # The engine's healthcheck (every 10 s) has run by now, or soon does.
    deadline = time.monotonic() + 30
    while server.attrs["State"]["Health"]["Status"] != "healthy":
        assert time.monotonic() < deadline, server.attrs["State"]["Health"]
        time.sleep(1)
        server.reload()

    hostname = server.attrs["Config"]["Hostname"]
    deployment.run("-f", "compose.yaml", "down", "-t", "30")
    assert not sandbox_containers(f"{hostname}-"), "the server left sandboxes behind"
    assert not list((deployment.host_state_dir / "workspaces").iterdir())


async def test_sessions_survive_a_crash_of_the_server_container(deploy: Any) -> None:
    """The server dies (SIGKILL) and the restart policy starts its container again: the
    same host name and the same pid as before, yet the new server knows the old one is
    gone, takes its sandbox back, and the session keeps its variables."""
    deployment: Deployment = deploy()
    async with deployment.client() as client:
        first = structured(await client.call_tool("run_code", {"code": "x = 41"}))
        sid = first["session_id"]

    server = deployment.container()
    restarts = server.attrs["RestartCount"]
    server.exec_run(["sh", "-c", "kill -KILL -1"])  # every process but init: the server
    deadline = time.monotonic() + 60
    while server.attrs["RestartCount"] == restarts:
        assert time.monotonic() < deadline, "the restart policy did not start it again"
        time.sleep(0.5)
        server.reload()
    deployment.wait_healthy()

    async with deployment.client() as client:
        again = structured(await client.call_tool("run_code", {"session_id": sid, "code": "x + 1"}))
        assert again["session_created"] is False, again
        assert again["state_lost"] is False, again
        assert again["result"] == "42", again
        structured(await client.call_tool("close_session", {"session_id": sid}))
    pidfiles = list((deployment.host_state_dir / "run").glob("*.pid"))
    assert len(pidfiles) == 1, f"the dead server's pid file is still there: {pidfiles}"


#: Run in the sandbox through the MCP client: HTTP and HTTPS to the allowed upstream (by
#: a name only the proxy's SANDBOX_NETWORK_RESOLVE knows), a host address the allowlist
#: does not name, raw TCP, and the secret: sent to its host, and its placeholder to
#: another. Every process's environment goes to the workspace, compared on the host
#: (the value must never be in the code: the server records it).
NETWORK_PROBE = """
import json, os, socket, urllib.request, urllib.error
def get(url, headers=None):
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                    timeout=30) as r:
            return f"{r.status} {r.read().decode()}"
    except urllib.error.HTTPError as e:
        return f"{e.code} {e.read().decode()}"
    except Exception as e:
        return f"error {e!r}"
out = {"http": get(URL), "https": get(URL_TLS), "blocked": get(BLOCKED)}
try:
    socket.create_connection(TCP, timeout=3).close()
    out["tcp"] = "connected"
except OSError as e:
    out["tcp"] = f"error {e!r}"
placeholder = os.environ[SECRET]
auth = {"Authorization": "Bearer " + placeholder}
out.update(placeholder=placeholder, secret=get(URL_SECRET, auth), elsewhere=get(URL_TLS, auth))
scan = [json.dumps(dict(os.environ)).encode()]
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        scan.append(open(f"/proc/{pid}/environ", "rb").read())
    except OSError:
        pass
open("/mnt/data/environ.scan", "wb").write(b"\\0".join(scan))
out["scanned"] = len(scan)
print(json.dumps(out))
"""
#: Run in the sandbox (bash): pip and npm install from the test's own index, through the
#: proxy, and the packages load.
INSTALL = """
set -e
pip install -q --index-url {url}/simple/ --trusted-host {host} mcs-demo-pkg
npm install -s --registry {url}/ mcs-demo-js
python -c 'import mcs_demo_pkg; print(mcs_demo_pkg.VALUE)'
node -e "console.log(require('mcs-demo-js').value)"
"""
SECRET_NAME = "MCS_DEPLOY_API_KEY"


def _package_index(root: Path, url: str) -> dict[str, str]:
    """The test's own index (:mod:`tests.pkgindex`) in ``root``: a wheel and an npm
    package, each holding a token of its own."""
    from .. import pkgindex

    tokens = {name: f"tok-{secrets.token_hex(6)}" for name in ("py", "js")}
    init = f"VALUE = {tokens['py']!r}\n".encode()
    pkgindex.add_wheel(root, "mcs-demo-pkg", {"mcs_demo_pkg/__init__.py": init})
    code = {"index.js": f"module.exports = {{ value: {tokens['js']!r} }};\n"}
    pkgindex.add_npm_package(root, url, "mcs-demo-js", code)
    return tokens


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
async def test_network_by_policy_through_compose(
    deploy: Any, runtime: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The server in its container runs each networked sandbox's egress proxy (no host
    firewall needed): the allowed upstream answers over HTTP and HTTPS (the test's own CA,
    given to the server as SANDBOX_NETWORK_UPSTREAM_CA), another address gets the 403 and
    is listed in blocked_hosts, raw TCP has no route; a secret goes to its host only and
    is nowhere in the sandbox, the server's state dir or its logs; pip and npm install
    from the test's own index through the allowlist."""
    import json
    import sys

    from .. import labnet, netlab, pkgindex

    require_docker(runtime)
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to build the test network")
    root = tmp_path_factory.mktemp("deploy-net")
    value = f"sk-deploy-{secrets.token_hex(16)}"
    with labnet.namespace("mcs-dn") as ns:
        ca = netlab.make_ca(root, ["upstream.test", "secret.test"], [ns.ns_ip])
        tokens = {port: f"tok-{secrets.token_hex(6)}" for port in (8080, 8443)}
        for port, tls in ((8080, []), (8443, [str(ca.cert), str(ca.key)])):
            argv = [sys.executable, "-c", netlab.SERVER, ns.ns_ip, str(port), tokens[port], value]
            labnet.serve_inside(ns, [*argv, *tls], ns.ns_ip, port)
        index_url = "http://pkgs.test:8081"
        packages = _package_index(root / "index", index_url)
        argv = [sys.executable, "-c", pkgindex.SERVER, str(root / "index"), ns.ns_ip, "8081"]
        labnet.serve_inside(ns, argv, ns.ns_ip, 8081)
        names = ("upstream.test", "secret.test", "pkgs.test")
        secrets_toml = f'[secrets.{SECRET_NAME}]\nvalue = "{value}"\nhosts = ["secret.test"]\n'
        deployment: Deployment = deploy(
            files={"config/secrets.toml": secrets_toml.encode()},
            SANDBOX_DOCKER_RUNTIME=runtime,
            SANDBOX_ALLOW_NETWORK="true",
            # By name, resolved by the proxy from this list (the names are in no DNS); the
            # address entry lets them land on the upstreams' private address.
            SANDBOX_NETWORK_ALLOW=",".join([*names, f"{ns.ns_ip}/32"]),
            SANDBOX_NETWORK_RESOLVE=",".join(f"{name}={ns.ns_ip}" for name in names),
            SANDBOX_NETWORK_UPSTREAM_CA="/var/lib/mcp-code-sandbox/upstream-ca.pem",
            SANDBOX_SECRETS_FILE="/var/lib/mcp-code-sandbox/config/secrets.toml",
            SANDBOX_EXEC_TIMEOUT_S="120",
        )
        # Read when a proxy opens: the state dir is where the server's container sees it.
        shutil.copyfile(ca.ca_pem, deployment.host_state_dir / "upstream-ca.pem")
        code = (
            "URL = 'http://upstream.test:8080/'\nURL_TLS = 'https://upstream.test:8443/'\n"
            f"BLOCKED = 'http://{ns.host_ip}:8080/'\nTCP = ('{ns.ns_ip}', 8080)\n"
            f"URL_SECRET = 'https://secret.test:8443/'\nSECRET = '{SECRET_NAME}'\n"
        ) + NETWORK_PROBE
        install = INSTALL.format(url=index_url, host="pkgs.test")
        async with deployment.client() as client:
            ran = structured(await client.call_tool("run_code", {"code": code, "network": True}))
            sid = ran["session_id"]
            started = time.monotonic()
            installed = structured(
                await client.call_tool(
                    "run_code",
                    {"session_id": sid, "code": install, "language": "bash", "network": True},
                )
            )
            install_s = time.monotonic() - started
        assert ran["status"] == "ok", ran
        found = json.loads(ran["stdout"].strip().splitlines()[-1])
        assert found["http"] == f"200 {tokens[8080]} -", found
        assert found["https"] == f"200 {tokens[8443]} -", found
        assert (
            found["blocked"].startswith("403 ")
            and "blocked by sandbox network policy" in (found["blocked"])
        )
        assert found["tcp"].startswith("error"), found
        assert ran["blocked_hosts"] == [ns.host_ip], ran
        # The secret: added for its host only; the sandbox held a placeholder.
        placeholder = found["placeholder"]
        assert placeholder and value not in placeholder, found
        assert found["secret"] == "200 auth-ok", found
        assert found["elsewhere"] == f"200 {tokens[8443]} Bearer {placeholder}", found
        assert found["scanned"] >= 2, found  # os.environ and at least its own process
        assert value not in json.dumps(ran)
        # Nowhere in the state dir but its own file: workspaces (the sandbox's environ
        # scan among them), sockets, records.
        hits = subprocess.run(
            ["grep", "-rl", "--exclude-dir=config", value, str(deployment.host_state_dir)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert hits.stdout == "" and hits.returncode == 1, (hits.stdout, hits.stderr)
        scans = list((deployment.host_state_dir / "workspaces").glob("*/environ.scan"))
        assert len(scans) == 1 and placeholder.encode() in scans[0].read_bytes()
        logs = deployment.run("logs", "--no-color")
        assert value not in logs and SECRET_NAME in logs  # the audit line names it
        # Packages, through the same allowlist.
        assert installed["status"] == "ok", installed
        assert installed["stdout"].split() == [packages["py"], packages["js"]], installed
        print(f"pip and npm install through compose ({runtime}): {install_s:.1f} s")
