"""The seccomp filter every bwrap sandbox runs under (bwrap ``--seccomp FD``).

A deny-list in the spirit of Docker's default profile and Flatpak's: the default action
is ALLOW, and syscalls that only serve to attack the kernel or escape the sandbox (new
namespaces, mounts, tracing, kernel modules, keyrings, BPF, io_uring, TTY injection,
exotic socket families) fail with EPERM. ``clone3`` fails with ENOSYS because its flags
live in memory a filter cannot read: libc then falls back to ``clone``, whose flags are
checked. Syscalls of any other architecture (i386/x32 on x86_64) kill the process.

Fail closed: when libseccomp cannot be loaded or the filter cannot be built, the error is
:class:`~mcp_code_sandbox.errors.BackendUnavailable` naming the package to install; a
sandbox is never started without its filter.
"""

from __future__ import annotations

import errno
import functools
import socket
import tempfile
from types import ModuleType
from typing import Any

from mcp_code_sandbox.errors import BackendUnavailable

__all__ = ["DENIED_SYSCALLS", "build_seccomp_bpf"]

#: Denied outright with EPERM. Names missing on the native architecture are skipped
#: (aarch64 has no ``iopl``, ``modify_ldt``, ``uselib``...).
DENIED_SYSCALLS: tuple[str, ...] = (
    # tracing and reading other processes' memory
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    # namespaces, mounts, root changes
    "unshare",
    "setns",
    "mount",
    "umount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "mount_setattr",
    # the kernel itself
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "init_module",
    "finit_module",
    "delete_module",
    "create_module",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "lookup_dcookie",
    "syslog",
    "acct",
    "quotactl",
    "quotactl_fd",
    "nfsservctl",
    "uselib",
    "modify_ldt",
    "iopl",
    "ioperm",
    "vhangup",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    # keyrings (shared with the host: not namespaced)
    "keyctl",
    "add_key",
    "request_key",
    # file handles bypass path permissions
    "open_by_handle_at",
    "name_to_handle_at",
    # the clock is the host's
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
)

_CLONE_NS_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)
_TIOCSTI = 0x5412
_TIOCLINUX = 0x541C
#: personality(2) values that programs legitimately use: PER_LINUX, PER_LINUX32,
#: UNAME26 variants, and the 0xffffffff query. Any flag outside them (ADDR_NO_RANDOMIZE,
#: READ_IMPLIES_EXEC, MMAP_PAGE_ZERO...) is denied.
_PERSONALITY_ALLOWED_BITS = 0x0008 | 0x0020000
_ALLOWED_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)

_INSTALL = (
    "libseccomp could not be loaded, and sandboxes never run without their seccomp filter: "
    "install it (apt-get install libseccomp2; pip install pyseccomp)"
)


def _load_pyseccomp() -> ModuleType:
    try:
        import pyseccomp
    except (ImportError, OSError, RuntimeError) as exc:
        # pyseccomp raises RuntimeError at import when libseccomp.so.2 is not found.
        raise BackendUnavailable(f"{_INSTALL} ({exc})") from None
    module: ModuleType = pyseccomp
    return module


def _known(sc: ModuleType, name: str) -> bool:
    try:
        sc.resolve_syscall(sc.Arch.NATIVE, name)
    except (ValueError, OSError):
        return False
    return True


def _add_clone_rules(sc: ModuleType, flt: Any) -> None:
    eperm = sc.ERRNO(errno.EPERM)
    for flag in _CLONE_NS_FLAGS:
        # One rule per flag: rules on one syscall are OR'ed, comparisons within one AND'ed.
        flt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")


def _add_ioctl_rules(sc: ModuleType, flt: Any) -> None:
    for request in (_TIOCSTI, _TIOCLINUX):
        # Masked to 32 bits: the kernel ignores the upper half of ``request``.
        flt.add_rule(sc.ERRNO(errno.EPERM), "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))


def _add_socket_rules(sc: ModuleType, flt: Any) -> None:
    eperm = sc.ERRNO(errno.EPERM)
    top = max(_ALLOWED_FAMILIES)
    for family in range(top):
        if family not in _ALLOWED_FAMILIES:
            flt.add_rule(eperm, "socket", sc.Arg(0, sc.EQ, family))
    # GE on the whole 64-bit register also catches values with upper bits set.
    flt.add_rule(eperm, "socket", sc.Arg(0, sc.GE, top + 1))


def _add_personality_rules(sc: ModuleType, flt: Any) -> None:
    # libseccomp allows one comparison per argument in a rule and ORs rules, so "not one
    # of the allowed values" is spelled as a union of masked patterns over the 32 bits
    # the kernel reads. Bit 31 is no persona flag and only the query sets it:
    # (a) bit 31 set and any lower bit clear is not the query → deny;
    # (b) bit 31 clear and any bit outside the allowed ones set → deny.
    eperm = sc.ERRNO(errno.EPERM)
    top = 1 << 31
    for shift in range(31):
        bit = 1 << shift
        flt.add_rule(eperm, "personality", sc.Arg(0, sc.MASKED_EQ, top | bit, top))
        if not bit & _PERSONALITY_ALLOWED_BITS:
            flt.add_rule(eperm, "personality", sc.Arg(0, sc.MASKED_EQ, top | bit, bit))


def _build(sc: ModuleType) -> bytes:
    flt = sc.SyscallFilter(defaction=sc.ALLOW)
    # Only the native ABI: i386/x32 syscalls on x86_64 would bypass every rule.
    flt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    for name in DENIED_SYSCALLS:
        if _known(sc, name):
            flt.add_rule(sc.ERRNO(errno.EPERM), name)
    _add_clone_rules(sc, flt)
    _add_ioctl_rules(sc, flt)
    _add_socket_rules(sc, flt)
    _add_personality_rules(sc, flt)
    with tempfile.TemporaryFile() as out:
        flt.export_bpf(out)
        out.seek(0)
        return out.read()


@functools.cache
def build_seccomp_bpf() -> bytes:
    """The filter as a BPF program for bwrap ``--seccomp``; built once per process."""
    sc = _load_pyseccomp()
    try:
        program = _build(sc)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise BackendUnavailable(f"cannot build the seccomp filter ({exc}); {_INSTALL}") from None
    if not program or len(program) % 8:
        raise BackendUnavailable(f"libseccomp returned an empty or broken filter; {_INSTALL}")
    return program
