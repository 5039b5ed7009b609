"""The framed JSON protocol between the host and the in-sandbox agent.

This module is the one definition both sides use. It is imported by the host
(``mcp_code_sandbox.agent.protocol``) and, inside the sandbox, by the agent as part of the
stand-alone package mounted at ``/opt/sandbox/lib/mcs_agent``: standard library only, and
no absolute imports of ``mcp_code_sandbox``.

Framing: a 4-byte big-endian unsigned length, then that many bytes of UTF-8 JSON holding
one object. A frame larger than ``MAX_FRAME_BYTES`` is a protocol error, and so is EOF in
the middle of a frame ("unexpected EOF"); EOF between frames is a clean close.

Messages host → agent (key ``op``)::

    {"op": "exec", "id": int, "language": str, "code": str, "timeout_s": float,
     "env": {str: str}, "budget": {"result_bytes": int, "images": int},
     "state": "save" | "load", "max_bytes": int}
                                              run one cell / program; with ``state``
                                              (Python only) save or load the variables
    {"op": "interrupt", "id": int, "reason": "timeout" | "cancelled"}
                                              stop run ``id`` (SIGINT, then kill + restart)
    {"op": "restart", "id": int}              a fresh interpreter; the files stay
    {"op": "park"}                            close the channel now, reconnect at once
                                              (``--connect`` only: a checkpoint is next)
    {"op": "shutdown"}                        exit cleanly
    {"op": "fs", "id": int, "action": "read" | "list" | "snapshot" | "usage" | "write"
     | "abort", ...}                          the workspace's files for a host that cannot
                                              see them; answered by one ``fs`` event
                                              (fields and rules: :class:`FsMessage`,
                                              :mod:`.files`); refused during a run

Messages agent → host (key ``ev``)::

    {"ev": "ready", "languages": {name: version}, "ipython": bool, "pid": int,
     "reattached": true, "execution_count": int}
                                              (the last two only after a reconnect)
    {"ev": "stream", "id": int, "name": "stdout" | "stderr", "text": str}
    {"ev": "display", "id": int, "source": "figure" | "display",
     "data": {mime: str}}                     image/png is base64; text types are text
    {"ev": "done", "id": int, "status": "ok" | "error" | "timeout" | "cancelled",
     "exit_code": int | None, "result": str | None,
     "error": {"name": str, "value": str, "traceback": str} | None,
     "execution_count": int | None, "state_lost": bool,
     "cut": {"result": bool, "error": bool, "displays_dropped": int,
             "displays_cut": int, "images_dropped": int, "displays_unsupported": int}}
                                              (``cut``: Python runs only)

    {"ev": "restarted", "id": int}            the ``restart`` of that id is done

    {"ev": "error", "message": str, "id": int | None}
                                              a host message the agent could not use
    {"ev": "fs", "id": int, "ok": bool, ...}  the answer to ``fs`` (:class:`FsEvent`)

The same shapes as :class:`typing.TypedDict` s below (:data:`HostMessage`,
:data:`AgentEvent`): the sender builds them, so the type checker holds each side to this
table. A receiver still checks every field it reads: a frame is only a claim (the host's
peer runs hostile code; the agent's peer is the host, but a malformed frame is still
answered with ``error``, not a crash).

Exactly one ``done`` ends every ``exec``, after all of its ``stream`` and ``display``
messages. ``state_lost`` is true only when the interpreter was restarted during this run
(or, for a Python run, when it died by itself since the previous Python run).

Semantics (agent side):

- ``exec``: ``language`` defaults to "python", ``timeout_s`` to 60, ``env`` to none. Runs
  are one at a time; an ``exec`` sent during a run is queued and starts after it.
  ``interrupt`` of a queued run ends it at once with ``done`` (that status, nothing run);
  of an unknown or finished run is ignored.
- ``done`` of Python: ``exit_code`` is null; ``status`` is "error" for an exception
  (``error.traceback`` holds the cell's frames only), "timeout"/"cancelled" once
  interrupted whatever the code then did. ``error.name`` "KernelDied" means the
  interpreter died by itself (``state_lost`` true); "KernelRestarted" that it ignored
  the interrupt for the grace period and was killed. ``execution_count`` counts like
  Jupyter's and restarts at 1 with the interpreter; null when the run had no answer.
- ``done`` of another language (a program per call): ``exit_code`` is its exit status,
  128 + N when killed by signal N; ``status`` "ok" for 0, else "error" (``error`` null;
  stderr and the code tell); ``execution_count`` null; ``result`` the value of the
  program's last expression for JavaScript and TypeScript when it ran to its end and
  that value was not ``undefined`` (:mod:`.lastexpr`), else null.
- ``exec`` with ``state`` (optional; Python only; ``code`` is then "" and ignored):
  instead of running code the kernel saves (``"save"``, with ``max_bytes`` > 0, the most
  the pickled values may hold) or loads (``"load"``) its user namespace, in the
  workspace's ``.session/`` only (see :mod:`.state` and :mod:`.statefiles`). It is
  queued, timed out and interrupted like a cell, and ends with the usual ``done``:
  ``status`` "ok" with ``result`` the report as JSON text, or "error" with ``error`` when
  it could not work at all (the disk, the quota); ``execution_count`` is the kernel's
  (after a load the restored one). A save or load does not count as a cell: no new
  execution count, nothing in ``In`` or ``_``. Reports::

      save {"kept": [{"name", "type", "bytes"}], "modules": [{"name", "module"}],
            "dropped": [{"name", "type", "why"}], "bytes": int}
      load {"found": bool, "restored": [str], "modules": [str],
            "failed": [{"name", "type", "why"}]}

- ``restart``: queued like an ``exec`` (it starts when the runs before it have ended);
  the interpreter and every process it started (with ``kill_strays``: every process in
  the sandbox but the agent) are killed and a fresh interpreter started, without
  loading any saved state; ``execution_count`` starts again at 1 and the next run's
  ``state_lost`` is false (the host asked for it). Answered by ``restarted``, or by
  ``error`` (with that ``id``) when ``id`` is not an integer. An agent older than this
  op answers ``error`` with ``id`` null ("unknown op").
- ``park``: only on a channel that can reconnect (``--connect``): the agent closes its
  end at once (the host waits for that EOF before it checkpoints the sandbox) and then
  tries to reconnect every ``hostlink.PARK_RETRY_S``, counting attempts rather than time
  against its give-up (a checkpointed sandbox is frozen for as long as it is paused, and
  its clock jumps when it is restored). It greets the next host with ``ready`` and
  ``reattached: true``; runs go on as when the host is lost. On a ``--channel-fd``
  channel ``park`` is answered with ``error``.
- ``budget`` (optional; defaults in :mod:`.budget`): a Python run's ``display`` messages
  past it are dropped as they arrive, and ``result`` / ``error`` texts are cut (head and
  tail, marked); ``cut`` says what was. Programs' output is only ``stream``, which the
  host bounds itself.
- ``stream`` text is UTF-8 decoded with replacement, in chunks of at most 64 KiB, split
  anywhere. Output is batched inside the sandbox (up to 64 KiB or 50 ms while the run
  goes on; all of it before ``display`` and ``done``), in the order it was written
  across stdout and stderr as far as the agent can see it. Output written while no run
  is in the interpreter (background threads or processes of an earlier cell) is dropped.
- ``error``: a frame that is not a JSON object, an unknown ``op``, or a malformed
  ``exec`` (then ``id`` is the run's, if it had one, and that run will not have a
  ``done``). The agent carries on; after an oversized frame it cannot, and exits.
  An agent that cannot start (bad ``--config``, no kernel) sends one ``error`` with
  ``id`` null instead of ``ready`` and exits 1.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict

__all__ = [
    "HEADER",
    "MAX_FRAME_BYTES",
    "AgentEvent",
    "BudgetMessage",
    "CutReport",
    "DisplayEvent",
    "DoneEvent",
    "ErrorDetail",
    "ErrorEvent",
    "ExecMessage",
    "FrameDecoder",
    "FsEvent",
    "FsMessage",
    "HostMessage",
    "InterruptMessage",
    "ParkMessage",
    "ProtocolError",
    "ReadyEvent",
    "RestartMessage",
    "RestartedEvent",
    "ShutdownMessage",
    "StreamEvent",
    "encode_frame",
    "read_frame",
    "write_frame",
]


# -- host → agent ---------------------------------------------------------------------


class BudgetMessage(TypedDict):
    """``exec``'s ``budget``: what a Python run may send back (see :mod:`.budget`)."""

    result_bytes: int
    images: int


