"""The egress policy: host patterns, presets, address ranges, narrowing per call."""

from __future__ import annotations

import ipaddress
import os
import subprocess
from urllib.parse import urlsplit

import pytest

from mcp_code_sandbox.egress import Policy, preset_hosts, resolver_from_settings
from mcp_code_sandbox.egress.dns import is_own_address, static_resolver, vetted_addresses
from mcp_code_sandbox.egress.policy import embedded_ipv4
from mcp_code_sandbox.errors import NetworkNotAllowed
from mcp_code_sandbox.settings import ConfigError, load_settings


def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


def test_the_default_allows_nothing() -> None:
    policy = Policy.from_settings(load_settings(environ={}))
    assert not policy.allows_anything
    assert policy.decide("example.com", 443).allowed is False
    assert policy.decide("example.com", 443).rule == "not-allowed"


def test_exact_names_and_wildcards() -> None:
    policy = Policy.parse(["api.example.com", "*.github.test"])
    assert policy.decide("API.Example.COM.", 443).rule == "allow:api.example.com"
    assert policy.decide("raw.github.test", 443).rule == "allow:*.github.test"
    assert policy.decide("a.b.github.test", 80).allowed
    # The wildcard is for names below, not the name itself, and not look-alikes.
    assert not policy.decide("github.test", 443).allowed
    assert not policy.decide("evilgithub.test", 443).allowed
    assert not policy.decide("example.com", 443).allowed


def test_presets_expand_to_the_hosts_pip_and_npm_download_from() -> None:
    from pip._internal.models.index import PyPI

    npm = subprocess.run(
        ["npm", "config", "get", "registry", "--userconfig", "/nonexistent"],
        capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"]},
    ).stdout  # fmt: skip
    registries = [PyPI.netloc, PyPI.file_storage_domain, urlsplit(npm.strip()).hostname or ""]
    assert preset_hosts("pypi") == tuple(registries[:2])
    assert preset_hosts("npm") == (registries[2],)
    policy = Policy.parse(["pypi", "npm"])
    for host in registries:
        assert policy.decide(host, 443).allowed, host
    assert not policy.decide("evil.org", 443).allowed


def test_deny_wins_over_allow() -> None:
    policy = Policy.parse(["*"], ["*.evil.test", "bad.test"])
    assert policy.decide("good.test", 443).rule == "allow:*"
    assert policy.decide("x.evil.test", 443).rule == "deny:*.evil.test"
    assert policy.decide("bad.test", 443).rule == "deny:bad.test"


def test_ip_literals_need_an_address_entry_even_under_a_star() -> None:
    policy = Policy.parse(["*"])
    assert policy.decide("93.184.216.34", 443).rule == "ip-literal"
    assert policy.decide("[2606:2800::1]", 443).rule == "ip-literal"
    opened = Policy.parse(["*", "10.213.0.0/16"])
    assert opened.decide("10.213.4.2", 80).rule == "allow:10.213.0.0/16"
    assert not opened.decide("10.214.0.1", 80).allowed


@pytest.mark.parametrize(
    ("address", "rule"),
    [
        ("127.0.0.1", "private-address"),
        ("10.0.0.1", "private-address"),
        ("192.168.1.1", "private-address"),
        ("172.16.0.1", "private-address"),
        ("100.64.0.1", "private-address"),  # carrier-grade NAT
        ("169.254.1.1", "private-address"),  # link-local
        ("::1", "private-address"),
        ("fe80::1", "private-address"),
        ("fc00::1", "private-address"),
        ("224.0.0.1", "private-address"),
        ("::ffff:127.0.0.1", "private-address"),  # v4-mapped loopback
        ("169.254.169.254", "metadata-address"),
        ("fd00:ec2::254", "metadata-address"),
    ],
)
def test_private_link_local_and_metadata_addresses_are_refused(address: str, rule: str) -> None:
    verdict = Policy.parse(["*"]).check_address(ip(address), own=False)
    assert (verdict.allowed, verdict.rule) == (False, rule)


