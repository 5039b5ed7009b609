"""The certificates of the agent channel on Kubernetes: a CA and the servers' certificate.

The agent in every sandbox pod trusts one CA (its certificate, public, is mounted from a
ConfigMap) and accepts a connection only from a peer that presents a certificate for
:data:`~mcp_code_sandbox.agent.listener.SERVER_NAME` signed by it (see
:mod:`mcp_code_sandbox.agent.listener` for why that way round). Every server replica holds
the same server certificate and key (a Secret); the CA key signs new server certificates
and belongs nowhere in the cluster.

:func:`write_certs` (``mcp-code-sandbox kubernetes certs --out DIR``) writes ``ca.crt``,
``ca.key``, ``server.crt``, ``server.key``. Run again on the same directory it keeps the
CA and issues a fresh server certificate, so renewing one changes no pod. Keys are EC
P-256, written mode 0600.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mcp_code_sandbox.agent.listener import SERVER_NAME

__all__ = [
    "CA_LIFETIME",
    "SERVER_LIFETIME",
    "Authority",
    "CertFiles",
    "issue_server_cert",
    "make_ca",
    "write_certs",
]

#: The CA outlives many server certificates: replacing it means a new ConfigMap and new
#: pods, so it is made rarely.
CA_LIFETIME = datetime.timedelta(days=3650)
#: A server certificate is renewed by running the command again (the CA stays).
SERVER_LIFETIME = datetime.timedelta(days=397)
#: Clocks of the node that makes the certificates and of the pods differ a little.
_CLOCK_SKEW = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class Authority:
    """A CA: its certificate (public) and its key (signs server certificates only)."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class CertFiles:
    """What :func:`write_certs` wrote, and whether it kept an existing CA."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    kept_ca: bool


def make_ca(
    *, now: datetime.datetime | None = None, lifetime: datetime.timedelta = CA_LIFETIME
) -> Authority:
    """A new self-signed CA, valid from ``now`` (default: the current time) for ``lifetime``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mcp-code-sandbox agent channel CA")])
    start = (now or _now()) - _CLOCK_SKEW
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Authority(cert, key)


def issue_server_cert(
    ca: Authority,
    *,
    name: str = SERVER_NAME,
    now: datetime.datetime | None = None,
    lifetime: datetime.timedelta = SERVER_LIFETIME,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A server certificate for ``name`` signed by ``ca``, and its new key. (Tests pass
    another ``name``, or a ``now`` in the past, to make certificates the agent refuses.)"""
    key = ec.generate_private_key(ec.SECP256R1())
    start = (now or _now()) - _CLOCK_SKEW
    ca_ski = ca.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(min(start + lifetime, ca.cert.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca.key, hashes.SHA256())
    )
    return cert, key


def write_certs(out: Path) -> CertFiles:
    """Write the four files into ``out`` (made if missing). A CA already there (both
    ``ca.crt`` and ``ca.key``) is kept; the server certificate and key are always new.
    Raises ``OSError``, or ``ValueError`` for CA files that cannot be loaded."""
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    files = CertFiles(out / "ca.crt", out / "ca.key", out / "server.crt", out / "server.key",
                      kept_ca=(out / "ca.crt").exists() and (out / "ca.key").exists())  # fmt: skip
    if files.kept_ca:
        ca = _load_ca(files.ca_cert, files.ca_key)
    else:
        ca = make_ca()
        _write(files.ca_key, _key_pem(ca.key), 0o600)
        _write(files.ca_cert, ca.cert.public_bytes(serialization.Encoding.PEM), 0o644)
    cert, key = issue_server_cert(ca)
    _write(files.server_key, _key_pem(key), 0o600)
    _write(files.server_cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return files


def _load_ca(cert_path: Path, key_path: Path) -> Authority:
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise ValueError(f"{key_path} is not the key of {cert_path}")
    return Authority(cert, key)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` with ``data`` at ``mode``: written beside it, then renamed, so a
    key is never readable by others, not even for a moment, and never half written."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.chmod(tmp, mode)  # whatever the umask took away (a certificate's 0644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)
