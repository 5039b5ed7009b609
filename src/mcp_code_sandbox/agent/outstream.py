"""The kernel's ``sys.stdout`` and ``sys.stderr``: buffered, in order, sent in batches.

Before this, every ``write`` of user code was its own ``write(2)`` to a pipe, its own read
by the supervisor and its own frame to the host: 200,000 ``print`` calls cost seconds, and
tens of seconds under gVisor, where each system call is dear. Now what Python code prints
collects in one ordered buffer (:class:`Outbox`) of both streams, and goes to the
supervisor as ``stream`` messages on the control socket, at most ``FLUSH_BYTES`` at a time:

- when the buffer holds ``FLUSH_BYTES`` (64 KiB: one message's worth, as large as a pipe
  read of the supervisor's, so the host sees the same chunk sizes as before);
- every ``FLUSH_S`` (50 ms) while a cell runs, from a thread, so a long cell's output
  still streams (progress shows it) and a cell that prints and then sleeps is not held
  back; 50 ms is below what a person notices and what the host's 2 s progress tick
  could show, and caps the messages at 20 a second;
- when user code calls ``flush()`` (``print(..., flush=True)``: it asked for it);
- before a ``display`` message and at the end of the cell (the kernel flushes);
- before user code starts a process (``os.system``, ``subprocess``, ``!cmd``, ``fork``:
  an audit hook), and then, from the cell's own thread, a ``sync`` round trip: the
  supervisor takes all of the buffer before it reads what the child writes to the pipes.

Order: stdout is buffered in C (the ``TextIOWrapper``'s own pending text, grown to
``FLUSH_BYTES``: no Python code runs per ``print``); stderr is written through, and each
stderr write first moves stdout's pending text into the buffer, so a print to stdout,
then to stderr, then to stdout arrives in that order. What reaches fd 1 / fd 2 directly
(child processes, C code, ``os.write``) still goes through the pipes, which the
supervisor reads; the supervisor drains them before it forwards a batch from here, so a
child's output comes before what Python printed after the child started.

Semantics: output written while no run is in the kernel (a background thread of an
earlier cell) is dropped here, as the supervisor would drop it. A kernel killed (a
segfault, the OOM killer, a timeout's kill) loses what it printed in its last
``FLUSH_S``; ``print(..., flush=True)`` does not.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .interrupts import InterruptGate
from .protocol import read_frame, write_frame

__all__ = ["FLUSH_BYTES", "FLUSH_S", "SPAWN_EVENTS", "Outbox", "Streams", "install"]

#: Buffered output that is sent at once; also the most text one ``stream`` message holds.
FLUSH_BYTES = 64 * 1024
#: Longest a run's output waits in the buffer while the cell runs.
FLUSH_S = 0.05
#: Audit events raised just before user code starts another process.
SPAWN_EVENTS = frozenset(
    {"os.system", "subprocess.Popen", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty"}
)


class Outbox:
    """One ordered buffer of a run's stdout and stderr, and the kernel's only writer of the
    control socket (``display``, ``done`` and ``stream`` come from several threads).

    Called by the sinks below (any thread), by the flusher thread and by the kernel.
    ``run_id`` is the run whose output is collected; ``None`` between runs (then writes are
    dropped)."""

    def __init__(self, control: int, gate: InterruptGate) -> None:
        self._control = control
        self._gate = gate
        self._lock = threading.RLock()
        #: ``(name, pieces)`` in order; pieces joined only when sent (no quadratic copy).
        self._chunks: list[tuple[str, list[str]]] = []
        self._size = 0
        self._decoders = {name: _decoder() for name in ("stdout", "stderr")}
        self.run_id: int | None = None
        #: In a child that user code forked (``os.fork``, multiprocessing): the control
        #: socket is the parent's, never to be written here; the sinks write to the fds.
        self.forked = False

    def after_fork_in_child(self) -> None:
        """``os.register_at_fork``: the lock may be held by a thread the child lacks."""
        self._lock = threading.RLock()
        self._chunks, self._size, self.run_id = [], 0, None
        self.forked = True

    def add(self, name: str, data: bytes) -> None:
        """Bytes written to stream ``name``; sent once the buffer holds ``FLUSH_BYTES``."""
        with self._lock:
            if self.run_id is None:
                return
            text = self._decoders[name].decode(data)
            if not text:
                return
            if self._chunks and self._chunks[-1][0] == name:
                self._chunks[-1][1].append(text)
            else:
                self._chunks.append((name, [text]))
            self._size += len(data)
            if self._size >= FLUSH_BYTES:
                self.flush()

    def flush(self) -> None:
        """Send everything buffered as ``stream`` messages of at most ``FLUSH_BYTES``."""
        with self._lock:
            chunks, self._chunks, self._size = self._chunks, [], 0
            if self.run_id is None or not chunks:
                return
            with self._critical():
                for name, pieces in chunks:
                    text = "".join(pieces)
                    for start in range(0, len(text), FLUSH_BYTES):
                        piece = text[start : start + FLUSH_BYTES]
                        write_frame(self._control, _stream(self.run_id, name, piece))

    def send(self, message: dict[str, Any]) -> None:
        """A message after all output buffered before it."""
        with self._lock:
            self.flush()
            with self._critical():
                write_frame(self._control, message)

    def request(self, message: dict[str, Any]) -> None:
        """``send``, then wait for the supervisor's ``ack``. The cell's thread only: it is
        the only reader of the control socket during a run."""
        with self._lock, self._critical():
            self.flush()
            write_frame(self._control, message)
            read_frame(self._control)

    def start(self, run_id: int) -> None:
        with self._lock:
            self.run_id = run_id
            self._decoders = {name: _decoder() for name in self._decoders}

    def end(self) -> None:
        """The run is over: send what is still buffered; from now on writes are dropped."""
        with self._lock:
            self.flush()
            self.run_id = None

    def _critical(self) -> contextlib.AbstractContextManager[None]:
        # A KeyboardInterrupt half-way through a frame would garble the control socket.
        # Only the main thread gets signals (and may change their handlers).
        if threading.current_thread() is threading.main_thread():
            return self._gate.critical()
        return contextlib.nullcontext()


def _decoder() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def _stream(run_id: int, name: str, text: str) -> dict[str, Any]:
    return {"ev": "stream", "id": run_id, "name": name, "text": text}


class _Sink(io.RawIOBase):
    """What a ``TextIOWrapper`` writes its bytes into: the outbox. fd 1 / fd 2 stay what
    ``fileno()`` says, for code that writes there itself (``subprocess``, faulthandler)."""

    def __init__(self, name: str, fd: int, outbox: Outbox) -> None:
        super().__init__()
        self.name = f"<{name}>"
        self._stream_name = name
        self._fd = fd
        self._outbox = outbox
        #: Set while another stream moves this one's pending text into the outbox: the
        #: wrapper's flush() then must not send (a switch of streams is not a flush).
        self.moving = threading.local()
        #: The text stream whose pending text goes first: stdout's, for both sinks (stdout's
        #: own, for bytes written straight to ``sys.stdout.buffer``; when the wrapper itself
        #: writes, its pending text is already taken and this moves nothing).
        self.before: io.TextIOWrapper | None = None

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return False

    def write(self, data: Any) -> int:
        if self._outbox.forked:  # a forked child's output: fd 1 / fd 2, as before
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            return len(data)
        if self.before is not None:
            self._move(self.before)
        size = len(data)
        self._outbox.add(self._stream_name, bytes(data))
        return size

    def flush(self) -> None:
        if not getattr(self.moving, "on", False):
            self._outbox.flush()

    def _move(self, wrapper: io.TextIOWrapper) -> None:
        sink = wrapper.buffer
        if not isinstance(sink, _Sink):
            return
        sink.moving.on = True
        try:
            with contextlib.suppress(OSError, ValueError):  # closed by user code
                wrapper.flush()
        finally:
            sink.moving.on = False


class _Flusher:
    """Sends the buffer every ``FLUSH_S`` while a run is on; sleeps between runs."""

    def __init__(self, stdout: io.TextIOWrapper, outbox: Outbox) -> None:
        self._stdout = stdout
        self._outbox = outbox
        self._running = threading.Event()
        thread = threading.Thread(target=self._loop, name="mcs-output-flusher", daemon=True)
        thread.start()

    def running(self, on: bool) -> None:
        if on:
            self._running.set()
        else:
            self._running.clear()

    def _loop(self) -> None:
        while True:
            self._running.wait()
            time.sleep(FLUSH_S)
            if not self._running.is_set():
                continue
            try:
                self._stdout.flush()  # stdout's pending text, then the whole buffer
            except (OSError, ValueError):  # closed by user code: the rest still goes
                self._outbox.flush()


class Streams:
    """What :func:`install` set up; the kernel brackets each run with ``start``/``end``."""

    def __init__(self, outbox: Outbox, stdout: io.TextIOWrapper, stderr: io.TextIOWrapper):
        self.outbox = outbox
        self.stdout = stdout
        self.stderr = stderr
        self._flusher = _Flusher(stdout, outbox)

    def start(self, run_id: int) -> None:
        self.outbox.start(run_id)
        self._flusher.running(True)

    def flush(self) -> None:
        """Everything the cell printed through our streams, sent."""
        for stream in (self.stdout, self.stderr):
            with contextlib.suppress(OSError, ValueError):  # closed by user code
                stream.flush()
        self.outbox.flush()

    def end(self) -> None:
        self._flusher.running(False)
        self.outbox.end()

    def after_fork_in_child(self) -> None:
        self.outbox.after_fork_in_child()
        for stream in (self.stdout, self.stderr):  # no flusher thread here: no buffering
            with contextlib.suppress(OSError, ValueError):
                stream.reconfigure(write_through=True)

    def on_spawn(self) -> None:
        """A process is about to start: what was printed goes first (see the module)."""
        self._move_stdout()
        if self.outbox.run_id is None:
            return
        if threading.current_thread() is threading.main_thread():
            self.outbox.request({"ev": "sync", "id": self.outbox.run_id})
        else:
            self.outbox.flush()

    def _move_stdout(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # closed by user code
            self.stdout.flush()


def install(control: int, gate: InterruptGate) -> Streams:
    """Replace ``sys.stdout`` and ``sys.stderr`` (and their ``__`` originals) with buffered
    streams into one outbox, and hook process starts. Called once, by the kernel at start
    (before IPython, which keeps references to them)."""
    outbox = Outbox(control, gate)
    out_sink = _Sink("stdout", 1, outbox)
    err_sink = _Sink("stderr", 2, outbox)
    stdout = _wrap(out_sink, sys.stdout, write_through=False)
    # C-level buffering: Python code runs once per FLUSH_BYTES of prints, not per print.
    stdout._CHUNK_SIZE = FLUSH_BYTES  # type: ignore[attr-defined]
    stderr = _wrap(err_sink, sys.stderr, write_through=True)
    out_sink.before = err_sink.before = stdout
    sys.stdout = sys.__stdout__ = stdout  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = stderr  # type: ignore[misc]
    streams = Streams(outbox, stdout, stderr)
    sys.addaudithook(_spawn_hook(streams.on_spawn))
    os.register_at_fork(after_in_child=streams.after_fork_in_child)
    return streams


def _wrap(sink: _Sink, like: Any, write_through: bool) -> io.TextIOWrapper:
    encoding = getattr(like, "encoding", None) or "utf-8"
    errors = getattr(like, "errors", None) or "strict"
    # Straight onto the sink: its own buffer (the outbox) is the only one below the text.
    return io.TextIOWrapper(
        sink,
        encoding=encoding,
        errors=errors,
        write_through=write_through,
    )


def _spawn_hook(on_spawn: Callable[[], None]) -> Callable[[str, tuple[Any, ...]], None]:
    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event in SPAWN_EVENTS:
            on_spawn()

    return hook
