"""Shape plain results into MCP ``CallToolResult``s: structured JSON, its text, media blocks.

Every tool result carries ``structuredContent`` matching the tool's output schema and the
same JSON as a text block; images and links ride beside it as content blocks. Errors are
``isError`` results with ``"<code>: <message>"`` and ``_meta.error_code`` (DESIGN §7).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
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
from mcp_code_sandbox.images import MAX_PIXELS, fit_image
from mcp_code_sandbox.runs import RunReport
from mcp_code_sandbox.server.models import DisplayOut, FileOut, RunError, RunResult
from mcp_code_sandbox.settings import Settings

__all__ = ["error_result", "file_uri", "run_result", "structured_result"]

_PLAIN_RUN_FIELDS = frozenset(RunResult.model_fields) - {"notice", "error", "files", "displays"}
_TEXT_DISPLAYS = ("text/markdown", "text/plain", "image/svg+xml", "text/html")


def file_uri(session_id: str, path: str) -> str:
    return f"sandbox://{session_id}/{path}"


def error_result(error: SandboxError) -> CallToolResult:
    meta: dict[str, Any] = {"error_code": error.code}
    meta.update({k: v for k, v in error.details.items() if isinstance(v, str | int)})
    return CallToolResult(
        content=[TextContent(type="text", text=str(error))], is_error=True, _meta=meta
    )


def structured_result(model: BaseModel, extra: list[ContentBlock] | None = None) -> CallToolResult:
    data = model.model_dump(mode="json")
    text = TextContent(type="text", text=json.dumps(data, ensure_ascii=False, indent=1))
    return CallToolResult(content=[text, *(extra or [])], structured_content=data)


def run_result(
    report: RunReport, settings: Settings, link: Callable[[str], str] | None = None
) -> CallToolResult:
    """RunResult JSON + one image block per figure/image (within budget) + file links;
    ``link`` makes each file's ``download_url`` (none when ``None``).

    Blocking (it decodes and re-encodes images): call it in a worker thread."""
    images: list[ContentBlock] = []
    skipped = 0
    candidates = [
        (d.data, d.mime_type)
        for d in report.displays
        if d.mime_type.startswith(("image/png", "image/jpeg"))
    ]
    candidates += [(f.data, f.mime_type) for f in report.image_files]
    for data, mime in candidates:
        if len(images) >= settings.max_images:
            skipped += 1
            continue
        fitted = fit_image(data, mime, settings.max_image_bytes)
        if fitted is None:
            skipped += 1
            continue
        images.append(
            ImageContent(
                type="image", data=base64.b64encode(fitted[0]).decode(), mime_type=fitted[1]
            )
        )
    notice = report.notice
    if skipped:
        more = (
            f"{skipped} more image(s) not shown (limit {settings.max_images} per result, "
            f"{settings.max_image_bytes} bytes each, and images over {MAX_PIXELS} pixels "
            "are not decoded for a preview); they are in /mnt/data or can be saved there "
            "with savefig"
        )
        notice = f"{notice}. {more}" if notice else more
    links: list[ContentBlock] = [
        ResourceLink(
            type="resource_link",
            uri=file_uri(report.session_id, c.path),
            name=c.path,
            mime_type=c.mime_type,
            size=c.size_bytes,
        )
        for c in report.files
    ]
    # The plain fields carry over by name; only the nested ones need shaping.
    plain = {k: v for k, v in vars(report).items() if k in _PLAIN_RUN_FIELDS}
    model = RunResult(
        **plain,
        notice=notice,
        error=RunError(**report.error) if report.error else None,
        files=[
            FileOut(
                path=c.path,
                size_bytes=c.size_bytes,
                mime_type=c.mime_type,
                change=c.change,
                download_url=link(c.path) if link else None,
            )
            for c in report.files
        ],
        displays=[
            DisplayOut(
                mime_type=d.mime_type,
                text=d.data[: settings.max_output_bytes].decode("utf-8", "replace"),
            )
            for d in report.displays
            if d.mime_type in _TEXT_DISPLAYS
        ],
    )
    return structured_result(model, images + links)


def embedded_blob(uri: str, data: bytes, mime_type: str) -> EmbeddedResource:
    return EmbeddedResource(
        type="resource",
        resource=BlobResourceContents(
            uri=uri, mime_type=mime_type, blob=base64.b64encode(data).decode()
        ),
    )
