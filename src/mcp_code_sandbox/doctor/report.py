"""``doctor`` checks of the bwrap backend: what works on this host and what is enforced.

:func:`check_bwrap` is output-free: each check is a :class:`Check`. :func:`run_doctor`
prints them for the CLI (the doctor's result is its output, so stdout). A check that cannot
run (no bwrap at all) still yields a row saying so, with the command that fixes it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import NamedTuple, TextIO

from mcp_code_sandbox.backends.base import Backend
from mcp_code_sandbox.backends.bwrap import cgroups
from mcp_code_sandbox.backends.bwrap.backend import BwrapBackend
from mcp_code_sandbox.backends.seccomp import build_seccomp_bpf
from mcp_code_sandbox.errors import BackendUnavailable, SandboxError
from mcp_code_sandbox.provision.venv import runtime_status
from mcp_code_sandbox.sessions.uids import UidLease, uid_pool
from mcp_code_sandbox.settings import Settings

__all__ = ["Check", "check_bwrap", "run_doctor"]

_NOBODY = 65534
_NAMESPACES = ("user", "pid", "net", "ipc", "uts", "cgroup-try")
_USERNS_FIX = (
    "enable unprivileged user namespaces: sysctl kernel.unprivileged_userns_clone=1 "
    "(Debian < 11), user.max_user_namespaces > 0, or on Ubuntu >= 23.10 "
    "kernel.apparmor_restrict_unprivileged_userns=0 / an AppArmor profile for bwrap"
)


class Check(NamedTuple):
    name: str
    ok: bool
    detail: str
    #: What to run or change when not ``ok``; ``None`` when there is nothing to do.
    fix: str | None = None


def _bwrap_run(bwrap: str, uid: int | None, *args: str) -> subprocess.CompletedProcess[str]:
    """``bwrap`` with ``args`` around ``/usr/bin/true``, as ``uid`` (root: as a sandbox)."""
    argv = [
        bwrap,
        *args,
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/bin",
        "/bin",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "/usr/bin/true",
    ]
    if uid is not None:
        argv = [
            "/usr/bin/setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--",
            *argv,
        ]
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


def network_check(settings: Settings, why_not: str | None, how: str) -> Check:
    """Whether network-by-permission works here, and how it is fenced (both backends)."""
    base = "each sandbox has no network unless a call asks for it"
    if not settings.allow_network:
        return Check("network", True, f"{base}; network=true is refused (SANDBOX_ALLOW_NETWORK)")
    if why_not is not None:
        return Check(
            "network", False, f"{base}; SANDBOX_ALLOW_NETWORK=true but {why_not}",
            "see above, or unset SANDBOX_ALLOW_NETWORK",
        )  # fmt: skip
    return Check("network", True, f"{base}; network=true gives {how}")


def _bwrap_network_check(settings: Settings) -> Check:
    from mcp_code_sandbox.backends.bwrap.net import network_unavailable
    from mcp_code_sandbox.backends.netfilter import Iptables

    how = (
        "outbound access through slirp4netns; its group's connections to this host's "
        "addresses, 169.254.0.0/16, container bridges and IPv6 are rejected (iptables OUTPUT)"
    )
    return network_check(settings, network_unavailable(Iptables()), how)


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
        )
    packages = ", ".join(f"{k} {v}" for k, v in sorted(node.packages.items()))
    return Check("javascript/typescript", True, f"Node.js {node.node}, bun {node.bun}; {packages}")


def uid_range_detail(settings: Settings) -> tuple[str, str | None]:
    """The range of sandbox uids and where they are leased, for the uid checks; and why
    no uid can be leased here (``None`` when one can)."""
    pool = uid_pool(settings)
    skipped = f", {pool.skipped} of them skipped (ids of this host's users)" if pool.skipped else ""
    detail = f"host uids {pool.describe()}{skipped}, leased in {pool.directory}"
    try:
        pool.open()
    except SandboxError as exc:
        return detail, exc.message
    return detail, None


def workspace_quota_check(settings: Settings, backend: Backend) -> Check:
    """How the workspace quota binds ``backend``'s sandboxes here (both backends)."""
    from mcp_code_sandbox.sessions import quota

    try:
        mode = quota.choose(settings, backend)
    except BackendUnavailable as exc:
        return Check("workspace quota", False, exc.message, "see above")
    return Check("workspace quota", True, mode.describe())


def _uid_check(settings: Settings) -> Check:
    name = "per-sandbox uids"
    if os.geteuid() != 0:
        return Check(
            name, False,
            f"no (server not root): every sandbox runs as the server's uid {os.geteuid()}, "
            "so per-user limits like inotify instances are shared by all sandboxes",
            "run the server as root",
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
    ]


#: Checks without which no sandbox starts; the others degrade to rlimits.
_ESSENTIAL = (
    "bwrap",
    "user namespaces",
    "--disable-userns",
    "seccomp filter",
    "runtime environment",
)


#: Docker checks without which its sandboxes cannot start.
_DOCKER_ESSENTIAL = ("docker engine", "docker runtime", "docker seccomp", "docker image")


def run_doctor(settings: Settings, out: TextIO = sys.stdout) -> int:
    """Print every check of each backend; exit status 1 when no backend can start a
    sandbox (or the one chosen by SANDBOX_BACKEND cannot), else 0."""
    from mcp_code_sandbox.doctor.docker import check_docker

    usable: dict[str, bool] = {}
    for backend, checks, essential in (
        ("bwrap", check_bwrap(settings), _ESSENTIAL),
        ("docker", check_docker(settings), _DOCKER_ESSENTIAL),
    ):
        print(f"{backend} backend:", file=out)
        _print(checks, out)
        usable[backend] = not [c for c in checks if not c.ok and c.name in essential]
    chosen = settings.backend
    if chosen == "auto":
        chosen = "docker" if usable["docker"] else "bwrap"
    state = "ready" if usable[chosen] else "NOT usable"
    print(f"backend in use ({settings.backend}): {chosen}, {state}", file=out)
    return 0 if usable[chosen] else 1


def _print(checks: list[Check], out: TextIO) -> None:
    for check in checks:
        mark = "ok  " if check.ok else "FAIL"
        print(f"  {mark} {check.name}: {check.detail}", file=out)
        if not check.ok and check.fix:
            print(f"       fix: {check.fix}", file=out)
