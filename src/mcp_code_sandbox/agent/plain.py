"""The fallback shell: a persistent ``__main__`` namespace and an ``exec`` loop.

Used when IPython is not importable (or the agent was started with ``--plain``). Like a
notebook, a trailing expression is evaluated and its ``repr`` becomes the result; the
traceback of a failing cell keeps only the cell's own frames (``<cell-N>``).
"""

from __future__ import annotations

import ast
import builtins
import linecache
import os
import sys
import traceback
from types import ModuleType
from typing import Any

from .cells import Emit, Outcome, emit_display, error_info, mime_bundle, value_text
from .figures import is_artist, is_figure
from .interrupts import InterruptGate

__all__ = ["PlainShell"]


class PlainShell:
    ipython = False

    def __init__(self, emit: Emit, gate: InterruptGate) -> None:
        self._emit = emit
        self._gate = gate
        self.execution_count = 0
        main = ModuleType("__main__")
        # Reuse the real __main__ module object so pickling and `if __name__ == ...` behave.
        sys.modules["__main__"] = main
        self.namespace: dict[str, Any] = main.__dict__
        self.namespace.update({"__builtins__": builtins, "display": self._display})
        #: The cells run, like IPython's ``In`` (index 0 empty), for a saved state.
        self.inputs: list[str] = [""]

    def _display(self, *objs: object) -> None:
        for obj in objs:
            emit_display(self._emit, mime_bundle(obj))

    # -- what a save or load of the session's variables needs (``cells.StateShell``) --

    def warm_up(self) -> None:
        pass  # ``exec`` has nothing to prepare

    def user_namespace(self) -> dict[str, Any]:
        return self.namespace

    def is_own(self, name: str, value: Any) -> bool:
        return name == "display" and value == self._display

    def history(self) -> list[str]:
        return list(self.inputs)

    def set_history(self, inputs: list[str]) -> None:
        self.inputs = list(inputs) or [""]

    def last_count(self) -> int:
        return self.execution_count

    def set_last_count(self, count: int) -> None:
        self.execution_count = count

    def run(self, code: str) -> Outcome:
        self.execution_count += 1
        self.inputs.append(code)
        filename = f"<cell-{self.execution_count}>"
        # Register the source so tracebacks can quote the failing line.
        lines = code.splitlines(keepends=True)
        linecache.cache[filename] = (len(code), None, lines, filename)
        try:
            value = self._execute(code, filename)
        except BaseException as exc:  # user code may raise anything, KeyboardInterrupt too
            text = _format(exc, filename)
            return Outcome("error", None, error_info(exc, text), self.execution_count)
        result = None
        if value is not None:
            self.namespace["_"] = value
        if value is not None and not is_figure(value):  # a figure: its image, at the end
            bundle = mime_bundle(value)
            result, shown = value_text(bundle)
            if shown:
                emit_display(self._emit, bundle)
        artist = value is not None and is_artist(value)
        return Outcome("ok", result, None, self.execution_count, artist=artist)

    def _execute(self, code: str, filename: str) -> Any:
        tree = ast.parse(code, filename, "exec")
        last: ast.Expression | None = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body[-1].value)
            del tree.body[-1]
        body = compile(tree, filename, "exec")
        with self._gate.armed():
            exec(body, self.namespace)  # noqa: S102 - running the user's code is the job
            if last is None:
                return None
            return eval(compile(last, filename, "eval"), self.namespace)  # noqa: S307


def _format(exc: BaseException, filename: str) -> str:
    if isinstance(exc, SyntaxError) and exc.filename == filename:
        return "".join(traceback.format_exception_only(type(exc), exc))
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    te.stack = _user_frames(te.stack, filename)
    return "".join(te.format())


def _user_frames(stack: traceback.StackSummary, filename: str) -> traceback.StackSummary:
    """Drop the agent's own frames: those above the cell's first frame and our handlers."""
    frames = list(stack)
    starts = [i for i, frame in enumerate(frames) if frame.filename == filename]
    if starts:
        frames = frames[starts[0] :]
    return traceback.StackSummary.from_list(
        [f for f in frames if not f.filename.startswith(_AGENT_DIR)]
    )


_AGENT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
