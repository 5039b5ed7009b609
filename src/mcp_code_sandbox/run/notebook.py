"""A session's runs as a Jupyter notebook: what a run records, and the notebook built
from the records.

:func:`entry_of` turns a finished run (:class:`.execute.RunReport`) into the bounded
:class:`..sessions.runlog.RunEntry` the service appends to the session's run log;
:func:`build_notebook` turns the log back into an nbformat-4 notebook, validated, for
``export_notebook``.

How runs become cells: Python runs are code cells with their outputs in Jupyter's order
(stdout and stderr streams, ``display()`` outputs and figures as ``display_data`` with
``image/png``, images the run saved in the workspace, the last expression's value as
``execute_result``, an exception as an ``error`` output with its traceback). Other
agent languages are code cells with a cell magic that runs them the same way in
Jupyter (``%%bash``; ``%%script node`` and ``%%script bun``, since IPython's
``%%javascript`` runs in the browser, not in Node.js), with their streams and, when they
failed, an ``error`` output. A runner image's language has no magic: a markdown cell with
the code and its output fenced. The sandbox's words (status, notices, duration) go into
each cell's metadata under ``mcp_code_sandbox``.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import nbformat

from mcp_code_sandbox.run.execute import RunReport
from mcp_code_sandbox.sessions.runlog import RecordedDisplay, RunEntry
from mcp_code_sandbox.workspace.mime import IMAGE_MIME_TYPES

__all__ = ["MAGICS", "MAX_IMAGE_FILES", "ReadImage", "build_notebook", "entry_of"]

#: The cell magic that runs each agent language in Jupyter as it ran in the sandbox.
MAGICS = {"bash": "%%bash", "javascript": "%%script node", "typescript": "%%script bun"}
#: Image files of one run a cell refers to (the rest are counted in its metadata).
MAX_IMAGE_FILES = 16
_TEXT_DISPLAYS = ("text/markdown", "text/plain", "image/svg+xml", "text/html")
_EMBEDDED = ("image/png", "image/jpeg")
#: One cell or output, as nbformat 4 lays it out (checked once, for the whole notebook:
#: nbformat's own ``new_*`` builders validate every piece, 5 ms each).
Node = dict[str, Any]
#: Read a workspace image for embedding: its bytes, or ``None`` when it is gone or too big.
ReadImage = Callable[[str], bytes | None]


def entry_of(
    report: RunReport,
    code: str,
    started_at: float,
    *,
    max_images: int,
    max_image_bytes: int,
    max_text_bytes: int,
) -> RunEntry:
    """The run log's entry for one finished run , bounded:
    at most ``max_images`` display images of at most ``max_image_bytes`` each, text
    displays cut at ``max_text_bytes``, image files by path. Called by the service."""
    displays: list[RecordedDisplay] = []
    images = 0
    for display in report.displays:
        if display.mime_type in _EMBEDDED:
            if images < max_images and len(display.data) <= max_image_bytes:
                displays.append(RecordedDisplay(display.mime_type, data=display.data))
                images += 1
        elif display.mime_type in _TEXT_DISPLAYS:
            text = display.data[:max_text_bytes].decode("utf-8", "replace")
            displays.append(RecordedDisplay(display.mime_type, text=text))
    image_files = [c.path for c in report.files if c.mime_type in IMAGE_MIME_TYPES]
    return RunEntry(
        language=report.language,
        code=code,
        status=report.status,
        exit_code=report.exit_code,
        stdout=report.stdout,
        stderr=report.stderr,
        result=report.result,
        error=report.error,
        execution_count=report.execution_count,
        duration_ms=report.duration_ms,
        started_at=started_at,
        displays=displays,
        image_files=image_files[:MAX_IMAGE_FILES],
        notice=report.notice,
    )


def build_notebook(entries: list[RunEntry], missing: int, read_image: ReadImage) -> bytes:
    """The notebook of ``entries`` (in order), validated, as the bytes of an ``.ipynb``
    file; ``missing`` runs that were not recorded are said in a last markdown cell.
    Blocking (it may read images): called in a worker thread."""
    cells = [_cell(entry, read_image) for entry in entries]
    dropped = sum(1 for entry in entries if entry.outputs_dropped)
    if missing or dropped:
        cells.append(_markdown(_gaps(missing, dropped)))
    for number, cell in enumerate(cells, 1):
        cell["id"] = f"run-{number}"
    nb = nbformat.from_dict(
        {
            "nbformat": 4,
            "nbformat_minor": 5,
            "cells": cells,
            "metadata": {
                "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                "language_info": {"name": "python"},
            },
        }
    )
    nbformat.validate(nb)  # raises ValidationError: our bug, an internal_error
    return nbformat.writes(nb).encode("utf-8")


def _markdown(source: str, metadata: dict[str, Any] | None = None) -> Node:
    return {"cell_type": "markdown", "source": source, "metadata": metadata or {}}


def _output(kind: str, **fields: Any) -> Node:
    if kind in ("display_data", "execute_result"):
        fields.setdefault("metadata", {})
    return {"output_type": kind, **fields}


def _gaps(missing: int, dropped: int) -> str:
    said = []
    if dropped:
        said.append(f"{dropped} run(s) above are shown without their outputs")
    if missing:
        said.append(f"{missing} later run(s) are not in this notebook")
    return (
        "*" + " and ".join(said) + ": the session's run record reached its size limit "
        "(`SANDBOX_NOTEBOOK_MAX_BYTES`).*"
    )


def _meta(entry: RunEntry) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "language": entry.language,
        "status": entry.status,
        "exit_code": entry.exit_code,
        "duration_ms": entry.duration_ms,
    }
    if entry.notice:
        meta["notice"] = entry.notice
    if entry.outputs_dropped:
        meta["outputs_dropped"] = True
    if entry.code_cut:
        meta["code_cut"] = True
    return {"mcp_code_sandbox": meta}


def _cell(entry: RunEntry, read_image: ReadImage) -> Node:
    if entry.language != "python" and entry.language not in MAGICS:
        return _fenced(entry)
    source = entry.code if entry.language == "python" else f"{MAGICS[entry.language]}\n{entry.code}"
    outputs = _streams(entry)
    outputs += [_display(d) for d in entry.displays]
    outputs += [o for o in (_image_file(p, read_image) for p in entry.image_files) if o]
    if entry.result is not None:
        outputs.append(
            _output(
                "execute_result",
                data={"text/plain": entry.result},
                execution_count=entry.execution_count,
            )
        )
    if entry.status != "ok":
        outputs.append(_error(entry))
    return {
        "cell_type": "code",
        "source": source,
        "execution_count": entry.execution_count if entry.language == "python" else None,
        "outputs": outputs,
        "metadata": _meta(entry),
    }


def _streams(entry: RunEntry) -> list[Node]:
    return [
        _output("stream", name=name, text=text)
        for name, text in (("stdout", entry.stdout), ("stderr", entry.stderr))
        if text
    ]


def _display(display: RecordedDisplay) -> Node:
    if display.data is not None:
        value = base64.b64encode(display.data).decode("ascii")
    else:
        value = display.text or ""
    return _output("display_data", data={display.mime_type: value})


def _image_file(path: str, read_image: ReadImage) -> Node | None:
    """A workspace image the run saved, embedded when it is still there (and PNG or
    JPEG, which every notebook viewer shows); else its path, as plain text."""
    mime = "image/jpeg" if path.lower().endswith((".jpg", ".jpeg")) else "image/png"
    data = read_image(path) if path.lower().endswith((".png", ".jpg", ".jpeg")) else None
    if data is None:
        return _output("display_data", data={"text/plain": f"[image file /mnt/data/{path}]"})
    return _output(
        "display_data",
        data={mime: base64.b64encode(data).decode("ascii")},
        metadata={"filename": path},
    )


def _error(entry: RunEntry) -> Node:
    error = entry.error or {}
    name = error.get("name") or ("Timeout" if entry.status == "timeout" else "Error")
    value = error.get("value") or _failed(entry)
    traceback = error.get("traceback") or ""
    lines = traceback.splitlines() or [f"{name}: {value}"]
    return _output("error", ename=name, evalue=value, traceback=lines)


def _failed(entry: RunEntry) -> str:
    if entry.status == "error" and entry.exit_code is not None:
        return f"exit code {entry.exit_code}"
    return entry.notice or entry.status


def _fenced(entry: RunEntry) -> Node:
    """A runner language's run: its code and output, fenced (markdown cells have no
    outputs)."""
    fence = "`" * max(3, _longest_backticks(entry.code, entry.stdout, entry.stderr) + 1)
    text = (
        f"**{entry.language}** ({entry.status})\n\n{fence}{entry.language}\n{entry.code}\n{fence}"
    )
    output = entry.stdout + entry.stderr
    if output:
        text += f"\n\nOutput:\n\n{fence}\n{output}\n{fence}"
    return _markdown(text, metadata=_meta(entry))


def _longest_backticks(*texts: str) -> int:
    longest = 0
    for text in texts:
        run = 0
        for char in text:
            run = run + 1 if char == "`" else 0
            longest = max(longest, run)
    return longest
