"""The seccomp filter builds; its effect is tested in tests/integration (real bwrap)."""

from __future__ import annotations

from mcp_code_sandbox.backends.seccomp import DENIED_SYSCALLS, build_seccomp_bpf


def test_filter_builds_and_is_cached() -> None:
    program = build_seccomp_bpf()
    assert program and len(program) % 8 == 0
    assert build_seccomp_bpf() is program


def test_deny_list_covers_the_escapes() -> None:
    for name in ("ptrace", "unshare", "setns", "mount", "bpf", "keyctl", "io_uring_setup"):
        assert name in DENIED_SYSCALLS
