"""TLS for the egress proxy: reading the SNI of a tunnel, and terminating TLS where a
secret has to be added.

Both use the standard library's ``ssl`` (OpenSSL) over memory BIOs, so the proxy sees the
client's first bytes before deciding anything: :func:`accept_tls` feeds the ClientHello
to a server-side ``SSLObject`` whose SNI callback decides. A name other than the CONNECT
host is refused with a TLS ``access_denied`` alert (no domain fronting). A host without
secrets is not intercepted: the handshake is abandoned and the buffered ClientHello
goes to the upstream untouched. A host with secrets gets a certificate for it from this
proxy's :class:`EphemeralCA` (made with ``cryptography``; its key lives in this process's
memory only) and the session continues as a :class:`TlsStream`.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .policy import parse_address
from .streams import CHUNK, ByteStream, Counter

__all__ = [
    "ALPN",
    "EphemeralCA",
    "Handshaken",
    "NotTls",
    "SniRefused",
    "Tunnel",
    "accept_tls",
    "prepare_tls",
    "system_roots_pem",
    "upstream_context",
]

#: We speak HTTP/1.1 to intercepted clients and upstreams (h11), so ALPN offers only that.
ALPN = ["http/1.1"]
#: The most ClientHello bytes buffered while waiting for the SNI.
MAX_HELLO = 64 * 1024
LEAF_DAYS = 7


class EphemeralCA:
    """A CA made for one proxy (one sandbox) and forgotten with it. Only that sandbox
    trusts it (its CA bundle), and its key never leaves this process's memory."""

    def __init__(self, label: str) -> None:
        """Blocking (key generation): the proxy builds it in a worker thread."""
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "mcp-code-sandbox egress proxy"),
                x509.NameAttribute(NameOID.COMMON_NAME, f"sandbox egress CA {label}"[:64]),
            ]
        )
        now = datetime.datetime.now(datetime.UTC)
        self._name = name
        self.certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )

    def pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def leaf_context(self, host: str) -> ssl.SSLContext:
        """A server context presenting a certificate for ``host`` signed by this CA.
        Blocking (key generation, loading): call it in a worker thread; cache it."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        address = parse_address(host)
        san: x509.GeneralName = (
            x509.IPAddress(address) if address is not None else x509.DNSName(host)
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(ALPN)
        chain = cert.public_bytes(serialization.Encoding.PEM) + self.pem()
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        _load_chain_from_memory(context, chain, key_pem)
        return context


def _load_chain_from_memory(context: ssl.SSLContext, chain: bytes, key: bytes) -> None:
    """``load_cert_chain`` reads files only; give it memory files (``memfd``), so that no
    private key is ever written to a disk or a shared directory."""
    fds = [os.memfd_create("mcs-egress-chain"), os.memfd_create("mcs-egress-key")]
    try:
        for fd, data in zip(fds, (chain, key), strict=True):
            os.write(fd, data)
        context.load_cert_chain(f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}")
    finally:
        for fd in fds:
            os.close(fd)


def system_roots_pem() -> bytes:
    """The host's trusted roots as PEM (OpenSSL's default CA file; ``certifi``'s bundle
    when the system has none). Blocking: read once per proxy, in a thread."""
    paths = ssl.get_default_verify_paths()
    candidates = [paths.cafile, paths.openssl_cafile]
    with contextlib.suppress(ImportError):
        import certifi

        candidates.append(certifi.where())
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate).read_bytes()
    return b""


@functools.lru_cache(maxsize=4)
def upstream_context(extra_ca: Path | None) -> ssl.SSLContext:
    """How the proxy verifies an upstream it terminates TLS for: the system roots plus
    ``extra_ca`` (``SANDBOX_NETWORK_UPSTREAM_CA``), hostname checked. Blocking (loading
    the roots takes tens of ms), so made once per file and shared by every proxy: the
    context is only read after this, which ``ssl`` allows from any thread."""
    context = ssl.create_default_context()
    if extra_ca is not None:
        context.load_verify_locations(cafile=str(extra_ca))
    context.set_alpn_protocols(ALPN)
    return context


def prepare_tls(
    label: str, with_ca: bool, upstream_ca: Path | None
) -> tuple[EphemeralCA | None, bytes, ssl.SSLContext]:
    """A proxy's TLS pieces (blocking: the proxy calls it in a thread): its CA when it has
    secrets to add, the sandbox's bundle (that CA, the system roots, ``upstream_ca``)
    and the context it verifies upstreams with."""
    ca = EphemeralCA(label) if with_ca else None
    extra = upstream_ca.read_bytes() if upstream_ca is not None else b""
    bundle = (ca.pem() if ca else b"") + system_roots_pem() + b"\n" + extra
    return ca, bundle, upstream_context(upstream_ca)


@dataclass(frozen=True)
class Tunnel:
    """Not for interception: send ``hello`` (the client's bytes so far) upstream as is."""

    sni: str | None
    hello: bytes


@dataclass(frozen=True)
class SniRefused:
    """The ClientHello named another host than the CONNECT (or none for a name)."""

    sni: str | None


@dataclass(frozen=True)
class NotTls:
    """The client did not start a TLS handshake this proxy could read (or gave up)."""

    reason: str


@dataclass
class Handshaken:
    """The handshake with the client completed under this proxy's certificate."""

    stream: TlsStream


def sni_matches(sni: str | None, connect_host: str) -> bool:
    """An SNI must name the CONNECT host; a CONNECT to an IP literal may have none."""
    if sni is None:
        return parse_address(connect_host) is not None
    return sni.lower().rstrip(".") == connect_host


async def accept_tls(
    client: ByteStream, first: bytes, connect_host: str, leaf: ssl.SSLContext | None
) -> Tunnel | SniRefused | NotTls | Handshaken:
    """Read the client's ClientHello (``first``: bytes already read) and decide: refuse
    an SNI other than ``connect_host``; without ``leaf``, hand back the bytes for a
    tunnel; with it, finish the handshake as ``connect_host``. The caller bounds the
    time this takes."""
    verdict: list[str] = []
    sni_seen: list[str | None] = []

    def on_sni(obj: ssl.SSLObject, name: str | None, _: ssl.SSLContext) -> int | None:
        sni_seen.append(name)
        if not sni_matches(name, connect_host):
            verdict.append("refuse")
            return ssl.ALERT_DESCRIPTION_ACCESS_DENIED
        if leaf is None:
            verdict.append("tunnel")
            return ssl.ALERT_DESCRIPTION_HANDSHAKE_FAILURE  # abandoned, never sent
        obj.context = leaf
        verdict.append("intercept")
        return None

    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    probe.minimum_version = ssl.TLSVersion.TLSv1_2
    probe.set_alpn_protocols(ALPN)
    probe.sni_callback = on_sni
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = probe.wrap_bio(incoming, outgoing, server_side=True)
    hello = bytearray(first)
    data = first
    while True:
        incoming.write(data)
        try:
            tls.do_handshake()
        except ssl.SSLWantReadError:
            await client.write(outgoing.read())
            if not verdict and len(hello) > MAX_HELLO:
                return NotTls("ClientHello too large")
            data = await client.read()
            if not data:
                return NotTls("the client closed before the handshake ended")
            if not verdict:
                hello += data
            continue
        except ssl.SSLError as exc:
            if verdict[:1] == ["tunnel"]:
                return Tunnel(sni_seen[0], bytes(hello))
            if verdict[:1] == ["refuse"]:
                await client.write(outgoing.read())  # the access_denied alert
                return SniRefused(sni_seen[0])
            return NotTls(f"TLS handshake failed: {exc.reason or exc}")
        await client.write(outgoing.read())
        return Handshaken(TlsStream(tls, incoming, outgoing, client))


class TlsStream:
    """A server-side TLS session over another stream (the client's socket), after
    :func:`accept_tls`. ``received``/``sent`` count plaintext bytes."""

    def __init__(
        self,
        tls: ssl.SSLObject,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        raw: ByteStream,
    ) -> None:
        self._tls = tls
        self._incoming = incoming
        self._outgoing = outgoing
        self._raw = raw
        self.received = Counter()
        self.sent = Counter()

    async def read(self) -> bytes:
        while True:
            try:
                data = self._tls.read(CHUNK)
            except ssl.SSLWantReadError:
                await self._flush()
                raw = await self._raw.read()
                if not raw:
                    return b""
                self._incoming.write(raw)
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""
            self.received.bytes += len(data)
            return data

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = self._tls.write(view[:CHUNK])
            view = view[written:]
            self.sent.bytes += written
            await self._flush()

    async def _flush(self) -> None:
        if pending := self._outgoing.read():
            await self._raw.write(pending)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self._tls.unwrap()
        with contextlib.suppress(Exception):
            await self._flush()
        await self._raw.close()
