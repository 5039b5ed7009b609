"""``doctor``'s view of who holds what on the state directory (``sessions.holder``): where
the state directory is and why, which service serves it, and what no live server holds:
sessions kept for the next service, and the garbage of servers that died (records, mounted
workspaces, loop devices, containers). Output-free: one :class:`.checks.Check` a fact."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mcp_code_sandbox.backends.base import Leftover
from mcp_code_sandbox.doctor.checks import Check
from mcp_code_sandbox.sessions import records
from mcp_code_sandbox.sessions.holder import replicas_serve, service_pid
from mcp_code_sandbox.sessions.recovery import alive
from mcp_code_sandbox.settings import Settings

__all__ = ["leftovers_check", "state_dir_check"]

#: The defaults of ``SANDBOX_STATE_DIR``, as the README gives them.
_DEFAULTS = (
    "the default is /var/lib/mcp-code-sandbox for root and "
    "$XDG_STATE_HOME/mcp-code-sandbox (~/.local/state/mcp-code-sandbox) for other users"
)


def state_dir_check(settings: Settings) -> Check:
    """Where the state directory is, and the service that serves it now, if any."""
    pid = service_pid(settings.run_dir)
    serving = (
        f"served by the service with {f'pid {pid}' if pid else 'a pid of another namespace'}"
        ": a stdio server or `exec` started here keeps "
        "sessions of its own and never touches the service's"
        if pid is not None
        else "served by replicas (SANDBOX_REPLICA): a stdio server or `exec` started here "
        "keeps sessions of its own and never touches theirs"
        if replicas_serve(settings.run_dir)
        else "no service runs on it now"
    )
    return Check("state directory", True, f"{settings.state_dir} ({_DEFAULTS}); {serving}")


def leftovers_check(settings: Settings, containers: Sequence[Leftover] = ()) -> Check:
    """What no live server holds: ``containers`` are the backend's leftovers (docker:
    containers of servers that are gone; empty when the engine was not asked)."""
    saved = records.load_records(settings.sessions_dir, remove_bad=False)  # only reads
    held = {r.slot for r in saved if alive(settings.run_dir / f"{r.instance}.pid")}
    kept = [r for r in saved if r.slot not in held and r.handover and not r.pool]
    kept_slots = {r.slot for r in kept}
    garbage = [r for r in saved if r.slot not in held and r.slot not in kept_slots]
    containers = [
        c for c in containers if c.workspace is None or c.workspace.name not in kept_slots
    ]
    mounts = [m for m in _mounts_under(settings.workspaces_dir) if m.name not in held]
    loops = [
        device
        for device, image in _loop_devices_of(settings.volumes_dir)
        if image.name.split(".")[0] not in held
    ]
    found = [
        *([f"{len(garbage)} records of servers that died"] if garbage else []),
        *([f"{len(mounts)} mounted workspaces"] if mounts else []),
        *([f"{len(loops)} loop devices ({', '.join(loops)})"] if loops else []),
        *([f"{len(containers)} containers"] if containers else []),
    ]
    waiting = (
        f"{len(kept)} sessions of a service that stopped wait for the next service here; "
        if kept
        else ""
    )
    if not found:
        return Check("leftovers", True, f"{waiting}nothing held by a server that is gone")
    return Check(
        "leftovers",
        False,
        f"{waiting}left by servers that are gone: {'; '.join(found)}",
        fix="start any server on this state directory (`mcp-code-sandbox exec 1` will do): "
        "its start removes them, and never touches what a running server holds",
    )


def _mounts_under(directory: Path) -> list[Path]:
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    points = [Path(line.split()[4]) for line in lines if len(line.split()) > 4]
    return [p for p in points if p.parent == directory]


def _loop_devices_of(directory: Path) -> list[tuple[str, Path]]:
    """``(loopN, backing image)`` for each loop device backed by a file in ``directory``."""
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            image = Path(backing.read_text().strip())
        except OSError:
            continue
        if image.parent == directory:
            found.append((backing.parts[3], image))
    return sorted(found)
