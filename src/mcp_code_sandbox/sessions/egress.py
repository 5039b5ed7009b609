"""The egress proxies of the sandboxes that have network: one per sandbox, opened before
it starts and closed when it stops.

A sandbox never has a route out (every backend gives it an empty network namespace);
with network it gets a directory of the host, bound read-only at ``layout.EGRESS_DIR``,
holding the Unix socket of its own proxy (:mod:`mcp_code_sandbox.egress.proxy`), which
allows what the server's policy (or the call's narrower list of hosts) allows, and, for
secrets, the bundle of the CA it intercepts TLS with. The agent bridges the socket to
``127.0.0.1`` (``agent.egress``), and the proxy variables of every language point there.

Owned by :class:`.sandboxes.Sandboxes`: it calls :meth:`EgressProxies.open` while it
builds a spec with network and :meth:`EgressProxies.close` on every stop of that sandbox
(free, replace, session end), whatever the stop did; the manager calls :meth:`aclose` at
shutdown, after every session ended or paused, for any a stop cut short left open.

On a backend whose sandboxes cannot see a Unix socket of the server
(``backends.egress_gate``: kubernetes), the proxies listen nowhere of their own: one TCP
port of the server (:class:`~mcp_code_sandbox.egress.gate.ProxyGate`, opened at the
first proxy) hands each connection to the proxy whose credential it presents. The
proxy URL, with that credential, is then no part of the spec (a pod would show it):
:meth:`EgressProxies.run_env` gives it with every run's env, and a running sandbox can
get a proxy without a restart (its route out is the backend's to open:
``GatedEgress.allow_egress``).

Semantics of a call's wish (``Wish``): ``None`` no network; ``()`` the server's whole
policy (``network=true``); a tuple of hosts, a subset of that policy. A call with network
on a sandbox that has it gives the running proxy its own policy (:meth:`EgressProxies.narrow`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import structlog

from mcp_code_sandbox.backends.base import Egress
from mcp_code_sandbox.backends.unix_sockets import SocketDir
from mcp_code_sandbox.egress.dns import resolver_from_settings
from mcp_code_sandbox.egress.gate import Credential, ProxyGate
from mcp_code_sandbox.egress.limits import ConnectionBudget
from mcp_code_sandbox.egress.policy import Policy
from mcp_code_sandbox.egress.presets import learn_presets
from mcp_code_sandbox.egress.proxy import MAX_CONNECTIONS, EgressProxy, open_proxy
from mcp_code_sandbox.egress.secrets import Secret, load_secrets, placeholder_env
from mcp_code_sandbox.errors import SandboxError, SandboxFailed
from mcp_code_sandbox.layout import EGRESS_CA_NAME, egress_env
from mcp_code_sandbox.metrics import Metrics
from mcp_code_sandbox.sessions import records
from mcp_code_sandbox.settings import Settings

__all__ = ["SOCKET_NAME", "EgressProxies", "Wish"]

log = structlog.get_logger("mcp_code_sandbox.sessions.egress")

#: The proxy's socket in its directory (``agent.egress.EGRESS_SOCKET`` inside).
SOCKET_NAME = "proxy.sock"
Wish = tuple[str, ...] | None
#: A run result lists at most this many blocked hosts, each cut to a DNS name's length.
MAX_BLOCKED = 50
MAX_HOST_CHARS = 253
#: A sweep's check that a proxy still listens: a live one accepts at once.
_PROBE_S = 0.5


@dataclass(frozen=True)
class _Open:
    """A running proxy and its directory, held open for the socket's short address; or
    (behind the gate) no directory and its credential instead."""

    proxy: EgressProxy
    directory: SocketDir | None
    credential: Credential | None = None


class EgressProxies:
    """Every open egress proxy of this server, by its directory."""

    def __init__(
        self, settings: Settings, metrics: Metrics, gate: tuple[str, int] | None = None
    ) -> None:
        """``gate``: the address and port the proxies are reached on over the network
        (``GatedEgress.egress_gate``); None: each proxy's socket in a directory."""
        self.settings = settings
        self._gate_address = gate
        self._gate: ProxyGate | None = None
        self._gate_lock = asyncio.Lock()
        self.metrics = metrics
        #: In the state dir: the Docker engine binds it from its own view of that dir.
        self.root = settings.state_dir / "egress"
        self._open: dict[Path, _Open] = {}
        self._policy: Policy | None = None
        self._secrets: tuple[Secret, ...] | None = None
        self._swept = False
        #: How the proxies resolve names: ``network_resolve`` first, then the host's DNS.
        self._resolver = resolver_from_settings(settings)
        #: The descriptors all the proxies may take, and each owner's share of them.
        self._budget = ConnectionBudget.for_process(MAX_CONNECTIONS)

    def policy(self, hosts: tuple[str, ...] = ()) -> Policy:
        """The server's policy, or (``hosts``) the call's narrower one. Raises
        ``NetworkNotAllowed`` naming a host the server does not allow. Called by the
        service to refuse a call before it holds a session, and by :meth:`open`."""
        if self._policy is None:
            self._policy = Policy.from_settings(self.settings)
        return self._policy.narrowed(hosts) if hosts else self._policy

    def check(self) -> None:
        """Parse the policy and read the secrets file now (blocking: a worker thread).
        Called by the service at start when network is allowed; raises what they raise
        (``ValueError`` for the policy, ``SecretsFileError`` naming the file). The
        presets are learnt here too (npm runs once), so no call waits for them."""
        learn_presets()
        self.policy()
        self._loaded_secrets()

    def _loaded_secrets(self) -> tuple[Secret, ...]:
        """The secrets file, read on first use (it was checked when the server started)."""
        if self._secrets is None:
            path = self.settings.secrets_file
            self._secrets = () if path is None else load_secrets(path)
        return self._secrets

    async def open(
        self, key: str, owner: str, session_id: str, hosts: tuple[str, ...]
    ) -> tuple[Egress, dict[str, str]]:
        """A new proxy for one sandbox of ``key``; its :class:`Egress` for the spec and
        the variables the sandbox gets (proxy URLs, CA bundle, secrets' placeholders).
        Raises ``SandboxFailed`` when its directory or socket cannot be made (the host
        path goes to the log, never into the message)."""
        policy = self.policy(hosts)
        secrets_ = self._loaded_secrets()
        if self._gate_address is not None:
            name = f"{key}-{secrets.token_hex(4)}"
            return await self._open_gated(name, policy, hosts or None, owner, session_id), {}
        host_dir, directory = await asyncio.to_thread(self._make_dir, key)
        try:
            proxy = await self._proxy(directory, policy, owner, session_id)
        except BaseException as exc:
            directory.close()
            await asyncio.to_thread(shutil.rmtree, host_dir, True)
            if isinstance(exc, SandboxFailed):
                log.error("cannot start an egress proxy", dir=str(host_dir), error=exc.message)
                raise SandboxFailed(
                    "could not start the sandbox's egress proxy (its socket could not be "
                    "made; the server's log says why). Try again, or run without network"
                ) from None
            raise
        self._open[host_dir] = _Open(proxy, directory)
        try:
            ca = proxy.ca_bundle()
            await asyncio.to_thread(self._publish, host_dir, ca)
        except BaseException:
            await self.close(Egress(host_dir))
            raise
        env = egress_env(ca is not None)
        env.update(placeholder_env(secrets_))
        return Egress(host_dir, hosts or None), env

    async def reopen(
        self, name: str, hosts: tuple[str, ...] | None, owner: str, session_id: str
    ) -> Egress | None:
        """A proxy again in the directory ``name`` that another replica's proxy left for a
        sandbox this server took over (``hosts``: its last call's, ``None`` the whole
        policy): the sandbox keeps its network. ``None`` (logged) when the directory is
        gone or the policy no longer allows those hosts: the sandbox is then taken as
        without network, as after a restart."""
        host_dir = self.root / name
        if self._gate_address is not None:
            try:
                policy = self.policy(hosts or ())
                return await self._open_gated(name, policy, hosts, owner, session_id)
            except SandboxError as exc:
                log.warning("cannot open a taken-over sandbox's proxy again", error=str(exc))
                return None
        try:
            policy = self.policy(hosts or ())
            directory = await asyncio.to_thread(SocketDir, host_dir)
        except (OSError, SandboxError) as exc:
            log.warning("cannot open a taken-over sandbox's proxy again", error=str(exc))
            return None
        try:
            await asyncio.to_thread(directory.unlink_socket, SOCKET_NAME)
            proxy = await self._proxy(directory, policy, owner, session_id)
        except BaseException as exc:
            directory.close()
            if isinstance(exc, (OSError, SandboxError)):
                log.warning("cannot open a taken-over sandbox's proxy again", error=str(exc))
                return None
            raise
        self._open[host_dir] = _Open(proxy, directory)
        egress = Egress(host_dir, hosts)
        try:
            await asyncio.to_thread(self._publish, host_dir, proxy.ca_bundle())
        except OSError as exc:
            log.warning("cannot publish a taken-over proxy's CA", error=str(exc))
            await self.close(egress)
            return None
        return egress

    async def _open_gated(
        self, name: str, policy: Policy, hosts: tuple[str, ...] | None, owner: str, session: str
    ) -> Egress:
        """A proxy behind the gate (opened first if need be), named ``name``: its
        :class:`Egress` names a directory that is never made (the proxy has none)."""
        gate = await self._opened_gate()
        proxy = await self._proxy(None, policy, owner, session)
        host_dir = self.root / name
        self._open[host_dir] = _Open(proxy, None, gate.admit(proxy))
        return Egress(host_dir, hosts)

    async def _opened_gate(self) -> ProxyGate:
        """The gate, listening (opened at the first proxy). Raises ``SandboxFailed`` when
        its address cannot be bound (the address goes to the log)."""
        assert self._gate_address is not None
        async with self._gate_lock:
            if self._gate is None:
                gate = ProxyGate(*self._gate_address)
                try:
                    await gate.start()
                except OSError as exc:
                    log.error("cannot open the egress gate", address=self._gate_address,
                              error=str(exc))  # fmt: skip
                    raise SandboxFailed(
                        "could not open the server's egress port for the sandbox's proxy "
                        "(the server's log says why). Try again, or run without network"
                    ) from None
                self._gate = gate
            return self._gate

    def run_env(self, egress: Egress | None) -> dict[str, str]:
        """The variables a run of a sandbox behind the gate gets (its proxy's URL with its
        credential, the secrets' placeholders); ``{}`` for any other sandbox, whose
        variables are in its spec. The CA bundle of a proxy that intercepts TLS is no
        file such a sandbox has: intercepted hosts fail its TLS checks (README)."""
        opened = None if egress is None else self._open.get(egress.host_dir)
        if opened is None or opened.credential is None or self._gate is None:
            return {}
        env = egress_env(False, opened.credential.url(self._gate.host, self._gate.port))
        env.update(placeholder_env(self._loaded_secrets()))
        return env

    async def _proxy(
        self, directory: SocketDir | None, policy: Policy, owner: str, session_id: str
    ) -> EgressProxy:
        return await open_proxy(
            # Through the directory's fd, held open as long as the proxy: the state dir
            # may be too deep for a socket's address (``backends.unix_sockets``).
            None if directory is None else Path(directory.address(SOCKET_NAME)),
            policy,
            self._loaded_secrets(),
            owner=owner,
            session=session_id,
            metrics=self.metrics,
            upstream_ca=self.settings.network_upstream_ca,
            resolver=self._resolver,
            budget=self._budget,
        )

    def narrow(self, egress: Egress, hosts: tuple[str, ...]) -> Egress:
        """Give the running proxy of ``egress`` the policy of a call that asked for
        ``hosts`` (``()``: the server's); the sandbox's :class:`Egress` from now on.
        Called by the session side for a call with network on a sandbox that has it.
        Raises ``NetworkNotAllowed`` as :meth:`policy` does (the service checked first)."""
        policy = self.policy(hosts)
        opened = self._open.get(egress.host_dir)
        if opened is not None:
            opened.proxy.use_policy(policy)
        return Egress(egress.host_dir, hosts or None)

    def _make_dir(self, key: str) -> tuple[Path, SocketDir]:
        """A fresh directory for one sandbox's proxy (a random suffix: a sandbox of the
        same session that a dead server left running still has its old one bound), and
        that directory held open. Those of a previous server are removed first: their
        proxies are gone. Raises ``SandboxFailed`` (the path is logged)."""
        host_dir = self.root / f"{key}-{secrets.token_hex(4)}"
        try:
            if not self._swept:
                self._swept = True
                self._sweep()
            self.root.mkdir(mode=0o755, parents=True, exist_ok=True)
            host_dir.mkdir(mode=0o755)
            # Whatever the umask: the sandbox's uid must traverse it (it holds no secret).
            os.chmod(host_dir, 0o755)  # noqa: S103
            return host_dir, SocketDir(host_dir)
        except OSError as exc:
            log.error("cannot make an egress proxy's directory", dir=str(host_dir), error=str(exc))
            shutil.rmtree(host_dir, ignore_errors=True)
            raise SandboxFailed(
                "could not make the directory of the sandbox's egress proxy in the state "
                f"directory ({exc.strerror or exc}; the server's log names it). Check that "
                "the server may write its state directory, or run without network"
            ) from None

    def _sweep(self) -> None:
        """Remove the directories of proxies that are gone: not this server's, not named
        by a session's record (a replica is about to open its proxy again), and with no
        proxy listening (another live server's)."""
        named = {
            str(r.egress["dir"])
            for r in records.load_records(self.settings.sessions_dir, remove_bad=False)
            if r.egress is not None
        }
        with contextlib.suppress(FileNotFoundError):
            for entry in self.root.iterdir():
                if entry in self._open or entry.name in named or _listening(entry):
                    continue
                shutil.rmtree(entry, ignore_errors=True)

    @staticmethod
    def _publish(host_dir: Path, ca: bytes | None) -> None:
        """Write the CA bundle beside the socket (whose mode the proxy already opened to
        the sandbox's uid), read-only: public certificates, no key. A proxy opened again
        replaces the last one's (its CA is new; it is renamed into place)."""
        if ca is not None:
            draft = host_dir / f".{EGRESS_CA_NAME}.new"
            draft.unlink(missing_ok=True)
            draft.write_bytes(ca)
            os.chmod(draft, 0o444)
            os.replace(draft, host_dir / EGRESS_CA_NAME)

    async def close(self, egress: Egress | None, *, keep_dir: bool = False) -> None:
        """Close the proxy of ``egress`` and remove its directory (``keep_dir``: leave it,
        for the replica that takes its sandbox over); nothing for ``None`` or one already
        closed. Never raises (logged): called on every stop path."""
        if egress is None:
            return
        opened = self._open.pop(egress.host_dir, None)
        if opened is not None:
            if opened.credential is not None and self._gate is not None:
                self._gate.forget(opened.credential)
            try:
                await opened.proxy.aclose()
            except Exception:
                log.exception("cannot close an egress proxy", dir=str(egress.host_dir))
            finally:
                if opened.directory is not None:  # after the proxy: it unlinks its socket
                    opened.directory.close()
        if self._gate_address is not None:
            return  # no directory was made
        if not keep_dir:
            await asyncio.to_thread(shutil.rmtree, egress.host_dir, True)

    def take_blocked(self, egresses: Iterable[Egress | None]) -> list[str]:
        """The hosts the proxies of ``egresses`` refused since the last call, each once,
        sorted: for the run result (``blocked_hosts``)."""
        blocked: set[str] = set()
        for egress in egresses:
            if egress is not None and (opened := self._open.get(egress.host_dir)) is not None:
                # Names the sandbox sent: bounded here, escaped by the tool layer.
                blocked.update(host[:MAX_HOST_CHARS] for host in opened.proxy.take_blocked())
        return sorted(blocked)[:MAX_BLOCKED]

    async def aclose(self) -> None:
        """Close every proxy still open (at shutdown: any a stop cut short left open)."""
        for host_dir in list(self._open):
            await self.close(Egress(host_dir))
        if self._gate is not None:
            await self._gate.aclose()
            self._gate = None

    @property
    def gated(self) -> bool:
        """Are the proxies behind the gate (see the module doc)?"""
        return self._gate_address is not None

    @property
    def open_count(self) -> int:
        return len(self._open)


def _listening(host_dir: Path) -> bool:
    """Does a proxy listen in ``host_dir``? (Blocking; bounded.)"""
    try:
        with SocketDir(host_dir) as directory, socket.socket(socket.AF_UNIX) as probe:
            probe.settimeout(_PROBE_S)
            probe.connect(directory.address(SOCKET_NAME))
    except OSError:
        return False
    return True
