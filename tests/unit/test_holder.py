"""The state directory's one service (``sessions.holder``): its lock, and how a second
one, ``doctor`` and a stdio server learn who holds it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mcp_code_sandbox.sessions.holder import (
    SERVICE_LOCK,
    PidFile,
    ServiceLock,
    pid_file_alive,
    refused,
    replicas_serve,
    service_pid,
)
from mcp_code_sandbox.settings import ConfigError


def test_a_second_claim_names_the_holder_and_the_setting(tmp_path: Path) -> None:
    run_dir = tmp_path / "state" / "run"
    first = ServiceLock.claim(run_dir)
    try:
        assert service_pid(run_dir) == os.getpid()
        with pytest.raises(ConfigError) as refused:
            ServiceLock.claim(run_dir)
        [line] = refused.value.lines
        assert f"pid {os.getpid()}" in line and "SANDBOX_STATE_DIR" in line
        assert str(tmp_path / "state") in line
    finally:
        first.release()
    assert service_pid(run_dir) is None  # the file stays; nobody holds it
    ServiceLock.claim(run_dir).release()


def test_a_lock_file_a_dead_service_left_names_nobody(tmp_path: Path) -> None:
    (tmp_path / SERVICE_LOCK).write_text(f"{os.getpid()}.1")  # held by no one
    assert service_pid(tmp_path) is None
    assert service_pid(tmp_path / "missing") is None


def test_a_holder_in_another_pid_namespace_is_still_a_holder(tmp_path: Path) -> None:
    lock = ServiceLock.claim(tmp_path)
    try:
        (tmp_path / SERVICE_LOCK).write_text("1.12345")  # a container's pid 1
        assert service_pid(tmp_path) == 0
        with pytest.raises(ConfigError, match="another pid namespace"):
            ServiceLock.claim(tmp_path)
    finally:
        lock.release()


#: Holds ``argv[1]``'s pid file as a server in another pid namespace would: its mark
#: names pid 1 (here some other process), its lock is the only proof of life.
_HOLD = """
import os, sys
from pathlib import Path
from mcp_code_sandbox.sessions.holder import PidFile
held = PidFile.claim(Path(sys.argv[1]))
os.pwrite(os.open(sys.argv[1], os.O_WRONLY), b"1.1      ", 0)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_pid_file_is_alive_while_locked_whatever_its_mark(tmp_path: Path) -> None:
    """Two appliance containers on one volume are both pid 1: the lock tells."""
    import subprocess
    import sys

    path = tmp_path / "other.pid"
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"held\n"
        assert pid_file_alive(path)
    finally:
        proc.kill()
        proc.communicate()
    assert not pid_file_alive(path)  # unlocked, and its mark's pid 1 is not that process
    assert not pid_file_alive(tmp_path / "none.pid")


def test_a_pid_file_appears_locked_and_goes_on_release(tmp_path: Path) -> None:
    path = tmp_path / "me.pid"
    held = PidFile.claim(path)
    assert pid_file_alive(path) and path.read_text().startswith(f"{os.getpid()}.")
    assert [p.name for p in tmp_path.iterdir()] == ["me.pid"]
    held.release()
    held.release()
    assert not path.exists()


# -- replicas: several services sharing one state directory (issue 25) --------------------


def test_replicas_start_beside_each_other_and_a_lone_service_is_refused(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "state" / "run"
    first = ServiceLock.claim(run_dir, replica=True)
    second = ServiceLock.claim(run_dir, replica=True)
    try:
        assert refused(run_dir, replica=True) is None
        assert replicas_serve(run_dir) and service_pid(run_dir) is None  # doctor says so
        line = refused(run_dir)
        assert line is not None and "SANDBOX_REPLICA=true" in line and "--replica" in line
        assert str(tmp_path / "state") in line
        with pytest.raises(ConfigError) as claimed:
            ServiceLock.claim(run_dir)
        assert claimed.value.lines == [line]
        first.release()
        assert refused(run_dir) == line  # one replica still serves
    finally:
        first.release()
        second.release()
    assert refused(run_dir) is None and refused(run_dir, replica=True) is None
    lone = ServiceLock.claim(run_dir)
    assert not replicas_serve(run_dir)  # a lone service is not replicas
    lone.release()


def test_a_replica_is_refused_beside_a_lone_service_naming_its_pid(tmp_path: Path) -> None:
    run_dir = tmp_path / "state" / "run"
    lone = ServiceLock.claim(run_dir)
    try:
        line = refused(run_dir, replica=True)
        assert line is not None and f"pid {os.getpid()}" in line
        assert "SANDBOX_STATE_DIR" in line
        with pytest.raises(ConfigError) as claimed:
            ServiceLock.claim(run_dir, replica=True)
        assert claimed.value.lines == [line]
        assert refused(run_dir) == line
    finally:
        lone.release()
    ServiceLock.claim(run_dir, replica=True).release()


def test_asking_whether_a_service_may_start_takes_no_lock(tmp_path: Path) -> None:
    assert refused(tmp_path / "missing") is None  # no lock file: nobody ever served here
    ServiceLock.claim(tmp_path).release()
    for replica in (False, True, False):
        assert refused(tmp_path, replica=replica) is None
    lone = ServiceLock.claim(tmp_path)  # nothing was left held by the questions
    lone.release()


#: Claims ``argv[1]`` as a replica's pid file, lets go of it the way a replica stops
#: (the file stays, to say its server died), and exits.
_STOP_AS_A_REPLICA = """
import sys
from pathlib import Path
from mcp_code_sandbox.sessions.holder import PidFile, pid_file_alive
held = PidFile.claim(Path(sys.argv[1]))
assert pid_file_alive(held.path)
held.release(keep=True)
held.release(keep=True)
"""


def test_a_replicas_pid_file_stays_and_reads_dead_once_it_stops(tmp_path: Path) -> None:
    """The other replicas see it died, and take its sessions over."""
    import subprocess
    import sys

    path = tmp_path / "replica.pid"
    subprocess.run(
        [sys.executable, "-c", _STOP_AS_A_REPLICA, str(path)],
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert path.exists() and not pid_file_alive(path)
