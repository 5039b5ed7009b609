"""A session's variables saved to ``.session/`` and loaded back: the portable pause.

Kernel-side only: :func:`save` (here) and :func:`.stateload.load` run in the kernel, as
the user, on an ``exec`` with ``state`` (see :mod:`.protocol`), instead of a cell. The
host never reads what they write; it gets the JSON report only.

What is saved: every name of the user namespace but those starting with ``_`` and the
shell's own (``In``, ``Out``, ``get_ipython``, ``exit``, ``quit``, ``display``, and what
IPython's ``user_ns_hidden`` holds unchanged), plus the input history and the execution
count, so numbering continues after a load.

- A module bound to a name (``import numpy as np``) is recorded by module name and
  imported again at load.
- Every other value is pickled into a file of its own with cloudpickle (functions and
  classes defined in the session are pickled by value), or stdlib pickle where
  cloudpickle is missing (then what the session defined is not saved: it is named).
- A value that is the value of another name (``a = b = [1]``, a dict holding ``df``) is
  pickled as a reference to that name, so identity between variables survives, each
  file stays independent (sizes add up; one can be dropped), and a value that refers to
  one not saved is itself not saved, and named (never half-restored). Sharing below the
  top level (two lists holding one inner list) is not kept across files.
- A function's globals are the user namespace itself (a reference, never a copy): a
  restored ``def f(): return df.shape`` sees whatever ``df`` is bound to later.
- Values that cannot be pickled are named with why; past ``max_bytes`` in all the largest
  values are dropped first (a value alone larger than ``max_bytes`` is cut off while it
  is written, so a huge one costs no more than ``max_bytes`` of disk).

Semantics of the reports (``done.result``, JSON):
  save: ``{"kept": [{"name", "type", "bytes"}], "modules": [{"name", "module"}],
  "dropped": [{"name", "type", "why"}], "bytes": int}`` (``bytes``: the state on disk).
  load: ``{"found": bool, "restored": [name], "modules": [name],
  "failed": [{"name", "type", "why"}]}``; ``found`` false when there is no complete
  saved state (then ``failed`` may say what was wrong with what was there).
Lists hold at most ``MAX_REPORTED`` entries; texts are cut and free of control
characters.
"""

from __future__ import annotations

import errno
import importlib
import io
import json
import os
import pickle
import re
import sys
import types
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol

from . import statefiles

__all__ = [
    "FORMAT",
    "HISTORY_CHARS",
    "MAX_REPORTED",
    "NAME_CHARS",
    "WHY_CHARS",
    "StateShell",
    "clean",
    "save",
]

FORMAT = 1
MAX_REPORTED = 1000
NAME_CHARS = 200
WHY_CHARS = 300
#: Immutable atoms: never pickled as a reference to another name (they need no identity,
#: and a reference would tie a value to whether the other name was saved). Strings and
#: bytes only when short: a large one is kept once, whoever else refers to it.
_ATOMS = (type(None), bool, int, float, complex)
_SHORT = 4096
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
#: The history kept (characters of all inputs together); older inputs are emptied.
HISTORY_CHARS = 4 * 1024 * 1024


class StateShell(Protocol):
    """What a shell (``ipy``, ``plain``) offers a save or load."""

    def user_namespace(self) -> dict[str, Any]: ...

    def is_own(self, name: str, value: Any) -> bool:
        """Is ``name`` the shell's own (not the user's), bound to ``value``?"""
        ...

    def history(self) -> list[str]: ...

    def set_history(self, inputs: list[str]) -> None: ...

    def last_count(self) -> int:
        """The execution count of the last cell (0 before the first)."""
        ...

    def set_last_count(self, count: int) -> None: ...