class ExecMessage(TypedDict):
    """Run one cell (Python) or program (other languages); answered by one ``done``."""

    op: Literal["exec"]
    id: int
    code: str
    language: NotRequired[str]  # default "python"
    timeout_s: NotRequired[float]  # default 60
    env: NotRequired[dict[str, str]]  # default none
    budget: NotRequired[BudgetMessage]  # default Budget()
    #: Save or load the variables instead of running ``code`` (Python only).
    state: NotRequired[Literal["save", "load"]]
    #: With ``state`` "save": the most bytes the pickled values may hold (> 0).
    max_bytes: NotRequired[int]


class InterruptMessage(TypedDict):
    """Stop run ``id``: SIGINT, then after the grace a kill and an interpreter restart."""

    op: Literal["interrupt"]
    id: int
    reason: Literal["timeout", "cancelled"]


class RestartMessage(TypedDict):
    """Replace the interpreter by a fresh one (files stay); answered by ``restarted``."""

    op: Literal["restart"]
    id: int


class ShutdownMessage(TypedDict):
    op: Literal["shutdown"]


class ParkMessage(TypedDict):
    """Close the channel and come back at once (before a checkpoint of the sandbox)."""

    op: Literal["park"]


class FsMessage(TypedDict):
    """One file request (:mod:`.files`); ``path`` is a list of names below /mnt/data.

    ``read``: ``path``, ``offset``, ``max_bytes`` (at most ``files.READ_PAGE_BYTES`` are
    sent). ``list``: ``path``, ``recursive``, ``limit``, ``skip`` (top-level names left
    out), ``start`` (the page). ``snapshot``: ``limit``, ``skip`` (left out, and with
    ``count_hidden`` counted), ``start``. ``usage``: ``limit``. ``write``: ``path``,
    ``data`` (base64, at most ``files.WRITE_CHUNK_BYTES``) at ``offset`` of ``size``
    bytes, ``overwrite``, ``quota`` (checked at offset 0), ``end`` on the last chunk.
    ``abort``: drop a write in progress."""

    op: Literal["fs"]
    id: int
    action: Literal["read", "list", "snapshot", "usage", "write", "abort"]
    path: NotRequired[list[str]]
    offset: NotRequired[int]
    max_bytes: NotRequired[int]
    recursive: NotRequired[bool]
    limit: NotRequired[int]
    skip: NotRequired[list[str]]
    start: NotRequired[int]
    count_hidden: NotRequired[bool]
    data: NotRequired[str]
    size: NotRequired[int]
    overwrite: NotRequired[bool]
    quota: NotRequired[int]
    end: NotRequired[bool]


