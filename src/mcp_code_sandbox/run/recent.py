"""The latest runs of every owner, in memory, for the operator's ``/ui`` page.

A bounded ring (:data:`RING_SIZE` entries, the oldest dropped first): the service adds
one entry per ``run_code`` that got as far as a language check, whatever its end (a
result, or a tool error such as ``session_busy``). Nothing of the code or its output is
kept, only what the page shows: who, which session, language, status, duration and the
error's name or code. The error name comes from the sandbox (a user's exception class),
so it is cut to :data:`MAX_ERROR_CHARS` here; escaping is the page's job.

Semantics: ``status`` is a run's own (``ok``, ``error``, ``timeout``, ``cancelled``), or
``failed`` when the tool failed before or around the run; ``error`` is then the error
code, else for ``error`` what :func:`error_label` finds (the exception's name, or the
exit code), else ``None``.
"""

from __future__ import annotations

import itertools
import re
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_ERROR_CHARS", "RING_SIZE", "RecentRuns", "RunEntry", "error_label"]

RING_SIZE = 200
MAX_ERROR_CHARS = 120
#: A failed run's language and session id are the client's words (an unknown language,
#: an invalid id are refused, and recorded): cut too.
MAX_LANGUAGE_CHARS = 40
MAX_ID_CHARS = 80
#: How much of a failed run's stderr is searched for its uncaught error: runtimes print it
#: first (after the source line), so a flood after it is never read.
STDERR_SCAN_CHARS = 16 * 1024
#: The line a JavaScript runtime prints for an uncaught error, the one above its first
#: stack frame: ``TypeError: ...`` (node, bun), ``MyErr [Error]: ...`` (node, a subclass),
#: ``error: ...`` (bun, a subclass or a syntax error).
_UNCAUGHT = re.compile(r"([A-Za-z_$][\w$]{0,100})(?: \[[A-Za-z_$][\w$]*\])?(?::\s|:?$)")
_FRAME = re.compile(r"\s+at \S")


def error_label(
    status: str, error: Mapping[str, Any] | None, exit_code: int | None, stderr: str
) -> str | None:
    """What the page says of how a run failed: the exception's name where the run has one
    (Python's, from the agent), else the name of the uncaught error a program printed on
    stderr (JavaScript, TypeScript: node and bun print no structured error), else ``exit
    code N``; ``None`` for a run that did not end in ``error``."""
    if status != "error":
        return None
    name = (error or {}).get("name")
    if isinstance(name, str) and name:
        return name
    lines = stderr[:STDERR_SCAN_CHARS].splitlines()
    for line, after in itertools.pairwise(lines):
        found = _UNCAUGHT.match(line)
        if found and _FRAME.match(after):
            uncaught = found.group(1)
            return "Error" if uncaught == "error" else uncaught
    return f"exit code {exit_code}" if exit_code else None


@dataclass(frozen=True)
class RunEntry:
    #: Wall-clock time the run ended (Unix seconds).
    ended_at: float
    owner: str
    session_id: str | None
    language: str
    status: str
    duration_ms: int
    error: str | None


class RecentRuns:
    """The ring. Called by the service (``add``, on the event loop) and the ``/ui`` page
    (``listed``); no lock needed: both run on the event loop."""

    def __init__(self, size: int = RING_SIZE) -> None:
        self._entries: deque[RunEntry] = deque(maxlen=size)

    def add(
        self,
        owner: str,
        session_id: str | None,
        language: str,
        status: str,
        duration_ms: int,
        error: str | None,
    ) -> None:
        cut = None if error is None else error[:MAX_ERROR_CHARS]
        language = language[:MAX_LANGUAGE_CHARS]
        if session_id is not None:  # an invalid one too (``invalid_session_id``): cut
            session_id = session_id[:MAX_ID_CHARS]
        entry = RunEntry(time.time(), owner, session_id, language, status, duration_ms, cut)
        self._entries.append(entry)

    def listed(self, owner: str | None = None, limit: int = RING_SIZE) -> list[RunEntry]:
        """Newest first: every owner's (``owner`` None, for admins) or one owner's."""
        found = [e for e in reversed(self._entries) if owner is None or e.owner == owner]
        return found[:limit]
