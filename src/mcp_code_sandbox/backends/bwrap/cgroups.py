"""Per-sandbox cgroups: memory, CPU and pids limits where the server may write them.

Layout. cgroup v1: one directory per controller hierarchy,
``<hierarchy>/<own cgroup>/mcp-code-sandbox/<name>`` (v1 has no rule against processes in
inner nodes). cgroup v2: ``<own cgroup>/mcp-code-sandbox/<name>``; v2 forbids processes in
a cgroup whose children have controllers enabled, so when the server's own cgroup must
enable them the server first moves itself into the leaf ``<own cgroup>/server``. That only
works in a delegated cgroup holding nothing but the server (a systemd unit with
``Delegate=yes``, a container); anything else is reported, never forced.

``<name>`` is ``<server pid>-<server start time>-<key>``: a leftover is a directory whose
server is no longer alive, found without any record on disk.

Semantics: :class:`CgroupSupport` ``enforceable`` empty means "only rlimits apply", and
``reasons`` says why per controller. Nothing here raises for a missing or read-only
cgroup tree; :meth:`CgroupSupport.create` raises ``OSError`` only when a directory it
was told it could make cannot be made, which the backend maps.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mcp_code_sandbox.backends.base import Limits, Usage

__all__ = ["CONTROLLERS", "CgroupHandle", "CgroupSupport", "detect", "process_start_time"]

CONTROLLERS = ("memory", "cpu", "pids")
BASE_NAME = "mcp-code-sandbox"
_CPU_PERIOD_US = 100_000
_V1_LIMIT_FILE = {
    "memory": "memory.limit_in_bytes",
    "cpu": "cpu.cfs_quota_us",
    "pids": "pids.max",
}


def process_start_time(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot; with the pid, a process's identity."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22, counted after the ")" that ends the (spaceful) command name.
    return stat.rpartition(")")[2].split()[19]


def _alive(name: str) -> bool:
    pid, _, rest = name.partition("-")
    started, _, _ = rest.partition("-")
    return pid.isdigit() and process_start_time(int(pid)) == started


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _pids(procs_file: Path) -> list[int]:
    try:
        return [int(line) for line in procs_file.read_text().split()]
    except (OSError, ValueError):
        return []


def _process_cpu_s(pids: list[int]) -> float | None:
    """User + system CPU seconds of ``pids`` (those still there); ``None`` for none."""
    ticks = 0
    found = False
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
            found = True
    return ticks / os.sysconf("SC_CLK_TCK") if found else None


@dataclass
class CgroupHandle:
    """The cgroup directories of one sandbox (one per v1 hierarchy, one in v2)."""

    dirs: list[Path]

    @property
    def procs_files(self) -> list[Path]:
        """Write a pid into each of these to put that process (and its future children) in."""
        return [d / "cgroup.procs" for d in self.dirs]

    def pids(self) -> list[int]:
        return sorted({pid for f in self.procs_files for pid in _pids(f)})

    def usage(self) -> Usage:
        """Memory (v2 ``memory.current``, v1 ``memory.usage_in_bytes``) and CPU time (v2
        ``cpu.stat``; else what its live processes used, from ``/proc``), read now for
        the operator's page; unknown parts ``None``. Never raises."""
        memory = cpu = None
        for d in self.dirs:
            for name in ("memory.current", "memory.usage_in_bytes"):
                with contextlib.suppress(OSError, ValueError):
                    memory = int((d / name).read_text())
            with contextlib.suppress(OSError, ValueError):
                for line in (d / "cpu.stat").read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "usage_usec":
                        cpu = int(value) / 1e6
        if cpu is None:
            cpu = _process_cpu_s(self.pids())
        return Usage(memory_bytes=memory, cpu_seconds=cpu)

    def remove(self, attempts: int = 50) -> bool:
        """Kill what is left inside, then remove the directories; bounded. True when gone."""
        for _ in range(attempts):
            for d in self.dirs:
                if (d / "cgroup.kill").exists():
                    with contextlib.suppress(OSError):
                        _write(d / "cgroup.kill", "1")
            for pid in self.pids():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            for d in list(self.dirs):
                try:
                    d.rmdir()
                except FileNotFoundError:
                    self.dirs.remove(d)
                except OSError:
                    continue
                else:
                    self.dirs.remove(d)
            if not self.dirs:
                return True
            time.sleep(0.05)
        return False