HostMessage = (
    ExecMessage | InterruptMessage | ParkMessage | RestartMessage | ShutdownMessage | FsMessage
)


# -- agent → host ---------------------------------------------------------------------


class ReadyEvent(TypedDict):
    """The agent's first message on every connection: its languages and versions."""

    ev: Literal["ready"]
    languages: dict[str, str]
    ipython: bool
    pid: int
    #: Only on a connection the agent re-established (the docker backend's ``--connect``).
    reattached: NotRequired[bool]
    execution_count: NotRequired[int]
    #: Only from a listening agent (``--listen``): the ``ADDR:PORT`` it was told to listen
    #: on, which the server checks is the address it dialled (``listener`` says why).
    listen: NotRequired[str]


class StreamEvent(TypedDict):
    ev: Literal["stream"]
    id: int
    name: str  # "stdout" | "stderr"
    text: str


class DisplayEvent(TypedDict):
    ev: Literal["display"]
    id: int
    source: str  # "figure" | "display"
    data: dict[str, str]  # mime -> text; image/png base64


class ErrorDetail(TypedDict):
    """A run's error: ``traceback`` holds the cell's frames only; "" when there are none."""

    name: str
    value: str
    traceback: str


class CutReport(TypedDict, total=False):
    """What the agent cut to keep a Python run within its budget (keys may be missing)."""

    result: bool
    error: bool
    displays_dropped: int
    displays_cut: int
    images_dropped: int
    #: Displays with none of the forms a result carries (only JavaScript, a widget...).
    displays_unsupported: int


