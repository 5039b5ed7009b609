"""The docker backend's network for sandboxes that may use one (``run_code(network=true)``).

One bridge network per server process, made on the first networked sandbox and removed
at shutdown (or, after a crash, by the next server's start once no container is left on
it). It is the engine's own bridge driver with:

- ``enable_icc=false``: the engine drops traffic between containers on the bridge, so
  two sandboxes never reach each other (other bridges are kept apart by the engine's
  isolation chains);
- a bridge interface name of ours (``mcs`` + 8 hex digits), so the host-side rules of
  :func:`.netfilter.bridge_rules` can name it: INPUT drops all that comes from it to the
  host itself (every address of the host: loopback services can't be reached anyway, as
  127.0.0.1 in a container is its own, and the server's own ports on 0.0.0.0 or any
  interface address can't be either), DOCKER-USER drops 169.254.0.0/16;
- no IPv6: the network has none, and each sandbox turns it off in its own namespace
  (``net.ipv6.conf.*.disable_ipv6``), so link-local IPv6 between containers or to the
  host's bridge address is not there to use.

Networks carry the container labels' prefix (``LABEL_INSTANCE`` and ``LABEL_NETWORK``
with the bridge name), which is how cleanup finds them. The fence is set before the
network is handed out, and it fails closed: no rules, no network (``network_not_allowed``).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mcp_code_sandbox.backends.docker.engine import instance_alive, same_host
from mcp_code_sandbox.backends.docker.spec import IPV6_OFF, LABEL_INSTANCE, LABEL_NETWORK
from mcp_code_sandbox.backends.netfilter import Iptables, bridge_rules
from mcp_code_sandbox.errors import NetworkNotAllowed, SandboxError

__all__ = [
    "IPV6_OFF",
    "SandboxNetworks",
    "bridge_exists",
    "check_local",
    "network_kwargs",
    "new_bridge_name",
]

log = logging.getLogger(__name__)
_BRIDGE = re.compile(r"mcs[0-9a-f]{8}")


#: How long an empty network of a server this host cannot see (another host name: a
#: server in a container, or on another machine sharing the engine) is left alone.
FOREIGN_GRACE_S = 600.0


def _age_s(info: dict[str, Any]) -> float:
    """Seconds since the engine created the network (0 when it does not say)."""
    created = str(info.get("Created") or "")
    match = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)", created)
    if match is None:
        return 0.0
    when = datetime.datetime.fromisoformat(match.group(1)).replace(tzinfo=datetime.UTC)
    return time.time() - when.timestamp()


def new_bridge_name() -> str:
    return f"mcs{secrets.token_hex(4)}"  # 11 characters: interface names stop at 15


def network_kwargs(bridge: str, instance: str) -> dict[str, Any]:
    """``networks.create`` kwargs of the sandboxes' network. Pure: no engine needed."""
    return {
        "name": f"mcp-code-sandbox-{bridge}",
        "driver": "bridge",
        "options": {
            "com.docker.network.bridge.name": bridge,
            "com.docker.network.bridge.enable_icc": "false",
            "com.docker.network.bridge.enable_ip_masquerade": "true",
        },
        "enable_ipv6": False,
        "internal": False,
        "check_duplicate": True,
        "labels": {LABEL_INSTANCE: instance, LABEL_NETWORK: bridge},
    }


def bridge_exists(bridge: str, sys_class_net: Path = Path("/sys/class/net")) -> bool:
    """Is the bridge an interface of this host? Not when the engine runs elsewhere (a
    remote ``DOCKER_HOST``, rootless Docker, Podman's own namespace): then host rules
    here would fence nothing."""
    return (sys_class_net / bridge).exists()


def check_local(bridge: str) -> None:
    if not bridge_exists(bridge):
        raise NetworkNotAllowed(
            f"network is not available: the engine's bridge {bridge} is not an interface "
            "of this host (a remote or rootless engine), so its traffic cannot be fenced here"
        )


Call = Callable[..., Awaitable[Any]]


