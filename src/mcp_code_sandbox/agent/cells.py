"""What running one Python cell produces, shared by the plain and the IPython shell.

Kernel-side only. ``Outcome.error`` is the protocol's ``error`` object; user code that
fails is data here, never an exception out of a shell.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "ANSI",
    "LEFT_OUT",
    "RICH_MIMES",
    "Emit",
    "Outcome",
    "Shell",
    "StateShell",
    "emit_display",
    "error_info",
    "mime_bundle",
    "pick_mimes",
    "value_text",
]

#: Sends one ``display`` message: (source, {mime: data}).
Emit = Callable[[str, dict[str, str]], None]
#: The source of an emit that carries nothing: a display had forms a result does not
#: carry (JavaScript, a widget) and none it does but its text; the kernel counts it.
LEFT_OUT = "left_out"

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

#: Richest first (for a model: a markdown table reads better than its HTML). Only these
#: reach the host; a bundle with none of them is left out and counted (``unsupported``).
RICH_MIMES = (
    "image/png",
    "image/jpeg",
    "image/svg+xml",
    "text/markdown",
    "text/html",
    "text/latex",
    "application/json",
)
_BASE64_MIMES = ("image/png", "image/jpeg")


@dataclass
class Outcome:
    status: str  # "ok" | "error"
    result: str | None
    error: dict[str, str] | None
    execution_count: int
    #: The value was a matplotlib artist (``<Axes: >``, a list of ``Line2D``): said only
    #: when the cell drew no figure (the kernel knows, after the cell).
    artist: bool = False


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

    image/png and image/jpeg may arrive as raw bytes (``_repr_png_``) or as base64 text
    (IPython's ``Image``); they always leave as base64 text. application/json arrives as
    the object IPython's formatter returns and leaves as its JSON text.
    """
    out: dict[str, str] = {}
    for mime in RICH_MIMES:
        value = data.get(mime)
        if value is None:
            continue
        if mime in _BASE64_MIMES and isinstance(value, bytes):
            value = base64.b64encode(value).decode("ascii")
        elif isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        elif mime == "application/json" and not isinstance(value, str):
            try:
                value = json.dumps(value, ensure_ascii=False, default=repr)
            except (TypeError, ValueError):  # circular: no JSON of it
                continue
        if isinstance(value, str):
            out[mime] = value
            break
    plain = data.get("text/plain")
    if isinstance(plain, str):
        out["text/plain"] = plain
    return out or None


def emit_display(emit: Emit, data: dict[str, Any]) -> None:
    """Send ``data`` (a display's bundle) as its richest form and text, saying
    (:data:`LEFT_OUT`) when forms a result does not carry were all it had beside text."""
    picked = pick_mimes(data)
    others = set(data) - set(RICH_MIMES) - {"text/plain"}
    if others and not (picked and set(picked) - {"text/plain"}):
        emit(LEFT_OUT, {})
    if picked:
        emit("display", picked)


def value_text(data: dict[str, Any]) -> tuple[str | None, bool]:
    """A cell value's bundle, once: ``(result, shown)``. Its text when that is all it
    has; its markdown (a DataFrame's table) as the text, which reads as well and says
    it once; any other richer form (an image, HTML, LaTeX, JSON) is ``shown`` as a
    display instead, with no text: not also ``<IPython.core.display.HTML object>``."""
    picked = pick_mimes(data) or {}
    plain = picked.get("text/plain")
    rich = [mime for mime in picked if mime != "text/plain"]
    if not rich:
        return plain, False
    if rich == ["text/markdown"]:
        return picked["text/markdown"], False
    return None, True


def mime_bundle(obj: object) -> dict[str, Any]:
    """A Jupyter-style bundle from an object's ``_repr_*_`` methods, for the plain shell."""
    bundle: dict[str, Any] = {"text/plain": repr(obj)}
    from .tables import dataframe_markdown  # at first use (see kernel.deferred)

    table = dataframe_markdown(obj)
    if table is not None:  # as the IPython shell's formatter does (``ipy``)
        bundle["text/markdown"] = table
    for mime, method in (
        ("image/png", "_repr_png_"),
        ("image/jpeg", "_repr_jpeg_"),
        ("image/svg+xml", "_repr_svg_"),
        ("text/markdown", "_repr_markdown_"),
        ("text/html", "_repr_html_"),
        ("text/latex", "_repr_latex_"),
        ("application/json", "_repr_json_"),
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
