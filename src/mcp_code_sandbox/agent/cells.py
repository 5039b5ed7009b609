"""What running one Python cell produces, shared by the plain and the IPython shell.

Kernel-side only. ``Outcome.error`` is the protocol's ``error`` object; user code that
fails is data here, never an exception out of a shell.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "ANSI",
    "RICH_MIMES",
    "Emit",
    "Outcome",
    "Shell",
    "StateShell",
    "error_info",
    "mime_bundle",
    "pick_mimes",
]

#: Sends one ``display`` message: (source, {mime: data}).
Emit = Callable[[str, dict[str, str]], None]

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

#: Richest first. Only these reach the host; e.g. text/html falls back to text/plain.
RICH_MIMES = ("image/png", "image/svg+xml", "text/markdown")


@dataclass
class Outcome:
    status: str  # "ok" | "error"
    result: str | None
    error: dict[str, str] | None
    execution_count: int


class StateShell(Protocol):
    """What a shell (``ipy``, ``plain``) offers a save or load."""

    def user_namespace(self) -> dict[str, Any]: ...

    def is_own(self, name: str, value: Any) -> bool:
        """Is ``name`` the shell's own (not the user's), bound to ``value``?"""
        ...

    def history(self) -> list[str]: ...

    def set_history(self, inputs: list[str]) -> None: ...

    def last_count(self) -> int:
        """The execution count of the last cell (0 before the first)."""
        ...

    def set_last_count(self, count: int) -> None: ...


class Shell(StateShell, Protocol):
    """A persistent interpreter: runs cells, and hands its namespace to a save or load."""

    ipython: bool

    def run(self, code: str) -> Outcome: ...

    def warm_up(self) -> None:
        """Do now what the first cell would do first, with no trace a cell could see (no
        count, no history, no names). Called by the kernel after its ``ready``, while the
        host's ``exec`` is on its way."""
        ...


def error_info(exc: BaseException, traceback_text: str) -> dict[str, str]:
    return {
        "name": type(exc).__name__,
        "value": str(exc),
        "traceback": ANSI.sub("", traceback_text).rstrip("\n"),
    }


def pick_mimes(data: dict[str, Any]) -> dict[str, str] | None:
    """The richest supported representation plus text/plain; ``None`` when there is none.

    image/png may arrive as raw bytes (``_repr_png_``) or as base64 text (IPython's
    ``Image``); it always leaves as base64 text.
    """
    out: dict[str, str] = {}
    for mime in RICH_MIMES:
        value = data.get(mime)
        if value is None:
            continue
        if mime == "image/png" and isinstance(value, bytes):
            value = base64.b64encode(value).decode("ascii")
        elif isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if isinstance(value, str):
            out[mime] = value
            break
    plain = data.get("text/plain")
    if isinstance(plain, str):
        out["text/plain"] = plain
    return out or None


def mime_bundle(obj: object) -> dict[str, Any]:
    """A Jupyter-style bundle from an object's ``_repr_*_`` methods, for the plain shell."""
    bundle: dict[str, Any] = {"text/plain": repr(obj)}
    for mime, method in (
        ("image/png", "_repr_png_"),
        ("image/svg+xml", "_repr_svg_"),
        ("text/markdown", "_repr_markdown_"),
    ):
        fn = getattr(obj, method, None)
        if callable(fn):
            try:
                value = fn()
            except Exception:  # noqa: S112 - a broken _repr_ must not fail display()
                continue
            if isinstance(value, tuple):  # (data, metadata) form
                value = value[0]
            if value is not None:
                bundle[mime] = value
    return bundle
