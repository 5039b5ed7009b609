"""A session's runs, in order, on the host: what ``export_notebook`` (and the operator's
view) read back.

One JSON line per run in ``<state_dir>/runlogs/<slot>.jsonl``: never in the workspace,
which the sandbox can write. It lives as long as the session's record: the session
manager removes it when the session ends (before the record, see
:func:`remove_log`), crash recovery removes it with a dropped session's workspace and
keeps it for a re-attached one (same slot), and a log whose record is gone is garbage
(:func:`sweep`). Being on disk, it outlives a pause of the session too.

Bounded, hard: the file never grows past ``max_bytes``. Every entry's texts are the run's
result (already within the output and result budgets); images come by reference (the
workspace path) where the run wrote a file, and only figures and ``display()`` images,
at most ``max_image_bytes`` each, are kept as bytes. An entry that would not fit keeps
only its code (its outputs are said to be dropped); when even that would not fit, the
log ends with one fixed-width marker that counts the runs not recorded, rewritten in
place for each later run (room for it is kept free), so a full log stops growing.

Semantics of an entry's fields: ``None`` means the run had none (no result, no error,
no execution count: a language without one); empty lists mean nothing of that kind.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["RecordedDisplay", "RunEntry", "RunLog", "log_path", "remove_log", "sweep"]

_SUFFIX = ".jsonl"
#: Most bytes of code an entry keeps once the log is past its byte budget.
_CODE_ONLY_BYTES = 16 * 1024
#: The last line of a full log: how many runs were not recorded, fixed-width so that
#: each later run rewrites it in place (ten digits outlast any session's runs).
_MARKER = b'{"skipped":%010d}\n'
_MARKER_BYTES = len(_MARKER % 0)
_MARKER_LINE = re.compile(rb'\{"skipped":(\d{10})\}\n')


@dataclass(frozen=True)
class RecordedDisplay:
    """One rich output: text (``text``) for text types and SVG, bytes for images."""

    mime_type: str
    text: str | None = None
    data: bytes | None = None


@dataclass(frozen=True)
class RunEntry:
    """One ``run_code`` call as a notebook cell needs it."""

    language: str
    code: str
    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    result: str | None
    error: dict[str, str] | None
    execution_count: int | None
    duration_ms: int
    #: Wall-clock seconds when the run started.
    started_at: float
    displays: list[RecordedDisplay] = field(default_factory=list)
    #: Image files the run created or changed, by workspace path (read at export).
    image_files: list[str] = field(default_factory=list)
    notice: str | None = None
    #: The log was over its budget: the run's outputs were not kept (or, with
    #: ``code_cut``, not all of its code either).
    outputs_dropped: bool = False
    code_cut: bool = False


def log_path(directory: Path, slot: str) -> Path:
    return directory / f"{slot}{_SUFFIX}"


class RunLog:
    """The runs of one session slot. Blocking file I/O: callers run it in a worker thread.
    Appended to by the service after each run (with the session's lock held, so one
    writer at a time); read by ``export_notebook`` and the operator's view."""

    def __init__(self, directory: Path, slot: str, max_bytes: int) -> None:
        self.directory = directory
        self.path = log_path(directory, slot)
        self.max_bytes = max_bytes

    def append(self, entry: RunEntry) -> None:
        """Add ``entry`` at the end, within the byte budget (see the module doc)."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "r+b") as log:
            size = log.seek(0, os.SEEK_END)
            skipped = _skipped_at_end(log, size)
            if skipped is not None:  # full: count this run too, in place
                log.seek(size - _MARKER_BYTES)
                log.write(_MARKER % min(skipped + 1, 10**10 - 1))
                return
            # Room for the marker stays free, so a full log can always say so.
            room = self.max_bytes - _MARKER_BYTES - size
            line = _dump(entry)
            if len(line) > room:
                line = _dump(_code_only(entry))
            if len(line) > room:
                line = _MARKER % 1
            if size + len(line) <= self.max_bytes:
                log.write(line)
            # Else a log over its budget before the bound was hard (or after the setting
            # was lowered): it is not written to again.

    def entries(self) -> list[RunEntry]:
        """The recorded runs, in the order they ran."""
        return self.read()[0]

    def read(self) -> tuple[list[RunEntry], int]:
        """The recorded runs in order, and how many runs were not recorded (the log was
        full) or cannot be read back. Holds the whole log: for tests and small logs;
        ``export_notebook`` streams :meth:`records`."""
        found: list[RunEntry] = []
        missing = 0
        for record in self.records():
            if isinstance(record, int):
                missing += record
            else:
                found.append(record)
        return found, missing

    def records(self) -> Iterator[RunEntry | int]:
        """The log, one run at a time, in order: an entry, or a number of runs that
        were not recorded (the log was full) or cannot be read back. Holds one line at a
        time, never the whole log."""
        try:
            log = self.path.open("rb")
        except FileNotFoundError:
            return
        with log:
            for line in log:
                marker = _MARKER_LINE.fullmatch(line)
                if marker is not None:
                    yield int(marker.group(1))
                    continue
                entry = _load(line)
                yield 1 if entry is None else entry


def remove_log(directory: Path, slot: str) -> None:
    """Delete a slot's log; called when its session ends and by crash recovery, before
    the session's record is removed (so a log never outlives its record unseen)."""
    with contextlib.suppress(FileNotFoundError):
        log_path(directory, slot).unlink()


