"""The network fence's pure parts: iptables rules, slirp4netns argv, bwrap's pid report,
the docker network's kwargs, and the request check. The real fence is tested in
tests/integration/test_network.py."""

from __future__ import annotations

import os

import pytest

from mcp_code_sandbox.backends.bwrap.net import build_slirp_argv, read_child_pid
from mcp_code_sandbox.backends.docker.net import network_kwargs, new_bridge_name
from mcp_code_sandbox.backends.netfilter import COMMENT, SLIRP_GID, bridge_rules, slirp_rules
from mcp_code_sandbox.errors import NetworkNotAllowed, SandboxFailed
from mcp_code_sandbox.run.request import RunRequest, check_request
from mcp_code_sandbox.settings import load_settings


def test_slirp_rules_reject_the_host_link_local_bridges_and_ipv6() -> None:
    rules = slirp_rules()
    text = [" ".join(r.spec) for r in rules]
    assert all(f"--gid-owner {SLIRP_GID}" in t and t.endswith("-j REJECT") for t in text)
    assert all(COMMENT in t for t in text)
    assert any("--dst-type LOCAL" in t for t in text)
    assert any("-d 169.254.0.0/16" in t for t in text)
    assert {r.chain for r in rules} == {"OUTPUT"}
    assert any(r.ip6 for r in rules)


def test_bridge_rules_name_the_bridge() -> None:
    rules = bridge_rules("mcs0123abcd")
    assert [(r.chain, r.ip6) for r in rules] == [
        ("INPUT", False),
        ("DOCKER-USER", False),
        ("INPUT", True),
    ]
    assert all(r.spec[:2] == ("-i", "mcs0123abcd") for r in rules)
    assert "169.254.0.0/16" in rules[1].spec


def test_slirp_argv() -> None:
    argv = build_slirp_argv("/usr/bin/slirp4netns", 4242, ready_fd=7, exit_fd=8)
    assert argv[:4] == ["/usr/bin/setpriv", f"--regid={SLIRP_GID}", "--clear-groups", "--"]
    for flag in ("--disable-host-loopback", "--enable-sandbox", "--enable-seccomp", "-6"):
        assert (flag in argv) is (flag != "-6")
    # a path, not a pid: slirp must not join the sandbox's (nested) user namespace
    assert argv[-3:] == ["--netns-type=path", "/proc/4242/ns/net", "tap0"]


def test_child_pid_read_from_a_partial_report() -> None:
    read, write = os.pipe()
    try:
        os.write(write, b'{ "child-pid": 31337')  # the rest comes after --block-fd
        assert read_child_pid(read, 1) == 31337
        os.close(write)
        write = -1
        with pytest.raises(SandboxFailed):
            read_child_pid(read, 1)
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)


def test_docker_network_kwargs() -> None:
    bridge = new_bridge_name()
    assert len(bridge) <= 15 and bridge.startswith("mcs")
    k = network_kwargs(bridge, "host-1-ab")
    assert k["options"]["com.docker.network.bridge.enable_icc"] == "false"
    assert k["options"]["com.docker.network.bridge.name"] == bridge
    assert k["enable_ipv6"] is False and k["internal"] is False
    assert k["labels"]["mcp-code-sandbox.network"] == bridge


def test_network_needs_the_servers_permission() -> None:
    with pytest.raises(NetworkNotAllowed, match="SANDBOX_ALLOW_NETWORK"):
        check_request(load_settings({}, environ={}), RunRequest("1", network=True))
    allowed = load_settings({"allow_network": True}, environ={})
    assert check_request(allowed, RunRequest("1", network=True)) > 0


def test_network_age_from_the_engines_created_stamp() -> None:
    import time

    from mcp_code_sandbox.backends.docker.engine import same_host
    from mcp_code_sandbox.backends.docker.net import _age_s

    stamp = time.strftime("%Y-%m-%dT%H:%M:%S.123456789Z", time.gmtime(time.time() - 120))
    assert 115 < _age_s({"Created": stamp}) < 130
    assert _age_s({}) == 0.0 and _age_s({"Created": "yesterday"}) == 0.0
    import socket

    assert same_host(f"{socket.gethostname()}-12.34-abcd")
    assert not same_host("0123456789ab-1.2-abcd")
