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

Nothing a sandbox produced is active in the notebook: viewers (nbviewer, VS Code, GitHub,
a trusted JupyterLab) render HTML, SVG and markdown outputs as they are, scripts and
event handlers included. Only PNG and JPEG (base64 of bytes) and plain text go in as
they came; an SVG is shown as an ``<img>`` of a base64 ``data:`` URL, where a browser
runs no script and loads nothing; markdown and HTML are kept as plain text.

Bounded: the notebook is at most ``max_bytes`` (the session's run-log budget), built one
cell at a time into a file, so an export holds one cell, never the whole notebook. A run
that does not fit is written without its outputs, and once even its code does not fit,
it and every later run are left out; workspace images are embedded while they fit, else
named by path. A last markdown cell says what was cut and why.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

from nbformat.validator import get_validator

from mcp_code_sandbox.run.execute import RunReport
from mcp_code_sandbox.sessions.runlog import RecordedDisplay, RunEntry
from mcp_code_sandbox.workspace.mime import IMAGE_MIME_TYPES

__all__ = [
    "MAGICS",
    "MAX_IMAGE_FILES",
    "ReadImage",
    "Written",
    "build_notebook",
    "entry_of",
    "write_notebook",
]

#: The cell magic that runs each agent language in Jupyter as it ran in the sandbox.
MAGICS = {"bash": "%%bash", "javascript": "%%script node", "typescript": "%%script bun"}
#: Image files of one run a cell refers to (the rest are counted in its metadata).
MAX_IMAGE_FILES = 16
_TEXT_DISPLAYS = ("text/markdown", "text/plain", "image/svg+xml", "text/html")
_EMBEDDED = ("image/png", "image/jpeg")
#: One cell or output, as nbformat 4 lays it out (each cell is checked against nbformat's
#: schema as it is written; nbformat's own ``new_*`` builders validate every piece, slowly).
Node = dict[str, Any]
#: Read a workspace image for embedding: its bytes, or ``None`` when it is gone or too big.
ReadImage = Callable[[str], bytes | None]
#: What the notebook around the run cells takes at most: its frame and metadata, and the
#: last cell that says what was cut (a few sentences with counts).
_RESERVED_BYTES = 4096
#: The JSON around an embedded image beside its base64 (output type, MIME, file name).
_IMAGE_OVERHEAD = 1024
_METADATA: Node = {
    "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
    "language_info": {"name": "python"},
}
#: The one cell of a notebook skeleton, to check a cell against nbformat's schema alone.
_SKELETON: Node = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}}


@dataclass(frozen=True)
class Written:
    """A notebook :func:`write_notebook` wrote."""

    size_bytes: int
    #: Run cells in it (with or without their outputs).
    runs: int
    #: What it leaves out, as its last cell says; ``None``: nothing.
    cut: str | None


@dataclass
class _Cuts:
    """What a notebook leaves out, counted as it is written; said in its last cell."""

    #: Recorded without outputs: the run log was full (``RunEntry.outputs_dropped``).
    dropped: int = 0
    #: Not recorded at all: the run log was full, or a line did not read back.
    missing: int = 0
    #: Written without outputs / left out / images named by path: the notebook was full.
    outputs_cut: int = 0
    left_out: int = 0
    images_named: int = 0

    def text(self) -> str | None:
        log: list[str] = []
        book: list[str] = []
        if self.dropped:
            log.append(f"{self.dropped} run(s) were recorded without their outputs")
        if self.missing:
            log.append(f"{self.missing} run(s) were not recorded")
        if self.outputs_cut:
            book.append(f"{self.outputs_cut} run(s) are shown without their outputs")
        if self.images_named:
            book.append(f"{self.images_named} image file(s) are named, not embedded")
        if self.left_out:
            book.append(f"the last {self.left_out} run(s) are left out")
        parts = []
        if log:
            parts.append(" and ".join(log) + ": the session's run record reached its size limit")
        if book:
            parts.append(" and ".join(book) + ": this notebook reached its size limit")
        if not parts:
            return None
        return "; ".join(parts) + " (`SANDBOX_NOTEBOOK_MAX_BYTES`)."


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


