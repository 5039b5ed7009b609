"""Network by permission (``SANDBOX_ALLOW_NETWORK`` + ``run_code(network=true)``), on each
backend, against a small network the tests build on this machine.

The test network: a namespace ``mcs-nt-*`` joined to the host by a veth pair
(10.213.N.1 on the host, 10.213.N.2 inside), with an HTTP server inside on 10.213.N.2 (what
a networked sandbox must reach) and one on 169.254.213.7, a link-local address on the
namespace's loopback, routed from the host through the veth (what it must not reach,
though the host can). On the host itself: HTTP servers on 127.0.0.1 and on 0.0.0.0 (like the
server's own ports), which no sandbox may reach at any host address. Every address a
probe tries is on this machine: no test traffic leaves it. Everything is removed even
when a test fails (namespace, veth, route, processes; the backend's iptables rules and
Docker network by the service's close, which the last test checks).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from mcp_code_sandbox.backends.netfilter import COMMENT
from mcp_code_sandbox.errors import NetworkNotAllowed
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.settings import Settings

from .. import labnet
from ..conftest import MakeService, each_backend

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2 to build the test network",
)

LINK_LOCAL = "169.254.213.7"
PORT = 8080
#: Answers every request with its token; argv: address port token. Not http.server:
#: its bind looks the address up in DNS, which here would leave the machine.
_SERVER = textwrap.dedent(
    """
    import socketserver, sys
    class H(socketserver.StreamRequestHandler):
        def handle(self):
            self.rfile.readline()
            self.wfile.write(b"HTTP/1.0 200 OK\\r\\n\\r\\n" + sys.argv[3].encode())
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    socketserver.ThreadingTCPServer((sys.argv[1], int(sys.argv[2])), H).serve_forever()
    """
)
#: Run in the sandbox: GET each address in TARGETS, print {address: body or error}.
_PROBE = textwrap.dedent(
    """
    import json, socket, struct
    def gateway():
        for line in open("/proc/net/route").read().splitlines()[1:]:
            f = line.split()
            if f[1] == "00000000":
                return socket.inet_ntoa(struct.pack("<L", int(f[2], 16)))
        return None
    found = {}
    gw = gateway()
    targets = TARGETS + ([[gw, p] for p in PORTS] if gw else [])
    for host, port in targets:
        try:
            with socket.create_connection((host, port), timeout=TIMEOUT) as s:
                s.settimeout(TIMEOUT)
                s.sendall(b"GET / HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n")
                data = b""
                while chunk := s.recv(4096):
                    data += chunk
                found[f"{host}:{port}"] = data.split(b"\\r\\n\\r\\n", 1)[-1].decode()
        except OSError as exc:
            found[f"{host}:{port}"] = f"error: {exc}"
    print(json.dumps(found))
    """
)


@dataclass
class LabNet:
    ns: str
    host_ip: str
    ns_ip: str
    #: token → the address:port that serves it
    tokens: dict[str, str]
    host_ports: tuple[int, int]  # 127.0.0.1, 0.0.0.0
    host_addresses: list[str]


def _serve(prefix: list[str], address: str, port: int, token: str) -> subprocess.Popen[bytes]:
    return labnet.serve(
        prefix, [sys.executable, "-c", _SERVER, address, str(port), token], address, port
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


def _host_addresses() -> list[str]:
    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], check=True, capture_output=True, text=True
    ).stdout
    return sorted({line.split()[3].split("/")[0] for line in out.splitlines()})


@pytest.fixture(scope="module")
def testnet() -> Iterator[LabNet]:
    with labnet.namespace() as ns:
        procs: list[subprocess.Popen[bytes]] = []
        route = False
        try:
            # On the namespace's loopback: this kernel has no dummy interfaces.
            labnet.ip("-n", ns.name, "addr", "add", f"{LINK_LOCAL}/32", "dev", "lo")
            # No default route inside: the namespace answers the host's veth address only
            # (both backends' traffic arrives from it), so nothing it sends leaves the machine.
            labnet.ip("route", "add", f"{LINK_LOCAL}/32", "via", ns.ns_ip)
            route = True
            tokens = {}
            for address in (ns.ns_ip, LINK_LOCAL):
                token = f"tok-{secrets.token_hex(6)}"
                procs.append(_serve(ns.inside, address, PORT, token))
                tokens[token] = f"{address}:{PORT}"
            ports = (_free_port(), _free_port())
            for address, port in zip(("127.0.0.1", "0.0.0.0"), ports, strict=True):
                token = f"tok-{secrets.token_hex(6)}"
                procs.append(_serve([], address, port, token))
                tokens[token] = f"{address}:{port}"
            yield LabNet(ns.name, ns.host_ip, ns.ns_ip, tokens, ports, _host_addresses())
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(5)
            if route:
                subprocess.run(["ip", "route", "del", f"{LINK_LOCAL}/32"], check=False)


@pytest.fixture
async def net_service(make_service: MakeService) -> AsyncIterator[SandboxService]:
    async with make_service(exec_timeout_s=60, allow_network=True) as svc:
        yield svc


def probe_code(targets: list[tuple[str, int]], ports: tuple[int, ...], timeout: float = 3) -> str:
    return (
        f"TARGETS = {json.dumps([list(t) for t in targets])}\n"
        f"PORTS = {list(ports)}\nTIMEOUT = {timeout}\n" + _PROBE
    )


async def probe(
    svc: SandboxService, session: str, code: str, *, network: bool
) -> tuple[dict[str, str], Any]:
    report = await svc.run_code("local", RunRequest(code, network=network), session)
    assert report.status == "ok", (report.stdout, report.stderr, report.error)
    return json.loads(report.stdout.strip().splitlines()[-1]), report


def host_targets(net: LabNet) -> list[tuple[str, int]]:
    return [(address, port) for address in net.host_addresses for port in net.host_ports]


def leaked(found: dict[str, str], net: LabNet, allowed: set[str]) -> dict[str, str]:
    """Answers that carry a token the sandbox must not have got."""
    return {
        where: body
        for where, body in found.items()
        if any(token in body for token in net.tokens if token not in allowed)
    }


def _token_of(net: LabNet, address: str) -> str:
    return next(token for token, where in net.tokens.items() if where.startswith(address + ":"))


@each_backend
async def test_network_reaches_outside_but_not_the_host(
    net_service: SandboxService, testnet: LabNet
) -> None:
    outside = _token_of(testnet, testnet.ns_ip)
    targets = [(testnet.ns_ip, PORT), (LINK_LOCAL, PORT), *host_targets(testnet)]
    found, report = await probe(
        net_service, "net-a", probe_code(targets, testnet.host_ports), network=True
    )
    assert found[f"{testnet.ns_ip}:{PORT}"] == outside
    assert found[f"{LINK_LOCAL}:{PORT}"].startswith("error"), found
    assert leaked(found, testnet, {outside}) == {}
    assert report.notice is None and not report.state_lost


@each_backend
async def test_no_network_reaches_nothing(net_service: SandboxService, testnet: LabNet) -> None:
    targets = [(testnet.ns_ip, PORT), (LINK_LOCAL, PORT), *host_targets(testnet)]
    found, _ = await probe(
        net_service, "net-off", probe_code(targets, testnet.host_ports, 1), network=False
    )
    assert all(body.startswith("error") for body in found.values()), found


@each_backend
async def test_switching_network_restarts_the_sandbox_and_says_so(
    net_service: SandboxService, testnet: LabNet
) -> None:
    outside = _token_of(testnet, testnet.ns_ip)
    code = probe_code([(testnet.ns_ip, PORT)], (), 2)
    run = net_service.run_code
    first = await run("local", RunRequest("x = 1\nprint('set')"), "net-switch")
    assert first.status == "ok"
    found, report = await probe(net_service, "net-switch", code, network=True)
    assert found[f"{testnet.ns_ip}:{PORT}"] == outside
    assert report.state_lost and report.notice and "with network" in report.notice
    kept = await run("local", RunRequest("print(x)", network=True), "net-switch")
    assert kept.status == "error" and kept.error and kept.error["name"] == "NameError"
    found, report = await probe(net_service, "net-switch", code, network=False)
    assert found[f"{testnet.ns_ip}:{PORT}"].startswith("error")
    assert report.state_lost and report.notice and "without network" in report.notice


@each_backend
async def test_two_networked_sessions_cannot_reach_each_other(
    net_service: SandboxService, testnet: LabNet
) -> None:
    listen = textwrap.dedent(
        f"""
        import socket, threading
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("0.0.0.0", 9000))
        srv.listen()
        def serve():
            while True:
                conn, _ = srv.accept()
                conn.recv(1024)
                conn.sendall(b"HTTP/1.0 200 OK\\r\\n\\r\\nfrom-a")
                conn.close()
        threading.Thread(target=serve, daemon=True).start()
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        probe.connect(("{testnet.ns_ip}", {PORT}))
        print(probe.getsockname()[0])
        """
    )
    a = await net_service.run_code("local", RunRequest(listen, network=True), "net-peer-a")
    assert a.status == "ok", (a.stdout, a.stderr, a.error)
    a_ip = a.stdout.strip().splitlines()[-1]
    itself = await net_service.run_code(
        "local", RunRequest(probe_code([("127.0.0.1", 9000)], ()), network=True), "net-peer-a"
    )
    assert "from-a" in itself.stdout  # A's server runs: what B can't reach is there
    found, _ = await probe(
        net_service, "net-peer-b", probe_code([(a_ip, 9000)], (), 3), network=True
    )
    assert "from-a" not in json.dumps(found), found


@each_backend
async def test_network_not_allowed_unless_the_server_allows_it(
    make_settings: Callable[..., Settings],
) -> None:
    from mcp_code_sandbox.backends import create_backend

    settings = make_settings()
    svc = SandboxService(settings, create_backend(settings))
    await svc.start()
    try:
        with pytest.raises(NetworkNotAllowed, match="SANDBOX_ALLOW_NETWORK"):
            await svc.run_code("local", RunRequest("print(1)", network=True), "net-refused")
    finally:
        await svc.aclose()


@pytest.mark.parametrize(
    "backend", [pytest.param("runsc", marks=pytest.mark.docker)], indirect=True
)
async def test_runsc_refuses_network_clearly(net_service: SandboxService) -> None:
    with pytest.raises(NetworkNotAllowed, match="gVisor"):
        await net_service.run_code("local", RunRequest("print(1)", network=True), "net-runsc")


@each_backend
async def test_fence_is_removed_with_the_server(
    make_settings: Callable[..., Settings], testnet: LabNet, backend: str
) -> None:
    from mcp_code_sandbox.backends import create_backend

    settings = make_settings(allow_network=True)
    svc = SandboxService(settings, create_backend(settings))
    await svc.start()
    try:
        found, _ = await probe(
            svc, "net-fence", probe_code([(testnet.ns_ip, PORT)], (), 2), network=True
        )
        assert "tok-" in found[f"{testnet.ns_ip}:{PORT}"]
        assert COMMENT in _rules()
    finally:
        await svc.aclose()
    assert COMMENT not in _rules()
    if backend != "bwrap":
        out = subprocess.run(
            ["docker", "network", "ls", "-q", "--filter", "label=mcp-code-sandbox.network"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        assert out.strip() == ""


def _rules() -> str:
    return "".join(
        subprocess.run([tool, "-S"], capture_output=True, text=True, check=False).stdout
        for tool in ("iptables", "ip6tables")
        if shutil.which(tool)
    )


@pytest.mark.parametrize(
    "backend", [pytest.param("docker", marks=pytest.mark.docker)], indirect=True
)
async def test_a_network_removed_behind_the_servers_back_is_made_again(
    net_service: SandboxService, testnet: LabNet
) -> None:
    """Another server that took this one for dead, or an operator, removed its (empty)
    network: the next networked session gets a new one instead of failing."""
    code = probe_code([(testnet.ns_ip, PORT)], (), 2)
    found, _ = await probe(net_service, "net-gone-1", code, network=True)
    assert "tok-" in found[f"{testnet.ns_ip}:{PORT}"]
    await net_service.close_session("local", "net-gone-1")
    networks = net_service.backend._networks  # type: ignore[attr-defined]
    old = networks.name
    subprocess.run(["docker", "network", "rm", old], check=True, capture_output=True)
    found, _ = await probe(net_service, "net-gone-2", code, network=True)
    assert "tok-" in found[f"{testnet.ns_ip}:{PORT}"]
    assert networks.name != old


@pytest.mark.parametrize(
    "backend", [pytest.param("docker", marks=pytest.mark.docker)], indirect=True
)
async def test_rules_of_a_vanished_bridge_are_removed_at_start(
    make_settings: Callable[..., Settings],
) -> None:
    """Rules whose bridge is gone (its network removed by something that could not reach
    this host's firewall) are cleaned up by the next server's start."""
    from mcp_code_sandbox.backends import create_backend
    from mcp_code_sandbox.backends.netfilter import Iptables, bridge_rules

    stale = "mcs0badc0de"
    iptables = Iptables()
    iptables.ensure(bridge_rules(stale))
    assert stale in iptables.tagged_interfaces()
    settings = make_settings(allow_network=True)
    svc = SandboxService(settings, create_backend(settings))
    await svc.start()
    try:
        assert stale not in iptables.tagged_interfaces()
    finally:
        await svc.aclose()
        iptables.remove(bridge_rules(stale))
