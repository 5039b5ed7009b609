"""Network by policy (``SANDBOX_ALLOW_NETWORK``, ``SANDBOX_NETWORK_ALLOW``, secrets, and
``run_code(network=true | [hosts])``) on every backend, against upstreams the tests build
on this machine.

A sandbox with network still has an empty network namespace: its only way out is its
egress proxy's Unix socket, bridged to ``127.0.0.1`` by the agent, with ``HTTP_PROXY`` and
friends set. The test network: a namespace ``mcs-nt-*`` joined to the host by a veth pair
(10.213.N.1 on the host, 10.213.N.2 inside), with HTTP and HTTPS servers inside on
10.213.N.2 (their certificate from a CA of the test's own, which the proxy is told to
trust: ``SANDBOX_NETWORK_UPSTREAM_CA``), one on a 169.254.x.y, a link-local address on the
namespace's loopback routed from the host through the veth, and on the host itself
servers on 127.0.0.1 and 0.0.0.0 (like the server's own ports). Names resolve through a
static table given to the proxies (``allowed.test`` and friends exist in no DNS here).
Every address a probe tries is on this machine: no test traffic leaves it.
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
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.errors import NetworkNotAllowed
from mcp_code_sandbox.run.execute import RunReport
from mcp_code_sandbox.run.request import RunRequest
from mcp_code_sandbox.service import SandboxService
from mcp_code_sandbox.settings import Settings

from .. import labnet, netlab
from ..conftest import MakeService, each_runtime, long_dir

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2 to build the test network",
)

#: A host route goes to it: random, so that test runs beside this one (another checkout's)
#: do not collide on the host's routing table.
LINK_LOCAL = f"169.254.{secrets.randbelow(100) + 100}.{secrets.randbelow(200) + 20}"
HTTP, HTTPS = 8080, 8443
SECRET_NAME = "MCS_TEST_API_KEY"
BLOCKED_MESSAGE = "blocked by sandbox network policy: {} is not in the allowlist"


@dataclass
class LabNet:
    host_ip: str
    ns_ip: str
    #: token → the address:port that serves it
    tokens: dict[str, str]
    host_ports: tuple[int, int]  # 127.0.0.1, 0.0.0.0
    ca: netlab.TestCA
    secret_value: str
    secrets_file: Path
    names: dict[str, list[str]]

    def token(self, where: str) -> str:
        return next(token for token, at in self.tokens.items() if at == where)

    def settings(self) -> dict[str, Any]:
        allow = ["allowed.test", "secret.test", "own.test", "linklocal.test", "loopback.test"]
        return {
            "allow_network": True,
            # The upstreams' address is private: an address entry lets names land on it.
            "network_allow": ",".join([*allow, f"{self.ns_ip}/32"]),
            "secrets_file": str(self.secrets_file),
            "network_upstream_ca": str(self.ca.ca_pem),
            # These names exist in no DNS here: the proxies resolve them from the list.
            "network_resolve": ",".join(f"{n}={'|'.join(a)}" for n, a in self.names.items()),
            "exec_timeout_s": 90,
        }


def _serve(
    prefix: list[str], address: str, port: int, token: str, expected: str, tls: list[str]
) -> Any:
    argv = [sys.executable, "-c", netlab.SERVER, address, str(port), token, expected, *tls]
    return labnet.serve(prefix, argv, address, port)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def testnet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabNet]:
    root = tmp_path_factory.mktemp("netlab")
    root.chmod(0o755)
    with labnet.namespace() as ns:
        procs: list[Any] = []
        route = False
        try:
            labnet.ip("-n", ns.name, "addr", "add", f"{LINK_LOCAL}/32", "dev", "lo")
            labnet.ip("route", "add", f"{LINK_LOCAL}/32", "via", ns.ns_ip)
            route = True
            ca = netlab.make_ca(root, ["allowed.test", "secret.test", "other.test"], [ns.ns_ip])
            value = f"sk-test-{secrets.token_hex(16)}"
            tls = [str(ca.cert), str(ca.key)]
            tokens: dict[str, str] = {}
            ports = (_free_port(), _free_port())
            servers = [
                (ns.inside, ns.ns_ip, HTTP, []),
                (ns.inside, ns.ns_ip, HTTPS, tls),
                (ns.inside, LINK_LOCAL, HTTP, []),
                ([], "127.0.0.1", ports[0], []),
                ([], "0.0.0.0", ports[1], []),
            ]
            for prefix, address, port, cert in servers:
                token = f"tok-{secrets.token_hex(6)}"
                procs.append(_serve(prefix, address, port, token, value, cert))
                tokens[token] = f"{address}:{port}"
            secrets_file = root / "secrets.toml"
            secrets_file.write_text(
                f'[secrets.{SECRET_NAME}]\nvalue = "{value}"\nhosts = ["secret.test"]\n'
            )
            secrets_file.chmod(0o600)
            names = {
                "allowed.test": [ns.ns_ip],
                "secret.test": [ns.ns_ip],
                "other.test": [ns.ns_ip],
                "own.test": [ns.host_ip],
                "linklocal.test": [LINK_LOCAL],
                "loopback.test": ["127.0.0.1"],
            }
            yield LabNet(ns.host_ip, ns.ns_ip, tokens, ports, ca, value, secrets_file, names)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(5)
            if route:
                subprocess.run(["ip", "route", "del", f"{LINK_LOCAL}/32"], check=False)


@pytest.fixture
async def net_service(make_service: MakeService, testnet: LabNet) -> AsyncIterator[SandboxService]:
    async with make_service(**testnet.settings()) as svc:
        yield svc


#: Run in the sandbox: helpers that never raise, each giving one line of text.
_HELPERS = textwrap.dedent(
    """
    import json, os, socket, urllib.request, urllib.error
    def get(url, headers=None):
        req = urllib.request.Request(url, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return f"{r.status} {r.read().decode()}"
        except urllib.error.HTTPError as e:
            return f"{e.code} {e.read().decode()}"
        except Exception as e:
            return f"error {e!r}"
    def tcp(host, port):
        try:
            socket.create_connection((host, port), timeout=3).close()
            return "connected"
        except OSError as e:
            return f"error {e!r}"
    def udp(host, port):
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.sendto(b"x", (host, port))
            return "sent"
        except OSError as e:
            return f"error {e!r}"
    def connected(connect_host, port):
        # A tunnel through the bridge: (socket, None), or (None, the refusal's line).
        s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
        target = f"{connect_host}:{port}"
        s.sendall(f"CONNECT {target} HTTP/1.1\\r\\nHost: {target}\\r\\n\\r\\n".encode())
        head = s.recv(4096).decode("latin-1")
        if not head.startswith("HTTP/1.1 200"):
            return None, "connect " + head.split("\\r\\n")[0]
        return s, None
    def fronted(connect_host, sni, port):
        # CONNECT to one host through the bridge, then a ClientHello naming another.
        import ssl
        try:
            s, refused = connected(connect_host, port)
            if refused:
                return refused
            tls = ssl.create_default_context().wrap_socket(s, server_hostname=sni)
            tls.sendall(f"GET / HTTP/1.0\\r\\nHost: {sni}\\r\\n\\r\\n".encode())
            return "tls " + tls.recv(4096).decode("latin-1")
        except (OSError, ssl.SSLError) as e:
            return f"error {e!r}"
    def tunnel(connect_host, host_header, port):
        # CONNECT to one host, then plain HTTP (as Node's fetch sends http:// URLs)
        # whose Host header names another.
        try:
            s, refused = connected(connect_host, port)
            if refused:
                return refused
            s.sendall(
                f"GET / HTTP/1.1\\r\\nHost: {host_header}:{port}\\r\\n"
                "Connection: close\\r\\n\\r\\n".encode()
            )
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            status = data.split(b"\\r\\n", 1)[0].decode("latin-1")
            return status + " " + data.split(b"\\r\\n\\r\\n", 1)[-1].decode("latin-1")
        except OSError as e:
            return f"error {e!r}"
    def dns(name):
        try:
            return str(socket.getaddrinfo(name, 80))
        except OSError as e:
            return f"error {e!r}"
    """
)


def _code(body: str) -> str:
    return _HELPERS + "\nout = {}\n" + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"


async def _run(
    svc: SandboxService, session: str, body: str, network: bool | list[str] = True
) -> tuple[dict[str, Any], RunReport]:
    report = await svc.run_code("local", RunRequest(_code(body), network=network), session)
    assert report.status == "ok", (report.stdout, report.stderr, report.error)
    return json.loads(report.stdout.strip().splitlines()[-1]), report


def _leaked(found: dict[str, Any], net: LabNet, allowed: set[str]) -> dict[str, str]:
    """Answers that carry a token the sandbox must not have got."""
    return {
        where: body
        for where, body in found.items()
        if any(token in body for token in net.tokens if token not in allowed)
    }


@each_runtime
async def test_allowed_hosts_over_http_and_https_and_nothing_else(
    net_service: SandboxService, testnet: LabNet
) -> None:
    p_lo, p_any = testnet.host_ports
    found, report = await _run(
        net_service,
        "net-policy",
        f"""
        out["http"] = get("http://allowed.test:{HTTP}/")
        out["https"] = get("https://allowed.test:{HTTPS}/")
        out["blocked_http"] = get("http://other.test:{HTTP}/")
        out["blocked_https"] = get("https://other.test:{HTTPS}/")
        out["ip_literal"] = get("http://{testnet.ns_ip}:{HTTP}/")
        out["ip_link_local"] = get("http://{LINK_LOCAL}:{HTTP}/")
        out["ip_host"] = get("http://{testnet.host_ip}:{p_any}/")
        out["own"] = get("http://own.test:{p_any}/")
        out["link_local"] = get("http://linklocal.test:{HTTP}/")
        out["loopback"] = get("http://loopback.test:{p_lo}/")
        out["tcp"] = tcp("{testnet.ns_ip}", {HTTP})
        out["tcp_host"] = tcp("{testnet.host_ip}", {p_any})
        out["udp"] = udp("{testnet.ns_ip}", 53)
        out["dns"] = dns("allowed.test")
        out["sni_same"] = fronted("allowed.test", "allowed.test", {HTTPS})
        out["sni_fronted"] = fronted("allowed.test", "other.test", {HTTPS})
        out["tunnel_same"] = tunnel("allowed.test", "allowed.test", {HTTP})
        out["tunnel_other"] = tunnel("allowed.test", "other.test", {HTTP})
        """,
    )
    assert found["http"] == f"200 {testnet.token(f'{testnet.ns_ip}:{HTTP}')} -"
    assert found["https"] == f"200 {testnet.token(f'{testnet.ns_ip}:{HTTPS}')} -"
    assert found["blocked_http"].startswith("403 "), found
    assert BLOCKED_MESSAGE.format("other.test") in found["blocked_http"]
    assert found["blocked_https"].startswith("error") and "403" in found["blocked_https"]
    # An address entry of the allowlist allows its literal too; every other literal, and
    # names that resolve to the host, link-local or loopback, are refused.
    assert found["ip_literal"].startswith("200 tok-")
    for key in ("ip_link_local", "ip_host", "own", "link_local", "loopback"):
        assert not found[key].startswith("200"), (key, found[key])
    # Domain fronting: the ClientHello must name the CONNECT host (the upstream's
    # certificate is valid for both names, so only the proxy can stop it).
    assert found["sni_same"].startswith("tls HTTP/1.0 200"), found["sni_same"]
    assert found["sni_fronted"].startswith("error"), found["sni_fronted"]
    for key in ("tcp", "tcp_host", "udp", "dns"):
        assert found[key].startswith("error"), (key, found[key])
    # Plain HTTP in a CONNECT tunnel: served for the CONNECT host only.
    http_token = testnet.token(f"{testnet.ns_ip}:{HTTP}")
    assert found["tunnel_same"] == f"HTTP/1.1 200 OK {http_token} -", found["tunnel_same"]
    assert found["tunnel_other"].startswith("HTTP/1.1 403 "), found["tunnel_other"]
    assert BLOCKED_MESSAGE.format("other.test") in found["tunnel_other"]
    allowed = {testnet.token(f"{testnet.ns_ip}:{HTTP}"), testnet.token(f"{testnet.ns_ip}:{HTTPS}")}
    assert _leaked(found, testnet, allowed) == {}
    assert "other.test" in report.blocked_hosts
    assert LINK_LOCAL in report.blocked_hosts and testnet.host_ip in report.blocked_hosts
    assert "allowed.test" not in report.blocked_hosts
    # Drained with each run: the next one lists only its own.
    _, again = await _run(net_service, "net-policy", 'out["x"] = 1')
    assert again.blocked_hosts == []


@each_runtime
async def test_a_secret_goes_to_its_host_only_and_never_into_the_sandbox(
    net_service: SandboxService, testnet: LabNet
) -> None:
    found, report = await _run(
        net_service,
        "net-secret",
        f"""
        import subprocess
        placeholder = os.environ["{SECRET_NAME}"]
        out["placeholder"] = placeholder
        auth = {{"Authorization": "Bearer " + placeholder}}
        out["to_its_host"] = get("https://secret.test:{HTTPS}/", auth)
        out["default_header"] = get("https://secret.test:{HTTPS}/")
        out["to_another_host"] = get("https://allowed.test:{HTTPS}/", auth)
        # Everywhere the sandbox can look: every process's environment and command line,
        # the files it can read outside the system dirs, a child's environment.
        value_seen = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                for what in ("environ", "cmdline"):
                    try:
                        data = open(f"/proc/{{pid}}/{{what}}", "rb").read()
                    except OSError:
                        continue
                    out.setdefault("scanned", 0)
                    out["scanned"] += 1
                    value_seen.append(data)
        for top in ("/tmp", "/mnt/data", "/run", "/etc", "/opt/sandbox/lib"):
            for base, dirs, files in os.walk(top):
                for name in files:
                    try:
                        value_seen.append(open(os.path.join(base, name), "rb").read(1 << 20))
                    except OSError:
                        pass
        value_seen.append(subprocess.run(["env"], capture_output=True).stdout)
        open("/mnt/data/scan.bin", "wb").write(b"\\0".join(value_seen))
        out["child_env_has_placeholder"] = placeholder.encode() in value_seen[-1]
        """,
    )
    value = testnet.secret_value
    placeholder = found["placeholder"]
    assert placeholder and value not in placeholder
    assert found["to_its_host"] == "200 auth-ok"
    assert found["default_header"] == "200 auth-ok"  # the template's header, added
    https_token = testnet.token(f"{testnet.ns_ip}:{HTTPS}")
    assert found["to_another_host"] == f"200 {https_token} Bearer {placeholder}"
    assert found["child_env_has_placeholder"] is True
    assert int(found["scanned"]) > 2
    # The scan is compared on the host, so the value never goes into the sandbox (nor into
    # a run's code, which the server records for export_notebook).
    [session] = net_service.sessions.with_id("net-secret")
    scanned = session.workspace.root / "scan.bin"
    assert value.encode() not in scanned.read_bytes()
    scanned.unlink()
    for text in (report.stdout, report.stderr, json.dumps(report.result)):
        assert value not in text
    state = net_service.settings.state_dir
    hits = subprocess.run(["grep", "-rl", value, str(state)], capture_output=True, text=True)
    assert hits.stdout == "", hits.stdout  # nothing of the server's on disk has it either


@each_runtime
async def test_a_call_narrows_the_policy_to_its_hosts(
    net_service: SandboxService, testnet: LabNet
) -> None:
    with pytest.raises(NetworkNotAllowed, match=r"evil\.test"):
        await _run(net_service, "net-narrow", 'out["x"] = 1', network=["allowed.test", "evil.test"])
    assert net_service.sessions.count() == 0  # refused before any sandbox
    found, report = await _run(
        net_service,
        "net-narrow",
        f"""
        out["asked"] = get("http://allowed.test:{HTTP}/")
        out["not_asked"] = get("http://secret.test:{HTTP}/")
        """,
        network=["allowed.test"],
    )
    assert found["asked"].startswith("200 tok-")
    assert found["not_asked"].startswith("403 ") and "secret.test" in found["not_asked"]
    assert report.blocked_hosts == ["secret.test"]
    # The next call's hosts replace them on the running sandbox: variables are kept.
    found, report = await _run(
        net_service,
        "net-narrow",
        f"""
        out["kept"] = "get" in globals()
        out["now_asked"] = get("http://secret.test:{HTTP}/")
        out["no_longer"] = get("http://allowed.test:{HTTP}/")
        """,
        network=["secret.test"],
    )
    assert not report.state_lost and found["kept"] is True
    assert found["now_asked"].startswith("200 tok-")
    assert found["no_longer"].startswith("403 ")
    assert report.blocked_hosts == ["allowed.test"]


@each_runtime
async def test_no_network_has_no_way_out(net_service: SandboxService, testnet: LabNet) -> None:
    found, _ = await _run(
        net_service,
        "net-off",
        f"""
        out["proxy_env"] = os.environ.get("HTTP_PROXY")
        out["egress_dir"] = os.path.exists("/run/mcs-egress")
        out["secret_env"] = os.environ.get("{SECRET_NAME}")
        out["http"] = get("http://allowed.test:{HTTP}/")
        out["tcp"] = tcp("{testnet.ns_ip}", {HTTP})
        out["bridge"] = tcp("127.0.0.1", 3128)
        """,
        network=False,
    )
    assert found["proxy_env"] is None and found["secret_env"] is None
    assert found["egress_dir"] is False
    for key in ("http", "tcp", "bridge"):
        assert found[key].startswith("error"), (key, found[key])


@each_runtime
async def test_switching_network_restarts_the_sandbox_and_says_so(
    net_service: SandboxService, testnet: LabNet
) -> None:
    run = net_service.run_code
    url = f"http://allowed.test:{HTTP}/"
    first = await run("local", RunRequest("x = 1\nprint('set')"), "net-switch")
    assert first.status == "ok"
    found, report = await _run(net_service, "net-switch", f'out["r"] = get("{url}")')
    assert found["r"].startswith("200 tok-")
    assert report.state_lost and report.notice and "with network" in report.notice
    kept = await run("local", RunRequest("print(x)", network=True), "net-switch")
    assert kept.status == "error" and kept.error and kept.error["name"] == "NameError"
    _, narrowed = await _run(net_service, "net-switch", "x = 2", network=["allowed.test"])
    assert not narrowed.state_lost and narrowed.notice is None  # other hosts: same sandbox
    found, report = await _run(net_service, "net-switch", f'out["r"] = get("{url}")', False)
    assert found["r"].startswith("error")
    assert report.state_lost and report.notice and "without network" in report.notice


@each_runtime
async def test_each_proxy_goes_with_its_sandbox(make_service: MakeService, testnet: LabNet) -> None:
    async with make_service(**testnet.settings()) as svc:
        egress = svc.sessions.sandboxes.egress
        await _run(svc, "net-life-a", 'out["x"] = 1')
        await _run(svc, "net-life-b", 'out["x"] = 1')
        assert egress.open_count == 2 and len(list(egress.root.iterdir())) == 2
        await svc.close_session("local", "net-life-a")
        assert egress.open_count == 1 and len(list(egress.root.iterdir())) == 1
        await _run(svc, "net-life-b", 'out["x"] = 1', network=False)  # replaced: no network
        assert egress.open_count == 0 and list(egress.root.iterdir()) == []
        await _run(svc, "net-life-b", 'out["x"] = 1')
        assert egress.open_count == 1
    assert egress.open_count == 0 and list(egress.root.iterdir()) == []


@each_runtime
async def test_network_not_allowed_unless_the_server_allows_it(
    make_settings: Callable[..., Settings],
) -> None:
    from mcp_code_sandbox.backends import create_backend

    settings = make_settings()
    svc = SandboxService(settings, create_backend(settings))
    await svc.start()
    try:
        for network in (True, ["allowed.test"]):
            with pytest.raises(NetworkNotAllowed, match="SANDBOX_ALLOW_NETWORK"):
                await svc.run_code("local", RunRequest("print(1)", network=network), "net-no")
    finally:
        await svc.aclose()


@each_runtime
async def test_every_language_finds_the_proxy(net_service: SandboxService, testnet: LabNet) -> None:
    """Node's fetch (NODE_USE_ENV_PROXY), bun's fetch and a shell's curl (where the
    sandbox has one) read the same variables: each reaches the allowed host and gets the
    policy's 403 for another, over HTTPS and plain HTTP (which Node's fetch tunnels
    through CONNECT as well)."""
    token = testnet.token(f"{testnet.ns_ip}:{HTTP}")
    tls_token = testnet.token(f"{testnet.ns_ip}:{HTTPS}")
    fetch = (
        "for (const url of URLS) {\n"
        "  try {\n"
        "    const r = await fetch(url);\n"
        "    console.log(r.status, await r.text());\n"
        "  } catch (e) { console.log('error', e.message, e.cause && e.cause.code); }\n}\n"
    )
    urls = [
        f"https://allowed.test:{HTTPS}/",
        f"https://other.test:{HTTPS}/",
        f"http://allowed.test:{HTTP}/",
        f"http://other.test:{HTTP}/",
    ]
    for language in ("javascript", "typescript"):
        body = f"const URLS = {json.dumps(urls)};\n{fetch}"
        code = body if language == "typescript" else f"(async () => {{\n{body}}})();"
        report = await net_service.run_code(
            "local", RunRequest(code, language, network=True), "net-langs"
        )
        assert report.status == "ok", (language, report.stdout, report.stderr)
        lines = report.stdout.strip().splitlines()
        assert lines[0] == f"200 {tls_token} -", (language, lines)
        assert lines[1].startswith("error"), (language, lines)  # the CONNECT got a 403
        assert lines[2] == f"200 {token} -", (language, lines)
        # Tunnelled (node): the CONNECT's 403 is an error; as a proxy request (bun): a 403.
        blocked = lines[3].startswith("error") or lines[3] == "403 " + BLOCKED_MESSAGE.format(
            "other.test"
        )
        assert blocked, (language, lines)
    shell = (
        "if command -v curl >/dev/null; then "
        f"curl -sS http://allowed.test:{HTTP}/; echo; "
        f"curl -sS -o /dev/null -w '%{{http_code}}' http://other.test:{HTTP}/; "
        "else echo no-curl; fi"
    )
    report = await net_service.run_code(
        "local", RunRequest(shell, "bash", network=True), "net-langs"
    )
    assert report.status == "ok", (report.stdout, report.stderr)
    if report.stdout.strip() != "no-curl":
        assert report.stdout.strip().splitlines() == [f"{token} -", "403"], report.stdout


@each_runtime
async def test_network_works_whatever_the_state_dirs_length(
    make_service: MakeService, testnet: LabNet, state_dir: Path
) -> None:
    # Longer than a socket's address (107 bytes) leaves room for with the proxy's socket
    # below it, as a real user's ~/.local/state/mcp-code-sandbox often is (issue 30).
    deep = long_dir(state_dir, 150)
    async with make_service(**testnet.settings(), state_dir=str(deep)) as svc:
        found, report = await _run(
            svc,
            "net-deep",
            f"""
            out["allowed"] = get("http://allowed.test:{HTTP}/")
            out["allowed_tls"] = get("https://allowed.test:{HTTPS}/")
            out["refused"] = get("http://other.test:{HTTP}/")
            """,
        )
    assert found["allowed"] == f"200 {testnet.token(f'{testnet.ns_ip}:{HTTP}')} -"
    assert found["allowed_tls"] == f"200 {testnet.token(f'{testnet.ns_ip}:{HTTPS}')} -"
    assert found["refused"].startswith("403 "), found
    assert BLOCKED_MESSAGE.format("other.test") in found["refused"]
    assert report.blocked_hosts == ["other.test"]
