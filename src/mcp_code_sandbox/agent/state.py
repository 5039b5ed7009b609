"""A session's variables saved to ``.session/`` and loaded back: the portable pause.

Kernel-side only: :func:`save` (here; the pickling is :mod:`.statewrite`'s, the files
:mod:`.statefiles`') and :func:`.stateload.load` run in the kernel, as the user, on an
``exec`` with ``state`` (see :mod:`.protocol`), instead of a cell. The host never reads
what they write; it gets the JSON report only.

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
  one not saved is itself not saved, and named (never half-restored). Names that refer
  to each other (``fig`` and ``ax``; a parent and its child) are pickled together, in
  one file, which is kept or dropped whole. Sharing below the top level (two lists
  holding one inner list) is not kept across files.
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

import json
import os
import sys
import types
from typing import Any

from . import statefiles
from .cells import StateShell
from .statewrite import NAME_CHARS, WHY_CHARS, Unit, Writer, clean, pickler_class, type_name

__all__ = [
    "FORMAT",
    "HISTORY_CHARS",
    "MAX_REPORTED",
    "save",
]

FORMAT = 1
MAX_REPORTED = 1000
#: Immutable atoms: never pickled as a reference to another name (they need no identity,
#: and a reference would tie a value to whether the other name was saved). Strings and
#: bytes only when short: a large one is kept once, whoever else refers to it.
_ATOMS = (type(None), bool, int, float, complex)
_SHORT = 4096
#: The history kept (characters of all inputs together); older inputs are emptied.
HISTORY_CHARS = 4 * 1024 * 1024


def save(shell: StateShell, workdir: str, max_bytes: int) -> dict[str, Any]:
    """Save ``shell``'s namespace to ``<workdir>/.session`` (see the module docstring);
    the save report. Raises ``OSError`` (the directory cannot be written: nothing is
    committed) and ``KeyboardInterrupt`` (likewise)."""
    namespace = shell.user_namespace()
    kind, base = pickler_class()
    candidates, modules, dropped = _candidates(shell, namespace, kind)
    names: dict[int, str] = {}
    for name, value in candidates:
        if not _is_atom(value):
            names.setdefault(id(value), name)
    with statefiles.open_state_dir(workdir, create=True) as state:
        data_name, data = statefiles.new_data_dir(state)
        committed = False
        try:
            writer = Writer(data, names, namespace, base, max_bytes, dropped)
            units = writer.write_all(candidates)
            kept = _fit(data, units, candidates, max_bytes, dropped)
            history = _write_history(data, shell.history())
            total = sum(unit.bytes for unit in kept) + history
            manifest = {
                "format": FORMAT, "data": data_name, "pickler": kind,
                "python": list(sys.version_info[:2]), "execution_count": shell.last_count(),
                "history": "history.json",
                "modules": [{"name": n, "module": m} for n, m in modules],
                "values": _manifest_values(kept),
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
        "kept": _kept_report(kept)[:MAX_REPORTED],
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
            dropped.append({"name": clean(name, NAME_CHARS), "type": type_name(value),
                            "why": "the name is too long to save"})  # fmt: skip
        elif isinstance(value, types.ModuleType):
            modules.append((name, clean(str(value.__name__), NAME_CHARS)))
        elif kind == "pickle" and _defined_in_session(value):
            why = "defined in the session: saving it needs cloudpickle, not installed here"
            dropped.append({"name": name, "type": type_name(value), "why": why})
        else:
            values.append((name, value))
    return values, modules, dropped


def _defined_in_session(value: Any) -> bool:
    kind = value if isinstance(value, type) else type(value)
    if isinstance(value, types.FunctionType):
        return value.__module__ == "__main__"
    return getattr(kind, "__module__", None) == "__main__"


def _manifest_values(units: list[Unit]) -> list[dict[str, Any]]:
    """Each kept name, its unit's file and size, and (a unit of several) its slot."""
    values: list[dict[str, Any]] = []
    for unit in units:
        several = len(unit.names) > 1
        for slot, (name, kind) in enumerate(zip(unit.names, unit.types, strict=True)):
            entry = {"name": name, "type": kind, "file": unit.file, "bytes": unit.bytes}
            values.append({**entry, "slot": slot} if several else entry)
    return values


def _kept_report(units: list[Unit]) -> list[dict[str, Any]]:
    """Names with their bytes: a unit of several counts once, on its first name."""
    return [
        {"name": name, "type": kind, "bytes": unit.bytes if slot == 0 else 0}
        for unit in units
        for slot, (name, kind) in enumerate(zip(unit.names, unit.types, strict=True))
    ]


def _fit(
    data: int, units: list[Unit], candidates: list[tuple[str, Any]], max_bytes: int,
    dropped: list[dict[str, str]],
) -> list[Unit]:  # fmt: skip
    """Drop what refers to a name not saved, then the largest files until the rest fit
    ``max_bytes``, then (again) what refers to a dropped one. What is dropped is named
    in ``dropped`` and its file removed."""
    kept = {unit.file: unit for unit in units}

    def saved_names() -> set[str]:
        return {name for unit in kept.values() for name in unit.names}

    def drop(unit: Unit, why: str) -> None:
        del kept[unit.file]
        statefiles.remove(data, unit.file)
        for name, kind in zip(unit.names, unit.types, strict=True):
            dropped.append({"name": name, "type": kind, "why": clean(why, WHY_CHARS)})

    def close_refs() -> None:
        changed = True
        while changed:
            changed = False
            present = saved_names()
            for unit in list(kept.values()):
                missing = sorted(unit.refs - present)
                if missing:
                    drop(unit, f"refers to {missing[0]}, which is not saved")
                    changed = True
                    break

    close_refs()
    total = sum(unit.bytes for unit in kept.values())
    for unit in sorted(kept.values(), key=lambda u: u.bytes, reverse=True):
        if total <= max_bytes:
            break
        total -= unit.bytes
        drop(unit, f"too large: {unit.bytes} bytes pickled; the budget is {max_bytes} "
                   "bytes in all, and the largest values go first")  # fmt: skip
    close_refs()
    order = {name: index for index, (name, _) in enumerate(candidates)}
    return sorted(kept.values(), key=lambda unit: order[unit.names[0]])


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
