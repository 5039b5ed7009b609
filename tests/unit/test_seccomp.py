"""The seccomp deny-list and its two encodings (bwrap's BPF, Docker's JSON profile).

Their effect is tested against real sandboxes: tests/integration (bwrap) and
tests/e2e/test_hostile_walls.py (bwrap, runc, runsc).
"""

from __future__ import annotations

import errno
import json
import socket
from typing import cast

from mcp_code_sandbox.backends.seccomp import (
    DENIED_SYSCALLS,
    Cond,
    Rule,
    build_seccomp_bpf,
    deny_rules,
    docker_seccomp_opt,
    docker_seccomp_profile,
)


def test_filter_builds_and_is_cached() -> None:
    program = build_seccomp_bpf()
    assert program and len(program) % 8 == 0
    assert build_seccomp_bpf() is program


def test_deny_list_covers_the_escapes() -> None:
    for name in ("ptrace", "unshare", "setns", "mount", "bpf", "keyctl", "io_uring_setup"):
        assert name in DENIED_SYSCALLS


def test_no_way_into_another_process() -> None:
    # Issue 10: pidfd_getfd copied the agent's host channel and stderr.
    for name in (
        "pidfd_getfd",
        "process_vm_readv",
        "process_vm_writev",
        "process_madvise",
        "kcmp",
        "ptrace",
    ):
        assert name in DENIED_SYSCALLS
    # ENOSYS, not EPERM: programs fall back to SIGCHLD as on kernels before 5.3.
    assert Rule("pidfd_open", errno.ENOSYS) in deny_rules()
    assert "pidfd_open" not in DENIED_SYSCALLS


def _profile_entries(name: str) -> list[dict[str, object]]:
    return [e for e in docker_seccomp_profile()["syscalls"] if name in e["names"]]


def test_docker_profile_allows_by_default_and_denies_the_same_list() -> None:
    profile = docker_seccomp_profile()
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
    # No architectures: runc builds for the engine's native one only, the rest is killed.
    assert "architectures" not in profile and "archMap" not in profile
    denied = {n for e in profile["syscalls"] if "args" not in e for n in e["names"]}
    assert denied == {*DENIED_SYSCALLS, "clone3", "pidfd_open"}
    for entry in profile["syscalls"]:
        assert entry["action"] == "SCMP_ACT_ERRNO"
    # Every rule of the bwrap filter is in the profile, and nothing else.
    rules = sum(len(e["names"]) for e in profile["syscalls"])
    assert rules == len(deny_rules())


def test_docker_profile_errnos() -> None:
    (clone3,) = _profile_entries("clone3")
    assert clone3["errnoRet"] == errno.ENOSYS
    (pidfd_open,) = _profile_entries("pidfd_open")
    assert pidfd_open["errnoRet"] == errno.ENOSYS
    (ptrace,) = _profile_entries("ptrace")
    assert ptrace["errnoRet"] == errno.EPERM
    assert {"io_uring_setup", "pidfd_getfd", "kcmp"} <= set(cast(list[str], ptrace["names"]))


def test_docker_profile_conditions_are_libseccomps() -> None:
    # Docker's MASKED_EQ: value is the mask, valueTwo what the masked argument equals.
    clone = _profile_entries("clone")
    newuser = {"index": 0, "value": 0x10000000, "valueTwo": 0x10000000,
               "op": "SCMP_CMP_MASKED_EQ"}  # fmt: skip
    assert any(e["args"] == [newuser] for e in clone)
    assert all(e["errnoRet"] == errno.EPERM for e in clone)
    tiocsti = {"index": 1, "value": 0xFFFFFFFF, "valueTwo": 0x5412, "op": "SCMP_CMP_MASKED_EQ"}
    assert any(e["args"] == [tiocsti] for e in _profile_entries("ioctl"))
    families = [e["args"][0] for e in _profile_entries("socket")]  # type: ignore[index]

    def denied(family: int) -> bool:
        ops = {"SCMP_CMP_EQ": family.__eq__, "SCMP_CMP_GE": family.__ge__}
        return any(ops[a["op"]](a["value"]) for a in families)

    for family in (socket.AF_NETLINK, socket.AF_PACKET, socket.AF_VSOCK, 0, 1 << 32 | 1):
        assert denied(family), family
    for family in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6):
        assert not denied(family), family


def test_personality_rules_match_only_the_unusual_values() -> None:
    rules = [r.arg for r in deny_rules() if r.syscall == "personality"]

    def denied(value: int) -> bool:
        return any(c is not None and value & c.value == c.value_two for c in rules)

    for allowed in (0x0, 0x0008, 0x0020000, 0x0020008, 0xFFFFFFFF):
        assert not denied(allowed), hex(allowed)
    for dangerous in (0x0040000, 0x0400000, 0x0100000, 0x80000000):  # ADDR_NO_RANDOMIZE...
        assert denied(dangerous), hex(dangerous)


def test_docker_opt_is_the_profile_as_json() -> None:
    opt = docker_seccomp_opt()
    assert opt.startswith("seccomp=")
    assert json.loads(opt.removeprefix("seccomp=")) == docker_seccomp_profile()
    assert docker_seccomp_opt() is opt  # built once


def test_cond_defaults() -> None:
    assert Cond(0, "EQ", 5).value_two == 0


def test_doctor_says_runc_runs_under_our_profile() -> None:
    from mcp_code_sandbox.doctor.docker import seccomp_check

    runc = seccomp_check("runc", ["name=seccomp,profile=default", "name=cgroupns"])
    assert runc.ok and "our profile" in runc.detail
    assert not seccomp_check("runc", ["name=apparmor"]).ok  # the engine could not apply it
    assert seccomp_check("runsc", []).ok
