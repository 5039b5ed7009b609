"""The agent's end of the host channel, and how it comes back when the host went away.

Three kinds of channel, with different answers to "the host is gone":

- ``--channel-fd`` (bwrap): an inherited socketpair. The sandbox dies with the server
  (``--die-with-parent``), so EOF means the end: the supervisor kills everything and exits.
- ``--connect PATH`` (docker): a Unix socket the server listens on. The container outlives
  a server that crashed, and a restarted server listens on the same path again, so at EOF
  the agent closes its end and reconnects with backoff while runs go on. What it would
  send meanwhile is dropped (a run's ``done`` may be lost). After ``give_up_s`` with no
  host the agent exits, so an orphaned container does not live for ever (the server also
  removes orphans at its next start). ``give_up_s`` 0: the server that made the sandbox
  has no successor (a private server, ``sessions.holder``), so the agent exits at once,
  and its container stops with it.

- ``--listen ADDR:PORT`` (Kubernetes): the agent listens and servers dial in, each
  connection authenticated first (:mod:`.listener`). There is no give-up timer: the agent
  waits for a server for as long as its pod lives (the server deletes pods), and the
  newest authenticated connection becomes the link once no run is in flight. ``fd`` is
  then the TLS connection's, read and written through ``tls``.

Parked (the host sent ``park`` before a checkpoint): the agent closes its end at once and
retries every ``PARK_RETRY_S`` rather than with backoff, and counts attempts, not time,
against ``give_up_s``: a checkpointed sandbox is frozen for as long as it stays paused
(hours, days), and when it is restored its clock has jumped by all of that.

Semantics: ``fd`` is ``None`` exactly while the host is away; ``retry_at`` is then when
the next attempt is due. Standard library only, like the rest of the agent.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .protocol import encode_frame

if TYPE_CHECKING:  # not at run time: ssl is imported only with --listen
    from .listener import Listener, TlsConnection

__all__ = [
    "BACKOFF_MAX_S",
    "PARK_RETRY_S",
    "RECONNECT_GIVE_UP_S",
    "HostLink",
    "bare_fd",
    "connect",
]

#: Longest pause between two reconnect attempts. A restarted server waits a few times
#: this for the agent (see ``backends.docker.REATTACH_WAIT_S``).
BACKOFF_MAX_S = 1.0
_BACKOFF_MIN_S = 0.05
#: Default time an agent with no host waits before it gives up and exits.
RECONNECT_GIVE_UP_S = 600.0
#: Between two attempts after a ``park``: the sandbox is about to be checkpointed, and
#: after its restore the agent should be back within tens of milliseconds.
PARK_RETRY_S = 0.02


def connect(path: str, wait_s: float) -> int:
    """Connect to the host's Unix socket at ``path``; the connected fd (blocking).

    A path not there yet, or refusing (a stale socket file of a dead server), is retried
    until ``wait_s`` has passed; other errors are raised at once."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return _connect_once(path)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(_BACKOFF_MIN_S)


def bare_fd(sock: socket.socket) -> int:
    """``sock``'s connection as a plain fd of the caller's own (not inheritable, as the
    socket's was; its blocking mode is the connection's, so it stays), ``sock`` closed.
    For code that selects and reads on fds, and for ``signal.set_wakeup_fd``."""
    try:
        return os.dup(sock.fileno())
    finally:
        sock.close()


def _connect_once(path: str) -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Bounded: a connect to a listener whose backlog is full blocks.
        sock.settimeout(2.0)
        sock.connect(path)
        sock.setblocking(True)
    except BaseException:
        sock.close()
        raise
    return bare_fd(sock)


