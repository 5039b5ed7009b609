"""Unix sockets the server listens on, whatever the length of their directory's path.

A socket's address (``sun_path``) holds at most 107 bytes, and a state directory is
often deeper than that leaves room for (``/home/<user>/.local/state/mcp-code-sandbox``
plus ``egress/<session key>-<random>/proxy.sock`` is past it for many user names). So
every socket the server makes is bound through a file descriptor of its directory: its
address is ``/proc/self/fd/<fd>/<name>``, under 32 bytes wherever the directory is.
:class:`SocketDir` holds that descriptor; the egress proxies (``sessions.egress``) and
the docker agent channel (``docker.sandbox``) bind through it, and so must any socket
added later.

Why not a short directory of its own (``/run/...`` or ``$XDG_RUNTIME_DIR``): a socket's
directory is bind-mounted into the sandbox, and the Docker engine must find it under
its own view of the state dir (``SANDBOX_DOCKER_HOST_STATE_DIR``, a server in a
container): a second directory would need a second mapping, and its own owner, modes,
clean-up and ``doctor`` check, for no gain. Inside the sandbox the socket's path is
short whatever the host's (``/run/mcs/agent.sock``, ``/run/mcs-egress/proxy.sock``).

Blocking calls: run them in a worker thread.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path
from types import TracebackType

__all__ = ["SocketDir"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class SocketDir:
    """A directory held open, whose sockets are named by a short address.

    Open while anything uses :meth:`address` (a listener binding or unlinking by it);
    :meth:`close` when done. The directory's last component is not followed if a
    link; raises ``OSError`` (with ``filename`` set) when it cannot be opened."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = os.open(path, _DIR_FLAGS)

    def address(self, name: str) -> str:
        """``name`` in this directory, as a path short enough for any socket address."""
        if self.fd is None:
            raise ValueError("the socket directory is closed")
        return f"/proc/self/fd/{self.fd}/{name}"

    def listen(
        self, name: str, *, owner: tuple[int, int] | None = None, mode: int
    ) -> socket.socket:
        """A new non-blocking stream listener bound at ``name`` (which must not exist),
        given ``owner`` (uid, gid; ``None``: the server's) and ``mode``."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.address(name))
            if owner is not None and owner != (os.geteuid(), os.getegid()):
                os.chown(name, *owner, dir_fd=self.fd)
            os.chmod(name, mode, dir_fd=self.fd)
            listener.listen(1)
        except BaseException:
            listener.close()
            raise
        listener.setblocking(False)
        return listener

    def unlink_socket(self, name: str) -> None:
        """Remove the socket ``name`` (one a dead server left); nothing if absent.
        Raises ``OSError`` if ``name`` is anything but a socket."""
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(f"{name} is not a socket")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> SocketDir:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
