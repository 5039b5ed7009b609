"""Which hosts a sandbox may reach through its egress proxy.

A :class:`Policy` is built once from the settings (``SANDBOX_NETWORK_ALLOW`` and
``SANDBOX_NETWORK_DENY``) and narrowed per call to the hosts the call names. Entries of
both lists, comma-separated:

- ``example.com``: that name exactly (any port).
- ``*.example.com``: every name below ``example.com``, not ``example.com`` itself.
- ``*``: every name (never an address: IP literals always need an entry of their own).
- a preset: ``pypi`` or ``npm`` (:mod:`.presets`), expanded to the hosts pip and npm
  download from by default.
- an address or network: ``10.0.0.5``, ``10.213.0.0/16``, ``::1``, ``[fd00::1]``.

Semantics: a name is allowed when an allow entry matches it and no deny entry does (deny
wins). The empty allow list (the default) allows nothing: network by permission then
gives a sandbox a proxy that refuses every host, until the operator names some.

Addresses are the second gate, checked by the proxy on the address it is about to connect
to (an IP literal, or every address a name resolved to; a name that resolves to one
forbidden address is refused whole, so DNS rebinding cannot slip one in). Loopback,
private, link-local, shared, reserved and multicast ranges and this host's own addresses
are refused unless an address entry of the allow list covers them. The cloud metadata
addresses (:data:`METADATA`) need an entry naming exactly that address: a broad
``10.0.0.0/8``, ``169.254.0.0/16`` or ``0.0.0.0/0`` does not open them.

An IPv6 address that carries an IPv4 one (:func:`embedded_ipv4`: IPv4-mapped and
-compatible, NAT64 ``64:ff9b::/96`` and ``64:ff9b:1::/48`` in each RFC 6052 layout, 6to4
``2002::/16``, Teredo's server and client) is judged twice: as itself, and each IPv4 in
it as that IPv4 would be. On a host with NAT64, ``64:ff9b::a9fe:a9fe`` *is* the
metadata address, and gets no further than ``169.254.169.254`` does.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from mcp_code_sandbox.egress.presets import PRESETS, preset_hosts
from mcp_code_sandbox.errors import NetworkNotAllowed

if TYPE_CHECKING:
    from mcp_code_sandbox.settings import Settings

__all__ = [
    "METADATA",
    "Decision",
    "IPAddress",
    "IPNetwork",
    "Policy",
    "embedded_ipv4",
    "normalize_host",
    "parse_address",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Cloud instance metadata (AWS, GCP, Azure, OpenStack; AWS's IPv6 one).
METADATA: Final[frozenset[IPAddress]] = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)
#: A DNS name: labels of letters, digits, ``-`` and ``_`` (seen in real names), max 253.
_NAME = re.compile(
    r"(?=.{1,253}$)([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*"
)


@dataclass(frozen=True)
class Decision:
    """The verdict on one host (or address): ``rule`` says which entry or check decided,
    e.g. ``allow:*.example.com``, ``deny:evil.example.com``, ``not-allowed``,
    ``ip-literal``, ``private-address``, ``metadata-address``, ``own-address``."""

    allowed: bool
    rule: str


def normalize_host(host: str) -> str:
    """``Example.COM.`` -> ``example.com``; ``[::1]`` -> ``::1``. Raises ValueError for
    what is neither a DNS name nor an IP literal (so nothing odd reaches a resolver)."""
    text = host.strip().lower().rstrip(".")
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if parse_address(text) is not None:
        return str(ipaddress.ip_address(text))
    if not _NAME.fullmatch(text):
        raise ValueError(f"{host!r} is not a host name or an IP address")
    return text


def parse_address(text: str) -> IPAddress | None:
    """An IP literal (``[v6]`` too), or None when ``text`` is a name."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _network(entry: str) -> IPNetwork | None:
    text = entry.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None


_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_COMPATIBLE = ipaddress.ip_network("::/96")
#: Where RFC 6052 (§2.2) puts the IPv4 address for each prefix length: (bit offset,
#: width) pieces, skipping bits 64-71 (the "u" octet). A local-use prefix's length is the
#: operator's choice, so every layout that fits in ``64:ff9b:1::/48`` is read.
_RFC6052 = {
    48: ((48, 16), (72, 16)),
    56: ((56, 8), (72, 24)),
    64: ((72, 32),),
    96: ((96, 32),),
}


