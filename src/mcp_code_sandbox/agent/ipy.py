"""The IPython shell: rich display, ``_`` results, ``%magics`` and ``!shell``.

The only module that imports IPython, and only inside :func:`make_ipython_shell`, which
raises ``ImportError`` when IPython is not installed. Nothing IPython would print to the
terminal reaches stdout: ``Out[n]:`` results and ``display()`` outputs are captured by a
DisplayHook and a DisplayPublisher, tracebacks by ``_showtraceback``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from typing import Any

from .cells import Emit, Outcome, emit_display, error_info, value_text
from .figures import is_artist, is_figure
from .interrupts import InterruptGate

__all__ = ["make_ipython_shell"]

#: Names the shell binds in the user namespace that are never the user's variables.
_OWN_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit", "display"})
#: How IPython (colors "nocolor") starts a traceback entry for a frame of the agent's own
#: code: user code calls into it (a patched ``savefig``, a flush of ``sys.stdout``), and
#: such frames say nothing to the user and name this package's path.
_AGENT_ENTRY = "File " + os.path.dirname(os.path.abspath(__file__)) + os.sep


def make_ipython_shell(emit: Emit, gate: InterruptGate) -> Any:
    # Through importlib: IPython is optional and the host's type checker has no stubs.
    DisplayHook: Any = importlib.import_module("IPython.core.displayhook").DisplayHook
    DisplayPublisher: Any = importlib.import_module("IPython.core.displaypub").DisplayPublisher
    shell_module = importlib.import_module("IPython.core.interactiveshell")
    InteractiveShell: Any = shell_module.InteractiveShell
    Config: Any = importlib.import_module("traitlets.config").Config

    class CapturingDisplayHook(DisplayHook):  # type: ignore[misc]
        """Keeps the last expression's formats instead of printing ``Out[n]:``."""

        captured: dict[str, Any] | None = None
        #: The value was a matplotlib Figure (its image is captured at the cell's end).
        figure = False
        #: The value was a matplotlib artist, or a list of them (``Outcome.artist``).
        artist = False

        def start_displayhook(self) -> None:
            pass

        def write_output_prompt(self) -> None:
            pass

        def compute_format_data(self, result: Any) -> Any:
            self.figure = is_figure(result)
            self.artist = is_artist(result)
            return super().compute_format_data(result)

        def write_format_data(self, format_dict: Any, md_dict: Any = None) -> None:
            self.captured = dict(format_dict)

        def finish_displayhook(self) -> None:
            self._is_active = False

    class CapturingPublisher(DisplayPublisher):  # type: ignore[misc]
        def publish(self, data: Any, metadata: Any = None, *args: Any, **kwargs: Any) -> None:
            emit_display(emit, dict(data))

        def clear_output(self, wait: bool = False) -> None:
            pass

    class Shell(InteractiveShell):  # type: ignore[misc]
        last_traceback: tuple[BaseException, str] | None = None
        _completer: Any = None

        # Tab completion is made at its first use, not at start: IPython's completer
        # (and its module) weigh on every kernel's start, and nothing here completes
        # unless a cell asks (``get_ipython().Completer``, ``complete()``, a hook).
        def init_completer(self) -> None:
            pass

        @property
        def Completer(self) -> Any:
            if self._completer is None:
                InteractiveShell.init_completer(self)  # sets Completer: see the setter
            return self._completer

        @Completer.setter
        def Completer(self, value: Any) -> None:
            self._completer = value

        def _showtraceback(self, etype: Any, evalue: Any, stb: list[str]) -> None:
            kept = [entry for entry in stb if not entry.startswith(_AGENT_ENTRY)]
            self.last_traceback = (evalue, "\n".join(kept))

        @contextlib.contextmanager
        def _tee(self, channel: str) -> Iterator[None]:
            # IPython 9 wraps sys.stdout.write and sys.stderr.write in Python for each
            # cell, to keep everything printed in its history: a Python call per write
            # (most of what 200,000 prints cost, once the output is buffered) and every
            # byte kept in the kernel's memory for good. The host keeps the output.
            yield

    config = Config()
    config.HistoryManager.enabled = False  # no sqlite file, no saving thread
    config.InteractiveShell.colors = "nocolor"
    config.InteractiveShell.autoindent = False
    config.InteractiveShell.automagic = True
    shell = Shell.instance(
        config=config,
        displayhook_class=CapturingDisplayHook,
        display_pub_class=CapturingPublisher,
    )
    # `!cmd` through a plain subprocess writing to fd 1 (our pipe): no pty needed.
    shell.system = shell.system_raw
    shell.user_ns["display"] = importlib.import_module("IPython.display").display
    # A DataFrame's markdown table (``tables``), for display(df) and for a cell's value:
    # what a model reads best, richer than its HTML (``cells.RICH_MIMES``).
    markdown = shell.display_formatter.formatters["text/markdown"]
    for module in ("pandas", "pandas.core.frame"):  # pandas 3 names its class's module
        markdown.for_type_by_name(module, "DataFrame", _dataframe_markdown)
    return IPythonShell(shell, gate)


