"""The bwrap backend's network: slirp4netns attached to a sandbox's own net namespace.

Every bwrap sandbox has its own empty network namespace (``--unshare-net``). One with
network gets a tap device in it from ``slirp4netns``, a user-mode TCP/IP stack that
relays each connection through an ordinary socket of the host. So the sandbox never
shares an interface with the host or another sandbox; what it can reach is what slirp's
sockets can, and :func:`.netfilter.slirp_rules` take away the host itself, link-local
addresses and container bridges (``--disable-host-loopback`` also makes slirp refuse
127.0.0.0/8 and its own gateway 10.0.2.2 by itself).

Order: bwrap starts with ``--json-status-fd`` and ``--block-fd``; it reports the pid of
the sandbox's first process (whose net namespace exists from then on) and waits. We run
slirp4netns against ``/proc/<pid>/ns/net`` (a path: with a pid, slirp would join that
process's current user namespace, which bwrap's ``--disable-userns`` replaces by a
nested one that has no power over the net namespace), wait for its ``--ready-fd``, then
unblock bwrap: user code never runs before its network is up and fenced.

slirp4netns runs as root (only root may open ``/dev/net/tun`` here and enter the
sandbox's namespace) in the group ``SLIRP_GID``, which the rules match, with
``--enable-sandbox`` (its own mount namespace; all capabilities dropped but
CAP_NET_BIND_SERVICE) and ``--enable-seccomp``. It exits when the server closes its
``--exit-fd``, which also happens when the server dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

from mcp_code_sandbox.backends.netfilter import SLIRP_GID, Iptables, slirp_rules
from mcp_code_sandbox.errors import NetworkNotAllowed, SandboxFailed

__all__ = [
    "RESOLV_CONF",
    "SLIRP_READY_TIMEOUT_S",
    "SlirpNet",
    "build_slirp_argv",
    "network_unavailable",
    "other_slirps",
    "read_child_pid",
]

#: The sandbox's /etc/resolv.conf: slirp's DNS forwarder (to the host's resolvers).
RESOLV_CONF = "nameserver 10.0.2.3\noptions timeout:2 attempts:2\n"
SLIRP_READY_TIMEOUT_S = 10.0
_CHILD_PID = re.compile(rb'"child-pid":\s*(\d+)')


def network_unavailable(iptables: Iptables) -> str | None:
    """Why a bwrap sandbox cannot get a fenced network on this host, or ``None``."""
    if shutil.which("slirp4netns") is None:
        return "slirp4netns is not installed (apt-get install slirp4netns; scripts/install.sh does)"
    return iptables.missing()


def build_slirp_argv(slirp: str, pid: int, ready_fd: int, exit_fd: int) -> list[str]:
    """slirp4netns for the net namespace of ``pid``, as root in group ``SLIRP_GID``."""
    return [
        "/usr/bin/setpriv",
        f"--regid={SLIRP_GID}",
        "--clear-groups",
        "--",
        slirp,
        "--configure",
        "--mtu=65520",
        "--disable-host-loopback",
        "--enable-sandbox",
        "--enable-seccomp",
        f"--ready-fd={ready_fd}",
        f"--exit-fd={exit_fd}",
        "--netns-type=path",
        f"/proc/{pid}/ns/net",
        "tap0",
    ]


_STATUS_MAX_BYTES = 4096


def read_child_pid(fd: int, timeout_s: float) -> int:
    """The sandbox's first pid from bwrap's ``--json-status-fd`` ``fd`` (blocking, bounded).

    bwrap writes ``{ "child-pid": N`` in one write and the rest of that document only
    after ``--block-fd`` let it go on: so what is read is matched, not parsed."""
    import select
    import time

    seen = b""
    deadline = time.monotonic() + timeout_s
    while (match := _CHILD_PID.search(seen)) is None:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise SandboxFailed(f"bwrap did not report the sandbox's pid within {timeout_s:.0f} s")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise SandboxFailed("bwrap exited before it reported the sandbox's pid")
        seen += chunk
        if len(seen) > _STATUS_MAX_BYTES:  # bwrap's first write is a few dozen bytes
            raise SandboxFailed("bwrap's status is not what bwrap writes")
    return int(match.group(1))


@dataclass
class SlirpNet:
    """One running slirp4netns; :meth:`close` ends it (bounded)."""

    proc: asyncio.subprocess.Process
    exit_fd: int

    @classmethod
    async def start(cls, pid: int, iptables: Iptables) -> SlirpNet:
        why = network_unavailable(iptables)
        if why is not None:
            raise NetworkNotAllowed(f"network is not available on this host: {why}")
        await asyncio.to_thread(iptables.ensure, slirp_rules())  # fail closed, before slirp
        slirp = shutil.which("slirp4netns")
        assert slirp is not None
        ready_r, ready_w = os.pipe()
        exit_r, exit_w = os.pipe()
        os.set_blocking(ready_r, False)
        try:
            proc = await asyncio.create_subprocess_exec(
                *build_slirp_argv(slirp, pid, ready_w, exit_r),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
                pass_fds=[ready_w, exit_r],
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
            )
        except OSError as exc:
            for fd in (ready_r, exit_w):
                os.close(fd)
            raise SandboxFailed(f"cannot start slirp4netns: {exc}") from None
        finally:
            os.close(ready_w)
            os.close(exit_r)
        net = cls(proc, exit_w)
        try:
            await net._wait_ready(ready_r)
        except BaseException:
            await net.close()
            raise
        finally:
            os.close(ready_r)
        return net

    async def _wait_ready(self, ready_r: int) -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[bytes] = loop.create_future()

        def on_readable() -> None:
            if not ready.done():
                try:
                    ready.set_result(os.read(ready_r, 1))
                except OSError as exc:
                    ready.set_exception(exc)

        loop.add_reader(ready_r, on_readable)
        try:
            data = await asyncio.wait_for(ready, SLIRP_READY_TIMEOUT_S)
        except (TimeoutError, OSError):
            data = b""
        finally:
            loop.remove_reader(ready_r)
        if data != b"1":
            raise SandboxFailed("slirp4netns did not bring up the sandbox's network")

    async def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.exit_fd)
        for sig, wait in ((None, 2.0), (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            if sig is not None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(sig)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), wait)
                return


def other_slirps(exclude: set[int] | frozenset[int] = frozenset()) -> bool:
    """Does any slirp4netns in group ``SLIRP_GID`` run (another server's)? Then the
    shared OUTPUT rules must stay."""
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if int(status.parent.name) in exclude or "Name:\tslirp4netns" not in text:
            continue
        gid = re.search(r"^Gid:\s+(\d+)", text, re.MULTILINE)
        if gid is not None and int(gid.group(1)) == SLIRP_GID:
            return True
    return False