def _bits(value: int, offset: int, width: int) -> int:
    return (value >> (128 - offset - width)) & ((1 << width) - 1)


def embedded_ipv4(address: IPAddress) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 ``address`` carries, by where packets to it may end up:
    IPv4-mapped and IPv4-compatible (``::a.b.c.d``), NAT64 (RFC 6052: the well-known
    ``64:ff9b::/96`` and the local-use ``64:ff9b:1::/48``, every layout), 6to4
    (``2002::/16``) and Teredo (its server, and its client de-obfuscated). Empty for an
    IPv4 address and for every other IPv6 one."""
    if not isinstance(address, ipaddress.IPv6Address):
        return []
    value = int(address)
    found: list[ipaddress.IPv4Address] = []
    if address.ipv4_mapped is not None:
        found.append(address.ipv4_mapped)
    elif (address in _COMPATIBLE and value > 1) or address in _NAT64:  # not :: nor ::1
        found.append(ipaddress.IPv4Address(value & 0xFFFFFFFF))
    elif address in _NAT64_LOCAL:
        for pieces in _RFC6052.values():
            v4 = 0
            for offset, width in pieces:
                v4 = (v4 << width) | _bits(value, offset, width)
            found.append(ipaddress.IPv4Address(v4))
    elif address.sixtofour is not None:
        found.append(address.sixtofour)
    elif address.teredo is not None:
        found.extend(address.teredo)
    return list(dict.fromkeys(found))


def _unmapped(address: IPAddress) -> IPAddress:
    """``::ffff:127.0.0.1`` is 127.0.0.1: judge (and connect to) what it really is."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


@dataclass(frozen=True)
class _Entries:
    """One list, split: name patterns (``*``, ``*.x``, ``x``) and networks."""

    names: tuple[str, ...] = ()
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str], what: str) -> _Entries:
        names: list[str] = []
        networks: list[IPNetwork] = []
        for raw in entries:
            entry = raw.strip().lower()
            if not entry:
                continue
            if entry in PRESETS:
                try:
                    names.extend(preset_hosts(entry))
                except ValueError as exc:
                    raise ValueError(f"{what}: {exc}") from None
            elif (network := _network(entry)) is not None:
                networks.append(network)
            elif entry == "*":
                names.append("*")
            elif entry.startswith("*."):
                names.append("*." + _checked_name(entry[2:], raw, what))
            else:
                names.append(_checked_name(entry, raw, what))
        return cls(tuple(dict.fromkeys(names)), tuple(dict.fromkeys(networks)))

    def name_match(self, name: str) -> str | None:
        """The first pattern matching ``name`` (normalized), or None."""
        for pattern in self.names:
            if pattern == "*" or pattern == name:
                return pattern
            if pattern.startswith("*.") and name.endswith(pattern[1:]):
                return pattern
        return None

    def network_match(self, address: IPAddress) -> IPNetwork | None:
        """The first network holding ``address``; for a metadata address only an entry
        naming exactly it (a single-address network)."""
        for network in self.networks:
            if address.version != network.version or address not in network:
                continue
            if address in METADATA and network.num_addresses != 1:
                continue
            return network
        return None


def _checked_name(name: str, raw: str, what: str) -> str:
    try:
        normalized = normalize_host(name)
    except ValueError:
        raise ValueError(
            f"{what}: {raw.strip()!r} is not a host name, *.name, *, an address, a network "
            f"or a preset ({', '.join(PRESETS)})"
        ) from None
    return normalized


