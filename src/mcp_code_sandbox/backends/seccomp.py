"""The seccomp filter every sandbox runs under: bwrap's ``--seccomp FD`` and, on Docker
with runc, the container's seccomp profile. One deny-list, two encodings.

A deny-list in the spirit of Docker's default profile and Flatpak's: the default action
is ALLOW, and syscalls that only serve to attack the kernel or escape the sandbox (new
namespaces, mounts, tracing, kernel modules, keyrings, BPF, io_uring, TTY injection,
exotic socket families, reaching into another process) fail with EPERM. ``clone3`` fails
with ENOSYS because its flags live in memory a filter cannot read: libc then falls back
to ``clone``, whose flags are checked. ``pidfd_open`` fails with ENOSYS too, as on a kernel
older than 5.3, so that programs take the fallback they have for those (asyncio, Go,
glib wait for children by SIGCHLD then). Syscalls of any other architecture (i386/x32 on
x86_64) kill the process.

:func:`deny_rules` is that list as data (pure); :func:`build_seccomp_bpf` compiles it
with libseccomp for bwrap, and :func:`docker_seccomp_profile` writes it in the JSON form
of a Docker seccomp profile (``security_opt: seccomp=<json>``), which the engine's runc
compiles with its own libseccomp. gVisor (runsc) ignores a container's seccomp profile
unless started with ``--oci-seccomp``: its own kernel is the wall there, so the docker
backend sends the profile to runc only.

Fail closed: when libseccomp cannot be loaded or the filter cannot be built, the error is
:class:`~mcp_code_sandbox.errors.BackendUnavailable` naming the package to install; a
sandbox is never started without its filter.
"""

from __future__ import annotations

import errno
import functools
import json
import socket
import tempfile
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from mcp_code_sandbox.errors import BackendUnavailable

__all__ = [
    "DENIED_SYSCALLS",
    "Cond",
    "Rule",
    "build_seccomp_bpf",
    "deny_rules",
    "docker_seccomp_opt",
    "docker_seccomp_profile",
]

#: Denied outright with EPERM. Names missing on the native architecture are skipped
#: (aarch64 has no ``iopl``, ``modify_ldt``, ``uselib``...).
DENIED_SYSCALLS: tuple[str, ...] = (
    # tracing and reading other processes' memory
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    # another process's fds and memory through a pidfd (pidfd_open is below, ENOSYS):
    # pidfd_getfd copies any fd of a process the caller may ptrace, and the agent (same
    # uid) holds the host channel. process_madvise/process_mrelease act on another mm.
    "pidfd_getfd",
    "process_madvise",
    "process_mrelease",
    # other processes' pages and robust-futex list (layout leaks, NUMA games)
    "move_pages",
    "migrate_pages",
    "get_robust_list",
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
    # watching other processes' file activity (Docker's default denies it too)
    "fanotify_init",
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
    "install it (`sudo apt install libseccomp2` on Debian and Ubuntu, `sudo dnf install "
    "libseccomp` on Fedora; pip install pyseccomp)"
)


@dataclass(frozen=True)
class Cond:
    """A test on one syscall argument, with libseccomp's (and Docker's) meaning:
    ``EQ``: arg == value; ``GE``: arg >= value (64-bit); ``MASKED_EQ``: arg & value ==
    value_two (``value`` is the mask)."""

    index: int
    op: Literal["EQ", "GE", "MASKED_EQ"]
    value: int
    value_two: int = 0


@dataclass(frozen=True)
class Rule:
    """``syscall`` fails with ``errno`` (only when ``arg`` holds, if set). Rules on one
    syscall are OR'ed."""

    syscall: str
    errno: int
    arg: Cond | None = None


def _clone_rules() -> list[Rule]:
    # One rule per flag: a call with any namespace flag set is denied.
    rules = [
        Rule("clone", errno.EPERM, Cond(0, "MASKED_EQ", flag, flag)) for flag in _CLONE_NS_FLAGS
    ]
    return [*rules, Rule("clone3", errno.ENOSYS)]


def _ioctl_rules() -> list[Rule]:
    # Masked to 32 bits: the kernel ignores the upper half of ``request``.
    return [
        Rule("ioctl", errno.EPERM, Cond(1, "MASKED_EQ", 0xFFFFFFFF, request))
        for request in (_TIOCSTI, _TIOCLINUX)
    ]