@pytest.mark.parametrize(
    ("address", "rule"),
    [
        ("64:ff9b::a9fe:a9fe", "metadata-address (embedded 169.254.169.254)"),  # NAT64
        ("64:ff9b::7f00:1", "private-address (embedded 127.0.0.1)"),
        ("64:ff9b::a00:1", "private-address (embedded 10.0.0.1)"),
        ("64:ff9b:1::a00:1", "private-address (embedded 0.0.0.0)"),  # local-use, /48
        ("64:ff9b:1:a9fe:a9:fe00::", "metadata-address (embedded 169.254.169.254)"),  # /56
        ("::7f00:1", "private-address (embedded 127.0.0.1)"),  # IPv4-compatible
        ("::a9fe:a9fe", "metadata-address (embedded 169.254.169.254)"),
        ("2002:a9fe:a9fe::1", "metadata-address (embedded 169.254.169.254)"),  # 6to4
        ("2002:7f00:1::", "private-address (embedded 127.0.0.1)"),
        ("2002:c0a8:101::1", "private-address (embedded 192.168.1.1)"),
        # Teredo: server 65.54.227.120, client 127.0.0.1 (stored inverted).
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", "private-address (embedded 127.0.0.1)"),
    ],
)
def test_ipv4_embedded_in_ipv6_is_judged_as_that_ipv4(address: str, rule: str) -> None:
    verdict = Policy.parse(["*"]).check_address(ip(address), own=False)
    assert (verdict.allowed, verdict.rule) == (False, rule)


def test_embedded_public_ipv4_passes_and_an_ipv4_entry_opens_its_embedded_forms() -> None:
    policy = Policy.parse(["*"])
    assert policy.check_address(ip("64:ff9b::808:808"), own=False).allowed
    assert policy.check_address(ip("2002:808:808::1"), own=False).allowed
    own = policy.check_address(ip("64:ff9b::808:808"), own=False, own_of=lambda _: True)
    assert own.rule == "own-address (embedded 8.8.8.8)"
    # A local-use NAT64 prefix may be /48 to /96: each layout's IPv4 is judged.
    assert embedded_ipv4(ip("64:ff9b:1:0:a9:fea9:fe00:0"))[2] == ip("169.254.169.254")
    assert not policy.check_address(ip("64:ff9b:1:0:a9:fea9:fe00:0"), own=False).allowed
    opened = Policy.parse(["*", "10.0.0.0/8", "64:ff9b::/96"])
    assert opened.check_address(ip("64:ff9b::a00:1"), own=False).allowed
    assert not opened.check_address(ip("64:ff9b::a9fe:a9fe"), own=False).allowed


def test_public_addresses_pass_but_not_the_hosts_own() -> None:
    policy = Policy.parse(["*"])
    assert policy.check_address(ip("93.184.216.34"), own=False).allowed
    assert policy.check_address(ip("93.184.216.34"), own=True).rule == "own-address"


def test_an_address_entry_opens_a_range_but_metadata_only_by_name() -> None:
    broad = Policy.parse(["*", "169.254.0.0/16", "0.0.0.0/0"])
    assert broad.check_address(ip("169.254.1.1"), own=False).allowed
    assert broad.check_address(ip("169.254.169.254"), own=False).rule == "metadata-address"
    exact = Policy.parse(["*", "169.254.169.254"])
    assert exact.check_address(ip("169.254.169.254"), own=False).allowed


def test_deny_ranges_win_over_allowed_ranges() -> None:
    policy = Policy.parse(["*", "10.0.0.0/8"], ["10.9.0.0/16"])
    assert policy.check_address(ip("10.1.0.1"), own=False).allowed
    assert policy.check_address(ip("10.9.0.1"), own=False).rule == "deny:10.9.0.0/16"


def test_the_loopback_and_other_host_addresses_are_own() -> None:
    assert is_own_address(ip("127.0.0.1"))
    assert not is_own_address(ip("192.0.2.1"))  # TEST-NET-1: nobody's


async def test_a_name_resolving_to_loopback_is_refused_dns_rebinding() -> None:
    policy = Policy.parse(["*.test"])
    resolver = static_resolver({"rebind.test": ["93.184.216.34", "127.0.0.1"]})
    addresses, verdict = await vetted_addresses(policy, resolver, "rebind.test", 443)
    assert addresses == []
    assert verdict.rule == "private-address"
    metadata = static_resolver({"meta.test": ["169.254.169.254"]})
    _, verdict = await vetted_addresses(policy, metadata, "meta.test", 80)
    assert verdict.rule == "metadata-address"


