"""Which processes a test started: the descendants of a pid, read from /proc."""

from __future__ import annotations

import os
import time
from pathlib import Path


def _stat(pid: str) -> tuple[int, str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces: split after the last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0]


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = _stat(pid)
        if stat is not None:
            children.setdefault(stat[0], []).append(int(pid))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def running(pids: set[int]) -> set[int]:
    """Those of ``pids`` that still exist and are not zombies."""
    alive = set()
    for pid in pids:
        stat = _stat(str(pid))
        if stat is not None and stat[1] != "Z":
            alive.add(pid)
    return alive


def wait_gone(pids: set[int], timeout: float = 15) -> set[int]:
    deadline = time.monotonic() + timeout
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running(pids)
