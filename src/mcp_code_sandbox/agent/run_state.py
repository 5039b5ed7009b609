"""One run (an ``exec``) as the supervisor tracks it, and the host messages it ends with.

Semantics of ``Run``: ``child`` is ``None`` for Python (the run is in the kernel) and the
program's process otherwise. ``reason`` is ``None`` until the run is interrupted (by its
deadline: "timeout"; by the host: "cancelled" or "timeout"), and from then on it is the
run's final status whatever the code does. ``kill_at`` is when an interrupted run that has
not finished gets killed. ``orphaned``: the host that asked for it went away; it runs to
its end or deadline, and nothing of it is sent to the next host.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from .budget import Budget, DisplayGate
from .children import Child, describe_exit
from .protocol import CutReport, DoneEvent, ErrorDetail

__all__ = [
    "GRACE_S",
    "Run",
    "done",
    "exec_error",
    "kernel_died_error",
    "killed_error",
    "program_exit_code",
]

#: Time a run gets between SIGINT and SIGKILL.
GRACE_S = 2.0


@dataclass
class Run:
    id: int
    language: str
    deadline: float
    #: When the agent started it (monotonic): ``done`` says how long the run took here.
    started: float = field(default_factory=time.monotonic)
    child: Child | None = None
    reason: str | None = None
    kill_at: float | None = None
    orphaned: bool = False
    #: Python runs: what of the kernel's displays may go on to the host (the kernel
    #: applies the same budget, but user code runs in the kernel).
    displays: DisplayGate = field(default_factory=lambda: DisplayGate(Budget()))


def done(
    run_id: int,
    status: str,
    *,
    exit_code: int | None = None,
    result: str | None = None,
    error: ErrorDetail | None = None,
    execution_count: int | None = None,
    state_lost: bool = False,
    cut: CutReport | None = None,
) -> DoneEvent:
    """The ``done`` message of run ``run_id``; the supervisor sends it (``cut``: Python only)."""
    message: DoneEvent = {
        "ev": "done",
        "id": run_id,
        "status": status,
        "exit_code": exit_code,
        "result": result,
        "error": error,
        "execution_count": execution_count,
        "state_lost": state_lost,
    }
    if cut is not None:
        message["cut"] = cut
    return message


def program_exit_code(returncode: int) -> int:
    """Shell convention: a program killed by signal N exits with 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode


def kernel_died_error(returncode: int, memory_bytes: int | None) -> ErrorDetail:
    value = f"the Python process {describe_exit(returncode)}"
    if returncode == -signal.SIGKILL:
        limit = f"{memory_bytes / 2**20:.0f} MiB" if memory_bytes else "the sandbox's memory limit"
        value += f"; this usually means it ran out of memory ({limit})"
    value += ". Variables and imports are lost; files in the workspace are kept."
    return {"name": "KernelDied", "value": value, "traceback": ""}


def killed_error(reason: str) -> ErrorDetail:
    value = (
        f"the code did not stop within {GRACE_S:g} s of an interrupt ({reason}), so the "
        "Python process was restarted. Variables and imports are lost; files are kept."
    )
    return {"name": "KernelRestarted", "value": value, "traceback": ""}


def exec_error(message: dict[str, Any], languages: set[str]) -> str | None:
    """Why an ``exec`` message is malformed, or ``None`` when it is fine."""
    run_id = message.get("id")
    if not isinstance(run_id, int) or isinstance(run_id, bool):
        return "exec: 'id' must be an integer"
    if not isinstance(message.get("code"), str):
        return "exec: 'code' must be a string"
    if message.get("language", "python") not in languages:
        return f"exec: unsupported language {message.get('language')!r}"
    timeout = message.get("timeout_s", 60)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        return "exec: 'timeout_s' must be a number"
    if not math.isfinite(timeout) or timeout <= 0:
        return "exec: 'timeout_s' must be positive"
    env = message.get("env") or {}
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
        for k, v in env.items()
    ):
        return "exec: 'env' must map names to strings"
    return _state_error(message)


def _state_error(message: dict[str, Any]) -> str | None:
    """Why an ``exec``'s ``state`` and ``max_bytes`` are malformed, or ``None``."""
    state = message.get("state")
    if state is None:
        return None
    if state not in ("save", "load"):
        return 'exec: \'state\' must be "save" or "load"'
    if message.get("language", "python") != "python":
        return "exec: 'state' is for Python only"
    max_bytes = message.get("max_bytes")
    if state == "save" and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0
    ):
        return "exec: a save needs 'max_bytes', a positive integer"
    return None
