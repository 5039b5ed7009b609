"""``mcp-code-sandbox kubernetes certs --out DIR``: a CA and the servers' certificate,
keys readable by their owner only; run again, it keeps the CA and renews the server's."""

from __future__ import annotations

import contextlib
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509

from mcp_code_sandbox.agent.listener import SERVER_NAME, client_context
from mcp_code_sandbox.backends.kubernetes.certs import write_certs
from mcp_code_sandbox.cli import main


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_command_writes_a_ca_and_a_server_certificate_with_private_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "certs"
    assert main(["kubernetes", "certs", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["ca.crt", "ca.key", "server.crt", "server.key"]
    assert mode(out / "ca.key") == mode(out / "server.key") == 0o600
    assert mode(out / "ca.crt") == mode(out / "server.crt") == 0o644
    assert "ca.key" in capsys.readouterr().out  # says where the CA key is, to keep it safe
    server = x509.load_pem_x509_certificate((out / "server.crt").read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [SERVER_NAME]


def test_the_agents_context_trusts_the_server_certificate_it_writes(tmp_path: Path) -> None:
    files = write_certs(tmp_path)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(files.server_cert, files.server_key)
    agent = client_context(str(files.ca_cert))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    server_in, server_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    agent_end = agent.wrap_bio(incoming, outgoing, server_hostname=SERVER_NAME)
    server_end = server.wrap_bio(server_in, server_out, server_side=True)
    for _ in range(10):  # the handshake, both ends stepped by hand
        for end in (agent_end, server_end):
            with contextlib.suppress(ssl.SSLWantReadError):
                end.do_handshake()
        server_in.write(outgoing.read())
        incoming.write(server_out.read())
    agent_end.do_handshake()  # raises if the chain or the name were not accepted
    assert agent_end.getpeercert() is not None


def test_run_again_it_keeps_the_ca_and_issues_a_new_server_certificate(tmp_path: Path) -> None:
    first = write_certs(tmp_path)
    ca, server = first.ca_cert.read_bytes(), first.server_cert.read_bytes()
    again = write_certs(tmp_path)
    assert again.kept_ca and not first.kept_ca
    assert again.ca_cert.read_bytes() == ca
    assert again.server_cert.read_bytes() != server
    assert mode(again.server_key) == 0o600


def test_a_ca_key_that_is_not_the_cas_is_refused(tmp_path: Path) -> None:
    write_certs(tmp_path / "a")
    write_certs(tmp_path / "b")
    (tmp_path / "a" / "ca.key").write_bytes((tmp_path / "b" / "ca.key").read_bytes())
    assert main(["kubernetes", "certs", "--out", str(tmp_path / "a")]) == 1
