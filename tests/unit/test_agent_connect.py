"""The agent's ``--connect PATH`` channel (the docker backend's): it connects to a Unix
socket the host listens on, waiting a while for one that is not there yet."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mcp_code_sandbox.agent.hostlink import connect
from mcp_code_sandbox.agent.protocol import read_frame, write_frame

SRC = Path(__file__).resolve().parents[2] / "src"
CONFIG = {"kill_strays": False, "pids": None, "file_bytes": None, "memory_bytes": None}


def test_agent_connects_says_ready_and_runs(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(1)
        argv = [sys.executable, "-m", "mcp_code_sandbox.agent", "--connect", str(path),
                "--workdir", str(tmp_path), "--config", json.dumps(CONFIG), "--plain"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            listener.settimeout(30)
            conn, _ = listener.accept()
            with conn:
                assert (read_frame(conn.fileno()) or {}).get("ev") == "ready"
                write_frame(conn, {"op": "exec", "id": 1, "code": "1+1", "timeout_s": 20})
                done = read_frame(conn.fileno())
                assert done is not None and done["result"] == "2"
                write_frame(conn, {"op": "shutdown"})
                assert proc.wait(timeout=20) == 0
        finally:
            proc.kill()
            proc.wait()


def test_connect_waits_for_the_listener(tmp_path: Path) -> None:
    path = tmp_path / "late.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def listen_later() -> None:
        time.sleep(0.3)
        listener.bind(str(path))
        listener.listen(1)

    thread = threading.Thread(target=listen_later)
    thread.start()
    try:
        fd = connect(str(path), wait_s=10)
        os.close(fd)
    finally:
        thread.join()
        listener.close()


def test_connect_gives_up_after_its_wait(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(FileNotFoundError):
        connect(str(tmp_path / "never.sock"), wait_s=0.2)
    assert time.monotonic() - started < 5


def test_without_a_host_the_agent_exits_1_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import mcp_code_sandbox.agent.__main__ as agent_main

    monkeypatch.setattr(agent_main, "CONNECT_WAIT_S", 0.1)
    assert agent_main.main(["--connect", str(tmp_path / "never.sock"), "--config", "{}"]) == 1
    assert capsys.readouterr().err.count("\n") == 1
