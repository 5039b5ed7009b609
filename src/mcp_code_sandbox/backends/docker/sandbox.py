"""The host end of a docker sandbox's channel: its run dir and the socket listening in it.

Per sandbox the server makes a run dir ``<state_dir>/run/<key>-<random>/`` (the name is
recorded in the container's ``LABEL_RUN_DIR``) and listens on ``agent.sock`` in it; the
dir is bind-mounted read-only at ``/run/mcs`` and the agent connects there. The name is
random, not the key, because two live servers sharing a state dir may each hold a session
of the same owner and id. Re-attaching after a crash binds the same path again
(:func:`bind_listener` with ``replace``): the agent keeps reconnecting to it.

Then the agent connects (:func:`accept_agent`) and says ``ready`` (:func:`wait_ready`);
a :class:`DockerSandbox` holds the channel. Blocking file-system calls here: run them in a
thread. Engine calls go through the backend's ``call`` (which maps docker-py's errors).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mcp_code_sandbox.backends import base
from mcp_code_sandbox.backends.base import Channel, Sandbox, SandboxSpec
from mcp_code_sandbox.backends.docker.spec import SOCKET_NAME
from mcp_code_sandbox.backends.streams import escape_control
from mcp_code_sandbox.backends.unix_sockets import SocketDir
from mcp_code_sandbox.errors import SandboxError, SandboxFailed

__all__ = [
    "DockerSandbox",
    "accept_agent",
    "bind_listener",
    "make_run_dir",
    "run_dir_from_label",
    "wait_ready",
]

log = logging.getLogger(__name__)

_LOG_TAIL = 20
_LOG_TAIL_BYTES = 4000
Call = Callable[..., Awaitable[Any]]


class DockerSandbox(Sandbox):
    def __init__(self, spec: SandboxSpec, channel: Channel, container: Any, run_dir: Path) -> None:
        super().__init__(spec, channel, backend_id=str(container.id))
        self.container = container
        self.run_dir = run_dir
        self.reader: asyncio.StreamReader | None = None
        #: A duplicate of the channel's socket, only ever peeked at by :meth:`is_alive`.
        self.peer: socket.socket | None = None
        #: Started from a checkpoint (``DockerBackend.restore``): not checkpointed again.
        self.restored = False

    def is_alive(self) -> bool:
        # No engine call here (it is synchronous): the container dies with its agent, and
        # the agent's socket then reaches EOF. Asked of the kernel, not only of the
        # reader: the event loop may not have read that EOF yet when a call comes in
        # right after a `docker kill`, and the call would then fail instead of getting
        # a new container.
        if self.reader is None or self.reader.at_eof():
            return False
        if self.peer is None:
            return True
        try:
            return self.peer.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True  # open, nothing to read
        except OSError:
            return False

    def close(self) -> None:
        self.channel.close()
        if self.peer is not None:
            self.peer.close()


def make_run_dir(base: Path, key: str) -> Path:
    """A new run dir under ``base``; ``SandboxFailed`` (the path logged) if it cannot be."""
    run_dir = base / f"{key}-{secrets.token_hex(4)}"
    try:
        base.mkdir(parents=True, exist_ok=True)
        run_dir.mkdir(mode=0o755)
    except OSError as exc:
        log.error("cannot make the sandbox's run dir %s: %s", run_dir, exc)
        raise SandboxFailed(
            "cannot make the sandbox's run directory in the state directory "
            f"({exc.strerror or exc}; the server's log names it). Check that the server "
            "may write its state directory, then try again"
        ) from None
    return run_dir


def run_dir_from_label(base: Path, name: str | None) -> Path | None:
    """The run dir a label names, or ``None``: only a plain name under ``base`` counts,
    since a label is not a path to trust."""
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        return None
    return base / name


def bind_listener(run_dir: Path, ids: tuple[int, int], *, replace: bool = False) -> socket.socket:
    """A non-blocking listener on ``run_dir/agent.sock``, owned by the sandbox's ``ids``
    (uid, gid), mode 0600: only the sandbox may connect (and root). Bound through the
    directory's fd (:class:`.unix_sockets.SocketDir`): a state dir may be deeper than a
    socket's address allows.

    ``replace`` first unlinks a socket a dead server left there (only a socket: anything
    else is refused, though the sandbox cannot write here, the mount being read-only).
    Raises ``SandboxFailed`` (the path goes to the log, not to the client); on a fresh run
    dir (not ``replace``) it is removed then.
    """
    try:
        with SocketDir(run_dir) as directory:
            if replace:
                directory.unlink_socket(SOCKET_NAME)
            return directory.listen(SOCKET_NAME, owner=ids, mode=0o600)
    except OSError as exc:
        log.error("cannot make the sandbox's channel in %s: %s", run_dir, exc)
        if not replace:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise SandboxFailed(
            "cannot make the sandbox's channel (a Unix socket in the state directory: "
            f"{exc.strerror or exc}); the server's log names it. Check that the server "
            "may write its state directory, then try again"
        ) from None


async def accept_agent(
    listener: socket.socket, container: Any, call: Call, wait_s: float, hint: str = ""
) -> tuple[Channel, asyncio.StreamReader, socket.socket]:
    """The agent's connection (and a duplicate of its socket, for ``is_alive``);
    fails early, with its log, if the container exits."""
    loop = asyncio.get_running_loop()
    accept = asyncio.ensure_future(loop.sock_accept(listener))
    try:
        async with asyncio.timeout(wait_s):
            while not accept.done():
                await asyncio.wait({accept}, timeout=0.5)
                if not accept.done():
                    await call(container.reload)
                    if container.status not in ("created", "running"):
                        raise SandboxFailed(
                            "the sandbox container exited before its agent connected"
                            + await log_tail(container, call)
                            + hint
                        )
    except TimeoutError:
        raise SandboxFailed(
            f"the sandbox agent did not connect within {wait_s:.0f} s"
            + await log_tail(container, call)
        ) from None
    finally:
        accept.cancel()
    conn, _ = accept.result()
    peer = conn.dup()
    reader, writer = await asyncio.open_unix_connection(sock=conn)
    return Channel(reader, writer), reader, peer


async def wait_ready(sandbox: DockerSandbox, call: Call, wait_s: float) -> dict[str, Any]:
    """The agent's ``ready`` (:func:`.base.wait_ready`); else ``SandboxFailed`` with the
    agent's own error message, if it sent one, and the container's log tail."""

    async def not_ready(message: dict[str, Any] | None, _timed_out: bool) -> str:
        error = message is not None and message.get("ev") == "error"
        detail = f" ({message.get('message')})" if message is not None and error else ""
        return f"the sandbox agent did not say ready{detail}" + await log_tail(
            sandbox.container, call
        )

    return await base.wait_ready(sandbox, wait_s, not_ready)


async def log_tail(container: Any, call: Call) -> str:
    try:
        raw = await call(container.logs, tail=_LOG_TAIL)
    except SandboxError:
        return " (its log could not be read)"
    # The log is the sandbox's to write (bounded by the engine's max-size): its last
    # bytes only, each line with its control characters escaped.
    text = bytes(raw)[-_LOG_TAIL_BYTES:].decode("utf-8", "replace").strip()
    lines = [escape_control(line) for line in text.splitlines()]
    return (":\n" + "\n".join(lines)) if lines else " (nothing in its log)"
