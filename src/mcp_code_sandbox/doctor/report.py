"""``mcp-code-sandbox doctor``: every check of each backend, printed, and the verdict.

The checks themselves are output-free (:mod:`.bwrap`, :mod:`.docker`); this prints them
for the CLI (the doctor's result is its output, so stdout) and says which backend is in
use and whether it can start a sandbox.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TextIO

from mcp_code_sandbox.backends.base import Leftover
from mcp_code_sandbox.doctor import bwrap, docker
from mcp_code_sandbox.doctor.bwrap import check_bwrap
from mcp_code_sandbox.doctor.checks import Check, pausing_check, pool_check
from mcp_code_sandbox.doctor.docker import check_docker
from mcp_code_sandbox.doctor.holders import leftovers_check, state_dir_check
from mcp_code_sandbox.errors import SandboxError
from mcp_code_sandbox.settings import Settings, docker_environ

__all__ = ["run_doctor"]


def run_doctor(settings: Settings, out: TextIO = sys.stdout) -> int:
    """Print every check of each backend; exit status 1 when no backend can start a
    sandbox (or the one chosen by SANDBOX_BACKEND cannot), else 0. What fails for the
    backend not in use is said as a note: it does not stop this server."""
    checked = {"bwrap": check_bwrap(settings), "docker": check_docker(settings)}
    essentials = {"bwrap": bwrap.ESSENTIAL, "docker": docker.ESSENTIAL}
    usable = {
        backend: not [c for c in checks if not c.ok and c.name in essentials[backend]]
        for backend, checks in checked.items()
    }
    chosen = settings.backend
    if chosen == "auto":
        chosen = "docker" if usable["docker"] else "bwrap"
    for backend, checks in checked.items():
        in_use = backend == chosen
        print(f"{backend} backend{'' if in_use else ' (not in use)'}:", file=out)
        _print(checks if in_use else [c._replace(note=True) for c in checks], out)
    state = "ready" if usable[chosen] else "NOT usable"
    print("sessions:", file=out)
    containers = _docker_leftovers(settings) if usable["docker"] else []
    _print(
        [
            state_dir_check(settings),
            pool_check(settings),
            pausing_check(settings),
            leftovers_check(settings, containers),
        ],
        out,
    )
    print(f"backend in use ({settings.backend}): {chosen}, {state}", file=out)
    return 0 if usable[chosen] else 1


def _print(checks: list[Check], out: TextIO) -> None:
    for check in checks:
        mark = "ok  " if check.ok else "note" if check.note else "FAIL"
        print(f"  {mark} {check.name}: {check.detail}", file=out)
        if not check.ok and check.fix:
            print(f"       {'if wanted' if check.note else 'fix'}: {check.fix}", file=out)


def _docker_leftovers(settings: Settings) -> list[Leftover]:
    """Containers of servers that are gone (none when the engine does not answer)."""
    from mcp_code_sandbox.backends.docker.backend import DockerBackend

    async def listed() -> list[Leftover]:
        backend = DockerBackend(settings, docker_environ())
        try:
            return await backend.list_leftovers()
        finally:
            await backend.aclose()

    try:
        return asyncio.run(listed())
    except SandboxError:
        return []
