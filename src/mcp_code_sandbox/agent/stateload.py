"""Loading what :mod:`.state` saved back into a fresh interpreter: the resume of a
variables pause. Kernel-side only.

Everything in ``.session`` is the user's to tamper with, so a load trusts nothing it
reads: the manifest is checked, each value's file must be a regular file of the size the
manifest says, and each value is unpickled on its own (a hostile pickle runs as the user,
inside the sandbox, where user code runs anyway). What fails is named with why and the
rest goes on; a value that refers to one not restored is not restored either.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import re
from dataclasses import dataclass
from typing import Any, BinaryIO

from . import statefiles
from .cells import StateShell
from .state import FORMAT, HISTORY_CHARS, MAX_REPORTED
from .statefiles import STATE_DIR, StateDirError
from .statewrite import NAME_CHARS, WHY_CHARS, clean

__all__ = ["load"]


class _NotLoaded(Exception):
    """A value could not be restored (or refers to one that was not)."""


@dataclass(frozen=True)
class _Entry:
    name: str
    type: str
    file: str
    bytes: int
    #: The value's place in its file's tuple (names that refer to each other are saved
    #: together); ``None``: the file holds this value alone.
    slot: int | None = None


class _Loader:
    """Loads values on demand, each once: a reference to another name loads that one
    first, so the order of the files does not matter."""

    def __init__(self, data: int, entries: dict[str, _Entry], namespace: dict[str, Any]):
        self._data = data
        self._entries = entries
        self._namespace = namespace
        self.values: dict[str, Any] = {}
        self.failed: dict[str, str] = {}
        self._loading: set[str] = set()
        #: Files of several values, read once: their tuple, or why they failed.
        self._groups: dict[str, tuple[Any, ...] | str] = {}

    def value(self, name: str) -> Any:
        if name in self.values:
            return self.values[name]
        if name in self.failed:
            raise _NotLoaded(f"refers to {name}, which could not be restored")
        if name in self._loading:
            raise _NotLoaded(f"refers to {name} in a cycle of variables")
        entry = self._entries.get(name)
        if entry is None:
            raise _NotLoaded(f"refers to {name}, which was not saved")
        self._loading.add(name)
        try:
            value = self._read(entry)
        except _NotLoaded as exc:
            self.failed[name] = str(exc)
            raise _NotLoaded(f"refers to {name}, which could not be restored") from None
        except RecursionError:
            self.failed[name] = "nested too deeply to restore"
            raise _NotLoaded(f"refers to {name}, which could not be restored") from None
        except Exception as exc:  # a broken or hostile pickle: its own failure
            self.failed[name] = clean(f"{type(exc).__name__}: {exc}", WHY_CHARS)
            raise _NotLoaded(f"refers to {name}, which could not be restored") from None
        finally:
            self._loading.discard(name)
        self.values[name] = value
        return value

    def _read(self, entry: _Entry) -> Any:
        if entry.slot is None:
            return self._load_file(entry)
        group = self._groups.get(entry.file)
        if group is None:
            try:
                loaded = self._load_file(entry)
            except Exception as exc:  # each value of the file is told why
                self._groups[entry.file] = clean(f"{type(exc).__name__}: {exc}", WHY_CHARS)
                raise
            group = loaded if isinstance(loaded, tuple) else "not the values the manifest names"
            self._groups[entry.file] = group
        if isinstance(group, str):
            raise _NotLoaded(group)
        if entry.slot >= len(group):
            raise _NotLoaded(f"{entry.file} holds {len(group)} values, not {entry.slot + 1}")
        return group[entry.slot]

    def _load_file(self, entry: _Entry) -> Any:
        try:
            handle, size = statefiles.open_file(self._data, entry.file)
        except StateDirError as exc:
            raise _NotLoaded(str(exc)) from None
        with handle:
            if size != entry.bytes:
                raise _NotLoaded(f"{entry.file} holds {size} bytes, the manifest says "
                                 f"{entry.bytes}: truncated or replaced")  # fmt: skip
            return self._unpickler(handle).load()

    def _unpickler(self, handle: BinaryIO) -> pickle.Unpickler:
        loader = self

        class Unpickler(pickle.Unpickler):
            def persistent_load(self, pid: Any) -> Any:
                if pid == ("ns",):
                    return loader._namespace
                if isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "var":
                    return loader.value(str(pid[1]))
                raise pickle.UnpicklingError("an unknown persistent reference")

        return Unpickler(handle)


def load(shell: StateShell, workdir: str) -> dict[str, Any]:
    """Restore what :func:`save` committed into ``shell``'s namespace; the load report.
    Never raises for what ``.session`` holds (user code may have written anything
    there); raises ``KeyboardInterrupt`` when interrupted."""
    report: dict[str, Any] = {"found": False, "restored": [], "modules": [], "failed": []}
    try:
        with statefiles.open_state_dir(workdir, create=False) as state:
            manifest = _manifest(statefiles.read_manifest_bytes(state))
            data = statefiles.open_data_dir(state, manifest["data"])
            try:
                _restore(shell, data, manifest, report)
            finally:
                os.close(data)
    except FileNotFoundError:
        pass  # nothing saved
    except (StateDirError, OSError, ValueError) as exc:
        report["found"] = False
        why = clean(f"no complete saved state: {exc}", WHY_CHARS)
        report["failed"] = [
            {"name": f"{STATE_DIR}/{statefiles.MANIFEST}", "type": "manifest", "why": why}
        ]
    for key in ("restored", "modules", "failed"):
        report[key] = report[key][:MAX_REPORTED]
    return report


def _manifest(raw: bytes) -> dict[str, Any]:
    """The manifest, checked; ``ValueError`` says what is wrong with it."""
    manifest = json.loads(raw)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError("the manifest is not one this agent writes")
    if not isinstance(manifest.get("data"), str):
        raise ValueError("the manifest names no data directory")
    for key in ("modules", "values"):
        if not isinstance(manifest.get(key), list):
            raise ValueError(f"the manifest's {key!r} is not a list")
    return manifest


def _restore(
    shell: StateShell, data: int, manifest: dict[str, Any], report: dict[str, Any]
) -> None:
    report["found"] = True
    namespace = shell.user_namespace()
    failed: list[dict[str, str]] = report["failed"]
    for item in manifest["modules"]:
        name, module = _field(item, "name"), _field(item, "module")
        if name is None or module is None or not name.isidentifier():
            failed.append({"name": "?", "type": "module", "why": "a malformed manifest entry"})
            continue
        try:
            namespace[name] = importlib.import_module(module)
            report["modules"].append(name)
        except Exception as exc:  # any error an import raises: the module's own
            failed.append({"name": name, "type": clean(module, NAME_CHARS),
                           "why": clean(f"import failed: {exc!r}", WHY_CHARS)})  # fmt: skip
    entries = _entries(manifest["values"], failed)
    loader = _Loader(data, entries, namespace)
    for name, entry in entries.items():
        try:
            namespace[name] = loader.value(name)
            report["restored"].append(name)
        except _NotLoaded:
            why = loader.failed.get(name, "could not be restored")
            failed.append({"name": name, "type": entry.type, "why": why})
    _restore_history(shell, data, manifest, failed)


def _field(item: Any, key: str) -> str | None:
    value = item.get(key) if isinstance(item, dict) else None
    return value if isinstance(value, str) and 0 < len(value) <= NAME_CHARS else None


def _entries(values: list[Any], failed: list[dict[str, str]]) -> dict[str, _Entry]:
    entries: dict[str, _Entry] = {}
    for item in values:
        name, kind, file = _field(item, "name"), _field(item, "type"), _field(item, "file")
        size: Any = item.get("bytes") if isinstance(item, dict) else None
        slot: Any = item.get("slot") if isinstance(item, dict) else None
        if (name is None or not name.isidentifier() or kind is None or file is None
                or re.fullmatch(r"[vg]\d{1,9}\.pkl", file) is None
                or not _count(size) or not (slot is None or _count(slot))):  # fmt: skip
            shown = clean(name, NAME_CHARS) if name else "?"
            failed.append({"name": shown, "type": "?", "why": "a malformed manifest entry"})
            continue
        entries[name] = _Entry(name, clean(kind, NAME_CHARS), file, size, slot)
    return entries


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 50


def _restore_history(
    shell: StateShell, data: int, manifest: dict[str, Any], failed: list[dict[str, str]]
) -> None:
    count = manifest.get("execution_count")
    try:
        handle, _ = statefiles.open_file(data, "history.json", 2 * HISTORY_CHARS + (1 << 20))
        with handle:
            inputs = json.loads(handle.read())
        if not isinstance(inputs, list) or not all(isinstance(t, str) for t in inputs):
            raise ValueError("not a list of strings")
    except (StateDirError, ValueError, OSError) as exc:
        why = clean(f"the input history was not restored: {exc}", WHY_CHARS)
        failed.append({"name": "In", "type": "list", "why": why})
        inputs = None
    if inputs is not None:
        shell.set_history(inputs)
    if isinstance(count, int) and not isinstance(count, bool) and 0 <= count < 1 << 31:
        shell.set_last_count(count)
