"""Facts about this host's processes: is a marked server still running, can we chown?

A server process leaves a mark (a pid file, a container label); is it still running? A
pid alone cannot say: pids are reused, and in a container they are reused at once, since
every start of the server's container gives it the same pid (1, or 7 under an init). So a
mark names the process by its pid and its start time (``/proc/<pid>/stat``, clock ticks
since boot), and a process counts as the marked one only when both match. A mark without
a start time (one of a server before this) is judged by its pid alone.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["can_chown", "process_alive", "process_mark", "process_start", "read_mark"]


def process_start(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot; ``None`` if there is no such
    process (or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces or ')': split after the last.
    fields = text[text.rindex(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 of stat(5); this list starts at field 3
    except (IndexError, ValueError):
        return None


def process_mark(pid: int | None = None) -> str:
    """``<pid>.<start>`` for ``pid`` (default: this process), or ``<pid>`` alone when its
    start time cannot be read."""
    pid = os.getpid() if pid is None else pid
    start = process_start(pid)
    return f"{pid}" if start is None else f"{pid}.{start}"


def read_mark(text: str) -> tuple[int, int | None] | None:
    """``(pid, start or None)`` from a mark; ``None`` when it is not one."""
    pid, dot, start = text.strip().partition(".")
    if not pid.isdigit() or (dot and not start.isdigit()):
        return None
    return int(pid), (int(start) if start else None)


def process_alive(pid: int, start: int | None = None) -> bool:
    """Does ``pid`` run, and (when ``start`` is given) is it the process that started then?"""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # it exists, and is not ours to signal
    if start is None:
        return True
    now = process_start(pid)
    # Unreadable (a /proc without it) is not evidence of a reuse: keep it alive.
    return now is None or now == start


def can_chown() -> bool:
    """Can this process give files to another uid (CAP_CHOWN in its effective set)?"""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) & 1)  # bit 0 is CAP_CHOWN
    except (OSError, ValueError):
        pass
    return os.geteuid() == 0
