"""Can bwrap make a user namespace on this host? Asked once, and answered with the fix.

Every bwrap sandbox starts in a new user namespace made by an unprivileged process (a
root server drops to the session's uid first). Hosts that refuse it: Ubuntu >= 23.10
(AppArmor's ``kernel.apparmor_restrict_unprivileged_userns=1``), kernels with
``user.max_user_namespaces=0`` or Debian's old ``kernel.unprivileged_userns_clone=0``,
and containers whose seccomp profile denies ``clone(CLONE_NEWUSER)``. There no sandbox
can start, and retrying cannot help: :func:`userns_problem` finds it with one bwrap run
(the backend's own probe command line), and :func:`userns_fix` says what fixes it *on
this host*, read from its ``/proc/sys`` (a pure function of :class:`HostFacts`).

``mcp-code-sandbox setup`` run as root on such an AppArmor host writes the profile that
fixes it (:mod:`mcp_code_sandbox.provision.apparmor`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from mcp_code_sandbox.backends.bwrap.argv import drop_uid_argv, minimal_argv

__all__ = [
    "HostFacts",
    "userns_fix",
    "userns_message",
    "userns_problem",
]

#: The probe's bwrap flags: a user namespace, and a network namespace inside it (AppArmor
#: may let the first be made and deny what it takes to set up the second).
PROBE_FLAGS = ("--unshare-user", "--unshare-net")
#: How long one probe may take: bwrap fails or succeeds in milliseconds; a host so
#: loaded that it takes this long is not told its namespaces are broken.
_PROBE_TIMEOUT_S = 30.0
#: The uid a root server's probe runs as, like its sandboxes (never as root), when the
#: server's own user namespace maps it.
_NOBODY = 65534
#: The longest part of bwrap's stderr quoted.
_SAID_CHARS = 300
_SYSCTL = Path("/proc/sys")


@dataclass(frozen=True)
class HostFacts:
    """What this host says about user namespaces; ``None``: the knob does not exist."""

    apparmor_restrict: str | None  # kernel.apparmor_restrict_unprivileged_userns
    max_user_namespaces: str | None  # user.max_user_namespaces
    unprivileged_userns_clone: str | None  # kernel.unprivileged_userns_clone (Debian)

    @classmethod
    def read(cls, sysctl: Path = _SYSCTL) -> HostFacts:
        def value(name: str) -> str | None:
            try:
                return (sysctl / name).read_text().strip()
            except OSError:
                return None

        return cls(
            value("kernel/apparmor_restrict_unprivileged_userns"),
            value("user/max_user_namespaces"),
            value("kernel/unprivileged_userns_clone"),
        )


def userns_fix(facts: HostFacts) -> str:
    """The fix for this host, most specific first, as commands a person can paste (no
    host path: a client reads it too)."""
    if facts.apparmor_restrict == "1":
        return (
            "AppArmor forbids it (kernel.apparmor_restrict_unprivileged_userns=1, as on "
            "Ubuntu 23.10 and later). Fix: run `sudo mcp-code-sandbox setup` once (it "
            "writes an AppArmor profile that lets bwrap create user namespaces), or "
            "`sudo sysctl kernel.apparmor_restrict_unprivileged_userns=0` for every program"
        )
    if facts.max_user_namespaces == "0":
        return (
            "the kernel allows no user namespaces (user.max_user_namespaces=0). Fix: "
            "`sudo sysctl user.max_user_namespaces=15000` (persist it in /etc/sysctl.d/)"
        )
    if facts.unprivileged_userns_clone == "0":
        return (
            "the kernel allows them to root only (kernel.unprivileged_userns_clone=0). "
            "Fix: `sudo sysctl kernel.unprivileged_userns_clone=1` (persist it in "
            "/etc/sysctl.d/)"
        )
    return (
        "in a container, its seccomp profile or a nested user namespace may forbid it. "
        "Fix: allow user namespaces there (Docker: `--security-opt seccomp=unconfined`, "
        "or run the server on the host), or use the docker backend (SANDBOX_BACKEND=docker)"
    )


def userns_message(said: str, fix: str) -> str:
    """The one message for this problem: log line at start, ``doctor``, every call."""
    return (
        f"this host does not let bubblewrap create user namespaces, which every sandbox "
        f"needs (bwrap: {said}). Because {fix}; then restart the server"
    )


def _probe_uid() -> int | None:
    """The uid to probe as: none (the server's own) unless root, then nobody's when
    this process's user namespace maps it (a root server's sandboxes never run as root)."""
    if os.geteuid() != 0:
        return None
    try:
        lines = Path("/proc/self/uid_map").read_text().split()
    except OSError:
        return None
    numbers = [int(n) for n in lines]
    for i in range(0, len(numbers) - 2, 3):
        inside, _, count = numbers[i : i + 3]
        if inside <= _NOBODY < inside + count:
            return _NOBODY
    return None


def userns_problem(bwrap: str | None = None) -> str | None:
    """The message (:func:`userns_message`) when ``bwrap`` cannot make a user namespace
    here, ``None`` when it can (or there is no bwrap: that is said elsewhere). Runs one
    short process: called once at start by the backend, and by ``doctor``."""
    bwrap = bwrap or shutil.which("bwrap")
    if bwrap is None:
        return None
    argv = minimal_argv(bwrap, PROBE_FLAGS, ["/bin/true"])
    if (uid := _probe_uid()) is not None:
        argv = [*drop_uid_argv(uid), *argv]
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=_PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None  # not this problem: starting a sandbox says what it is
    if done.returncode == 0:
        return None
    said = " ".join(done.stderr.split())[-_SAID_CHARS:] or f"exit {done.returncode}"
    if "namespace" not in said and "uid map" not in said and "RTM_NEWADDR" not in said:
        return None  # another failure (bwrap's own words say it when a sandbox starts)
    said = said.removeprefix("bwrap: ")
    return userns_message(said, userns_fix(HostFacts.read()))
