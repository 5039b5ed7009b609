"""``--listen``: the agent serves only servers that prove themselves with the shared CA's
certificate; anything else is closed before a frame is read or sent, and cannot keep a
server out. The newest server wins, but a run in flight ends on its own connection."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mcp_code_sandbox.agent.listener import MAX_PENDING, listen_address, parse_address
from mcp_code_sandbox.agent.protocol import encode_frame
from tests.listening_agent import (
    CONFIG,
    SRC,
    WAIT_S,
    Certs,
    Host,
    dial,
    free_port,
    make_certs,
    read_to_eof,
    spawn_agent,
)


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    return make_certs(tmp_path)


@pytest.fixture
def agent(tmp_path: Path, certs: Certs) -> Iterator[int]:
    """The agent's port."""
    port = free_port()
    workdir = tmp_path / "work"
    workdir.mkdir()
    proc = spawn_agent(workdir, certs.ca_file, port)
    try:
        yield port
    finally:
        proc.kill()
        proc.wait()


def serves(port: int, certs: Certs) -> None:
    """A good server still gets ``ready`` and runs code."""
    host = Host(port, certs.good)
    try:
        ready = host.receive()
        assert ready is not None and ready["ev"] == "ready"
        assert host.run(1, "print(6 * 7)")[0] == "42\n"
    finally:
        host.close()


def test_a_server_with_the_cas_certificate_gets_ready_and_runs_code(
    agent: int, certs: Certs
) -> None:
    host = Host(agent, certs.good)
    try:
        ready = host.receive()
        assert ready is not None
        assert ready["ev"] == "ready" and "reattached" not in ready
        assert ready["listen"] == f"127.0.0.1:{agent}"
        out, done = host.run(1, "print(1)")
        assert (out, done["status"]) == ("1\n", "ok")
    finally:
        host.close()


def test_plain_tcp_is_closed_unanswered_and_its_frames_never_run(
    agent: int, certs: Certs, tmp_path: Path
) -> None:
    planted = tmp_path / "work" / "planted"
    with dial(agent) as conn:
        conn.sendall(encode_frame({"op": "exec", "id": 1, "timeout_s": 5,
                                   "code": f"open({str(planted)!r}, 'w').close()"}))  # fmt: skip
        data = read_to_eof(conn)
    # At most the agent's own TLS ClientHello (a handshake record), never a frame.
    assert data == b"" or data.startswith(b"\x16\x03")
    assert b"ready" not in data
    serves(agent, certs)
    assert not planted.exists()


def test_a_peer_that_speaks_tls_as_a_client_without_a_certificate_is_refused(
    agent: int, certs: Certs
) -> None:
    anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    anonymous.check_hostname = False
    anonymous.verify_mode = ssl.CERT_NONE
    with dial(agent) as raw, pytest.raises((ssl.SSLError, OSError)):
        conn = anonymous.wrap_socket(raw)  # closed with ``raw``
        conn.recv(1)  # reached only if the handshake passed: EOF or an error
        raise OSError("closed")
    serves(agent, certs)


@pytest.mark.parametrize("which", ["other_ca", "expired", "wrong_name"])
def test_a_certificate_the_agent_does_not_trust_is_refused_before_any_frame(
    agent: int, certs: Certs, which: str
) -> None:
    try:
        host = Host(agent, getattr(certs, which))
    except (ssl.SSLError, OSError):
        pass  # refused during the handshake (TLS 1.2, or the alert came first)
    else:
        try:
            # TLS 1.3: the server's side is done before the agent judged the chain.
            assert host.receive() is None
        finally:
            host.close()
    serves(agent, certs)


def test_a_connection_that_never_finishes_its_handshake_is_closed(agent: int) -> None:
    with dial(agent) as conn:
        assert not read_to_eof(conn).startswith(b"\x00")  # closed: bounded, not for ever


def test_the_newest_server_takes_over_an_idle_agent_with_its_interpreter(
    agent: int, certs: Certs
) -> None:
    first = Host(agent, certs.good)
    second: Host | None = None
    try:
        assert (first.receive() or {}).get("ev") == "ready"
        assert first.run(1, "kept = 41")[1]["status"] == "ok"
        second = Host(agent, certs.good)
        ready = second.receive()
        assert ready is not None and ready["ev"] == "ready"
        assert ready["reattached"] is True
        assert first.receive() is None  # the old link is closed
        assert second.run(1, "print(kept + 1)")[0] == "42\n"
    finally:
        first.close()
        if second is not None:
            second.close()


def test_a_server_arriving_during_a_run_waits_and_the_run_ends_where_it_began(
    agent: int, certs: Certs, tmp_path: Path
) -> None:
    go = tmp_path / "work" / "go"
    first = Host(agent, certs.good)
    second: Host | None = None
    try:
        assert (first.receive() or {}).get("ev") == "ready"
        code = (
            "import os, time\nprint('started', flush=True)\n"
            f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        )
        first.send({"op": "exec", "id": 7, "code": code, "timeout_s": WAIT_S})
        first.until(7, stream="started")
        first.send({"op": "exec", "id": 8, "code": "print('never')", "timeout_s": WAIT_S})
        second = Host(agent, certs.good)  # authenticated now, while the run goes on
        assert second.quiet(0.3)  # no ready while the run is in flight
        go.touch()
        assert first.until(7)["status"] == "ok"
        # What the first server queued behind it is not run for the second: it ends.
        assert first.until(8)["status"] == "cancelled"
        ready = second.receive()
        assert ready is not None and ready["ev"] == "ready" and ready["reattached"] is True
        assert first.receive() is None
        assert second.run(1, "print('second')")[0] == "second\n"
    finally:
        first.close()
        if second is not None:
            second.close()


def test_a_flood_of_half_open_connections_does_not_keep_a_server_out(
    agent: int, certs: Certs
) -> None:
    flood: list[socket.socket] = []
    try:
        for _ in range(3 * MAX_PENDING):
            flood.append(dial(agent))
        serves(agent, certs)
    finally:
        for conn in flood:
            conn.close()


@pytest.mark.parametrize("bad", [["--listen", "127.0.0.1:1"], ["--listen", "nohost:1", "--ca"]])
def test_listen_without_its_ca_or_a_valid_address_does_not_start(
    tmp_path: Path, certs: Certs, bad: list[str]
) -> None:
    argv = [*bad, str(certs.ca_file)] if bad[-1] == "--ca" else bad
    command = [sys.executable, "-m", "mcp_code_sandbox.agent", *argv, "--plain",
               "--workdir", str(tmp_path), "--config", json.dumps(CONFIG)]  # fmt: skip
    proc = subprocess.run(
        command,
        env={**os.environ, "PYTHONPATH": str(SRC)},
        capture_output=True,
        timeout=WAIT_S,
        check=False,
    )
    assert proc.returncode != 0
    assert b"listen" in proc.stderr


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("10.1.2.3:7070", ("10.1.2.3", 7070)),
        ("[fd00::0:1]:7070", ("fd00::1", 7070)),
        ("fd00::1:7070", ("fd00::1", 7070)),  # $(POD_IP):7070 with an IPv6 pod address
    ],
)
def test_listen_addresses_are_read_and_written_canonically(
    text: str, address: tuple[str, int]
) -> None:
    assert parse_address(text) == address
    assert parse_address(listen_address(*address)) == address


@pytest.mark.parametrize("text", ["7070", "pod:7070", "10.1.2.3:", "10.1.2.3:70000"])
def test_a_listen_address_that_is_not_ip_and_port_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_address(text)
