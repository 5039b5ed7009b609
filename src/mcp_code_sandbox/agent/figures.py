"""Matplotlib figures (and PIL's ``Image.show()``) as ``display`` messages, the way a
notebook's inline backend does it.

Nothing here imports matplotlib: an import hook patches ``matplotlib.pyplot`` right after
the user's code imports it (so even the first cell behaves). From then on ``plt.show()``
captures and closes every open figure where it is called (keeping the order of output),
``Figure.show()`` does nothing instead of warning about a non-interactive backend, and
after each cell every figure still open is captured and closed. A figure the cell saved
with ``savefig`` to a file inside the workspace is closed without being captured: the
host returns that file itself.
"""

from __future__ import annotations

import base64
import importlib
import io
import os
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType
from typing import Any

from .cells import Emit

__all__ = ["FigureCapture", "is_artist", "is_figure"]


def is_figure(obj: object) -> bool:
    """Is ``obj`` a matplotlib Figure? Such a cell value comes back as the captured image
    alone, as in Jupyter, not also as ``<Figure size 640x480 with 1 Axes>``."""
    kind = type(obj)
    return kind.__module__.startswith("matplotlib") and any(
        k.__name__ == "Figure" and k.__module__ == "matplotlib.figure" for k in kind.__mro__
    )


def is_artist(obj: object) -> bool:
    """Is ``obj`` a matplotlib artist (``<Axes: >``, a ``Line2D``), or a list or tuple of
    nothing else (what ``plt.plot`` returns)? Beside the figure it drew, its repr is
    noise for a model, and a cell whose value it is returns no ``result``."""
    if isinstance(obj, list | tuple):
        return bool(obj) and all(_is_one_artist(item) for item in obj)
    return _is_one_artist(obj)


def _is_one_artist(obj: object) -> bool:
    kind = type(obj)
    return kind.__module__.startswith("matplotlib") and any(
        k.__name__ == "Artist" and k.__module__ == "matplotlib.artist" for k in kind.__mro__
    )


#: Attribute set on a Figure saved into the workspace.
_SAVED = "_mcs_saved_to_workdir"


class FigureCapture:
    def __init__(self, workdir: str, emit: Emit, warn: Callable[[str], None]) -> None:
        self._workdir = os.path.realpath(workdir)
        self._emit = emit
        self._warn = warn
        self._plt: Any = None
        self._savefig: Any = None
        #: Figures this cell drew (captured, or saved into the workspace): the kernel
        #: sets it to 0 before each cell.
        self.drawn = 0

    def install(self) -> None:
        """Called once at kernel start, before any user code."""
        sys.meta_path.insert(0, _ImportHook("matplotlib.pyplot", self._hook))
        sys.meta_path.insert(0, _ImportHook("PIL.ImageShow", self._hook_pil))

    def _hook_pil(self) -> bool:
        """``Image.show()`` returns the image inline, as ``plt.show()`` does: a viewer of
        ours goes first in PIL's list, so PIL never starts ``xdg-open`` or ``display`` (a
        bwrap sandbox sees the host's ``/usr``: the host's viewers are there)."""
        show = sys.modules.get("PIL.ImageShow")
        if show is None:
            return False
        try:
            show.register(_InlineViewer(self._emit, self._warn), 0)
        except Exception as exc:  # an odd PIL must not break the kernel
            self._warn(f"inline Image.show() disabled: {exc!r}")
            return False
        return True

    def flush(self) -> None:
        """After a cell: capture and close every open figure."""
        if self._hook():
            self._capture_all()

    def _hook(self) -> bool:
        if self._plt is not None:
            return True
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None:
            return False
        try:
            self._patch(plt)
        except Exception as exc:  # an odd matplotlib must not break the kernel
            self._warn(f"figure capture disabled: {exc!r}")
            return False
        return True

    def _patch(self, plt: Any) -> None:
        # Imported already, with pyplot; through importlib so no stubs are needed.
        Figure: Any = importlib.import_module("matplotlib.figure").Figure

        if str(plt.get_backend()).lower() != "agg":
            plt.switch_backend("Agg")  # never a GUI window, never a "cannot show" warning
        self._plt = plt
        self._savefig = original = Figure.savefig
        workdir = self._workdir

        def savefig(fig: Any, fname: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(fig, fname, *args, **kwargs)
            if isinstance(fname, str | os.PathLike):
                path = os.path.realpath(os.fspath(fname))
                if path == workdir or path.startswith(workdir + os.sep):
                    setattr(fig, _SAVED, True)
            return out

        def show(*args: Any, **kwargs: Any) -> None:
            self._capture_all()

        Figure.savefig = savefig
        Figure.show = lambda fig, *a, **k: None
        plt.show = show

    def _capture_all(self) -> None:
        plt = self._plt
        for num in plt.get_fignums():
            fig = plt.figure(num)
            self.drawn += 1
            if not getattr(fig, _SAVED, False):
                self._capture(fig)
        plt.close("all")

    def _capture(self, fig: Any) -> None:
        buf = io.BytesIO()
        try:
            self._savefig(fig, buf, format="png", bbox_inches="tight")
        except Exception as exc:  # e.g. a bad label: report it, keep the other figures
            self._warn(f"could not render figure {fig.number}: {exc!r}")
            return
        data = {"image/png": base64.b64encode(buf.getvalue()).decode("ascii")}
        data["text/plain"] = repr(fig)
        self._emit("figure", data)


class _InlineViewer:
    """A PIL viewer (``PIL.ImageShow.Viewer`` by protocol: ``show``) that sends the image
    as a display, PNG like a figure."""

    def __init__(self, emit: Emit, warn: Callable[[str], None]) -> None:
        self._emit = emit
        self._warn = warn

    def show(self, image: Any, **options: Any) -> int:
        buf = io.BytesIO()
        try:
            if image.mode not in ("1", "L", "LA", "I", "P", "RGB", "RGBA"):
                image = image.convert("RGBA")  # CMYK, F, YCbCr...: no PNG of their own
            image.save(buf, format="PNG")
        except Exception as exc:
            self._warn(f"could not show the image: {exc!r}")
            return 1  # shown as far as PIL knows: never a viewer of the host's instead
        data = {"image/png": base64.b64encode(buf.getvalue()).decode("ascii")}
        data["text/plain"] = repr(image)
        self._emit("display", data)
        return 1


class _ImportHook:
    """Runs ``on_import`` right after the module ``name`` finished importing.

    A meta path finder by protocol (``find_spec``), not by subclassing
    ``importlib.abc.MetaPathFinder``: importing ``importlib.abc`` pulls in
    ``importlib.resources`` and ``tempfile``, on every kernel's start."""

    def __init__(self, name: str, on_import: Callable[[], bool]) -> None:
        self._name = name
        self._on_import = on_import

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name != self._name:
            return None
        spec = PathFinder.find_spec(name, path)
        loader: Any = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module
        on_import = self._on_import

        def exec_module(module: ModuleType) -> None:
            original(module)
            on_import()

        loader.exec_module = exec_module  # this loader instance serves this one file
        return spec
