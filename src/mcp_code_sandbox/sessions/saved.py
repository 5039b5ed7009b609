"""What a variables pause saved, and what a resume restored: the agent's reports, parsed.

The agent saves and loads a session's variables inside the sandbox (``exec`` with
``state``; :mod:`mcp_code_sandbox.agent.state`) and answers with a JSON report. That text
comes from the sandbox, where user code runs, so it is hostile: :func:`parse_save` and
:func:`parse_load` accept only the documented shapes, keep at most ``MAX_ENTRIES`` of each
list, cut names and types to ``MAX_NAME_CHARS`` and reasons to ``MAX_WHY_CHARS``, strip
control characters (:func:`~mcp_code_sandbox.sanitize.clean_text`), and raise
:class:`~mcp_code_sandbox.errors.SandboxFailed` for anything else, never another error.
The host never unpickles anything: it reads this report only.

The session manager keeps the names and types of a :class:`SaveReport` in the session's
host-side record (``sessions.session.Paused``) to say which variables a paused session
holds.

Semantics: ``Variable.bytes`` is set for a kept value (its pickle's size), ``None``
otherwise; ``Variable.why`` is set for a value not kept or not restored. In
``SaveReport.modules`` a variable's ``name`` is the bound name and ``type`` the module's
name (``np`` → ``numpy``). ``LoadReport.found`` false: there was no complete saved state
(``failed`` may say what was wrong with what was there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mcp_code_sandbox.errors import SandboxFailed
from mcp_code_sandbox.sanitize import clean_text

__all__ = [
    "MAX_ENTRIES",
    "MAX_NAME_CHARS",
    "MAX_REPORT_CHARS",
    "MAX_WHY_CHARS",
    "LoadReport",
    "SaveReport",
    "Variable",
    "parse_load",
    "parse_save",
]

MAX_ENTRIES = 1000
MAX_NAME_CHARS = 200
MAX_WHY_CHARS = 300
#: A report longer than this is refused before it is parsed (the agent's are far shorter).
MAX_REPORT_CHARS = 8 * 1024 * 1024
#: The largest byte count believed (a petabyte): a bigger one is a lie.
_MAX_BYTES = 1 << 50


@dataclass(frozen=True)
class Variable:
    name: str
    type: str
    bytes: int | None = None
    why: str | None = None


@dataclass(frozen=True)
class SaveReport:
    kept: tuple[Variable, ...]
    #: ``name``: the bound name; ``type``: the module's name.
    modules: tuple[Variable, ...]
    dropped: tuple[Variable, ...]
    #: The saved state's size on disk.
    bytes: int


@dataclass(frozen=True)
class LoadReport:
    found: bool
    restored: tuple[str, ...]
    modules: tuple[str, ...]
    failed: tuple[Variable, ...]


def parse_save(text: str | None) -> SaveReport:
    """The agent's save report (``done.result`` of a save), checked; ``SandboxFailed``
    when it is not one."""
    raw = _decode(text, "save")
    kept = tuple(
        Variable(
            name=_text(v.get("name"), MAX_NAME_CHARS, "a kept name"),
            type=_text(v.get("type"), MAX_NAME_CHARS, "a kept type"),
            bytes=_count(v.get("bytes"), "a kept value's bytes"),
        )
        for v in (_object(x, "a kept value") for x in _list(raw, "kept"))
    )
    modules = tuple(
        Variable(
            name=_text(v.get("name"), MAX_NAME_CHARS, "a module's name"),
            type=_text(v.get("module"), MAX_NAME_CHARS, "a module"),
        )
        for v in (_object(x, "a module") for x in _list(raw, "modules"))
    )
    return SaveReport(
        kept=kept,
        modules=modules,
        dropped=_reasons(raw, "dropped"),
        bytes=_count(raw.get("bytes"), "the saved bytes"),
    )


def parse_load(text: str | None) -> LoadReport:
    """The agent's load report (``done.result`` of a load), checked; ``SandboxFailed``
    when it is not one."""
    raw = _decode(text, "load")
    found = raw.get("found")
    if not isinstance(found, bool):
        raise SandboxFailed("the sandbox's load report has no true/false 'found'")
    return LoadReport(
        found=found,
        restored=tuple(_text(n, MAX_NAME_CHARS, "a restored name") for n in _list(raw, "restored")),
        modules=tuple(_text(n, MAX_NAME_CHARS, "a module's name") for n in _list(raw, "modules")),
        failed=_reasons(raw, "failed"),
    )


def _decode(text: Any, kind: str) -> dict[str, Any]:
    if not isinstance(text, str):
        raise SandboxFailed(f"the sandbox sent no {kind} report")
    if len(text) > MAX_REPORT_CHARS:
        raise SandboxFailed(f"the sandbox's {kind} report is over {MAX_REPORT_CHARS} characters")
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError):
        raise SandboxFailed(f"the sandbox's {kind} report is not JSON") from None
    if not isinstance(raw, dict):
        raise SandboxFailed(f"the sandbox's {kind} report is not a JSON object")
    return raw


def _reasons(raw: dict[str, Any], key: str) -> tuple[Variable, ...]:
    return tuple(
        Variable(
            name=_text(v.get("name"), MAX_NAME_CHARS, f"a {key} name"),
            type=_text(v.get("type"), MAX_NAME_CHARS, f"a {key} type"),
            why=_text(v.get("why"), MAX_WHY_CHARS, f"a {key} reason"),
        )
        for v in (_object(x, f"a {key} entry") for x in _list(raw, key))
    )


def _object(raw: Any, what: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise SandboxFailed(f"the sandbox's report: {what} is not an object")
    return raw


def _list(raw: dict[str, Any], key: str) -> list[Any]:
    """``raw[key]``, a list, of which the first ``MAX_ENTRIES`` are kept."""
    value = raw.get(key)
    if not isinstance(value, list):
        raise SandboxFailed(f"the sandbox's report: {key!r} is not a list")
    return value[:MAX_ENTRIES]


def _text(value: Any, limit: int, what: str) -> str:
    if not isinstance(value, str):
        raise SandboxFailed(f"the sandbox's report: {what} is not a string")
    text = clean_text(value[: limit * 2]).replace("\n", " ").replace("\t", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_BYTES:
        raise SandboxFailed(f"the sandbox's report: {what} is not a byte count")
    return value
