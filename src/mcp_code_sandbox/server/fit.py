"""Fit a tool result into the result budget: the whole serialized message, measured.

A result travels as one JSON-RPC message, and the official MCP client refuses a
server-sent event over 1 MiB (``SANDBOX_MAX_RESULT_BYTES`` is well under that). The
structured content is in the message twice (as ``structuredContent`` and as the text
block holding the same JSON, its fields with a value, where every quote and backslash
is escaped again), beside base64 image blocks and resource links. So the budget is
checked on the real thing: the result is built, serialized the way the SDK sends it,
and measured; when it is over, the largest parts are cut down to a common level ("water
filling": no part is cut while a bigger one is left whole) and it is measured again.

The text block alone is held to a second, smaller budget when one is given: what the
client reads as tokens (``SANDBOX_MAX_RESULT_TOKENS``; Claude Code cuts a tool result at
25,000). It is met the same way, by the text parts only: images are not text.

Parts: the text fields (``stdout``, ``stderr``, ``result``, ``error.value``,
``error.traceback``, each text display), each image block (dropped whole) and the file
list with its links (cut from the end). What was cut is said: ``*_truncated`` flags and
one sentence in ``notice``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mcp_types import CallToolResult, ContentBlock, ImageContent, ResourceLink, TextContent

from mcp_code_sandbox.agent.budget import cut_text

__all__ = [
    "ENVELOPE_BYTES",
    "Fitted",
    "fit_count",
    "fit_result",
    "message_bytes",
    "text_bytes",
    "text_copy",
]

#: Room for what wraps a result on the wire: ``{"jsonrpc":"2.0","id":…,"result":…}``
#: and the SSE event's ``event:``/``id:``/``data:`` lines.
ENVELOPE_BYTES = 512
_ROUNDS = 8
#: Below this much for all the text parts together, images give way to text.
_MIN_TEXT_ROOM = 32 * 1024
_WHY = "cut to fit the result size limit"
#: Text fields of RunResult that may be cut, and the flag that says so.
_TEXTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("stdout",), "stdout_truncated"),
    (("stderr",), "stderr_truncated"),
    (("result",), "result_truncated"),
    (("error", "value"), "error_truncated"),
    (("error", "traceback"), "error_truncated"),
)


def message_bytes(result: CallToolResult) -> int:
    """Bytes of ``result`` as the SDK sends it, plus the envelope around it."""
    body = result.model_dump_json(by_alias=True, exclude_none=True)
    return len(body.encode("utf-8", "replace")) + ENVELOPE_BYTES


def text_copy(data: dict[str, Any]) -> str:
    """The text block beside ``structuredContent``: the same JSON with only the fields
    that have a value (DESIGN §6). ``null``, ``false`` and empty strings, lists and
    objects say nothing a model needs (``6*7`` is ``42``, not 24 keys); clients that
    want every field read ``structuredContent``, which stays complete."""
    return json.dumps(_valued(data), ensure_ascii=False)


def _valued(value: Any) -> Any:
    if isinstance(value, dict):
        kept = {k: _valued(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if not _empty(v)}
    if isinstance(value, list):
        return [_valued(v) for v in value]
    return value


def _empty(value: Any) -> bool:
    # By identity for null and false: 0 is a value (an exit code), and 0 == False.
    return value is None or value is False or value in ("", [], {})


def text_cost(text: str) -> int:
    """Bytes a string field adds to the message: once in the structured content, and
    once re-escaped inside the text copy."""
    encoded = json.dumps(text, ensure_ascii=False)
    again = json.dumps(encoded, ensure_ascii=False)
    return len(encoded.encode("utf-8", "replace")) + len(again.encode("utf-8", "replace")) - 2


@dataclass
class Fitted:
    """A result being fitted: its structured data and the blocks beside it."""

    data: dict[str, Any]
    images: list[ImageContent]
    links: list[ResourceLink]
    #: What was cut so far, for the notice: part name → how many.
    said: dict[str, int] = field(default_factory=dict)

    def build(self) -> CallToolResult:
        data = dict(self.data)
        if self.said:
            data["notice"] = _join(data.get("notice"), _sentence(self.said))
        text = TextContent(type="text", text=text_copy(data))
        blocks: list[ContentBlock] = [text, *self.images, *self.links]
        return CallToolResult(content=blocks, structured_content=data)


def fit_result(fitted: Fitted, limit: int, text_limit: int | None = None) -> CallToolResult:
    """The result within ``limit`` bytes, and its text block within ``text_limit`` bytes
    (what a client reads as tokens; see the module doc); ``fitted`` is changed."""
    for _ in range(_ROUNDS):
        result = fitted.build()
        size = message_bytes(result)
        text = text_bytes(result)
        if size > limit:
            _shrink(fitted, size - limit)
        elif text_limit is not None and text > text_limit:
            fitted.said["tokens"] = 1
            _shrink(fitted, text - text_limit, text_only=True)
        else:
            return result
    _strip(fitted)  # the estimates kept missing (never seen): keep only the fixed fields
    return fitted.build()


def text_bytes(result: CallToolResult) -> int:
    """Bytes of the text blocks of ``result``: what a client counts as its tokens."""
    texts = (block.text for block in result.content if isinstance(block, TextContent))
    return sum(len(text.encode("utf-8", "replace")) for text in texts)


def fit_count(build: Callable[[int], CallToolResult], count: int, limit: int) -> CallToolResult:
    """``build(k)`` for the largest ``k <= count`` whose result fits in ``limit`` bytes
    (a list of entries cut from its end): estimated from two measures, then checked."""
    result = build(count)
    size = message_bytes(result)
    if size <= limit:
        return result
    base = message_bytes(build(0))
    keep = count
    while keep > 0:
        per_entry = max((size - base) / keep, 1.0)
        keep = max(min(keep - 1, int((limit - base) / per_entry * 0.97)), 0)
        result = build(keep)
        size = message_bytes(result)
        if size <= limit:
            return result
    return result


@dataclass
class _Part:
    cost: int
    kind: str  # "text" | "image" | "files"
    ref: Any


def _text_copy_cost(text: str) -> int:
    """Bytes a string field adds to the text block alone."""
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8", "replace"))


def _parts(fitted: Fitted, text_only: bool = False) -> list[_Part]:
    """The parts that can be cut, with what each costs: in the whole message, or in the
    text block alone (``text_only``: images are not text and are left out)."""
    cost_of = _text_copy_cost if text_only else text_cost
    parts: list[_Part] = []
    data = fitted.data
    for path, flag in _TEXTS:
        value = _get(data, path)
        if isinstance(value, str) and value:
            parts.append(_Part(cost_of(value), "text", (path, flag)))
    for i, display in enumerate(data.get("displays") or []):
        text = display.get("text")
        if isinstance(text, str) and text:
            parts.append(_Part(cost_of(text), "text", (("displays", i, "text"), "")))
    if not text_only:
        parts += [_Part(len(image.data) + 64, "image", image) for image in fitted.images]
    files = data.get("files") or []
    if files:
        cost = cost_of(json.dumps(files, ensure_ascii=False, indent=1))
        if not text_only:
            cost += sum(
                len(link.model_dump_json(by_alias=True, exclude_none=True)) for link in fitted.links
            )
        parts.append(_Part(cost, "files", len(files)))
    return parts


def _level(costs: list[int], target: int) -> int:
    """The largest level L with sum(min(cost, L)) <= target."""
    ordered = sorted(costs)
    below = 0
    for i, cost in enumerate(ordered):
        rest = len(ordered) - i
        if below + cost * rest > target:
            return max((target - below) // rest, 0)
        below += cost
    return ordered[-1] if ordered else 0


def _shrink(fitted: Fitted, excess: int, text_only: bool = False) -> None:
    """Cut the text parts and the file list down to a common level; images (already
    held to part of the budget) go only when the texts cannot make room, and never for
    the text block alone (``text_only``)."""
    parts = _parts(fitted, text_only)
    images = [p for p in parts if p.kind == "image"]
    texts = [p for p in parts if p.kind != "image"]
    room = sum(p.cost for p in texts) - excess
    if room < _MIN_TEXT_ROOM and images:
        _cut(fitted, max(images, key=lambda p: p.cost), 0)
        return
    if not texts:
        _strip(fitted)
        return
    # A little more than the excess: the costs are estimates and markers add text.
    target = room - room // 50 - 1024
    level = _level([p.cost for p in texts], max(target, 0))
    for part in texts:
        if part.cost > level:
            _cut(fitted, part, level)


def _cut(fitted: Fitted, part: _Part, level: int) -> None:
    if part.kind == "image":
        fitted.images.remove(part.ref)
        _count(fitted, "images", 1)
        return
    if part.kind == "files":
        keep = len(fitted.data["files"]) * level // part.cost
        dropped = len(fitted.data["files"]) - keep
        fitted.data["files"] = fitted.data["files"][:keep]
        fitted.links = fitted.links[:keep]
        _count(fitted, "files", dropped)
        fitted.data["files_truncated"] = True
        return
    path, flag = part.ref
    text: str = _get(fitted.data, path)
    chars = max(len(text) * level // part.cost, 0)
    _set(fitted.data, path, cut_text(text, chars, _WHY)[0])
    if flag:
        fitted.data[flag] = True
    else:
        fitted.data["displays_truncated"] = True
    _count(fitted, path[0] if path[0] != "error" else "error", 1)


def _strip(fitted: Fitted) -> None:
    """Last resort: every part that can go, goes."""
    data = fitted.data
    for path, flag in _TEXTS:
        if isinstance(_get(data, path), str) and _get(data, path):
            _set(data, path, f"[{_WHY}]")
            data[flag] = True
    if data.get("displays"):
        _count(fitted, "displays", len(data["displays"]))
        data["displays"], data["displays_truncated"] = [], True
    if data.get("files"):
        _count(fitted, "files", len(data["files"]))
        data["files"], data["files_truncated"] = [], True
    _count(fitted, "images", len(fitted.images))
    fitted.images, fitted.links = [], []
    fitted.said["everything"] = 1


def _count(fitted: Fitted, name: str, n: int) -> None:
    if n:
        fitted.said[name] = fitted.said.get(name, 0) + n


def _sentence(said: dict[str, int]) -> str:
    names = {"images": "image(s) left out", "files": "file(s) not listed"}
    quiet = ("everything", "tokens")
    what = [f"{n} {names[k]}" if k in names else k for k, n in said.items() if k not in quiet]
    if "tokens" in said:
        text = "the result's text was longer than a client reads at once, so it was cut"
        limit = "SANDBOX_MAX_RESULT_TOKENS or SANDBOX_MAX_RESULT_BYTES"
    else:
        text = "the result was too large for one message, so it was cut"
        limit = "SANDBOX_MAX_RESULT_BYTES"
    if what:
        text += " (" + ", ".join(what) + ")"
    return (
        text + ": read files with read_file, list them with list_files, or print less "
        f"(the limit is {limit})"
    )


def _join(first: Any, second: str) -> str:
    return f"{first}; {second}" if isinstance(first, str) and first else second


def _get(data: dict[str, Any], path: tuple[Any, ...]) -> Any:
    value: Any = data
    for key in path:
        if isinstance(value, dict):
            value = value.get(key)
        elif isinstance(value, list) and isinstance(key, int) and key < len(value):
            value = value[key]
        else:
            return None
    return value


def _set(data: dict[str, Any], path: tuple[Any, ...], value: str) -> None:
    target: Any = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
