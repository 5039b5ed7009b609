"""Shape plain results into MCP ``CallToolResult``s: structured JSON, its text, media blocks.

Every tool result carries ``structuredContent`` matching the tool's output schema and,
as a text block, the same JSON with only the fields that have a value; images and links
ride beside it as content blocks. Errors are ``isError`` results with
``"<code>: <message>"`` and ``_meta.error_code`` (DESIGN §7).
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mcp_types import (
    BlobResourceContents,
    CallToolResult,
    ContentBlock,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
)
from pydantic import BaseModel

from mcp_code_sandbox.errors import SandboxError
from mcp_code_sandbox.run.execute import RunReport
from mcp_code_sandbox.sanitize import clean_text, escape_name
from mcp_code_sandbox.server.fit import Fitted, fit_result, text_copy
from mcp_code_sandbox.server.media import MAX_PIXELS, fit_image
from mcp_code_sandbox.server.models import DisplayOut, FileOut, RunError, RunResult
from mcp_code_sandbox.settings import Settings

__all__ = [
    "Images",
    "error_result",
    "file_uri",
    "image_blocks",
    "light",
    "run_result",
    "structured_result",
]

_PLAIN_RUN_FIELDS = frozenset(RunResult.model_fields) - {
    "notice",
    "error",
    "files",
    "displays",
    "blocked_hosts",
}
#: Fields whose text a sandbox wrote (see :mod:`mcp_code_sandbox.sanitize`).
_SANDBOX_TEXT = ("stdout", "stderr", "result")
#: Changed files a run result lists (with links); the rest are counted, list_files has all.
MAX_FILES_LISTED = 100
_TEXT_DISPLAYS = (
    "text/markdown",
    "text/plain",
    "image/svg+xml",
    "text/html",
    "text/latex",
    "application/json",
)
_IMAGE_DISPLAYS = ("image/png", "image/jpeg")
#: A report with no image and at most this much text (and few files) is shaped on the
#: event loop: well under a millisecond, less than the trip to a worker thread costs.
LIGHT_TEXT_BYTES = 16 * 1024
LIGHT_FILES = 16


def file_uri(session_id: str, path: str) -> str:
    return f"sandbox://{session_id}/{path}"


def error_result(error: SandboxError) -> CallToolResult:
    meta: dict[str, Any] = {"error_code": error.code}
    meta.update({k: v for k, v in error.details.items() if isinstance(v, str | int)})
    # Messages may quote what a sandbox wrote (a file name, its last words).
    text = clean_text(str(error))
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True, _meta=meta)


def structured_result(model: BaseModel, extra: list[ContentBlock] | None = None) -> CallToolResult:
    data = model.model_dump(mode="json")
    text = TextContent(type="text", text=text_copy(data))
    return CallToolResult(content=[text, *(extra or [])], structured_content=data)


def light(report: RunReport) -> bool:
    """Is shaping ``report`` (:func:`run_result`) cheap enough for the event loop? No
    image to decode, little text, few files: what most cells return. The tool layer asks,
    and sends anything else to a worker thread."""
    if report.image_files or len(report.files) > LIGHT_FILES:
        return False
    if any(d.mime_type.startswith(_IMAGE_DISPLAYS) for d in report.displays):
        return False
    error = report.error or {}
    size = len(report.stdout) + len(report.stderr) + len(report.result or "")
    size += sum(len(str(v)) for v in error.values()) + sum(len(d.data) for d in report.displays)
    return size + len(report.notice or "") <= LIGHT_TEXT_BYTES


def run_result(
    report: RunReport, settings: Settings, link: Callable[[str], str] | None = None
) -> CallToolResult:
    """RunResult JSON + one image block per figure/image (within budget) + file links;
    ``link`` makes each file's ``download_url`` (none when ``None``).

    Blocking (it decodes and re-encodes images): call it in a worker thread."""
    candidates = [
        (d.data, d.mime_type) for d in report.displays if d.mime_type.startswith(_IMAGE_DISPLAYS)
    ]
    candidates += [(f.data, f.mime_type) for f in report.image_files]
    # Images share half of the result budget (base64 is 4/3 of the bytes).
    shown = image_blocks(candidates, settings.max_images, settings.max_image_bytes,
                         settings.max_result_bytes * 3 // 8)  # fmt: skip
    skipped = report.cut.get("images_dropped", 0) + shown.skipped  # the agent's: same limits
    notice = report.notice
    if skipped:
        more = (
            f"{skipped} more image(s) not shown (limit {settings.max_images} per result, "
            f"{shown.per_image} bytes each, and images over {MAX_PIXELS} pixels "
            "are not decoded for a preview); they are in /mnt/data or can be saved there "
            "with savefig"
        )
        notice = f"{notice}. {more}" if notice else more
    files = report.files[:MAX_FILES_LISTED]
    notice = _budget_notice(report, notice)
    # Names as clients see and give them back: control characters escaped.
    names = [escape_name(c.path) for c in files]
    links = [
        ResourceLink(
            type="resource_link",
            uri=file_uri(report.session_id, name),
            name=name,
            mime_type=c.mime_type,
            size=c.size_bytes,
        )
        for c, name in zip(files, names, strict=True)
    ]
    # The plain fields carry over by name; only the nested ones need shaping.
    plain = {k: v for k, v in vars(report).items() if k in _PLAIN_RUN_FIELDS}
    plain.update({k: clean_text(plain[k]) for k in _SANDBOX_TEXT if plain.get(k) is not None})
    model = RunResult(
        **plain,
        notice=clean_text(notice) if notice else notice,
        error=_run_error(report.error),
        files=[
            FileOut(
                path=name,
                size_bytes=c.size_bytes,
                mime_type=c.mime_type,
                change=c.change,
                download_url=link(name) if link else None,
            )
            for c, name in zip(files, names, strict=True)
        ],
        files_truncated=len(report.files) > len(files),
        blocked_hosts=[clean_text(host) for host in report.blocked_hosts],
        result_truncated=bool(report.cut.get("result")),
        error_truncated=bool(report.cut.get("error")),
        displays_truncated=bool(
            report.cut.get("displays_dropped") or report.cut.get("displays_cut")
        ),
        displays=[
            DisplayOut(
                mime_type=d.mime_type,
                text=clean_text(d.data[: settings.max_output_bytes].decode("utf-8", "replace")),
            )
            for d in report.displays
            if d.mime_type in _TEXT_DISPLAYS
        ],
    )
    shaped = Fitted(model.model_dump(mode="json"), shown.blocks, links)
    return fit_result(shaped, settings.max_result_bytes, settings.result_text_bytes)


@dataclass(frozen=True)
class Images:
    """What :func:`image_blocks` made: the blocks, how many candidates it left out, and
    the bytes each image was allowed."""

    blocks: list[ImageContent]
    skipped: int
    per_image: int


def image_blocks(
    candidates: Sequence[tuple[bytes, str]], max_images: int, max_image_bytes: int, room: int
) -> Images:
    """The one place images are budgeted, for every result that carries them (``run_code``
    and ``read_file``): at most ``max_images`` of ``candidates`` (bytes, MIME type), each
    downscaled to an equal share of ``room`` bytes and at most ``max_image_bytes``; a
    candidate that cannot be made that small is skipped (counted, never cut).

    Blocking (it decodes and re-encodes images): call it in a worker thread."""
    slots = max(min(len(candidates), max_images), 1)
    per_image = min(max_image_bytes, room // slots)
    blocks: list[ImageContent] = []
    skipped = 0
    for data, mime in candidates:
        fitted = fit_image(data, mime, per_image) if len(blocks) < max_images else None
        if fitted is None:
            skipped += 1
            continue
        encoded = base64.b64encode(fitted[0]).decode()
        blocks.append(ImageContent(type="image", data=encoded, mime_type=fitted[1]))
    return Images(blocks, skipped, per_image)


def _budget_notice(report: RunReport, notice: str | None) -> str | None:
    """What the agent's budget and the file list's cap left out, in words."""
    said = []
    if report.cut.get("result"):
        said.append("the value of the last expression was cut")
    if report.cut.get("error"):
        said.append("the error message or traceback was cut")
    if dropped := report.cut.get("displays_dropped"):
        said.append(f"{dropped} display() output(s) were left out")
    if len(report.files) > MAX_FILES_LISTED:
        many = f"at least {len(report.files)}" if report.files_partial else len(report.files)
        said.append(
            f"{many} files changed, more than a result lists ({MAX_FILES_LISTED}): "
            "list_files shows them all"
        )
    if said:
        text = "; ".join(said) + " (over the result budget)"
        notice = f"{notice}. {text}" if notice else text
    if unsupported := report.cut.get("displays_unsupported"):
        text = (
            f"{unsupported} display() output(s) were left out: they had none of the forms "
            "a result carries (text, markdown, HTML, LaTeX, JSON, PNG, JPEG, SVG), e.g. "
            "only JavaScript or a widget; display() text or an image instead, or save a file"
        )
        notice = f"{notice}. {text}" if notice else text
    return notice


def _run_error(error: dict[str, Any] | None) -> RunError | None:
    if not error:
        return None
    return RunError(**{k: clean_text(v) if isinstance(v, str) else v for k, v in error.items()})


def embedded_blob(uri: str, data: bytes, mime_type: str) -> EmbeddedResource:
    return EmbeddedResource(
        type="resource",
        resource=BlobResourceContents(
            uri=uri, mime_type=mime_type, blob=base64.b64encode(data).decode()
        ),
    )