class DoneEvent(TypedDict):
    """The end of run ``id``; see "Semantics" above for what each field means per language."""

    ev: Literal["done"]
    id: int
    status: str  # "ok" | "error" | "timeout" | "cancelled"
    exit_code: int | None
    result: str | None
    error: ErrorDetail | None
    execution_count: int | None
    state_lost: bool
    cut: NotRequired[CutReport]
    #: Seconds the run took inside the sandbox, by the agent's clock (a trace's span).
    run_s: NotRequired[float]


class RestartedEvent(TypedDict):
    """The ``restart`` of ``id`` is done: a fresh interpreter is ready."""

    ev: Literal["restarted"]
    id: int


class ErrorEvent(TypedDict):
    """A host message the agent could not use (``id`` null: not about a run)."""

    ev: Literal["error"]
    message: str
    id: int | None


class FsEvent(TypedDict):
    """The answer to ``fs`` request ``id``. Refused (``ok`` false): ``code`` (an error
    code of the server's: ``not_found``, ``invalid_path``, ``file_exists``,
    ``quota_exceeded``, ``invalid_argument``, ``internal_error``), ``message`` and, for a
    quota, ``details``. Else by action: ``read`` ``size``, ``mtime_ns``, ``data``,
    ``head`` (base64); ``list`` ``entries`` ``[[path, mode, size, mtime_ns]]``;
    ``snapshot`` ``files`` ``[[path, size, mtime_ns, ctime_ns, ino]]`` and
    ``extra_bytes``; both with ``truncated`` and ``next`` (the next page's ``start``,
    null at the end); ``usage`` ``bytes``; a write's last chunk ``size``, ``mtime_ns``."""

    ev: Literal["fs"]
    id: int | None
    ok: bool
    code: NotRequired[str]
    message: NotRequired[str]
    details: NotRequired[dict[str, int]]
    size: NotRequired[int]
    mtime_ns: NotRequired[int]
    data: NotRequired[str]
    head: NotRequired[str]
    entries: NotRequired[list[list[Any]]]
    files: NotRequired[list[list[Any]]]
    extra_bytes: NotRequired[int]
    truncated: NotRequired[bool]
    next: NotRequired[int | None]
    bytes: NotRequired[int]


AgentEvent = (
    ReadyEvent | StreamEvent | DisplayEvent | DoneEvent | RestartedEvent | ErrorEvent | FsEvent
)

HEADER = struct.Struct(">I")
#: One frame at most: room for a few large PNGs in base64 inside one display message.
MAX_FRAME_BYTES = 64 * 1024 * 1024


class ProtocolError(Exception):
    """A frame was oversized, not JSON, not an object, or cut short by EOF."""


def encode_frame(message: Mapping[str, Any]) -> bytes:
    # "replace": a lone surrogate (``raise ValueError("\ud800")``) must not make the
    # frame unencodable; it becomes "?".
    body = json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"frame is not UTF-8 JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("frame is not a JSON object")
    return message


class FrameDecoder:
    """Incremental decoder: feed bytes, get whole messages. For non-blocking readers."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        out: list[dict[str, Any]] = []
        while len(self._buf) >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buf)
            if length > MAX_FRAME_BYTES:
                raise ProtocolError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
            if len(self._buf) < HEADER.size + length:
                break
            body = bytes(self._buf[HEADER.size : HEADER.size + length])
            del self._buf[: HEADER.size + length]
            out.append(decode_body(body))
        return out

    @property
    def pending(self) -> int:
        """Bytes of an unfinished frame; non-zero at EOF means the peer cut a frame short."""
        return len(self._buf)


def _read_exactly(fd: int, n: int) -> bytes:
    chunks: list[bytes] = []
    remaining = n
    while remaining:
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            if remaining == n:
                return b""
            raise ProtocolError("unexpected EOF inside a frame")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> dict[str, Any] | None:
    """Blocking read of one message from a file descriptor; ``None`` on clean EOF."""
    header = _read_exactly(fd, HEADER.size)
    if not header:
        return None
    if len(header) < HEADER.size:
        raise ProtocolError("unexpected EOF inside a frame header")
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    body = _read_exactly(fd, length)
    if len(body) != length:
        raise ProtocolError("unexpected EOF inside a frame")
    return decode_body(body)


def write_frame(fd: int | socket.socket, message: Mapping[str, Any]) -> None:
    """Blocking write of one whole message (callers serialise writers with a lock)."""
    data = memoryview(encode_frame(message))
    while data:
        sent = fd.send(data) if isinstance(fd, socket.socket) else os.write(fd, data)
        data = data[sent:]
