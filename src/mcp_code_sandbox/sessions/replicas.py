"""Several HTTP servers on one state directory, as replicas: any of them serves any session.

Started with ``SANDBOX_REPLICA=true`` (``--replica``), HTTP servers on one state
directory share its sessions (a server without it stays alone there: :mod:`.holder`).
The rules:

- **The record is the truth.** A session's record (:mod:`.records`) names the replica that
  holds it now (``instance``). Every replica reads records; only the holder writes one.
- **One holder at a time.** The holder alone talks to the session's sandbox (its agent
  accepts one host connection), runs its calls one at a time in arrival order, pauses,
  resumes, moves or ends it. A replica that gets a call for a session another replica
  holds takes it over before it runs the call: a *handover*.
- **A handover** is done under the session's :class:`Lease` (an ``flock`` on
  ``run_dir/leases/<key>``: one handover of a session at a time, and the kernel drops it
  with a holder that dies). The taker starts listening on the sandbox's channel, then asks
  the holder, over the holder's control socket (:class:`Control`,
  ``run_dir/replicas/<instance>.sock``), to let go. The holder waits for the calls it has
  already queued for the session (they arrived first), writes the record as it stands,
  closes its end of the channel and forgets the session; the agent reconnects to the taker
  at once (:mod:`mcp_code_sandbox.agent.hostlink`), which writes the record as its own.
  Calls queued on the holder after that ask for the session back in turn, so calls run
  in the order they reached the replicas' queues.
- **A dead holder** (SIGKILL, a clean stop) holds nothing: its sessions' containers run on
  (their agents wait for a host) and their records stay. The next replica that gets a
  call for one of them, and every replica's reaper once a pass, takes over what dead
  servers left exactly as a restarted server does (:func:`.recovery.recover`, under its
  lock, so two replicas never both take a session).
- **A clean stop of a replica** lets go of its sessions without pausing them: a rolling
  restart (start a new replica, stop the old) pauses nothing.

Why a handover and not an agent that takes several host connections: the agent's channel
is a Unix socket the server listens on and the agent connects to (under gVisor a socket
the sandbox made is not visible on the host), so only one replica can be on the other
end at a time; a handover costs one reconnect only when a call lands on a replica that is
not the session's last, keeps every call on one ordered channel, and needs nothing new
from the agent or the image.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from mcp_code_sandbox.backends.unix_sockets import SocketDir

__all__ = ["LEASES_DIR", "REPLICAS_DIR", "Control", "Lease", "ask_to_let_go"]

log = structlog.get_logger("mcp_code_sandbox.sessions.replicas")

#: Under ``run_dir``: one lock file per session key, held during a handover.
LEASES_DIR = "leases"
#: Under ``run_dir``: each live replica's control socket, ``<instance>.sock``.
REPLICAS_DIR = "replicas"
#: Between two tries of a lease another replica holds: a handover takes milliseconds,
#: and a call waiting on one should not pay much more than that.
_LEASE_POLL_S = 0.002
_LEASE_POLL_MAX_S = 0.02
#: A request or an answer on a control socket is one short JSON line.
_LINE_LIMIT = 4096

#: ``let_go(owner, session_id)``: True when this replica held the session and has let
#: it go (its record is written, its channel closed); False when it did not hold it.
LetGo = Callable[[str, str], Awaitable[bool]]


class Lease:
    """The exclusive ``flock`` on ``run_dir/leases/<key>``: one handover of a session at a
    time across replicas. The kernel drops it when its holder dies, however it dies."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @classmethod
    async def take(cls, run_dir: Path, key: str, wait_s: float) -> Lease:
        """Wait (polling, never blocking the loop) for the lease; ``TimeoutError`` after
        ``wait_s``."""
        directory = run_dir / LEASES_DIR
        directory.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(directory / key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        pause = _LEASE_POLL_S
        try:
            async with asyncio.timeout(wait_s):
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        return cls(fd)
                    except BlockingIOError:
                        await asyncio.sleep(pause)
                        pause = min(pause * 2, _LEASE_POLL_MAX_S)
        except BaseException:
            os.close(fd)
            raise

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class Control:
    """This replica's control socket, where other replicas ask it to let go of a session.

    Only the server's uid can connect (the run dir and the socket are its own, mode 0700
    and 0600); a request is one JSON line ``{"let_go": [owner, session_id]}``, the answer
    one line ``{"held": bool}``."""

    def __init__(self, run_dir: Path, instance: str, let_go: LetGo) -> None:
        self.directory = run_dir / REPLICAS_DIR
        self.name = f"{instance}.sock"
        self._let_go = let_go
        self._server: asyncio.Server | None = None
        self._sockets: SocketDir | None = None

    async def start(self) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._sockets = SocketDir(self.directory)
        self._sockets.unlink_socket(self.name)
        listener = self._sockets.listen(self.name, mode=0o600)
        listener.listen(64)  # every other replica may ask at once
        self._server = await asyncio.start_unix_server(
            self._serve, sock=listener, limit=_LINE_LIMIT
        )

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        if self._sockets is not None:
            with contextlib.suppress(OSError):
                self._sockets.unlink_socket(self.name)
            self._sockets.close()
            self._sockets = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readuntil(b"\n")
            request = json.loads(line)
            owner, session_id = request["let_go"]
            if not isinstance(owner, str) or not isinstance(session_id, str):
                raise ValueError("owner and session id are strings")
            held = await self._let_go(owner, session_id)
            writer.write(json.dumps({"held": held}).encode() + b"\n")
            await writer.drain()
        except Exception as exc:  # a peer of ours sent nonsense, or went away
            log.warning("a replica's request failed", error=repr(exc))
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def ask_to_let_go(
    run_dir: Path, instance: str, owner: str, session_id: str, wait_s: float
) -> bool | None:
    """Ask replica ``instance`` to let go of a session; its answer (``held``), or
    ``None`` when it does not answer (not a replica, or dead): then it holds nothing
    that runs, and what it left is taken over as a dead server's. ``TimeoutError`` after
    ``wait_s``: it still runs a call of the session."""
    try:
        with SocketDir(run_dir / REPLICAS_DIR) as sockets:
            async with asyncio.timeout(wait_s):
                reader, writer = await asyncio.open_unix_connection(
                    sockets.address(f"{instance}.sock"), limit=_LINE_LIMIT
                )
                try:
                    request = {"let_go": [owner, session_id]}
                    writer.write(json.dumps(request).encode() + b"\n")
                    await writer.drain()
                    answer = json.loads(await reader.readuntil(b"\n"))
                finally:
                    writer.close()
    except (OSError, asyncio.IncompleteReadError, ValueError):
        return None  # TimeoutError goes to the caller: the holder is busy, not gone
    return answer.get("held") is True if isinstance(answer, dict) else None