class SandboxNetworks:
    """This server's sandboxes' network, made on first use, and the removal of networks
    (with their rules) that no server needs any more. Used by :class:`.backend.DockerBackend`
    only; ``call`` is its ``_call`` (a docker-py call in a thread, errors mapped)."""

    def __init__(self, instance: str, call: Call, iptables: Iptables | None = None) -> None:
        self.instance = instance
        self._call = call
        self._iptables = iptables or Iptables()
        self._lock = asyncio.Lock()
        self.name: str | None = None
        self.bridge: str | None = None

    def unavailable(self, runtime: str) -> str | None:
        if runtime == "runsc":
            return (
                "sandboxes under gVisor (SANDBOX_DOCKER_RUNTIME=runsc) have no network here: "
                "the engine registers runsc with --network=none (scripts/docker-engine.sh "
                "does), which leaves a gVisor sandbox without any network stack; use runc "
                "for sessions that need the network"
            )
        return self._iptables.missing()

    async def get(self, client: Any) -> str:
        """The network's name, made (and fenced) on first use. The rules are checked on
        every call, so a firewall reload that dropped them is repaired before use."""
        async with self._lock:
            if self.name is not None and self.bridge is not None:
                if await self._exists(client, self.name):
                    await asyncio.to_thread(self._iptables.ensure, bridge_rules(self.bridge))
                    return self.name
                # Removed behind our back (by hand, or by a server that took it for a
                # dead one's): make a new one rather than fail every networked start.
                log.warning("sandbox network %s is gone; making a new one", self.name)
                await asyncio.to_thread(self._iptables.remove, bridge_rules(self.bridge))
                self.name = self.bridge = None
            bridge = new_bridge_name()
            kwargs = network_kwargs(bridge, self.instance)
            network = await self._call(client.networks.create, **kwargs)
            try:
                check_local(bridge)
                await asyncio.to_thread(self._iptables.ensure, bridge_rules(bridge))
            except BaseException:
                await self._remove(client, str(network.id), bridge)
                raise
            self.name, self.bridge = str(kwargs["name"]), bridge
            log.info("sandbox network %s (bridge %s) created", self.name, bridge)
            return self.name

    async def prune(self, client: Any, *, ours_too: bool) -> None:
        """Remove the networks of servers that are gone (and this server's own when
        ``ours_too``, at shutdown) once no container is on them. A network that still
        has containers (re-attached sandboxes of a dead server) keeps, or gets back, its
        fence."""
        found = await self._call(client.api.networks, filters={"label": LABEL_NETWORK})
        for entry in found:
            labels = entry.get("Labels") or {}
            instance = labels.get(LABEL_INSTANCE, "")
            bridge = labels.get(LABEL_NETWORK, "")
            if not _BRIDGE.fullmatch(bridge):
                continue  # not one we made: never touch it
            if instance == self.instance and not ours_too:
                continue
            if instance != self.instance and instance_alive(instance, self.instance):
                continue
            try:
                info = await self._call(client.api.inspect_network, entry["Id"])
            except SandboxError:
                continue  # removed in between
            if not same_host(instance) and _age_s(info) < FOREIGN_GRACE_S:
                # A server on another host (or in a container) cannot be seen from here:
                # its network, new and still empty, may be about to get a sandbox.
                continue
            if info.get("Containers"):
                if bridge_exists(bridge):
                    await asyncio.to_thread(self._iptables.ensure, bridge_rules(bridge))
                continue
            await self._remove(client, str(entry["Id"]), bridge)
        if ours_too:
            self.name = self.bridge = None
        await asyncio.to_thread(self._remove_orphan_rules)

    def _remove_orphan_rules(self) -> None:
        """Rules for a bridge that no longer exists (its network was removed by something
        that could not reach this host's firewall, e.g. a server in a container): an
        interface of that name only comes back with a new network, which sets its own."""
        for bridge in self._iptables.tagged_interfaces():
            if _BRIDGE.fullmatch(bridge) and not bridge_exists(bridge):
                log.info("removing the firewall rules of the vanished bridge %s", bridge)
                self._iptables.remove(bridge_rules(bridge))

    async def _exists(self, client: Any, name: str) -> bool:
        try:
            await self._call(client.api.inspect_network, name)
        except SandboxError:
            return False
        return True

    async def _remove(self, client: Any, network_id: str, bridge: str) -> None:
        try:
            await self._call(client.api.remove_network, network_id)
        except SandboxError as exc:
            log.warning("cannot remove the sandbox network %s: %s", network_id, exc.message)
            return  # still in use: its rules stay with it
        await asyncio.to_thread(self._iptables.remove, bridge_rules(bridge))
