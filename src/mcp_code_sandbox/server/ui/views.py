"""Rendering the ``/ui`` pages: the Jinja environment (everything escaped), the value
filters, and the headers every page carries.

Every value on the pages may come from a client or a sandbox (session ids, owners,
error names): the templates never mark anything safe, and autoescaping is on for every
template, so each one is HTML-escaped where it is written.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2
from starlette.responses import HTMLResponse

from mcp_code_sandbox.run.recent import RunEntry

__all__ = ["SECURITY_HEADERS", "ago", "duration", "ended_note", "render", "size"]

_HERE = Path(__file__).parent
STATIC_DIR = _HERE / "static"

#: Served with every ``/ui`` answer: only our own resources (no inline script or style
#: at all: the pages have none), never in a frame, never cached, never sniffed.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
    "Pragma": "no-cache",
    "X-Content-Type-Options": "nosniff",
    # Not ``no-referrer``: under it a browser posts forms with ``Origin: null``, which
    # the Origin check (rightly) refuses. Same-origin only: no URL leaves the server.
    "Referrer-Policy": "same-origin",
}


def size(n: int | None) -> str:
    """Bytes for people: ``1.5 MiB``; ``unknown`` for ``None``."""
    if n is None:
        return "unknown"
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n} B"


def duration(seconds: float) -> str:
    """``42 s``, ``5 min``, ``3.2 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def ago(wall: float) -> str:
    return f"{duration(max(0.0, time.time() - wall))} ago"


def ended_note(
    run: RunEntry, live: Mapping[tuple[str, str], float], ended: Mapping[tuple[str, str], str]
) -> str | None:
    """What a recent run's row says of its session when that session is gone: why it
    ended (``ended``: the server's words), or that it ended; ``None`` while the session it
    ran in is open. ``live``: each open session's creation time (wall clock), so a run of
    an earlier session under the same name reads as ended too. A run that failed before
    any session (an invalid id) gets no note."""
    if run.session_id is None:
        return None
    key = (run.owner, run.session_id)
    created = live.get(key)
    if created is not None and run.ended_at >= created:
        return None
    why = ended.get(key) if created is None else None
    if why is not None:
        return why
    return None if run.status == "failed" and created is None else "this session has ended"


_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(_HERE / "templates"),
    autoescape=True,  # every template, whatever its name
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_ENV.filters.update(size=size, duration=duration, ago=ago)


def render(template: str, context: dict[str, Any], status: int = 200) -> HTMLResponse:
    """The page ``template`` for ``context``, with :data:`SECURITY_HEADERS`."""
    html = _ENV.get_template(template).render(**context)
    return HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)
