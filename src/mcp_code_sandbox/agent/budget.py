"""The result budget of one run, as the agent (and again the host) enforces it.

A run's result must reach an MCP client whose transport refuses large messages (the
official client: one server-sent event over 1 MiB). The host shapes the final result to
its byte budget (``server/fit.py``); this module bounds what gets that far, early, so a
hostile cell cannot make the agent, the channel or the host hold more than a few times
the budget: the last expression's text, the error's value and traceback, and the
``display`` outputs, which are dropped as they arrive once the run has used its share.

Used by the kernel (before it frames anything), by the supervisor (which does not trust
the kernel: user code runs in it) and by the host's agent client (which trusts neither).
Standard library only; one definition for all three.

Semantics: ``result_bytes`` is the host's whole-result budget (``SANDBOX_MAX_RESULT_BYTES``);
``images`` how many images a result may carry (``SANDBOX_MAX_IMAGES``). A text field is
cut to ``result_bytes // 2`` characters (head and tail, the cut marked in the text): the
host counts the structured content and its text copy, so no single field can use more.
Displays: at most ``MAX_DISPLAYS`` per run, at most ``images`` of them images (each at
most ``MAX_IMAGE_CHARS`` of base64; the host downscales what it keeps), and their text
together at most ``result_bytes`` characters. Images dropped are counted apart from
other displays (a result says "N more image(s) not shown").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .protocol import BudgetMessage

__all__ = [
    "DEFAULT_IMAGES",
    "DEFAULT_RESULT_BYTES",
    "MAX_DISPLAYS",
    "MAX_IMAGE_CHARS",
    "STATE_RESULT_BYTES",
    "Budget",
    "DisplayGate",
    "cut_text",
]

DEFAULT_RESULT_BYTES = 512 * 1024
#: The budget of a save's or load's report (``exec`` with ``state``): never cut, as the
#: report is JSON; the agent bounds it (``state.MAX_REPORTED`` entries, short texts).
STATE_RESULT_BYTES = 16 * 1024 * 1024
DEFAULT_IMAGES = 4
#: Display messages kept per run, of any kind (each costs a few dozen bytes even empty).
MAX_DISPLAYS = 64
#: Largest image (base64 characters) a display may carry: the host decodes and
#: downscales each kept image, so this bounds its memory per image (~6 MiB of PNG).
MAX_IMAGE_CHARS = 8 * 1024 * 1024
#: Below this much room left, a text display is dropped rather than cut to a stub.
_MIN_TEXT_CUT = 1024
_IMAGE_MIMES = ("image/png", "image/jpeg")


@dataclass(frozen=True)
class Budget:
    result_bytes: int = DEFAULT_RESULT_BYTES
    images: int = DEFAULT_IMAGES

    @property
    def text_chars(self) -> int:
        """The most characters one text field (result, error value, traceback) keeps."""
        return max(self.result_bytes // 2, 256)

    @classmethod
    def from_message(cls, raw: Any) -> Budget:
        """From an ``exec`` message's ``budget``; defaults for what is missing or bad."""
        if not isinstance(raw, dict):
            return cls()
        return cls(
            result_bytes=_positive(raw.get("result_bytes"), DEFAULT_RESULT_BYTES),
            images=_positive(raw.get("images"), DEFAULT_IMAGES, allow_zero=True),
        )

    def to_message(self) -> BudgetMessage:
        """``exec``'s ``budget``: the host sends it, the supervisor passes it to the kernel."""
        return {"result_bytes": self.result_bytes, "images": self.images}


def _positive(value: Any, default: int, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        return default
    return value if value > 0 or (allow_zero and value == 0) else default


def cut_text(text: str, limit: int, why: str = "over the result budget") -> tuple[str, bool]:
    """``text`` within ``limit`` characters: head and tail, the cut marked between them.

    Returns ``(text, cut)``. Slicing only: never encodes or copies the whole of a huge
    string."""
    if len(text) <= limit:
        return text, False
    marker = f"\n[... {len(text) - limit} characters cut: {why} ...]\n"
    keep = max(limit - len(marker), 0)
    head = keep - keep // 2
    tail = keep // 2
    return text[:head] + marker + (text[-tail:] if tail else ""), True


def cut_error(error: Any, limit: int) -> tuple[dict[str, str] | None, bool]:
    """A protocol ``error`` object with each of its texts within ``limit`` characters."""
    if not isinstance(error, dict):
        return None, False
    out: dict[str, str] = {}
    cut_any = False
    for key, keep in (("name", 200), ("value", limit), ("traceback", limit)):
        value = error.get(key, "")
        text, cut = cut_text(value if isinstance(value, str) else str(value), keep)
        out[key] = text
        cut_any = cut_any or cut
    return out, cut_any


class DisplayGate:
    """Admits a run's ``display`` outputs while they fit; counts the ones it drops."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.kept = 0
        self.images = 0
        self.text_chars = 0
        #: Displays dropped whole (images past their count or size apart), and text
        #: displays cut to fit.
        self.dropped = 0
        self.images_dropped = 0
        self.cut = 0
        #: Displays with none of the forms a result carries (e.g. only JavaScript or a
        #: widget): left out, not for the budget; counted by the kernel.
        self.unsupported = 0

    def admit(self, data: Any) -> dict[str, str] | None:
        """``data`` (a display's ``{mime: str}``) as it may be forwarded, or ``None``."""
        if not isinstance(data, dict) or self.kept >= MAX_DISPLAYS:
            self.dropped += 1
            return None
        image = next((m for m in _IMAGE_MIMES if isinstance(data.get(m), str)), None)
        if image is not None:
            if self.images >= self.budget.images or len(data[image]) > MAX_IMAGE_CHARS:
                self.images_dropped += 1
                return None
            self.images += 1
            plain = data.get("text/plain")
            out = {image: data[image]}
            if isinstance(plain, str):
                out["text/plain"] = plain[:200]
            self.kept += 1
            return out
        return self._admit_text(data)

    def _admit_text(self, data: dict[Any, Any]) -> dict[str, str] | None:
        room = self.budget.result_bytes - self.text_chars
        texts = {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}
        size = sum(len(v) for v in texts.values())
        if not texts or (size > room and room < _MIN_TEXT_CUT):
            self.dropped += 1
            return None
        if size > room:  # one cut display, then nothing more of this kind fits
            share = room // len(texts)
            texts = {k: cut_text(v, share)[0] for k, v in texts.items()}
            size = sum(len(v) for v in texts.values())
            self.cut += 1
        self.text_chars += size
        self.kept += 1
        return texts

    def summary(self) -> dict[str, int]:
        return {
            "displays_dropped": self.dropped,
            "displays_cut": self.cut,
            "images_dropped": self.images_dropped,
            "displays_unsupported": self.unsupported,
        }
