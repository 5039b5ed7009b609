"""Languages other than Python: each call runs one program as a child of the supervisor.

A new language is one entry in ``PROGRAMS``: how to turn code into an argv, and how to
ask the interpreter for its version. ``ready`` lists only those whose interpreter exists.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PROGRAMS", "Program", "available"]


@dataclass(frozen=True)
class Program:
    executable: str
    argv: Callable[[str, str], list[str]]  # (resolved executable, code) -> argv
    version_argv: tuple[str, ...]


PROGRAMS: dict[str, Program] = {
    "bash": Program(
        "bash",
        lambda exe, code: [exe, "-c", code],
        ("-c", 'printf %s "${BASH_VERSION%%(*}"'),
    ),
}


def available() -> dict[str, tuple[str, str]]:
    """``{language: (executable path, version)}`` for the interpreters found on PATH."""
    found: dict[str, tuple[str, str]] = {}
    for name, program in PROGRAMS.items():
        exe = shutil.which(program.executable)
        if exe is None:
            continue
        found[name] = (exe, _version(exe, program.version_argv))
    return found


def _version(exe: str, argv: tuple[str, ...]) -> str:
    try:
        out = subprocess.run(
            [exe, *argv], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.strip().lstrip("v") or "unknown"
