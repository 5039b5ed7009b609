"""Sockets bound through their directory's fd: they work however deep the directory is."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from mcp_code_sandbox.backends.docker.sandbox import bind_listener
from mcp_code_sandbox.backends.unix_sockets import SocketDir
from mcp_code_sandbox.errors import SandboxFailed


def _deep(base: Path) -> Path:
    path = base / "/".join(["d" * 60] * 5)  # 300+ characters: no sun_path holds it
    path.mkdir(parents=True)
    return path


def test_a_listener_in_a_deep_directory_accepts(tmp_path: Path) -> None:
    deep = _deep(tmp_path)
    with SocketDir(deep) as directory:
        listener = directory.listen("s.sock", mode=0o600)
        with listener, socket.socket(socket.AF_UNIX) as client:
            client.connect(directory.address("s.sock"))
            listener.setblocking(True)
            conn, _ = listener.accept()
            conn.close()
    assert (deep / "s.sock").is_socket()
    assert (deep / "s.sock").stat().st_mode & 0o777 == 0o600


def test_the_docker_channel_binds_in_a_deep_state_dir(tmp_path: Path) -> None:
    deep = _deep(tmp_path)
    bind_listener(deep, (os.geteuid(), os.getegid())).close()
    assert (deep / "agent.sock").is_socket()
    # A socket a dead server left is replaced; anything else there is refused, and the
    # message names no host path.
    bind_listener(deep, (os.geteuid(), os.getegid()), replace=True).close()
    (deep / "agent.sock").unlink()
    (deep / "agent.sock").write_text("not a socket")
    with pytest.raises(SandboxFailed) as failed:
        bind_listener(deep, (os.geteuid(), os.getegid()), replace=True)
    assert str(tmp_path) not in failed.value.message


def test_a_missing_directory_fails_without_naming_it(tmp_path: Path) -> None:
    with pytest.raises(SandboxFailed) as failed:
        bind_listener(tmp_path / "gone", (os.geteuid(), os.getegid()))
    assert str(tmp_path) not in failed.value.message
    assert "state directory" in failed.value.message