def sweep(directory: Path, has_record: Callable[[str], bool]) -> None:
    """Delete logs whose slot has no record (``has_record(slot)`` false): what a server
    killed between removing a record and its log left. Called by crash recovery under
    its lock."""
    if not directory.is_dir():
        return
    for path in directory.glob(f"*{_SUFFIX}"):
        if not has_record(path.name.removesuffix(_SUFFIX)):
            path.unlink(missing_ok=True)


def _skipped_at_end(log: BinaryIO, size: int) -> int | None:
    """The count of the marker that ends the log, or ``None`` when it does not end with
    one (the log is not full yet)."""
    if size < _MARKER_BYTES:
        return None
    log.seek(size - _MARKER_BYTES)
    marker = _MARKER_LINE.fullmatch(log.read(_MARKER_BYTES))
    if marker is None:
        return None
    if size > _MARKER_BYTES:  # a whole line: after a newline, or the first
        log.seek(size - _MARKER_BYTES - 1)
        if log.read(1) != b"\n":
            return None
    return int(marker.group(1))


def _code_only(entry: RunEntry) -> RunEntry:
    code = entry.code.encode("utf-8")
    cut = len(code) > _CODE_ONLY_BYTES
    return dataclasses.replace(
        entry,
        code=code[:_CODE_ONLY_BYTES].decode("utf-8", "ignore") if cut else entry.code,
        stdout="",
        stderr="",
        result=None,
        error=None,
        displays=[],
        image_files=[],
        outputs_dropped=True,
        code_cut=cut,
    )


def _dump(entry: RunEntry) -> bytes:
    data = dataclasses.asdict(entry)
    data["displays"] = [
        {
            "mime_type": d.mime_type,
            "text": d.text,
            "data": None if d.data is None else base64.b64encode(d.data).decode("ascii"),
        }
        for d in entry.displays
    ]
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    # A sandbox's strings may hold lone surrogates (JSON's "\ud800"): "?", never an error.
    return text.encode("utf-8", "replace") + b"\n"


def _load(line: bytes) -> RunEntry | None:
    """An entry from one line; ``None`` for a marker or a line that does not parse (a
    server killed mid-write leaves a partial last line)."""
    try:
        raw = json.loads(line)
        if not isinstance(raw, dict) or raw.get("skipped"):
            return None
        displays = [_display(d) for d in raw.pop("displays", [])]
        entry = RunEntry(**raw, displays=displays)
    except (ValueError, TypeError, binascii.Error):
        return None
    return entry


def _display(raw: dict[str, Any]) -> RecordedDisplay:
    data = raw.get("data")
    return RecordedDisplay(
        mime_type=str(raw["mime_type"]),
        text=raw.get("text"),
        data=None if data is None else base64.b64decode(data, validate=True),
    )
