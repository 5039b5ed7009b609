"""What ``doctor`` says of network by policy: what enforces it, and what it allows."""

from __future__ import annotations

from mcp_code_sandbox.doctor.checks import network_check
from mcp_code_sandbox.settings import load_settings

HOW = "the sandbox keeps its empty network namespace (bwrap --unshare-net, loopback only)"


def test_refused_unless_allowed() -> None:
    check = network_check(load_settings(environ={}), None, HOW)
    assert check.ok and "network=true is refused (SANDBOX_ALLOW_NETWORK)" in check.detail


def test_says_what_enforces_it_and_what_it_allows() -> None:
    settings = load_settings(
        {"allow_network": True, "network_allow": "pypi,api.example.com", "network_deny": "x.y"},
        environ={},
    )
    check = network_check(settings, None, HOW)
    assert check.ok
    assert HOW in check.detail and "egress proxy" in check.detail and "SNI" in check.detail
    assert "allowing pypi, api.example.com but not x.y" in check.detail
    empty = network_check(load_settings({"allow_network": True}, environ={}), None, HOW)
    assert "nothing (SANDBOX_NETWORK_ALLOW is empty)" in empty.detail


def test_a_runtime_that_cannot_reach_the_socket_fails() -> None:
    settings = load_settings({"allow_network": True}, environ={})
    check = network_check(settings, "runsc is registered without --host-uds=open", HOW)
    assert not check.ok and "--host-uds=open" in check.detail and check.fix
