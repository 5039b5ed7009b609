"""The kernel: one persistent Python interpreter, started and restarted by the supervisor.

Run as ``python -s -B -m <package>.kernel --control-fd N --workdir DIR --config JSON
[--plain]`` with fd 1 and fd 2 being pipes the supervisor reads, so everything user code
writes there (``os.system``, C extensions) becomes ``stream`` messages and nothing can
reach the host channel. What Python code prints (``sys.stdout``, ``sys.stderr``) is
buffered here and sent in batches on the control socket (:mod:`.outstream`). It speaks
the same framing with the supervisor over the control socket::

    kernel → supervisor   {"ev": "ready", "ipython": bool, "version": str}
    supervisor → kernel   {"op": "exec", "id": int, "code": str, "env": {str: str},
                           "budget": {...}, "state"?: "save" | "load",
                           "max_bytes"?: int}   (``state``: see :mod:`.state`)
    kernel → supervisor   {"ev": "stream", "id": int, "name": "stdout" | "stderr",
                           "text": str}        (at most 64 KiB of text)
                          {"ev": "sync", "id": int}
                          (a process is about to start; answered by {"op": "ack"} once
                          the pipes' output so far is taken)
                          {"ev": "display", "id": int, "source": str, "data": {...}}
                          (answered by {"op": "ack"} once forwarded)
                          {"ev": "done", "id": int, "status": "ok" | "error",
                           "result": str | None, "error": {...} | None,
                           "execution_count": int, "cut": {...}}

Displays past the run's budget are dropped here, before they are framed, and the result
and error texts are cut (:mod:`.budget`); the supervisor checks both again.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from .budget import Budget, DisplayGate, cut_error, cut_text
from .cells import LEFT_OUT, Outcome, Shell, error_info
from .config import AgentConfig, apply_limits
from .figures import FigureCapture
from .interrupts import InterruptGate
from .ipy import make_ipython_shell
from .outstream import Streams, install
from .packages import refresh_import_path
from .protocol import read_frame

__all__ = ["main"]


def deferred() -> tuple[Callable[..., dict[str, Any]], Callable[..., dict[str, Any]]]:
    """:func:`.state.save` and :func:`.stateload.load`, imported at their first use, not at
    the kernel's start: most sessions are never paused, and their modules were a
    measurable part of every sandbox's start (``plain`` and ``tables`` wait for their first
    use too).

    Safe to import late, with the workspace first on ``sys.path``: a relative import is
    found in the agent's package, never on ``sys.path``, and the standard modules they
    import are imported by then, by IPython's start (a test checks that); a kernel
    without IPython calls this at its start."""
    from .state import save
    from .stateload import load

    return save, load


def _python_version() -> str:
    # Not platform.python_version(): importing platform is slow, on every sandbox start.
    return ".".join(str(part) for part in sys.version_info[:3])


class Kernel:
    def __init__(
        self, control: int, workdir: str, plain: bool, preload: tuple[str, ...] = ()
    ) -> None:
        self._control = control
        self._preload = preload
        self._gate = InterruptGate()
        self._run_id: int | None = None
        self._displays = DisplayGate(Budget())
        # Before the shell: IPython keeps references to sys.stdout and sys.stderr.
        self._streams: Streams = install(control, self._gate)
        self.shell = self._make_shell(plain)
        self._workdir = workdir
        self._figures = FigureCapture(workdir, self._emit, _warn)

    def _make_shell(self, plain: bool) -> Shell:
        if not plain:
            try:
                shell: Shell = make_ipython_shell(self._emit, self._gate)
                return shell
            except ImportError:
                pass
            except Exception as exc:  # a broken IPython: still give the user Python
                _warn(f"IPython failed to start, using the plain shell: {exc!r}")
        from .plain import PlainShell  # only now: see ``deferred``

        deferred()  # without IPython, what it would have imported is not there yet
        return PlainShell(self._emit, self._gate)

    def _emit(self, source: str, data: dict[str, str]) -> None:
        if self._run_id is None or threading.current_thread() is not threading.main_thread():
            return  # a display outside the cell's own thread has no place in the output
        if source == LEFT_OUT:  # forms the host does not return (``cells.RICH_MIMES``)
            self._displays.unsupported += 1
            return
        admitted = self._displays.admit(data)
        if admitted is None:
            return  # over the run's budget: dropped here, counted in the done
        data = admitted
        message = {"ev": "display", "id": self._run_id, "source": source, "data": data}
        _flush_stdio(self._streams)  # output printed before the display stays before it...
        # ...and output printed after it stays after it: wait until the supervisor has
        # sent what the pipes held and the display itself.
        self._streams.outbox.request(message)

    def serve(self) -> None:
        self._gate.install()
        self._figures.install()
        _preload(self._preload)  # after the figure hook: a preloaded pyplot is patched too
        gc.freeze()  # the start's objects (see the agent's ``main``)
        gc.enable()
        ready = {"ev": "ready", "ipython": self.shell.ipython, "version": _python_version()}
        self._streams.outbox.send(ready)
        # While the ready goes to the host and its first exec comes back: what the first
        # cell would otherwise do before running (between cells, SIGINT is swallowed).
        try:
            self.shell.warm_up()
        except Exception as exc:  # the cell will meet it again, and say so
            _warn(f"warming up the shell failed: {exc!r}")
        while (message := read_frame(self._control)) is not None:
            if message.get("op") == "exec":
                self._exec(message)

    def _exec(self, message: dict[str, Any]) -> None:
        self._run_id = message["id"]
        self._streams.start(message["id"])
        self._displays = DisplayGate(Budget.from_message(message.get("budget")))
        refresh_import_path()  # a `pip install` since the last cell may have made it
        state = message.get("state")
        with _cell_env(message.get("env") or {}):
            if state in ("save", "load"):
                outcome = self._state(state, message.get("max_bytes"))
            else:
                self._figures.drawn = 0
                outcome = self.shell.run(str(message["code"]))
                try:
                    self._figures.flush()
                except BaseException as exc:  # a late KeyboardInterrupt lands here too
                    _warn(f"figure capture failed: {exc!r}")
                if outcome.artist and self._figures.drawn:
                    outcome.result = None  # `<Axes: >` beside its figure: noise
        _flush_stdio(self._streams)
        self._streams.end()
        self._streams.outbox.send(_done(self._run_id, outcome, self._displays))
        self._run_id = None

    def _state(self, op: str, max_bytes: Any) -> Outcome:
        """Save or load the namespace (:mod:`.state`) instead of running a cell: no
        execution count, no history, no ``_``. Interruptible like a cell; a failure of
        the whole operation (the disk, the quota) is an ``error`` outcome."""
        try:
            save, load = deferred()
            with self._gate.armed():
                if op == "save":
                    report = save(self.shell, self._workdir, int(max_bytes or 1))
                else:
                    report = load(self.shell, self._workdir)
                result = json.dumps(report, ensure_ascii=False)
        except BaseException as exc:  # KeyboardInterrupt too: the supervisor says why
            return Outcome("error", None, error_info(exc, ""), self.shell.last_count())
        return Outcome("ok", result, None, self.shell.last_count())


def _done(run_id: int | None, outcome: Outcome, displays: DisplayGate) -> dict[str, Any]:
    limit = displays.budget.text_chars
    result, result_cut = (
        (None, False) if outcome.result is None else cut_text(outcome.result, limit)
    )
    error, error_cut = cut_error(outcome.error, limit)
    cut = {"result": result_cut, "error": error_cut, **displays.summary()}
    return {
        "ev": "done",
        "id": run_id,
        "status": outcome.status,
        "result": result,
        "error": error,
        "execution_count": outcome.execution_count,
        "cut": cut,
    }


@contextmanager
def _cell_env(env: Mapping[str, str]) -> Iterator[None]:
    """The call's env applies to this cell only; what it was before comes back after."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _preload(modules: tuple[str, ...]) -> None:
    """Import ``modules`` into ``sys.modules`` only: the user's namespace stays as a fresh
    kernel's, and the session's first ``import pandas`` finds it loaded. One that fails
    is said on stderr (startup chatter) and skipped: the cell that imports it will say
    why."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            _warn(f"preloading {name} failed: {exc!r}")


def _warn(text: str) -> None:
    print(f"[sandbox] {text}", file=sys.stderr)


def _flush_stdio(streams: Streams) -> None:
    for stream in (sys.stdout, sys.stderr):  # ours, or what user code put there
        with contextlib.suppress(Exception):  # closed or replaced by user code
            stream.flush()
    streams.flush()
    if _LIBC is not None:  # C code's buffered stdio (printf without fflush) too
        _LIBC.fflush(None)


def _load_libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


_LIBC = _load_libc()


def _setup_process(workdir: str, control: int, config: AgentConfig) -> None:
    # User code and its children must never inherit the control socket.
    os.set_inheritable(control, False)
    apply_limits(config)
    os.chdir(workdir)
    # Like Jupyter: the working directory is importable, the agent's own dir is not.
    sys.path[0] = workdir
    os.environ["MPLBACKEND"] = "Agg"


def main(argv: list[str] | None = None) -> None:
    gc.disable()  # for the imports to come, as the agent does (on again at the ready)
    parser = argparse.ArgumentParser(prog="kernel")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--config", default="{}")
    parser.add_argument("--plain", action="store_true")
    args = parser.parse_args(argv)
    config = AgentConfig.from_json(args.config)
    _setup_process(args.workdir, args.control_fd, config)
    Kernel(args.control_fd, args.workdir, args.plain, config.preload).serve()


if __name__ == "__main__":
    main()
