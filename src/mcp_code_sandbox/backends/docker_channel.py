"""The host end of a docker sandbox's channel: its run dir and the socket listening in it.

Per sandbox the server makes a run dir ``<state_dir>/run/<key>-<random>/`` (the name is
recorded in the container's ``LABEL_RUN_DIR``) and listens on ``agent.sock`` in it; the
dir is bind-mounted read-only at ``/run/mcs`` and the agent connects there. The name is
random, not the key, because two live servers sharing a state dir may each hold a session
of the same owner and id. Re-attaching after a crash binds the same path again
(:func:`bind_listener` with ``replace``): the agent keeps reconnecting to it.

Blocking file-system calls: run them in a thread.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import stat
from pathlib import Path

from mcp_code_sandbox.backends.base import SANDBOX_GID, SANDBOX_UID
from mcp_code_sandbox.backends.docker_spec import SOCKET_NAME
from mcp_code_sandbox.errors import SandboxFailed

__all__ = ["bind_listener", "make_run_dir", "run_dir_from_label"]


def make_run_dir(base: Path, key: str) -> Path:
    base.mkdir(parents=True, exist_ok=True)
    run_dir = base / f"{key}-{secrets.token_hex(4)}"
    run_dir.mkdir(mode=0o755)
    return run_dir


def run_dir_from_label(base: Path, name: str | None) -> Path | None:
    """The run dir a label names, or ``None``: only a plain name under ``base`` counts,
    since a label is not a path to trust."""
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        return None
    return base / name


def bind_listener(run_dir: Path, *, replace: bool = False) -> socket.socket:
    """A non-blocking listener on ``run_dir/agent.sock``, owned by the sandbox uid, 0600.

    ``replace`` first unlinks a socket a dead server left there (only a socket: anything
    else is refused, though the sandbox cannot write here, the mount being read-only).
    Raises ``SandboxFailed``; on a fresh run dir (not ``replace``) it is removed then.
    """
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Through the directory's fd: a state dir may be deeper than sun_path's 108 bytes,
        # and no link in the path is followed.
        dir_fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        listener.close()
        raise SandboxFailed(f"cannot open the sandbox's run dir {run_dir}: {exc}") from None
    try:
        if replace:
            _unlink_socket(dir_fd)
        listener.bind(f"/proc/self/fd/{dir_fd}/{SOCKET_NAME}")
        os.chown(SOCKET_NAME, SANDBOX_UID, SANDBOX_GID, dir_fd=dir_fd)
        os.chmod(SOCKET_NAME, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        listener.close()
        if not replace:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise SandboxFailed(f"cannot make the sandbox's channel in {run_dir}: {exc}") from None
    finally:
        os.close(dir_fd)
    listener.listen(1)
    listener.setblocking(False)
    return listener


def _unlink_socket(dir_fd: int) -> None:
    try:
        st = os.stat(SOCKET_NAME, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"{SOCKET_NAME} is not a socket")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SOCKET_NAME, dir_fd=dir_fd)
