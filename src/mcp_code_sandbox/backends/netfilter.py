"""Host-side packet filters that fence in sandboxes with network (``run_code(network=true)``).

Both backends give a networked sandbox outbound access that must not reach the host
itself (its loopback services, the server's own ports on any address), link-local
metadata addresses (169.254.0.0/16) or other sandboxes. The rules are built here as pure
argument lists (unit-tested without iptables) and applied by :class:`Iptables`:

- bwrap (:func:`slirp_rules`): the sandbox's traffic leaves through ``slirp4netns``, a
  user-mode stack that turns it into ordinary sockets of the host. slirp runs with the
  dedicated group ``SLIRP_GID``, and OUTPUT rules match that group (``-m owner
  --gid-owner``): no connection of it may go to a local address (``addrtype LOCAL``:
  127/8 and every address of every host interface), to 169.254.0.0/16, or into a
  container bridge; no IPv6 at all.
- docker (:func:`bridge_rules`): the sandbox's packets arrive from its bridge. INPUT drops
  everything from the bridge to the host itself; DOCKER-USER (forwarded traffic) drops
  169.254.0.0/16. Sandboxes on one bridge are kept apart by the engine
  (``enable_icc=false``); other bridges by its isolation chains.

Every rule carries the comment ``COMMENT``, so an operator can see whose it is.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from mcp_code_sandbox.errors import NetworkNotAllowed

__all__ = [
    "COMMENT",
    "LINK_LOCAL",
    "SLIRP_GID",
    "Iptables",
    "Rule",
    "bridge_rules",
    "slirp_rules",
]

COMMENT = "mcp-code-sandbox"
LINK_LOCAL = "169.254.0.0/16"
#: Host group of every slirp4netns the bwrap backend starts; owns nothing else.
SLIRP_GID = 100_001
_TIMEOUT_S = 10


@dataclass(frozen=True)
class Rule:
    """One rule: ``ip6`` picks ip6tables; ``spec`` is everything after the chain name."""

    chain: str
    spec: tuple[str, ...]
    ip6: bool = False


def _tagged(*parts: str) -> tuple[str, ...]:
    return (*parts, "-m", "comment", "--comment", COMMENT, "-j", "REJECT")


def slirp_rules(gid: int = SLIRP_GID) -> list[Rule]:
    """OUTPUT rules for the sockets of slirp4netns (group ``gid``)."""
    owner = ("-m", "owner", "--gid-owner", str(gid))
    return [
        Rule("OUTPUT", _tagged(*owner, "-m", "addrtype", "--dst-type", "LOCAL")),
        Rule("OUTPUT", _tagged(*owner, "-d", LINK_LOCAL)),
        # Container bridges: the engine's sandboxes and any other container on the host.
        *(Rule("OUTPUT", _tagged(*owner, "-o", name)) for name in ("docker0", "br-+", "mcs+")),
        Rule("OUTPUT", _tagged(*owner), ip6=True),
    ]


def bridge_rules(bridge: str) -> list[Rule]:
    """INPUT and DOCKER-USER rules for the sandboxes' bridge interface ``bridge``."""
    return [
        Rule("INPUT", _tagged("-i", bridge)),
        Rule("DOCKER-USER", _tagged("-i", bridge, "-d", LINK_LOCAL)),
        Rule("INPUT", _tagged("-i", bridge), ip6=True),
    ]


class Iptables:
    """Applies :class:`Rule` lists with the host's ``iptables``/``ip6tables`` (as root).

    ``ensure`` inserts what is missing at the top of its chain (``-C`` first, so calling
    it before every sandbox start is cheap and idempotent) and raises
    ``NetworkNotAllowed`` when a rule cannot be set: a sandbox is never given a network
    without its fence. ``remove`` deletes every copy and never raises. IPv6 rules are
    skipped when there is no ``ip6tables`` (then the kernel has no IPv6 to filter, or the
    sandboxes get none: both backends turn it off inside).
    """

    def __init__(self) -> None:
        self.v4 = shutil.which("iptables")
        self.v6 = shutil.which("ip6tables")

    def missing(self) -> str | None:
        """Why rules cannot be applied here, or ``None``."""
        import os

        if self.v4 is None:
            return "iptables is not installed (apt-get install iptables)"
        if os.geteuid() != 0:
            return "the server is not root, so it cannot set the iptables rules that fence it in"
        return None

    def _binary(self, rule: Rule) -> str | None:
        return self.v6 if rule.ip6 else self.v4

    def _run(self, binary: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [binary, "-w", "5", *args],
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            check=False,
        )

    def ensure(self, rules: Sequence[Rule]) -> None:
        why = self.missing()
        if why is not None:
            raise NetworkNotAllowed(f"network is not available: {why}")
        for rule in rules:
            binary = self._binary(rule)
            if binary is None:
                continue
            if self._run(binary, "-C", rule.chain, *rule.spec).returncode == 0:
                continue
            done = self._run(binary, "-I", rule.chain, "1", *rule.spec)
            if done.returncode != 0:
                raise NetworkNotAllowed(
                    f"network is not available: cannot set the firewall rule "
                    f"{rule.chain} {' '.join(rule.spec)}: {done.stderr.strip()[:200]}"
                )

    def present(self, rules: Sequence[Rule]) -> bool:
        """Are all ``rules`` in place? (For ``doctor`` and tests.)"""
        for rule in rules:
            binary = self._binary(rule)
            if binary is None:
                continue
            if self._run(binary, "-C", rule.chain, *rule.spec).returncode != 0:
                return False
        return True

    def tagged_interfaces(self) -> set[str]:
        """The input interfaces (``-i``) that rules with our comment name, in any chain
        of either family; empty when they cannot be listed."""
        found: set[str] = set()
        for binary in (self.v4, self.v6):
            if binary is None or self.missing() is not None:
                continue
            try:
                listed = self._run(binary, "-S").stdout
            except (OSError, subprocess.TimeoutExpired):
                continue
            for line in listed.splitlines():
                words = line.split()
                if COMMENT in words and "-i" in words[:-1]:
                    found.add(words[words.index("-i") + 1])
        return found

    def remove(self, rules: Sequence[Rule]) -> None:
        for rule in rules:
            binary = self._binary(rule)
            if binary is None:
                continue
            for _ in range(10):  # every copy (two servers may each have inserted one)
                try:
                    if self._run(binary, "-D", rule.chain, *rule.spec).returncode != 0:
                        break
                except (OSError, subprocess.TimeoutExpired):
                    break