@dataclass(frozen=True)
class CgroupSupport:
    """What this process may enforce with cgroups, and where."""

    version: Literal[1, 2] | None
    #: Controllers whose limits this process can set; empty: only rlimits apply.
    enforceable: frozenset[str]
    #: Why a controller is not enforceable, per controller (and ``"all"``).
    reasons: dict[str, str] = field(default_factory=dict)
    #: Controller → the ``mcp-code-sandbox`` directory sandboxes are made under.
    bases: dict[str, Path] = field(default_factory=dict)

    def name_for(self, key: str) -> str:
        return f"{os.getpid()}-{process_start_time(os.getpid())}-{key}"

    def create(self, key: str, limits: Limits) -> CgroupHandle | None:
        """Make and configure the cgroup(s) of sandbox ``key``; ``None`` when none apply."""
        if not self.enforceable:
            return None
        name = self.name_for(key)
        dirs = sorted({self.bases[c] / name for c in self.enforceable})
        handle = CgroupHandle(dirs=[])
        try:
            for d in dirs:
                d.mkdir()
                handle.dirs.append(d)
            for controller in sorted(self.enforceable):
                self._set_limit(self.bases[controller] / name, controller, limits)
        except OSError:
            handle.remove()
            raise
        return handle

    def _set_limit(self, d: Path, controller: str, limits: Limits) -> None:
        quota = max(1000, int(limits.cpu * _CPU_PERIOD_US))
        if self.version == 2:
            if controller == "memory":
                _write(d / "memory.max", str(limits.memory_bytes))
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", "0")
            elif controller == "cpu":
                _write(d / "cpu.max", f"{quota} {_CPU_PERIOD_US}")
            else:
                _write(d / "pids.max", str(limits.pids))
            return
        if controller == "memory":
            _write(d / "memory.limit_in_bytes", str(limits.memory_bytes))
            # memsw (memory + swap) must not be below the memory limit: set it after.
            if (d / "memory.memsw.limit_in_bytes").exists():
                _write(d / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
            if (d / "memory.swappiness").exists():
                _write(d / "memory.swappiness", "0")
        elif controller == "cpu":
            _write(d / "cpu.cfs_period_us", str(_CPU_PERIOD_US))
            _write(d / "cpu.cfs_quota_us", str(quota))
        else:
            _write(d / "pids.max", str(limits.pids))

    def list_leftovers(self) -> list[CgroupHandle]:
        """Sandbox cgroups whose server process is gone, grouped by name."""
        by_name: dict[str, list[Path]] = {}
        for base in set(self.bases.values()):
            with contextlib.suppress(OSError):
                for d in base.iterdir():
                    if d.is_dir() and not _alive(d.name):
                        by_name.setdefault(d.name, []).append(d)
        return [CgroupHandle(dirs) for _, dirs in sorted(by_name.items())]


def _own_paths(proc_cgroup: str) -> dict[str, str]:
    """``/proc/self/cgroup`` → controller (or ``""`` for v2) → path."""
    out: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _under(hierarchy: Path, own: str) -> Path:
    # In a cgroup namespace (containers) the own path may not exist below the mount.
    candidate = hierarchy / own.lstrip("/")
    return candidate if candidate.is_dir() else hierarchy


def _detect_v1(root: Path, own: dict[str, str]) -> CgroupSupport:
    bases: dict[str, Path] = {}
    reasons: dict[str, str] = {}
    for c in CONTROLLERS:
        hierarchy = root / c
        if not hierarchy.is_dir():
            reasons[c] = f"no cgroup v1 {c} hierarchy at {hierarchy}"
            continue
        base = _under(hierarchy, own.get(c, "/")) / BASE_NAME
        try:
            base.mkdir(exist_ok=True)
        except OSError as exc:
            reasons[c] = f"cannot create {base}: {exc.strerror}"
            continue
        if not os.access(base, os.W_OK | os.X_OK):
            # Made by another (root) server before: a server that is not root finds it
            # but may not create its sandboxes' directories in it.
            reasons[c] = f"cannot create cgroups in {base} (not writable by uid {os.geteuid()})"
            continue
        if not (base / _V1_LIMIT_FILE[c]).exists():
            reasons[c] = f"{base} has no {_V1_LIMIT_FILE[c]}"
            continue
        bases[c] = base
    return CgroupSupport(1, frozenset(bases), reasons, bases)


def _enable(parent: Path, wanted: list[str]) -> None:
    _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))


def _detect_v2(root: Path, own_path: str) -> CgroupSupport:
    own = _under(root, own_path)
    available = (
        set((own / "cgroup.controllers").read_text().split())
        if (own / "cgroup.controllers").exists()
        else set()
    )
    wanted = [c for c in CONTROLLERS if c in available]
    reasons = {
        c: f"controller {c} is not delegated to {own}" for c in CONTROLLERS if c not in available
    }
    if not wanted:
        return CgroupSupport(2, frozenset(), reasons)
    base = own / BASE_NAME
    try:
        enabled = set((own / "cgroup.subtree_control").read_text().split())
        if not set(wanted) <= enabled:
            if _pids(own / "cgroup.procs"):
                # No internal processes: the server moves itself into a leaf first.
                (own / "server").mkdir(exist_ok=True)
                _write(own / "server" / "cgroup.procs", str(os.getpid()))
            _enable(own, wanted)
        base.mkdir(exist_ok=True)
        _enable(base, wanted)
    except OSError as exc:
        why = (
            f"cannot delegate {own} to sandboxes ({exc.strerror}); run the server in a "
            "cgroup of its own, e.g. a systemd unit with Delegate=yes"
        )
        return CgroupSupport(2, frozenset(), {c: why for c in CONTROLLERS})
    return CgroupSupport(2, frozenset(wanted), reasons, dict.fromkeys(wanted, base))


def detect(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: str | None = None) -> CgroupSupport:
    """Find what this process can enforce; prepares the base directories as a side effect."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            proc_cgroup = ""
    own = _own_paths(proc_cgroup)
    try:
        if (root / "cgroup.controllers").exists():
            return _detect_v2(root, own.get("", "/"))
        if (root / "memory").is_dir() or (root / "pids").is_dir():
            return _detect_v1(root, own)
    except OSError as exc:
        return CgroupSupport(None, frozenset(), {"all": f"cannot read {root}: {exc}"})
    return CgroupSupport(None, frozenset(), {"all": f"no cgroup filesystem at {root}"})
