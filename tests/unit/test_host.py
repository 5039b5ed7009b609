"""Marks of server processes (pid files, container labels) survive pid reuse: a server in
a container has the same pid at every start, so only the start time tells them apart."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from mcp_code_sandbox.backends.docker.engine import instance_alive
from mcp_code_sandbox.host import process_alive, process_mark, process_start, read_mark
from mcp_code_sandbox.sessions.recovery import alive

PID = os.getpid()


def test_this_process_has_a_start_time_and_a_mark() -> None:
    start = process_start(PID)
    assert isinstance(start, int) and start > 0
    assert process_mark() == f"{PID}.{start}"
    assert process_start(999_999_999) is None


def test_read_mark() -> None:
    assert read_mark("7") == (7, None)
    assert read_mark("7.12345\n") == (7, 12345)
    for bad in ("", "x", "7.", "7.x", "-1", "7.1.2"):
        assert read_mark(bad) is None, bad


def test_a_reused_pid_is_not_the_process_that_left_the_mark() -> None:
    start = process_start(PID)
    assert start is not None
    assert process_alive(PID, start)
    assert process_alive(PID)  # an old mark, without a start time: the pid alone
    assert not process_alive(PID, start + 1)
    assert not process_alive(999_999_999)
    assert not process_alive(0)


def test_pid_files(tmp_path: Path) -> None:
    pidfile = tmp_path / "x.pid"
    assert not alive(pidfile)  # no file
    pidfile.write_text(process_mark())
    assert alive(pidfile)
    pidfile.write_text(str(PID))  # a server before start times were recorded
    assert alive(pidfile)
    pidfile.write_text(f"{PID}.{(process_start(PID) or 0) + 1}")
    assert not alive(pidfile)
    pidfile.write_text("garbage")
    assert not alive(pidfile)


def test_container_labels_of_a_restarted_server_container_are_leftovers() -> None:
    host = socket.gethostname()
    start = process_start(PID)
    assert start is not None
    assert instance_alive(f"{host}-{PID}.{start}-abcd", "mine")
    # Same host name, same pid, started at another time: the container restarted.
    assert not instance_alive(f"{host}-{PID}.{start + 1}-abcd", "mine")
    assert not instance_alive(f"{host}-{PID}.x-abcd", "mine")
