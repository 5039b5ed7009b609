"""``setup`` as root on an AppArmor host that forbids unprivileged user namespaces
(Ubuntu >= 23.10): a profile that lets the bwrap in use create them, and only it.

The alternative, ``kernel.apparmor_restrict_unprivileged_userns=0``, lifts the
restriction for every program on the host; a profile for bwrap keeps it for the rest, as
Ubuntu's own profiles for browsers and container tools do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from mcp_code_sandbox.backends.bwrap.userns import HostFacts
from mcp_code_sandbox.provision.common import Progress

__all__ = ["PROFILE_NAME", "allow_bwrap_userns", "apparmor_profile"]

PROFILE_NAME = "mcp-code-sandbox-bwrap"
_PROFILES = Path("/etc/apparmor.d")


def apparmor_profile(bwrap: str) -> str:
    """The profile: ``bwrap`` (by its path) may create user namespaces and is otherwise
    unconfined, which is what it was before the restriction."""
    return (
        "# Written by `mcp-code-sandbox setup`: lets bubblewrap create the user namespaces\n"
        "# every sandbox needs (kernel.apparmor_restrict_unprivileged_userns=1).\n"
        "abi <abi/4.0>,\n"
        "include <tunables/global>\n\n"
        f"profile {PROFILE_NAME} {bwrap} flags=(unconfined) {{\n"
        "  userns,\n"
        f"  include if exists <local/{PROFILE_NAME}>\n"
        "}\n"
    )


def allow_bwrap_userns(
    progress: Progress,
    *,
    facts: HostFacts | None = None,
    bwrap: str | None = None,
    directory: Path = _PROFILES,
    parser: str | None = None,
    root: bool | None = None,
) -> Path | None:
    """On a host whose AppArmor forbids unprivileged user namespaces, write and load the
    profile (root), or say the command that does (not root). Returns the profile's path
    when written. Called first by ``setup`` run by a person (the server's own background
    build does not change the host); the arguments are for tests."""
    facts = facts or HostFacts.read()
    bwrap = bwrap or shutil.which("bwrap")
    if facts.apparmor_restrict != "1" or bwrap is None:
        return None
    path = directory / PROFILE_NAME
    text = apparmor_profile(bwrap)
    written = path.exists() and path.read_text() == text
    if not (os.geteuid() == 0 if root is None else root):
        if not written:
            progress(
                "warning: AppArmor forbids unprivileged user namespaces here, which every "
                "bwrap sandbox needs: run `sudo mcp-code-sandbox setup` once to allow them "
                f"for {bwrap}"
            )
        return None
    if written:
        return path
    path.write_text(text)
    parser = parser or shutil.which("apparmor_parser") or "/sbin/apparmor_parser"
    try:
        subprocess.run([parser, "-r", str(path)], check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        said = getattr(exc, "stderr", None) or str(exc)
        progress(f"warning: wrote {path} but could not load it ({said.strip()[-300:]})")
        return path
    progress(f"wrote the AppArmor profile {path}: {bwrap} may create user namespaces")
    return path