def test_narrowed_keeps_a_subset_and_the_servers_denies() -> None:
    index, files = preset_hosts("pypi")
    server = Policy.parse(["pypi", "*.example.test", "10.213.0.0/16"], ["bad.example.test"])
    call = server.narrowed([index, "api.example.test", "*.cdn.example.test", "10.213.1.0/24"])
    assert call.decide(index, 443).allowed
    assert not call.decide(files, 443).allowed  # not asked for
    assert call.decide("x.cdn.example.test", 443).allowed
    assert call.decide("10.213.1.5", 80).allowed
    assert not call.decide("10.213.2.5", 80).allowed
    # Names the call allowed may still resolve into the server's ranges.
    assert call.check_address(ip("10.213.2.5"), own=False).allowed
    assert server.narrowed(["pypi"]).decide(files, 443).allowed


@pytest.mark.parametrize(
    ("asked", "named"),
    [
        (["api.example.test", "evil.test"], "evil.test"),
        (["*.test"], "*.test"),  # wider than *.example.test
        (["example.test"], "example.test"),  # *.x never covers x
        (["bad.example.test"], "bad.example.test"),  # denied by the server
        (["*"], "*"),
        (["10.214.0.1"], "10.214.0.1/32"),
        (["10.0.0.0/8"], "10.0.0.0/8"),
    ],
)
def test_narrowed_refuses_what_the_server_does_not_allow(asked: list[str], named: str) -> None:
    server = Policy.parse(["pypi", "*.example.test", "10.213.0.0/16"], ["bad.example.test"])
    with pytest.raises(NetworkNotAllowed) as caught:
        server.narrowed(asked)
    assert caught.value.code == "network_not_allowed"
    assert named in caught.value.message
    assert caught.value.details["host"] == named


def test_narrowed_refuses_what_is_no_host_at_all() -> None:
    with pytest.raises(NetworkNotAllowed, match="not a host name"):
        Policy.parse(["*"]).narrowed(["http://example.com/path"])


def test_a_bad_entry_is_named() -> None:
    with pytest.raises(ValueError, match=r"allow list: 'exa mple\.com'"):
        Policy.parse(["exa mple.com"])


def test_settings_read_the_lists_and_refuse_nonsense() -> None:
    settings = load_settings(
        environ={
            "SANDBOX_NETWORK_ALLOW": "pypi, *.example.test,10.0.0.0/8",
            "SANDBOX_NETWORK_DENY": "x.example.test",
        }
    )
    assert settings.network_allow == ["pypi", "*.example.test", "10.0.0.0/8"]
    assert (
        Policy.from_settings(settings).decide("x.example.test", 443).rule == "deny:x.example.test"
    )
    with pytest.raises(ConfigError, match="SANDBOX_NETWORK_ALLOW"):
        load_settings(environ={"SANDBOX_NETWORK_ALLOW": "https://example.com/"})


async def test_pinned_names_resolve_from_the_settings_and_others_fall_back() -> None:
    settings = load_settings(
        environ={"SANDBOX_NETWORK_RESOLVE": "pypi.test=10.213.7.2, dual.test=10.0.0.1|[fd00::1]"}
    )
    resolve = resolver_from_settings(settings)
    assert await resolve("PYPI.test", 443) == [ip("10.213.7.2")]
    assert await resolve("dual.test", 443) == [ip("10.0.0.1"), ip("fd00::1")]
    assert await resolve("localhost", 80)  # the host's resolver for the rest
    with pytest.raises(ConfigError, match="SANDBOX_NETWORK_RESOLVE"):
        load_settings(environ={"SANDBOX_NETWORK_RESOLVE": "pypi.test=not-an-ip"})


def test_presets_are_learnt_once_even_when_they_cannot_be(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failure is kept too: a call naming a preset never runs npm again (nor on the
    event loop: the server learns them at start, in a worker thread)."""
    from mcp_code_sandbox.egress import presets

    asked: list[str] = []

    def no_npm() -> tuple[str, ...]:
        asked.append("npm")
        raise ValueError("the npm preset: npm is not on the server's PATH")

    monkeypatch.setitem(presets.PRESETS, "npm", no_npm)
    presets._learnt.cache_clear()
    try:
        presets.learn_presets()
        for _ in range(3):
            with pytest.raises(ValueError, match="not on the server's PATH"):
                Policy.parse(["npm"])
        assert asked == ["npm"]
    finally:
        presets._learnt.cache_clear()
