"""``doctor`` checks of the bwrap backend: what works on this host and what is enforced.

:func:`check_bwrap` is output-free: each check is a :class:`.checks.Check` (printed by
:mod:`.report`). A check that cannot run (no bwrap at all) still yields a row saying so,
with the command that fixes it. The probes' bwrap command lines are the backend's own
(:func:`mcp_code_sandbox.backends.bwrap.argv.minimal_argv`), not retyped here.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from mcp_code_sandbox.backends.bwrap import cgroups
from mcp_code_sandbox.backends.bwrap.argv import drop_uid_argv, minimal_argv
from mcp_code_sandbox.backends.bwrap.backend import BwrapBackend
from mcp_code_sandbox.backends.bwrap.runtime import runtime_status
from mcp_code_sandbox.backends.bwrap.userns import userns_problem
from mcp_code_sandbox.backends.seccomp import build_seccomp_bpf
from mcp_code_sandbox.doctor.checks import (
    Check,
    network_check,
    pause_check,
    uid_range_detail,
    workspace_quota_check,
)
from mcp_code_sandbox.errors import BackendUnavailable, SandboxError
from mcp_code_sandbox.sessions.uids import UidLease, uid_pool
from mcp_code_sandbox.settings import Settings

__all__ = ["ESSENTIAL", "check_bwrap"]

_NOBODY = 65534
_NAMESPACES = ("user", "pid", "net", "ipc", "uts", "cgroup-try")
_USERNS_FIX = (
    "enable unprivileged user namespaces: sysctl kernel.unprivileged_userns_clone=1 "
    "(Debian < 11), user.max_user_namespaces > 0, or on Ubuntu >= 23.10 "
    "kernel.apparmor_restrict_unprivileged_userns=0 / an AppArmor profile for bwrap"
)


def _bwrap_run(bwrap: str, uid: int | None, *args: str) -> subprocess.CompletedProcess[str]:
    """``bwrap`` with ``args`` around ``/usr/bin/true``, as ``uid`` (root: as a sandbox)."""
    argv = minimal_argv(bwrap, args, ["/usr/bin/true"])
    if uid is not None:
        argv = [*drop_uid_argv(uid), *argv]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL, check=False
    )


def _try(bwrap: str, uid: int | None, name: str, args: list[str], fix: str) -> Check:
    try:
        done = _bwrap_run(bwrap, uid, *args)
    except (OSError, subprocess.SubprocessError) as exc:
        return Check(name, False, str(exc), fix)
    if done.returncode == 0:
        return Check(name, True, "works")
    return Check(name, False, done.stderr.strip()[-300:] or f"exit {done.returncode}", fix)


def _bwrap_checks(bwrap: str, uid: int | None) -> list[Check]:
    try:
        version = subprocess.run(
            [bwrap, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        version = f"unknown ({exc})"
    checks = [Check("bwrap", True, f"{bwrap}: {version}")]
    problem = userns_problem(bwrap)
    if problem is not None:  # the server's own words, which hold this host's fix
        checks.append(Check("user namespaces", False, problem))
        return checks
    userns = _try(bwrap, uid, "user namespaces", ["--unshare-user"], _USERNS_FIX)
    checks.append(userns)
    if not userns.ok:
        return checks
    for ns in _NAMESPACES[1:]:
        checks.append(
            _try(
                bwrap,
                uid,
                f"namespace {ns}",
                ["--unshare-user", f"--unshare-{ns}"],
                "a kernel with this namespace type",
            )
        )
    checks.append(
        _try(
            bwrap,
            uid,
            "--disable-userns",
            ["--unshare-user", "--disable-userns"],
            "bubblewrap >= 0.8 (apt-get install bubblewrap from a newer release)",
        )
    )
    return checks


def _bwrap_network_check(settings: Settings) -> Check:
    how = "the sandbox keeps its empty network namespace (bwrap --unshare-net, loopback only)"
    why_not = BwrapBackend(settings).describe().network_unavailable
    return network_check(settings, why_not, how)


def _seccomp_check() -> Check:
    try:
        program = build_seccomp_bpf()
    except BackendUnavailable as exc:
        return Check("seccomp filter", False, exc.message, "apt-get install libseccomp2")
    return Check("seccomp filter", True, f"{len(program) // 8} BPF instructions")


def _cgroup_checks() -> list[Check]:
    support = cgroups.detect()
    version = f"cgroup v{support.version}" if support.version else "no cgroups"
    rlimit = {"memory": "RLIMIT_DATA", "pids": "RLIMIT_NPROC", "cpu": "none"}
    out = []
    for controller in cgroups.CONTROLLERS:
        if controller in support.enforceable:
            out.append(Check(f"{controller} limit", True, f"{version} {controller} controller"))
        else:
            why = support.reasons.get(controller) or support.reasons.get("all", "")
            out.append(
                Check(
                    f"{controller} limit",
                    False,
                    f"rlimits only: {rlimit[controller]} ({why})",
                    "run the server as root, or in a cgroup with delegated controllers "
                    "(systemd: Delegate=yes)",
                    note=os.geteuid() != 0,  # a user's own server: as expected
                )
            )
    return out


def _runtime_check(settings: Settings) -> Check:
    status = runtime_status(settings)
    if not status.ok:
        return Check("runtime environment", False, status.detail, "mcp-code-sandbox setup")
    extra = f"; binds base prefix {status.base_prefix}" if status.base_prefix else ""
    return Check("runtime environment", True, status.detail + extra)


def _node_check(settings: Settings) -> Check:
    """Node.js and bun are optional (Python works without them): a FAIL here is not fatal."""
    node = runtime_status(settings).node
    if node is None:
        return Check(
            "javascript/typescript",
            False,
            f"no Node.js or bun at {settings.runtime_dir / 'node'}",
            "install npm (apt-get install npm), then mcp-code-sandbox setup",
            note=True,  # Python works without them
        )
    packages = ", ".join(f"{k} {v}" for k, v in sorted(node.packages.items()))
    return Check("javascript/typescript", True, f"Node.js {node.node}, bun {node.bun}; {packages}")


def _uid_check(settings: Settings) -> Check:
    name = "per-sandbox uids"
    if os.geteuid() != 0:
        return Check(
            name, False,
            f"no (server not root): every sandbox runs as the server's uid {os.geteuid()}, "
            "so per-user limits like inotify instances are shared by all sandboxes",
            "run the server as root (for several users)", note=True,
        )  # fmt: skip
    detail, why_not = uid_range_detail(settings)
    if why_not is not None:
        return Check(name, False, f"{detail}: {why_not}", "set SANDBOX_UID_LEASE_DIR")
    return Check(
        name, True,
        f"yes: each sandbox drops to a host uid of its own (setpriv), uid 1000 inside; "
        f"{detail}",
    )  # fmt: skip


def _check_uid(settings: Settings) -> UidLease | None:
    """As root, a uid to run the checks' bwrap as (leased like a session's); else None."""
    if os.geteuid() != 0:
        return None
    try:
        return uid_pool(settings).lease(f"doctor {os.getpid()}")
    except SandboxError:
        return None  # the uid check says why; the others run as nobody


def check_bwrap(settings: Settings) -> list[Check]:
    """Every check of the bwrap backend, in the order a person would fix them."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        checks = [Check("bwrap", False, "bwrap not found on PATH", "apt-get install bubblewrap")]
    else:
        lease = _check_uid(settings)
        uid = lease.uid if lease else (_NOBODY if os.geteuid() == 0 else None)
        try:
            checks = _bwrap_checks(bwrap, uid)
        finally:
            if lease is not None:
                lease.release()
    return [
        *checks,
        _seccomp_check(),
        *_cgroup_checks(),
        _runtime_check(settings),
        _node_check(settings),
        _uid_check(settings),
        workspace_quota_check(settings, BwrapBackend(settings)),
        _bwrap_network_check(settings),
        pause_check("bwrap has no checkpoint: CRIU does not run on this kernel generation"),
    ]


#: Checks without which no sandbox starts; the others degrade to rlimits.
ESSENTIAL = (
    "bwrap",
    "user namespaces",
    "--disable-userns",
    "seccomp filter",
    "runtime environment",
)
