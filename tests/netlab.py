"""Upstreams for the network-policy tests: HTTP and HTTPS servers in a test namespace
(:mod:`tests.labnet`), with a CA of the test's own, and the names the egress proxy resolves
them by (a static table: these names exist in no DNS of this machine).

Every server answers ``<token> <header>`` where ``header`` is the request's
``Authorization`` header (or ``-``), except that a request carrying exactly the expected
secret value answers ``auth-ok`` instead (the value itself never goes back to a sandbox).
"""

from __future__ import annotations

import datetime
import ipaddress
import textwrap
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

#: argv: address port token expected-secret [certfile keyfile]. Not http.server: its bind
#: looks the address up in DNS, which here would leave the machine.
SERVER = textwrap.dedent(
    """
    import socketserver, ssl, sys
    address, port, token, expected = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    tls = None
    if len(sys.argv) > 6:
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(sys.argv[5], sys.argv[6])
    class H(socketserver.StreamRequestHandler):
        def setup(self):
            if tls is not None:
                try:
                    self.request = tls.wrap_socket(self.request, server_side=True)
                except (ssl.SSLError, OSError):
                    self.request.close()
                    raise
            super().setup()
        def handle(self):
            self.rfile.readline()
            auth = "-"
            while (line := self.rfile.readline().strip()):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "authorization":
                    auth = value.strip()
            body = "auth-ok" if auth == "Bearer " + expected else f"{token} {auth}"
            self.wfile.write(
                f"HTTP/1.0 200 OK\\r\\nContent-Length: {len(body)}\\r\\n\\r\\n{body}".encode()
            )
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    socketserver.ThreadingTCPServer((address, port), H).serve_forever()
    """
)


_CA_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


@dataclass(frozen=True)
class TestCA:
    """A CA and one leaf for ``names`` (and ``addresses``), as PEM files in ``root``."""

    ca_pem: Path
    cert: Path
    key: Path


def make_ca(root: Path, names: list[str], addresses: list[str]) -> TestCA:
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mcs test upstream CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_USAGE, critical=True)
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    alt += [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    out = TestCA(root / "ca.pem", root / "leaf.pem", root / "leaf.key")
    out.ca_pem.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out.cert.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    out.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    for path in (out.ca_pem, out.cert, out.key):
        path.chmod(0o644)  # the servers run as root; the CA file is read by the proxy
    return out