def build_notebook(
    entries: Iterable[RunEntry | int], read_image: ReadImage, max_bytes: int
) -> bytes:
    """:func:`write_notebook` into memory: for tests and benchmarks."""
    out = io.BytesIO()
    write_notebook(entries, read_image, out, max_bytes)
    return out.getvalue()


def write_notebook(
    records: Iterable[RunEntry | int], read_image: ReadImage, out: BinaryIO, max_bytes: int
) -> Written:
    """Write the notebook of ``records`` (the run log's, in order: an entry, or a count of
    runs not recorded) to ``out``, at most ``max_bytes`` (or the few KiB of an empty
    notebook when that is less), each cell checked against nbformat's schema. Blocking
    (it reads the log and images): called in a worker thread."""
    cuts = _Cuts()
    writer = _Writer(out)
    room = max_bytes - _RESERVED_BYTES
    for record in records:
        if isinstance(record, int):
            cuts.missing += record
            continue
        if cuts.left_out:
            cuts.left_out += 1
            continue
        cuts.dropped += record.outputs_dropped
        cell_id = f"run-{writer.cells + 1}"
        cell = _fitted(record, read_image, room - writer.size, cuts, cell_id)
        if cell is None:
            cuts.left_out = 1
            continue
        writer.cell(cell)
    said = cuts.text()
    if said is not None:
        writer.cell(_encode(_markdown(f"*{said}*"), f"run-{writer.cells + 1}"))
    return Written(writer.end(), writer.cells - (said is not None), said)