def _socket_rules() -> list[Rule]:
    top = max(_ALLOWED_FAMILIES)
    rules = [
        Rule("socket", errno.EPERM, Cond(0, "EQ", family))
        for family in range(top)
        if family not in _ALLOWED_FAMILIES
    ]
    # GE on the whole 64-bit register also catches values with upper bits set.
    return [*rules, Rule("socket", errno.EPERM, Cond(0, "GE", top + 1))]


def _personality_rules() -> list[Rule]:
    # One comparison per argument in a rule, rules OR'ed: "not one of the allowed values"
    # is spelled as a union of masked patterns over the 32 bits the kernel reads. Bit 31
    # is no persona flag and only the query sets it:
    # (a) bit 31 set and any lower bit clear is not the query → deny;
    # (b) bit 31 clear and any bit outside the allowed ones set → deny.
    top = 1 << 31
    rules = []
    for shift in range(31):
        bit = 1 << shift
        rules.append(Rule("personality", errno.EPERM, Cond(0, "MASKED_EQ", top | bit, top)))
        if not bit & _PERSONALITY_ALLOWED_BITS:
            rules.append(Rule("personality", errno.EPERM, Cond(0, "MASKED_EQ", top | bit, bit)))
    return rules


@functools.cache
def deny_rules() -> tuple[Rule, ...]:
    """Every rule of the filter, for both encodings. Pure: no libseccomp needed."""
    return (
        *(Rule(name, errno.EPERM) for name in DENIED_SYSCALLS),
        Rule("pidfd_open", errno.ENOSYS),
        *_clone_rules(),
        *_ioctl_rules(),
        *_socket_rules(),
        *_personality_rules(),
    )


def docker_seccomp_profile() -> dict[str, Any]:
    """:func:`deny_rules` as a Docker seccomp profile (the JSON of ``--security-opt
    seccomp=``). No ``architectures``: runc then builds the filter for the engine's
    native architecture only, and a syscall of any other one (i386 on x86_64) hits
    libseccomp's bad-architecture action, which kills, as bwrap's filter does. Names
    the engine's architecture lacks are skipped by runc, as :func:`build_seccomp_bpf`
    skips them."""
    plain: dict[int, list[str]] = {}
    entries: list[dict[str, Any]] = []
    for rule in deny_rules():
        if rule.arg is None:
            plain.setdefault(rule.errno, []).append(rule.syscall)
            continue
        arg = rule.arg
        condition = {"index": arg.index, "value": arg.value, "valueTwo": arg.value_two,
                     "op": f"SCMP_CMP_{arg.op}"}  # fmt: skip
        entries.append({"names": [rule.syscall], "action": "SCMP_ACT_ERRNO",
                        "errnoRet": rule.errno, "args": [condition]})  # fmt: skip
    unconditional = [
        {"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": code}
        for code, names in plain.items()
    ]
    return {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [*unconditional, *entries]}


@functools.cache
def docker_seccomp_opt() -> str:
    """The ``security_opt`` entry that gives a container :func:`docker_seccomp_profile`
    (the Docker API takes the profile's JSON itself, not a path)."""
    return "seccomp=" + json.dumps(docker_seccomp_profile(), separators=(",", ":"))


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


def _build(sc: ModuleType) -> bytes:
    flt = sc.SyscallFilter(defaction=sc.ALLOW)
    # Only the native ABI: i386/x32 syscalls on x86_64 would bypass every rule.
    flt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    ops = {"EQ": sc.EQ, "GE": sc.GE, "MASKED_EQ": sc.MASKED_EQ}
    for rule in deny_rules():
        if not _known(sc, rule.syscall):  # aarch64 has no iopl, modify_ldt, uselib...
            continue
        if rule.arg is None:
            flt.add_rule(sc.ERRNO(rule.errno), rule.syscall)
        else:
            arg = rule.arg
            cond = sc.Arg(arg.index, ops[arg.op], arg.value, arg.value_two)
            flt.add_rule(sc.ERRNO(rule.errno), rule.syscall, cond)
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
