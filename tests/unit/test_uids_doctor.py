"""``doctor``'s line on per-sandbox uids, per backend: what is enforced here, and why not.

The "not root" cases pretend to be another user (``geteuid``, CAP_CHOWN): the tests run
as root, and the line only depends on those answers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mcp_code_sandbox import host
from mcp_code_sandbox.doctor import bwrap as doctor_bwrap
from mcp_code_sandbox.doctor import docker as doctor_docker
from mcp_code_sandbox.settings import Settings, load_settings


def settings(tmp_path: Path, **values: str) -> Settings:
    return load_settings({"uid_lease_dir": str(tmp_path / "uids"), **values}, environ={})


@pytest.fixture
def as_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(host, "can_chown", lambda: True)


@pytest.fixture
def as_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1234)  # the one os module doctor's both use
    monkeypatch.setattr(host, "can_chown", lambda: False)


@pytest.mark.usefixtures("as_root")
def test_root_says_each_sandbox_has_its_own_uid(tmp_path: Path) -> None:
    check = doctor_bwrap._uid_check(settings(tmp_path))
    assert check.ok and check.name == "per-sandbox uids"
    assert check.detail.startswith("yes: each sandbox drops to a host uid of its own")
    assert "1879048192-1879113727" in check.detail and str(tmp_path / "uids") in check.detail
    runc = doctor_docker.uid_check(settings(tmp_path), [])
    assert (
        runc.ok
        and "yes: each session's containers run as a host uid of its own (runc)" in runc.detail
    )
    gvisor = doctor_docker.uid_check(settings(tmp_path, docker_runtime="runsc"), [])
    assert gvisor.ok and "gVisor" in gvisor.detail


@pytest.mark.usefixtures("as_user")
def test_not_root_says_limits_are_shared(tmp_path: Path) -> None:
    check = doctor_bwrap._uid_check(settings(tmp_path))
    assert not check.ok
    assert check.detail.startswith(
        "no (server not root): every sandbox runs as the server's uid 1234, so per-user "
        "limits like inotify instances are shared by all sandboxes"
    )
    runc = doctor_docker.uid_check(settings(tmp_path), [])
    assert not runc.ok and "no (server cannot chown" in runc.detail
    gvisor = doctor_docker.uid_check(settings(tmp_path, docker_runtime="runsc"), [])
    assert gvisor.ok and "no (server cannot chown" in gvisor.detail and "gVisor" in gvisor.detail


@pytest.mark.usefixtures("as_root")
def test_a_remapping_engine_and_an_unusable_lease_dir_are_failures(tmp_path: Path) -> None:
    remapped = doctor_docker.uid_check(settings(tmp_path), ["name=seccomp", "name=userns"])
    assert not remapped.ok and "remaps uids (name=userns)" in remapped.detail
    (tmp_path / "file").write_text("")
    broken = settings(tmp_path, uid_lease_dir=str(tmp_path / "file" / "uids"))
    check = doctor_bwrap._uid_check(broken)
    assert not check.ok and "cannot make the uid lease directory" in check.detail
    assert check.fix == "set SANDBOX_UID_LEASE_DIR"