class _Writer:
    """The notebook's JSON, a cell at a time: what is written is never held again."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.size = 0
        self.cells = 0
        self._write(b'{\n "cells": [')

    def cell(self, encoded: bytes) -> None:
        self._write(b"\n  " if not self.cells else b",\n  ")
        self._write(encoded)
        self.cells += 1

    def end(self) -> int:
        metadata = json.dumps(_METADATA, sort_keys=True).encode()
        self._write(b'\n ],\n "metadata": ' + metadata + b',\n "nbformat": 4,\n')
        self._write(b' "nbformat_minor": 5\n}\n')
        return self.size

    def _write(self, data: bytes) -> None:
        self.out.write(data)
        self.size += len(data)


def _fitted(
    entry: RunEntry, read_image: ReadImage, room: int, cuts: _Cuts, cell_id: str
) -> bytes | None:
    """``entry``'s cell, encoded, within ``room`` bytes: whole, with the workspace images
    that fit (the rest named by path), else without its outputs; ``None`` when even its
    code does not fit."""
    cell = _cell(entry)
    encoded = _encode(cell, cell_id)
    if len(encoded) <= room and entry.image_files and cell["cell_type"] == "code":
        # After the displays, before the result and the error (Jupyter's order).
        at = len(cell["outputs"]) - (entry.result is not None) - (entry.status != "ok")
        cell["outputs"][at:at] = _image_files(entry, read_image, room - len(encoded), cuts)
        encoded = _encode(cell, cell_id)
    if len(encoded) > room:
        cell = _cell(entry, outputs=False)
        encoded = _encode(cell, cell_id)
        if len(encoded) > room:
            return None
        cuts.outputs_cut += 1
    return encoded


def _encode(cell: Node, cell_id: str) -> bytes:
    """``cell`` as one line of the notebook's JSON, checked against nbformat's schema (a
    failure is our bug: ``ValidationError``, an ``internal_error``). Strings from a
    sandbox may hold lone surrogates: each becomes ``?``, never invalid UTF-8."""
    cell["id"] = cell_id
    get_validator(version=4, version_minor=5).validate({**_SKELETON, "cells": [cell]})
    text = json.dumps(cell, ensure_ascii=False, sort_keys=True)
    return text.encode("utf-8", "replace")


def _markdown(source: str, metadata: dict[str, Any] | None = None) -> Node:
    return {"cell_type": "markdown", "source": source, "metadata": metadata or {}}


def _output(kind: str, **fields: Any) -> Node:
    if kind in ("display_data", "execute_result"):
        fields.setdefault("metadata", {})
    return {"output_type": kind, **fields}


def _meta(entry: RunEntry, *, cut: bool = False) -> dict[str, Any]:
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
    if cut:  # recorded, but the notebook had no room for them
        meta["outputs_cut"] = True
    return {"mcp_code_sandbox": meta}


def _cell(entry: RunEntry, *, outputs: bool = True) -> Node:
    """``entry``'s cell without the workspace images it saved (:func:`_fitted` adds those
    that fit); ``outputs=False``: its code alone, marked so in its metadata."""
    meta = _meta(entry, cut=not outputs)
    if entry.language != "python" and entry.language not in MAGICS:
        return _fenced(entry, meta, outputs=outputs)
    source = entry.code if entry.language == "python" else f"{MAGICS[entry.language]}\n{entry.code}"
    shown = _outputs(entry) if outputs else []
    return {
        "cell_type": "code",
        "source": source,
        "execution_count": _count(entry) if entry.language == "python" else None,
        "outputs": shown,
        "metadata": meta,
    }


def _outputs(entry: RunEntry) -> list[Node]:
    shown = _streams(entry) + [_display(d) for d in entry.displays]
    if entry.result is not None:
        shown.append(
            _output(
                "execute_result",
                data={"text/plain": entry.result},
                execution_count=_count(entry),
            )
        )
    if entry.status != "ok":
        shown.append(_error(entry))
    return shown


def _count(entry: RunEntry) -> int | None:
    """The run's execution count as a notebook may hold it (0 or more): the agent's
    word, which a sandbox can forge."""
    count = entry.execution_count
    return count if count is not None and count >= 0 else None


def _streams(entry: RunEntry) -> list[Node]:
    return [
        _output("stream", name=name, text=text)
        for name, text in (("stdout", entry.stdout), ("stderr", entry.stderr))
        if text
    ]


def _display(display: RecordedDisplay) -> Node:
    """A ``display()`` output, inert: images as base64 of their bytes, an SVG as an
    ``<img>`` of it (no script runs in an image), every other kind as plain text."""
    if display.data is not None and display.mime_type in _EMBEDDED:
        value = base64.b64encode(display.data).decode("ascii")
        return _output("display_data", data={display.mime_type: value})
    text = display.text or ""
    if display.mime_type == "image/svg+xml":
        svg = base64.b64encode(text.encode("utf-8", "replace")).decode("ascii")
        html = f'<img src="data:image/svg+xml;base64,{svg}" alt="SVG image">'
        return _output("display_data", data={"text/html": html, "text/plain": "[SVG image]"})
    return _output("display_data", data={"text/plain": text})


def _image_files(entry: RunEntry, read_image: ReadImage, room: int, cuts: _Cuts) -> list[Node]:
    """The workspace images ``entry`` saved, embedded while they fit in ``room`` bytes
    and are still there (and PNG or JPEG, which every notebook viewer shows); else by
    path, as plain text. One image is held at a time."""
    shown = []
    for path in entry.image_files:
        named = _output("display_data", data={"text/plain": f"[image file /mnt/data/{path}]"})
        data = read_image(path) if path.lower().endswith((".png", ".jpg", ".jpeg")) else None
        if data is None:
            shown.append(named)
            continue
        size = (len(data) + 2) // 3 * 4 + len(path) + _IMAGE_OVERHEAD
        if size > room:
            cuts.images_named += 1
            shown.append(named)
            continue
        room -= size
        mime = "image/jpeg" if path.lower().endswith((".jpg", ".jpeg")) else "image/png"
        shown.append(
            _output(
                "display_data",
                data={mime: base64.b64encode(data).decode("ascii")},
                metadata={"filename": path},
            )
        )
    return shown


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


def _fenced(entry: RunEntry, meta: dict[str, Any], *, outputs: bool) -> Node:
    """A runner language's run: its code and output, fenced (markdown cells have no
    outputs; inside a fence longer than any run of backticks in them, they stay text)."""
    fence = "`" * max(3, _longest_backticks(entry.code, entry.stdout, entry.stderr) + 1)
    text = (
        f"**{entry.language}** ({entry.status})\n\n{fence}{entry.language}\n{entry.code}\n{fence}"
    )
    output = entry.stdout + entry.stderr if outputs else ""
    if output:
        text += f"\n\nOutput:\n\n{fence}\n{output}\n{fence}"
    return _markdown(text, metadata=meta)


def _longest_backticks(*texts: str) -> int:
    longest = 0
    for text in texts:
        run = 0
        for char in text:
            run = run + 1 if char == "`" else 0
            longest = max(longest, run)
    return longest