class HostLink:
    """The channel fd, and (``path`` set) the state of reconnecting to the host."""

    def __init__(
        self,
        fd: int | None,
        path: str | None,
        give_up_s: float = RECONNECT_GIVE_UP_S,
        listener: Listener | None = None,
    ):
        """``fd`` ``None`` only with a ``listener``: no server has connected yet."""
        self.fd = fd
        self.path = path
        self.listener = listener
        #: The TLS connection ``fd`` belongs to (``--listen``); ``None``: ``fd`` is a bare one.
        self.tls: TlsConnection | None = None
        self.give_up_s = give_up_s
        self.retry_at = 0.0
        self._backoff = _BACKOFF_MIN_S
        self._give_up_at = 0.0
        #: Parked: attempts left before giving up (``None``: not parked, time counts).
        self._attempts_left: int | None = None
        #: Parked, and no word from a host since: the checkpoint and restore that follow
        #: may break a connection again, and that is still part of the park.
        self.parked = False

    @property
    def can_reconnect(self) -> bool:
        return self.path is not None or self.listener is not None

    def waits_for(self, *, parked: bool) -> bool:
        """Is a host that went away (``parked``: on purpose) waited for? ``give_up_s`` 0
        (a private server's sandbox, which no successor comes back for) waits only
        during a park. A listening agent always waits."""
        if self.listener is not None:
            return True
        return self.can_reconnect and (parked or self.parked or self.give_up_s > 0)

    def adopt(self, conn: TlsConnection) -> None:
        """An authenticated connection becomes the link (the caller closed the old one)."""
        self.fd = conn.fileno()
        self.tls = conn
        self.heard()

    def read(self) -> bytes | None:
        """What the host sent: ``b""`` at EOF, ``None`` when nothing whole came yet."""
        assert self.fd is not None
        if self.tls is not None:
            return self.tls.read()
        try:
            return os.read(self.fd, 1 << 20)
        except ConnectionResetError:
            return b""

    def send(self, message: Mapping[str, Any]) -> None:
        """Write one frame (blocking); ``OSError`` when the host is gone."""
        assert self.fd is not None
        data = encode_frame(message)
        if self.tls is not None:
            self.tls.send(data)
            return
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def close(self) -> None:
        """Close the connection (the caller unregistered it); ``fd`` stays for ``lost``."""
        if self.tls is not None:
            self.tls.close()
            self.tls = None
        elif self.fd is not None:
            os.close(self.fd)

    def heard(self) -> None:
        """A host spoke on the channel: a park is over."""
        self.parked = False

    def lost(self, *, parked: bool = False) -> None:
        """The host went away (``parked``: asked us to go): start waiting for it (the
        caller closed ``fd``)."""
        now = time.monotonic()
        self.fd = None
        parked = self.parked = parked or self.parked
        self._backoff = PARK_RETRY_S if parked else _BACKOFF_MIN_S
        self.retry_at = now + (PARK_RETRY_S if parked else 0.0)
        self._give_up_at = now + self.give_up_s
        park_s = self.give_up_s or RECONNECT_GIVE_UP_S  # a park is always waited for
        self._attempts_left = max(1, int(park_s / PARK_RETRY_S)) if parked else None

    def due_in(self) -> float:
        """Seconds until the next attempt is due: never more than the pause between two
        attempts, whatever the clock did meanwhile (a restored checkpoint's may go back)."""
        return max(0.0, min(self.retry_at - time.monotonic(), self._backoff))

    def try_reconnect(self) -> bool:
        """One attempt; True when connected (``fd`` set). Raises ``TimeoutError`` once
        the host has been away for ``give_up_s``."""
        assert self.path is not None
        now = time.monotonic()
        try:
            self.fd = _connect_once(self.path)
            self._attempts_left = None
            return True
        except OSError:
            pass
        if self._attempts_left is not None:  # parked: the clock may jump, attempts do not
            self._attempts_left -= 1
            if self._attempts_left <= 0:
                raise TimeoutError(f"no host at {self.path} after parking")
            self.retry_at = now + PARK_RETRY_S
            return False
        if now >= self._give_up_at:
            raise TimeoutError(f"no host at {self.path} for {self.give_up_s:g} s")
        self.retry_at = now + self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
        return False
