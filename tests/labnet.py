"""A test host on this machine: a network namespace joined to the host by a veth pair
(10.213.N.1 on the host, 10.213.N.2 inside), with no default route inside, so nothing it
sends leaves the machine. Networked sandboxes of both backends reach it through the host;
servers run inside with :func:`serve_inside`."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class Namespace:
    name: str
    host_ip: str
    ns_ip: str
    veth_host: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def inside(self) -> list[str]:
        """The argv prefix that runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.name]


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextlib.contextmanager
def namespace(prefix: str = "mcs-nt") -> Iterator[Namespace]:
    """A fresh namespace; it, its veth and every server started in it are removed after."""
    tag = secrets.token_hex(3)
    octet = int(tag[:2], 16)
    ns = Namespace(f"{prefix}-{tag}", f"10.213.{octet}.1", f"10.213.{octet}.2", f"ntvh{tag}")
    veth_ns = f"ntvn{tag}"
    try:
        ip("netns", "add", ns.name)
        ip("link", "add", ns.veth_host, "type", "veth", "peer", "name", veth_ns)
        ip("link", "set", veth_ns, "netns", ns.name)
        ip("addr", "add", f"{ns.host_ip}/30", "dev", ns.veth_host)
        ip("link", "set", ns.veth_host, "up")
        ip("-n", ns.name, "addr", "add", f"{ns.ns_ip}/30", "dev", veth_ns)
        ip("-n", ns.name, "link", "set", veth_ns, "up")
        ip("-n", ns.name, "link", "set", "lo", "up")
        yield ns
    finally:
        for proc in ns.procs:
            proc.kill()
            proc.wait(5)
        subprocess.run(["ip", "link", "del", ns.veth_host], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", ns.name], capture_output=True, check=False)


def serve(prefix: list[str], argv: list[str], address: str, port: int) -> subprocess.Popen[bytes]:
    """Start ``argv`` (a server) under ``prefix`` and wait until ``address:port`` accepts."""
    proc = subprocess.Popen([*prefix, *argv])
    deadline = time.monotonic() + 10
    connect = f"import socket; socket.create_connection(('{address}', {port}), 1).close()"
    probe = [*prefix, sys.executable, "-c", connect]
    while (tried := subprocess.run(probe, capture_output=True, timeout=10, check=False)).returncode:
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            proc.wait(5)
            raise RuntimeError(f"test server on {address}:{port} did not start: {tried.stderr!r}")
        time.sleep(0.1)
    return proc


def serve_inside(ns: Namespace, argv: list[str], address: str, port: int) -> None:
    ns.procs.append(serve(ns.inside, argv, address, port))
