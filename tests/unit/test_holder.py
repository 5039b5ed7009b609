"""The state directory's one service (``sessions.holder``): its lock, and how a second
one, ``doctor`` and a stdio server learn who holds it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mcp_code_sandbox.sessions.holder import SERVICE_LOCK, ServiceLock, service_pid
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
