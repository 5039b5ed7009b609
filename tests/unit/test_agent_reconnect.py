"""``--connect`` survives its host: at EOF the agent keeps its interpreter, reconnects to
the same path and says ``ready`` again with ``reattached``; ``--reconnect-s`` bounds how
long it waits, and a run in progress goes on unreported."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mcp_code_sandbox.agent.protocol import read_frame, write_frame

SRC = Path(__file__).resolve().parents[2] / "src"
CONFIG = {"kill_strays": False, "pids": None, "file_bytes": None, "memory_bytes": None}


def spawn(path: Path, workdir: Path, *extra: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "mcp_code_sandbox.agent", "--connect", str(path), "--plain",
            "--workdir", str(workdir), "--config", json.dumps(CONFIG), *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


def listen(path: Path) -> socket.socket:
    path.unlink(missing_ok=True)  # what a restarted server does with a stale socket
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    listener.settimeout(30)
    return listener


def accept(path: Path) -> socket.socket:
    with listen(path) as listener:
        conn, _ = listener.accept()
    return conn


def read(conn: socket.socket) -> dict[str, Any] | None:
    # Bounded: a broken agent must fail the test, not hang it (the socket stays blocking,
    # as read_frame needs).
    ready, _, _ = select.select([conn], [], [], 30)
    assert ready, "the agent sent nothing for 30 s"
    return read_frame(conn.fileno())


def run(conn: socket.socket, run_id: int, code: str) -> dict[str, Any]:
    write_frame(conn, {"op": "exec", "id": run_id, "code": code, "timeout_s": 20})
    while True:
        message = read(conn)
        assert message is not None, "the agent closed the channel"
        if message.get("ev") == "done" and message.get("id") == run_id:
            return message


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    path = tmp_path / "agent.sock"
    proc = spawn(path, tmp_path)
    try:
        # The listener closes at once, as the server's does: a host that is gone must
        # not leave one behind for the agent to reconnect into.
        with accept(path) as conn:
            assert (read(conn) or {}).get("ev") == "ready"
            assert run(conn, 1, "kept = 41")["status"] == "ok"
        yield path, proc
    finally:
        proc.kill()
        proc.wait()


def test_variables_survive_a_lost_host(agent: tuple[Path, subprocess.Popen[bytes]]) -> None:
    path, proc = agent
    # The first connection is closed: the host "crashed". A new one listens on the path.
    with accept(path) as conn:
        ready = read(conn) or {}
        assert ready.get("ev") == "ready" and ready.get("reattached") is True
        assert ready.get("execution_count") == 1
        assert ready.get("pid") == proc.pid
        done = run(conn, 1, "kept + 1")  # ids may start over with a new host
        assert done["status"] == "ok" and done["result"] == "42"
    with accept(path) as conn:  # and again
        assert (read(conn) or {}).get("reattached") is True
        assert run(conn, 7, "kept")["result"] == "41"
        write_frame(conn, {"op": "shutdown"})
        assert proc.wait(timeout=20) == 0


def test_a_run_in_progress_finishes_unreported(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    with listen(path) as listener:
        proc = spawn(path, tmp_path)
        try:
            conn, _ = listener.accept()
            listener.close()
            with conn:
                assert (read(conn) or {}).get("ev") == "ready"
                write_frame(conn, {"op": "exec", "id": 1, "timeout_s": 20,
                                   "code": "import time\nfor i in range(15):\n"
                                           "    print(i, flush=True); time.sleep(0.1)\n"
                                           "finished = True"})  # fmt: skip
                write_frame(conn, {"op": "exec", "id": 2, "code": "queued = True"})
                time.sleep(0.3)
            with accept(path) as conn:
                assert (read(conn) or {}).get("reattached") is True
                # Queued behind the orphaned run; nothing of run 1 (same id) comes here.
                write_frame(conn, {"op": "exec", "id": 1, "timeout_s": 20,
                                   "code": "(finished, 'queued' in globals())"})  # fmt: skip
                message = read(conn) or {}
                assert message.get("ev") == "done", message
                assert message["result"] == "(True, False)"
        finally:
            proc.kill()
            proc.wait()


def test_gives_up_after_reconnect_s(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    with listen(path) as listener:
        proc = spawn(path, tmp_path, "--reconnect-s", "1")
        try:
            conn, _ = listener.accept()
            with conn:
                assert (read(conn) or {}).get("ev") == "ready"
            listener.close()
            path.unlink()
            started = time.monotonic()
            assert proc.wait(timeout=20) == 1
            assert time.monotonic() - started < 10
        finally:
            proc.kill()
            proc.wait()


def test_channel_fd_mode_still_exits_at_eof(tmp_path: Path) -> None:
    host, child = socket.socketpair()
    argv = [sys.executable, "-m", "mcp_code_sandbox.agent", "--channel-fd", str(child.fileno()),
            "--workdir", str(tmp_path), "--config", json.dumps(CONFIG), "--plain"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen(argv, env=env, pass_fds=[child.fileno()], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    child.close()
    try:
        with host:
            assert (read(host) or {}).get("ev") == "ready"
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
        proc.wait()
