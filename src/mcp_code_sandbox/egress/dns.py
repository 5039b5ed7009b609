"""Name resolution for the egress proxy: the sandbox has no DNS; the proxy resolves.

A :data:`Resolver` is an async function ``(host, port) -> addresses``. The default,
:func:`system_resolver`, asks the host's resolver through ``loop.getaddrinfo`` (a worker
thread: never the event loop). Tests, and operators who pin names, pass their own
(:func:`static_resolver`). :func:`vetted_addresses` resolves and checks every address
against the policy before anything connects: the address judged is the address used.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from .policy import Decision, IPAddress, Policy, normalize_host, parse_address

if TYPE_CHECKING:
    from mcp_code_sandbox.settings import Settings

__all__ = [
    "ResolveFailed",
    "Resolver",
    "is_own_address",
    "resolver_from_settings",
    "static_resolver",
    "system_resolver",
    "vetted_addresses",
]

Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]
#: A name resolving to more than this many addresses: only the first ones are tried.
MAX_ADDRESSES = 8
RESOLVE_TIMEOUT_S = 10.0


class ResolveFailed(Exception):
    """The name did not resolve (NXDOMAIN, timeout, no address of a usable family)."""


async def system_resolver(host: str, port: int) -> list[IPAddress]:
    """The host's own resolver (``/etc/hosts``, DNS), in a worker thread."""
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT_S
        )
    except (OSError, TimeoutError) as exc:
        raise ResolveFailed(f"{host} did not resolve: {exc}") from None
    found: list[IPAddress] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if address not in found:
            found.append(address)
    return found


def static_resolver(
    table: Mapping[str, Sequence[str]], fallback: Resolver | None = None
) -> Resolver:
    """Names answered from ``table`` (name -> addresses), others by ``fallback`` (or
    failing). Tests use it for names that no DNS knows, and to make a name resolve to
    loopback (DNS rebinding) without touching ``/etc/hosts``."""
    answers = {
        name.lower(): [ipaddress.ip_address(a) for a in addresses]
        for name, addresses in table.items()
    }

    async def resolve(host: str, port: int) -> list[IPAddress]:
        if host.lower() in answers:
            return list(answers[host.lower()])
        if fallback is None:
            raise ResolveFailed(f"{host} did not resolve")
        return await fallback(host, port)

    return resolve


def resolver_from_settings(settings: Settings) -> Resolver:
    """The server's resolver: ``network_resolve`` (``name=address|address``) first, the
    host's resolver for every other name."""
    table: dict[str, list[str]] = {}
    for entry in settings.network_resolve:
        name, _, addresses = entry.partition("=")
        table[normalize_host(name)] = [a.strip().strip("[]") for a in addresses.split("|")]
    return static_resolver(table, fallback=system_resolver) if table else system_resolver


def is_own_address(address: IPAddress) -> bool:
    """Whether ``address`` belongs to this host: binding a socket to an address that is
    not one of the host's fails (EADDRNOTAVAIL). Two system calls that never wait on I/O
    (no packet is sent; a thread hop would cost more), so the proxy calls it inline.
    Unsure (another error): treated as own (refused)."""
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(address), 0))
    except OSError as exc:
        return exc.errno != errno.EADDRNOTAVAIL
    return True


async def vetted_addresses(
    policy: Policy, resolver: Resolver, host: str, port: int
) -> tuple[list[IPAddress], Decision]:
    """The addresses to connect to for ``host`` (a name :meth:`Policy.decide` allowed, or
    a literal), each checked by :meth:`Policy.check_address`. Refused whole when any one
    is refused: a name that answers with one public and one loopback address is a
    rebinding attempt, not a name to half-trust. Raises :class:`ResolveFailed`."""
    literal = parse_address(host)
    addresses = [literal] if literal is not None else await resolver(host, port)
    addresses = addresses[:MAX_ADDRESSES]
    if not addresses:
        raise ResolveFailed(f"{host} has no address")
    for address in addresses:
        verdict = policy.check_address(address, own=is_own_address(address), own_of=is_own_address)
        if not verdict.allowed:
            return [], verdict
    return addresses, Decision(True, "addresses-ok")