def _dataframe_markdown(frame: Any) -> str | None:
    from .tables import dataframe_markdown  # at first use (see kernel.deferred)

    return dataframe_markdown(frame)


class IPythonShell:
    ipython = True

    def __init__(self, shell: Any, gate: InterruptGate) -> None:
        self._shell = shell
        self._gate = gate

    def warm_up(self) -> None:
        """IPython's input transformers compile their regular expressions at the first
        cell: a cell of ``pass`` through them, which only returns its text."""
        self._shell.transform_cell("pass\n")

    def run(self, code: str) -> Outcome:
        shell = self._shell
        count = int(shell.execution_count)
        shell.last_traceback = None
        shell.displayhook.captured = None
        shell.displayhook.figure = False
        shell.displayhook.artist = False
        try:
            with self._gate.armed():
                result = shell.run_cell(code, store_history=True)
        except KeyboardInterrupt as exc:  # landed in IPython's own code, around the cell
            return Outcome("error", None, error_info(exc, ""), count)
        error = None
        failure = result.error_before_exec or result.error_in_exec
        if failure is not None:
            captured = shell.last_traceback
            text = captured[1] if captured and captured[0] is failure else ""
            error = error_info(failure, text)
        return Outcome(
            status="ok" if error is None else "error",
            result=self._result_text(),
            error=error,
            execution_count=count,
            artist=shell.displayhook.artist,
        )

    # -- what a save or load of the session's variables needs (``cells.StateShell``) --

    def user_namespace(self) -> dict[str, Any]:
        namespace: dict[str, Any] = self._shell.user_ns
        return namespace

    def is_own(self, name: str, value: Any) -> bool:
        if name in _OWN_NAMES:
            return True
        hidden = self._shell.user_ns_hidden
        return name in hidden and hidden[name] is value

    def history(self) -> list[str]:
        return [str(text) for text in self._shell.history_manager.input_hist_raw]

    def set_history(self, inputs: list[str]) -> None:
        """``In``/``_ih`` (the same list, in place) and the raw history: the cells of the
        saved session, so ``In[n]`` reads as before the pause."""
        manager = self._shell.history_manager
        manager.input_hist_parsed[:] = inputs
        manager.input_hist_raw[:] = inputs

    def last_count(self) -> int:
        return int(self._shell.execution_count) - 1

    def set_last_count(self, count: int) -> None:
        self._shell.execution_count = count + 1

    def _result_text(self) -> str | None:
        """The value once, in its richest form (``cells.value_text``)."""
        data = self._shell.displayhook.captured
        if not data or self._shell.displayhook.figure:
            return None
        text, shown = value_text(data)
        if shown:
            self._shell.display_pub.publish(data)
        return text
