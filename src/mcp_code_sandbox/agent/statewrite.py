"""Pickling a session's values into the files of a saved state (for :func:`.state.save`).

Kernel-side only. Each value goes to a file of its own, streamed (never held in memory
as a whole pickle), through a pickler that turns a value bound to another name into a
reference to that name and the user namespace into a reference to the namespace of
whoever loads it; then the names that refer to each other are pickled again, together.
What cannot be pickled, or passes the bounds, is dropped with why. See :mod:`.state`.
"""

from __future__ import annotations

import errno
import importlib
import io
import pickle
import re
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from . import statefiles

__all__ = ["NAME_CHARS", "WHY_CHARS", "Unit", "Writer", "clean", "pickler_class", "type_name"]

#: The longest name or type a report holds, and the longest reason.
NAME_CHARS = 200
WHY_CHARS = 300
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def clean(text: str, limit: int) -> str:
    """``text`` for a report: control characters made ``?``, at most ``limit`` long."""
    text = _CONTROL.sub("?", text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def type_name(value: Any) -> str:
    kind = type(value)
    module = getattr(kind, "__module__", "") or ""
    name = getattr(kind, "__qualname__", "") or kind.__name__
    qualified = name if module == "builtins" else f"{module}.{name}"
    return clean(str(qualified), NAME_CHARS)


def _why(exc: BaseException) -> str:
    return clean(f"not picklable: {type(exc).__name__}: {exc}", WHY_CHARS)


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
class Unit:
    """One file of the saved state: the value of one name, or (``len(names) > 1``) a
    tuple of the values of names that refer to each other (a cycle: ``fig`` and ``ax``),
    pickled together so that each is in the other's memo."""

    file: str
    names: list[str]
    types: list[str]
    bytes: int
    #: The names outside this unit that its pickle refers to.
    refs: set[str] = field(default_factory=set)


def pickler_class() -> tuple[str, type[pickle.Pickler]]:
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


class Writer:
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

    def write_all(self, candidates: list[tuple[str, Any]]) -> list[Unit]:
        """One file per value, then one per cycle of names that refer to each other."""
        units: list[Unit] = []
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

    def _write(self, file: str, members: list[tuple[str, Any]]) -> Unit | None:
        types_ = [type_name(value) for _, value in members]
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
        return Unit(file, [name for name, _ in members], types_, out.written, refs)

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