def clean(text: str, limit: int) -> str:
    """``text`` for a report: control characters made ``?``, at most ``limit`` long."""
    text = _CONTROL.sub("?", text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _type_name(value: Any) -> str:
    kind = type(value)
    module = getattr(kind, "__module__", "") or ""
    name = getattr(kind, "__qualname__", "") or kind.__name__
    qualified = name if module == "builtins" else f"{module}.{name}"
    return clean(str(qualified), NAME_CHARS)


def _why(exc: BaseException) -> str:
    return clean(f"not picklable: {type(exc).__name__}: {exc}", WHY_CHARS)


# -- saving -------------------------------------------------------------------------------


class _TooLarge(Exception):
    pass


class _DiskError(Exception):
    """Writing the state failed (the quota, a full disk), not pickling a value."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _Bounded(io.RawIOBase):
    """A write-only file that counts what goes through and refuses past ``limit``."""

    def __init__(self, target: BinaryIO, limit: int) -> None:
        self._target = target
        self.limit = limit
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if self.written + size > self.limit:
            raise _TooLarge
        self.written += size
        try:
            self._target.write(data)
        except OSError as exc:  # told apart from an OSError a value's __reduce__ raises
            if exc.errno == errno.EFBIG:  # the sandbox's file size limit: this value only
                raise _TooLarge from None
            raise _DiskError(exc) from None
        return size


@dataclass
class _Saved:
    name: str
    type: str
    file: str
    bytes: int
    #: The other names this value's pickle refers to.
    refs: set[str] = field(default_factory=set)


def _pickler_class() -> tuple[str, type[pickle.Pickler]]:
    """cloudpickle's Pickler where the runtime has it, else the standard library's.
    Through importlib: the agent imports nothing but the standard library by name."""
    try:
        cloudpickle = importlib.import_module("cloudpickle")
    except ImportError:
        return "pickle", pickle.Pickler
    pickler: type[pickle.Pickler] = cloudpickle.Pickler
    return "cloudpickle", pickler


def _make_pickler(
    base: type[pickle.Pickler], out: io.RawIOBase, name: str, names: dict[int, str],
    namespace: dict[str, Any], refs: set[str],
) -> pickle.Pickler:  # fmt: skip
    """A pickler for the value of ``name``: a value bound to another name becomes a
    reference to it; the user namespace (a function's globals) a reference to whatever
    namespace the load runs in."""
    globals_marker: dict[str, Any] = {}

    class Pickler(base):  # type: ignore[misc,valid-type]
        def persistent_id(self, obj: Any) -> Any:
            if obj is globals_marker or obj is namespace:
                return ("ns",)
            other = names.get(id(obj))
            if other is not None and other != name:
                refs.add(other)
                return ("var", other)
            return None

    pickler = Pickler(out, protocol=5)
    # cloudpickle rebuilds a function's globals from this dict (one per namespace and
    # pickler): as a persistent reference, it becomes the live namespace at load.
    globals_ref = getattr(pickler, "globals_ref", None)
    if isinstance(globals_ref, dict):
        globals_ref[id(namespace)] = globals_marker
    return pickler


def save(shell: StateShell, workdir: str, max_bytes: int) -> dict[str, Any]:
    """Save ``shell``'s namespace to ``<workdir>/.session`` (see the module docstring);
    the save report. Raises ``OSError`` (the directory cannot be written: nothing is
    committed) and ``KeyboardInterrupt`` (likewise)."""
    namespace = shell.user_namespace()
    kind, base = _pickler_class()
    candidates, modules, dropped = _candidates(shell, namespace, kind)
    names: dict[int, str] = {}
    for name, value in candidates:
        if not _is_atom(value):
            names.setdefault(id(value), name)
    with statefiles.open_state_dir(workdir, create=True) as state:
        data_name, data = statefiles.new_data_dir(state)
        committed = False
        try:
            saved = _write_values(data, candidates, names, namespace, base, max_bytes, dropped)
            kept = _fit(data, saved, candidates, max_bytes, dropped)
            history = _write_history(data, shell.history())
            total = sum(entry.bytes for entry in kept) + history
            manifest = {
                "format": FORMAT, "data": data_name, "pickler": kind,
                "python": list(sys.version_info[:2]), "execution_count": shell.last_count(),
                "history": "history.json",
                "modules": [{"name": n, "module": m} for n, m in modules],
                "values": [{"name": e.name, "type": e.type, "file": e.file, "bytes": e.bytes}
                           for e in kept],
                "dropped": dropped[:MAX_REPORTED], "bytes": total,
            }  # fmt: skip
            os.fsync(data)
            statefiles.commit(state, data_name, json.dumps(manifest).encode())
            committed = True
        finally:
            os.close(data)
            if not committed:
                statefiles.remove(state, data_name)
    return {
        "kept": [{"name": e.name, "type": e.type, "bytes": e.bytes} for e in kept][:MAX_REPORTED],
        "modules": [{"name": n, "module": m} for n, m in modules][:MAX_REPORTED],
        "dropped": dropped[:MAX_REPORTED],
        "bytes": total,
    }


def _is_atom(value: Any) -> bool:
    if isinstance(value, str | bytes):
        return len(value) < _SHORT
    return isinstance(value, _ATOMS)


def _candidates(
    shell: StateShell, namespace: dict[str, Any], kind: str
) -> tuple[list[tuple[str, Any]], list[tuple[str, str]], list[dict[str, str]]]:
    """The user's names: values to pickle, modules (name, module), and those skipped
    with why (a name too long; with stdlib pickle, what the session defined)."""
    values: list[tuple[str, Any]] = []
    modules: list[tuple[str, str]] = []
    dropped: list[dict[str, str]] = []
    for name, value in list(namespace.items()):
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
            continue
        if shell.is_own(name, value):
            continue
        if len(name) > NAME_CHARS:
            dropped.append({"name": clean(name, NAME_CHARS), "type": _type_name(value),
                            "why": "the name is too long to save"})  # fmt: skip
        elif isinstance(value, types.ModuleType):
            modules.append((name, clean(str(value.__name__), NAME_CHARS)))
        elif kind == "pickle" and _defined_in_session(value):
            why = "defined in the session: saving it needs cloudpickle, not installed here"
            dropped.append({"name": name, "type": _type_name(value), "why": why})
        else:
            values.append((name, value))
    return values, modules, dropped


def _defined_in_session(value: Any) -> bool:
    kind = value if isinstance(value, type) else type(value)
    if isinstance(value, types.FunctionType):
        return value.__module__ == "__main__"
    return getattr(kind, "__module__", None) == "__main__"


def _write_values(
    data: int, candidates: list[tuple[str, Any]], names: dict[int, str],
    namespace: dict[str, Any], base: type[pickle.Pickler], max_bytes: int,
    dropped: list[dict[str, str]],
) -> list[_Saved]:  # fmt: skip
    """Pickle each value into ``v<N>.pkl``, streamed; those that fail are ``dropped``.

    Bounds: one value may not pass ``max_bytes`` (it could never be kept), and once twice
    ``max_bytes`` has been written the rest are dropped unwritten (rather than filling
    the workspace with what the budget will drop anyway)."""
    saved: list[_Saved] = []
    written = 0
    for index, (name, value) in enumerate(candidates):
        file = f"v{index}.pkl"
        refs: set[str] = set()
        room = min(max_bytes, 2 * max_bytes - written)
        if room <= 0:
            dropped.append({"name": name, "type": _type_name(value),
                            "why": f"too large: the saved state passed {2 * max_bytes} bytes"
                                   " before this value was written"})  # fmt: skip
            continue
        handle = statefiles.create_file(data, file)  # an OSError here: the disk's
        try:
            out = _Bounded(handle, room)
            why = _dump(_make_pickler(base, out, name, names, namespace, refs), value, room,
                        max_bytes)  # fmt: skip
            if why is None:
                statefiles.sync_file(handle)
        finally:
            handle.close()
        if why is not None:
            statefiles.remove(data, file)
            dropped.append({"name": name, "type": _type_name(value), "why": why})
            continue
        written += out.written
        saved.append(_Saved(name, _type_name(value), file, out.written, refs))
    return saved


def _dump(pickler: pickle.Pickler, value: Any, room: int, max_bytes: int) -> str | None:
    """Pickle ``value``; why it was not saved, or ``None``. Raises ``OSError`` when the
    disk failed (nothing of this save is committed then)."""
    try:
        pickler.dump(value)
    except _TooLarge:
        return f"too large: over {room} bytes pickled, the budget is {max_bytes}"
    except _DiskError as exc:
        raise exc.error from None
    except RecursionError:
        return "nested too deeply to pickle"
    except Exception as exc:  # anything a __reduce__ or __getstate__ raises
        return _why(exc)
    return None


def _fit(
    data: int, saved: list[_Saved], candidates: list[tuple[str, Any]], max_bytes: int,
    dropped: list[dict[str, str]],
) -> list[_Saved]:  # fmt: skip
    """Drop values referring to one not saved, then the largest until the rest fit
    ``max_bytes``, then (again) those referring to a dropped one. What is dropped is
    named in ``dropped`` and its file removed."""
    kept = {entry.name: entry for entry in saved}

    def drop(entry: _Saved, why: str) -> None:
        del kept[entry.name]
        statefiles.remove(data, entry.file)
        dropped.append({"name": entry.name, "type": entry.type, "why": clean(why, WHY_CHARS)})

    def close_refs() -> None:
        changed = True
        while changed:
            changed = False
            for entry in list(kept.values()):
                missing = sorted(entry.refs - kept.keys())
                if missing:
                    drop(entry, f"refers to {missing[0]}, which is not saved")
                    changed = True

    close_refs()
    total = sum(entry.bytes for entry in kept.values())
    for entry in sorted(kept.values(), key=lambda e: e.bytes, reverse=True):
        if total <= max_bytes:
            break
        total -= entry.bytes
        drop(entry, f"too large: {entry.bytes} bytes pickled; the budget is {max_bytes} "
                    "bytes in all, and the largest values go first")  # fmt: skip
    close_refs()
    order = {name: index for index, (name, _) in enumerate(candidates)}
    return sorted(kept.values(), key=lambda e: order[e.name])


def _write_history(data: int, inputs: list[str]) -> int:
    """``history.json``: the inputs, oldest emptied past ``HISTORY_CHARS``; its bytes."""
    kept = [text if isinstance(text, str) else "" for text in inputs]
    total = 0
    for index in range(len(kept) - 1, -1, -1):
        total += len(kept[index])
        if total > HISTORY_CHARS:
            kept[index] = ""
    body = json.dumps(kept).encode()
    with statefiles.create_file(data, "history.json") as handle:
        handle.write(body)
        statefiles.sync_file(handle)
    return len(body)