@dataclass(frozen=True)
class Policy:
    """An allow list and a deny list, and the address ranges names may resolve into.

    ``literals``: networks a sandbox may reach by IP literal. ``resolved``: networks a
    resolved name may land in although private (or the host's own). For the server's
    policy both are the allow list's networks; a narrowed policy keeps the server's
    ``resolved`` (the operator allowed those landings) and only the call's ``literals``.
    """

    allow: _Entries = field(default_factory=_Entries)
    deny: _Entries = field(default_factory=_Entries)
    resolved: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, allow: Iterable[str], deny: Iterable[str] = ()) -> Policy:
        """From lists of entries (see the module docstring). Raises ValueError naming the
        first entry that is none of the accepted forms."""
        allowed = _Entries.parse(allow, "allow list")
        return cls(allowed, _Entries.parse(deny, "deny list"), allowed.networks)

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy:
        """The server's policy: ``network_allow`` and ``network_deny`` (already checked
        when the settings were loaded)."""
        return cls.parse(settings.network_allow, settings.network_deny)

    @property
    def allows_anything(self) -> bool:
        """False when the allow list is empty: every host would be refused."""
        return bool(self.allow.names or self.allow.networks)

    def narrowed(self, hosts: Sequence[str]) -> Policy:
        """The policy of one call that asked for ``hosts`` (entries as in the allow list).

        Every entry must be within this policy: a name (or ``*.x`` pattern) this policy
        allows whole, an address or network inside one of its networks. Raises
        :class:`NetworkNotAllowed` naming the first host that is not. The server's deny
        list stays in force.
        """
        try:
            asked = _Entries.parse(hosts, "network hosts")
        except ValueError as exc:
            raise NetworkNotAllowed(f"{exc}; list host names this server allows") from None
        for name in asked.names:
            if not self._covers(name):
                raise NetworkNotAllowed(
                    f"{name} is not allowed by this server's network policy; "
                    "ask only for hosts in its allowlist (or network=true for all of them)",
                    host=name,
                )
        for network in asked.networks:
            if not any(
                network.version == mine.version and network.subnet_of(mine)  # type: ignore[arg-type]
                for mine in self.allow.networks
            ):
                raise NetworkNotAllowed(
                    f"{network} is not allowed by this server's network policy; "
                    "ask only for addresses in its allowlist",
                    host=str(network),
                )
        return Policy(asked, self.deny, self.resolved)

    def _covers(self, pattern: str) -> bool:
        """Whether every name ``pattern`` matches is matched by this allow list."""
        if pattern == "*":
            return "*" in self.allow.names
        if pattern.startswith("*."):
            suffix = pattern[1:]  # ".example.com"
            return any(
                mine == "*" or (mine.startswith("*.") and suffix.endswith(mine[1:]))
                for mine in self.allow.names
            )
        return self.allow.name_match(pattern) is not None and self.deny.name_match(pattern) is None

    def decide(self, host: str, port: int) -> Decision:
        """The verdict on a CONNECT target or Host header, before any DNS: by name for
        names, by address entries for IP literals. ``port`` is accepted for the audit
        and for later per-port rules; every port of an allowed host is allowed today."""
        del port
        try:
            name = normalize_host(host)
        except ValueError:
            return Decision(False, "invalid-host")
        address = parse_address(name)
        if address is not None:
            return self._decide_literal(_unmapped(address))
        if (denied := self.deny.name_match(name)) is not None:
            return Decision(False, f"deny:{denied}")
        if (allowed := self.allow.name_match(name)) is not None:
            return Decision(True, f"allow:{allowed}")
        return Decision(False, "not-allowed")

    def _decide_literal(self, address: IPAddress) -> Decision:
        if (denied := self.deny.network_match(address)) is not None:
            return Decision(False, f"deny:{denied}")
        if (allowed := self.allow.network_match(address)) is not None:
            return Decision(True, f"allow:{allowed}")
        return Decision(False, "ip-literal")

    def check_address(
        self,
        address: IPAddress,
        *,
        own: bool,
        own_of: Callable[[IPAddress], bool] | None = None,
    ) -> Decision:
        """The verdict on an address the proxy is about to connect to (a literal that
        :meth:`decide` allowed, or one a name resolved to). ``own``: it is one of this
        host's addresses (the caller found out; see ``dns.is_own_address``). An IPv6
        address carrying IPv4 ones (:func:`embedded_ipv4`) is allowed only when each of
        them would be too (``own_of`` tells whether one is this host's; None: not)."""
        address = _unmapped(address)
        for inner in embedded_ipv4(address):
            verdict = self._check_one(inner, own=own_of is not None and own_of(inner))
            if not verdict.allowed:
                return Decision(False, f"{verdict.rule} (embedded {inner})")
        return self._check_one(address, own=own)

    def _check_one(self, address: IPAddress, *, own: bool) -> Decision:
        if (denied := self.deny.network_match(address)) is not None:
            return Decision(False, f"deny:{denied}")
        for network in self.resolved:
            inside = address.version == network.version and address in network
            if inside and (address not in METADATA or network.num_addresses == 1):
                return Decision(True, f"allow:{network}")
        if address in METADATA:
            return Decision(False, "metadata-address")
        if not address.is_global or address.is_multicast:
            return Decision(False, "private-address")
        if own:
            return Decision(False, "own-address")
        return Decision(True, "public-address")
