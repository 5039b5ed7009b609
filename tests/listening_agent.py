"""The real agent listening on TCP (``--listen``), and blocking "servers" that dial it.

For the tests of the agent's listener and of the server's channel: certificates from
``backends.kubernetes.certs`` (the right CA, another CA, expired, another name), the
agent as a subprocess on 127.0.0.1 and a free port, and :class:`Host`, a server end
that speaks TLS as the TLS server over a connection it opened.
"""

from __future__ import annotations

import datetime
import json
import os
import select
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization

from mcp_code_sandbox.agent.protocol import HEADER, decode_body, encode_frame
from mcp_code_sandbox.backends.kubernetes.certs import Authority, issue_server_cert, make_ca

SRC = Path(__file__).resolve().parents[1] / "src"
CONFIG = {"kill_strays": False, "pids": None, "file_bytes": None, "memory_bytes": None}
#: Bounds every wait, so that a broken agent fails a test instead of hanging it.
WAIT_S = 30.0


@dataclass(frozen=True)
class Certs:
    ca_file: Path
    good: ssl.SSLContext
    other_ca: ssl.SSLContext
    expired: ssl.SSLContext
    wrong_name: ssl.SSLContext


def make_certs(directory: Path) -> Certs:
    ca = make_ca()
    ca_file = directory / "ca.crt"
    ca_file.write_bytes(ca.cert.public_bytes(serialization.Encoding.PEM))
    long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=30)
    return Certs(
        ca_file=ca_file,
        good=_context(directory, "good", ca),
        other_ca=_context(directory, "other", make_ca()),
        expired=_context(directory, "expired", ca, now=long_ago),
        wrong_name=_context(directory, "name", ca, name="someone-else"),
    )


def _context(directory: Path, label: str, ca: Authority, **how: Any) -> ssl.SSLContext:
    if "now" in how:
        how["lifetime"] = datetime.timedelta(days=1)
    cert, key = issue_server_cert(ca, **how)
    cert_file, key_file = directory / f"{label}.crt", directory / f"{label}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    return context


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def spawn_agent(workdir: Path, ca_file: Path, port: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "mcp_code_sandbox.agent", "--listen", f"127.0.0.1:{port}",
            "--ca", str(ca_file), "--plain", "--workdir", str(workdir),
            "--config", json.dumps(CONFIG)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


def dial(port: int) -> socket.socket:
    """A TCP connection to the agent, retried while it is not listening yet."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Host:
    """A server's end: dials, then is the TLS server (raises ``ssl.SSLError`` or
    ``OSError`` where the agent refuses it during the handshake)."""

    def __init__(self, port: int, context: ssl.SSLContext) -> None:
        raw = dial(port)
        try:
            self.sock = context.wrap_socket(raw, server_side=True)
        except BaseException:
            raw.close()
            raise
        self._buf = b""

    def receive(self, wait_s: float = WAIT_S) -> dict[str, Any] | None:
        """The next frame; ``None`` at EOF (or a connection the agent broke off)."""
        while True:
            if len(self._buf) >= HEADER.size:
                (length,) = HEADER.unpack_from(self._buf)
                if len(self._buf) >= HEADER.size + length:
                    body = self._buf[HEADER.size : HEADER.size + length]
                    self._buf = self._buf[HEADER.size + length :]
                    return decode_body(body)
            if not self.sock.pending():
                readable, _, _ = select.select([self.sock], [], [], wait_s)
                assert readable, f"nothing from the agent for {wait_s:g} s"
            try:
                data = self.sock.recv(1 << 16)
            except (ssl.SSLError, OSError):
                data = b""
            if not data:
                return None
            self._buf += data

    def quiet(self, wait_s: float) -> bool:
        """Nothing arrives for ``wait_s``."""
        readable, _, _ = select.select([self.sock], [], [], wait_s)
        return not readable and not self.sock.pending()

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(encode_frame(message))

    def until(self, run_id: int, *, stream: str | None = None) -> dict[str, Any]:
        """Read up to run ``run_id``'s ``done`` (or a ``stream`` chunk holding ``stream``)."""
        while True:
            message = self.receive()
            assert message is not None, "the agent closed the channel"
            if message.get("id") != run_id:
                continue
            if message.get("ev") == "done":
                return message
            if stream is not None and stream in str(message.get("text")):
                return message

    def run(self, run_id: int, code: str) -> tuple[str, dict[str, Any]]:
        """Run ``code``: its stdout, and its ``done``."""
        self.send({"op": "exec", "id": run_id, "code": code, "timeout_s": WAIT_S})
        out = []
        while True:
            message = self.receive()
            assert message is not None, "the agent closed the channel"
            if message.get("id") == run_id and message.get("ev") == "stream":
                out.append(str(message.get("text")))
            if message.get("id") == run_id and message.get("ev") == "done":
                return "".join(out), message

    def close(self) -> None:
        self.sock.close()


def read_to_eof(sock: socket.socket) -> bytes:
    """All that comes on ``sock`` until the agent closes it."""
    data = b""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        readable, _, _ = select.select([sock], [], [], WAIT_S)
        assert readable, "the agent kept the connection open"
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
    raise AssertionError("the agent kept the connection open")
