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

from mcp_code_sandbox.agent.hostlink import PARK_RETRY_S, HostLink
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


def channel_fd_agent(tmp_path: Path) -> tuple[socket.socket, subprocess.Popen[bytes]]:
    """An agent on an inherited socket (``--channel-fd``), and the host's end of it."""
    host, child = socket.socketpair()
    argv = [sys.executable, "-m", "mcp_code_sandbox.agent", "--channel-fd", str(child.fileno()),
            "--workdir", str(tmp_path), "--config", json.dumps(CONFIG), "--plain"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen(argv, env=env, pass_fds=[child.fileno()], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    child.close()
    return host, proc


def test_channel_fd_mode_still_exits_at_eof(tmp_path: Path) -> None:
    host, proc = channel_fd_agent(tmp_path)
    try:
        with host:
            assert (read(host) or {}).get("ev") == "ready"
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
        proc.wait()


def test_park_closes_the_channel_and_the_agent_is_back_at_once(
    agent: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    path, proc = agent
    with accept(path) as conn:
        assert (read(conn) or {}).get("reattached") is True
        assert run(conn, 2, "parked = 'yes'")["status"] == "ok"
        write_frame(conn, {"op": "park"})
        assert read(conn) is None  # EOF: the agent closed its end at once
        # The stale socket file refuses (nobody listens): what a frozen sandbox finds.
        time.sleep(0.5)
    with accept(path) as conn:  # every 20 ms, not after a backoff of up to a second
        ready = read(conn) or {}
        assert ready.get("reattached") is True and ready.get("pid") == proc.pid
        assert ready.get("execution_count") == 2
        assert run(conn, 3, "kept, parked")["result"] == "(41, 'yes')"


def test_park_on_a_channel_that_cannot_reconnect_is_an_error(tmp_path: Path) -> None:
    host, proc = channel_fd_agent(tmp_path)
    try:
        with host:
            assert (read(host) or {}).get("ev") == "ready"
            write_frame(host, {"op": "park"})
            error = read(host) or {}
            assert error.get("ev") == "error" and "--connect" in error.get("message", "")
            assert run(host, 1, "1 + 1")["result"] == "2"  # and it carries on
    finally:
        proc.kill()
        proc.wait()


def test_parked_counts_attempts_not_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    link = HostLink(-1, str(tmp_path / "nobody.sock"), give_up_s=0.1)
    link.lost(parked=True)
    now = [1000.0]
    monkeypatch.setattr("mcp_code_sandbox.agent.hostlink.time.monotonic", lambda: now[0])
    attempts = int(0.1 / PARK_RETRY_S)
    for _ in range(attempts - 1):
        now[0] += 86_400.0  # a day frozen between two attempts: not a reason to give up
        assert link.try_reconnect() is False
        assert link.due_in() <= PARK_RETRY_S
    with pytest.raises(TimeoutError):
        link.try_reconnect()
    # Not parked, the time counts (as before).
    link = HostLink(-1, str(tmp_path / "nobody.sock"), give_up_s=0.1)
    link.lost()
    now[0] += 1.0
    with pytest.raises(TimeoutError):
        link.try_reconnect()


def test_the_clock_going_back_does_not_delay_the_next_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [5000.0]
    monkeypatch.setattr("mcp_code_sandbox.agent.hostlink.time.monotonic", lambda: now[0])
    link = HostLink(-1, str(tmp_path / "nobody.sock"))
    link.lost(parked=True)
    now[0] -= 3600.0  # a restored checkpoint's clock
    assert link.due_in() <= PARK_RETRY_S
