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
class _Unit:
    """One file of the saved state: the value of one name, or (``len(names) > 1``) a
    tuple of the values of names that refer to each other (a cycle: ``fig`` and ``ax``),
    pickled together so that each is in the other's memo."""

    file: str
    names: list[str]
    types: list[str]
    bytes: int
    #: The names outside this unit that its pickle refers to.
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
    base: type[pickle.Pickler], out: io.RawIOBase, own: set[str], names: dict[int, str],
    namespace: dict[str, Any], refs: set[str],
) -> pickle.Pickler:  # fmt: skip
    """A pickler for the values of ``own``: a value bound to another name becomes a
    reference to it (named in ``refs``); the user namespace (a function's globals) a
    reference to whatever namespace the load runs in."""
    globals_marker: dict[str, Any] = {}

    class Pickler(base):  # type: ignore[misc,valid-type]
        def persistent_id(self, obj: Any) -> Any:
            if obj is globals_marker or obj is namespace:
                return ("ns",)
            other = names.get(id(obj))
            if other is not None and other not in own:
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
            writer = _Writer(data, names, namespace, base, max_bytes, dropped)
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


def _manifest_values(units: list[_Unit]) -> list[dict[str, Any]]:
    """Each kept name, its unit's file and size, and (a unit of several) its slot."""
    values: list[dict[str, Any]] = []
    for unit in units:
        several = len(unit.names) > 1
        for slot, (name, kind) in enumerate(zip(unit.names, unit.types, strict=True)):
            entry = {"name": name, "type": kind, "file": unit.file, "bytes": unit.bytes}
            values.append({**entry, "slot": slot} if several else entry)
    return values


def _kept_report(units: list[_Unit]) -> list[dict[str, Any]]:
    """Names with their bytes: a unit of several counts once, on its first name."""
    return [
        {"name": name, "type": kind, "bytes": unit.bytes if slot == 0 else 0}
        for unit in units
        for slot, (name, kind) in enumerate(zip(unit.names, unit.types, strict=True))
    ]


class _Writer:
    """Pickles the values of a save into files of ``data``, streamed, and drops (into
    ``dropped``, with why) those that fail.

    Bounds: one file may not pass ``max_bytes`` (it could never be kept), and once twice
    ``max_bytes`` has been written the rest are dropped unwritten (rather than filling
    the workspace with what the budget will drop anyway)."""

    def __init__(
        self, data: int, names: dict[int, str], namespace: dict[str, Any],
        base: type[pickle.Pickler], max_bytes: int, dropped: list[dict[str, str]],
    ) -> None:  # fmt: skip
        self._data = data
        self._names = names
        self._namespace = namespace
        self._base = base
        self._max_bytes = max_bytes
        self._dropped = dropped
        self._written = 0

    def write_all(self, candidates: list[tuple[str, Any]]) -> list[_Unit]:
        """One file per value, then one per cycle of names that refer to each other."""
        units: list[_Unit] = []
        for index, (name, value) in enumerate(candidates):
            unit = self._write(f"v{index}.pkl", [(name, value)])
            if unit is not None:
                units.append(unit)
        values = dict(candidates)
        by_name = {unit.names[0]: unit for unit in units}
        edges = {unit.names[0]: unit.refs & by_name.keys() for unit in units}
        for index, cycle in enumerate(_cycles(edges)):
            for name in cycle:
                statefiles.remove(self._data, by_name.pop(name).file)
            group = self._write(f"g{index}.pkl", [(name, values[name]) for name in cycle])
            if group is not None:
                by_name[group.names[0]] = group
        order = {name: index for index, (name, _) in enumerate(candidates)}
        return sorted(by_name.values(), key=lambda unit: order[unit.names[0]])

    def _write(self, file: str, members: list[tuple[str, Any]]) -> _Unit | None:
        types_ = [_type_name(value) for _, value in members]
        room = min(self._max_bytes, 2 * self._max_bytes - self._written)
        if room <= 0:
            passed = f"too large: the saved state passed {2 * self._max_bytes} bytes before"
            self._drop(members, types_, passed + " it was written")
            return None
        own = {name for name, _ in members}
        refs: set[str] = set()
        value = members[0][1] if len(members) == 1 else tuple(v for _, v in members)
        handle = statefiles.create_file(self._data, file)  # an OSError here: the disk's
        try:
            out = _Bounded(handle, room)
            pickler = _make_pickler(self._base, out, own, self._names, self._namespace, refs)
            why = _dump(pickler, value, room, self._max_bytes)
            if why is None:
                statefiles.sync_file(handle)
        finally:
            handle.close()
        self._written += out.written
        if why is not None:
            statefiles.remove(self._data, file)
            self._drop(members, types_, why)
            return None
        return _Unit(file, [name for name, _ in members], types_, out.written, refs)

    def _drop(self, members: list[tuple[str, Any]], types_: list[str], why: str) -> None:
        together = f" (pickled together with {', '.join(n for n, _ in members[1:])})"
        for index, ((name, _), kind) in enumerate(zip(members, types_, strict=True)):
            text = why if len(members) == 1 or index else why + together
            self._dropped.append({"name": name, "type": kind, "why": clean(text, WHY_CHARS)})


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The groups of names that refer to each other (strongly connected components of
    more than one; Tarjan's, without recursion), each in the order of ``edges``."""
    order = {name: index for index, name in enumerate(edges)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        work = [(root, iter(sorted(edges[root], key=order.__getitem__)))]
        while work:
            node, pending = work[-1]
            for nxt in pending:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(edges[nxt], key=order.__getitem__))))
                    break
                if nxt in stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    group: list[str] = []
                    while True:
                        member = stack.pop()
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group, key=order.__getitem__))
    return groups


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
    data: int, units: list[_Unit], candidates: list[tuple[str, Any]], max_bytes: int,
    dropped: list[dict[str, str]],
) -> list[_Unit]:  # fmt: skip
    """Drop what refers to a name not saved, then the largest files until the rest fit
    ``max_bytes``, then (again) what refers to a dropped one. What is dropped is named
    in ``dropped`` and its file removed."""
    kept = {unit.file: unit for unit in units}

    def saved_names() -> set[str]:
        return {name for unit in kept.values() for name in unit.names}

    def drop(unit: _Unit, why: str) -> None:
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
