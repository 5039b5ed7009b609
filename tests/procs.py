"""Which processes a test started: the descendants of a pid, read from /proc; and, for
the docker backend, whose sandboxes are not our descendants, the containers of one server
instance, found by the label the backend puts on each."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path


def _stat(pid: str) -> tuple[int, str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces: split after the last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0]


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = _stat(pid)
        if stat is not None:
            children.setdefault(stat[0], []).append(int(pid))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def running(pids: set[int]) -> set[int]:
    """Those of ``pids`` that still exist and are not zombies."""
    alive = set()
    for pid in pids:
        stat = _stat(str(pid))
        if stat is not None and stat[1] != "Z":
            alive.add(pid)
    return alive


def wait_gone(pids: set[int], timeout: float = 15) -> set[int]:
    deadline = time.monotonic() + timeout
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running(pids)


def containers(instance: str) -> list[str]:
    """Ids of the containers, running or not, of the docker backend ``instance``."""
    import docker

    from mcp_code_sandbox.backends.docker.spec import LABEL_INSTANCE
    from mcp_code_sandbox.settings import docker_environ

    client = docker.from_env(environment=docker_environ(), timeout=30)
    try:
        found = client.containers.list(all=True, filters={"label": f"{LABEL_INSTANCE}={instance}"})
        return [str(c.id) for c in found]
    finally:
        client.close()


def engine_objects() -> set[str]:
    """The volumes and networks the engine has (the backend should never make either)."""
    import docker

    from mcp_code_sandbox.settings import docker_environ

    client = docker.from_env(environment=docker_environ(), timeout=30)
    try:
        volumes = {f"volume {v.name}" for v in client.volumes.list()}
        return volumes | {f"network {n.name}" for n in client.networks.list()}
    finally:
        client.close()


def command(pid: int) -> str | None:
    """The command name (``comm``) of ``pid``, None when it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def parent(pid: int) -> int | None:
    stat = _stat(str(pid))
    return None if stat is None else stat[0]


def _mentions(path: Path, needle: bytes) -> bool:
    try:
        return needle in path.read_bytes()
    except OSError:
        return False


def of_state_dir(state_dir: Path) -> list[str]:
    """Everything still alive or held that belongs to ``state_dir``, in words: processes
    whose command line or environment names it (servers, janitors, bwrap sandboxes),
    mounts under it, loop devices backed by a file in it, and containers with a mount
    from it. Empty: nothing is left."""
    needle = str(state_dir).encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid() or not running({int(pid)}):
            continue
        proc = Path("/proc", pid)
        if _mentions(proc / "cmdline", needle) or _mentions(proc / "environ", needle):
            found.append(f"process {pid} ({command(int(pid))})")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if point.startswith(str(state_dir)):
            found.append(f"mount {point}")
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        if _mentions(backing, needle):
            found.append(f"loop device {backing.parts[3]}")
    return found + [f"container {c}" for c in _containers_of(state_dir)]


def _containers_of(state_dir: Path, *, remove: bool = False) -> list[str]:
    """The containers with a mount from ``state_dir`` (``remove``: removed, by force)."""
    try:
        import docker
    except ImportError:
        return []
    from mcp_code_sandbox.settings import docker_environ

    try:
        client = docker.from_env(environment=docker_environ(), timeout=30)
        found = client.containers.list(all=True, sparse=True)
    except docker.errors.DockerException:
        return []  # no engine: no containers
    try:
        ids = []
        for c in found:
            mounts = c.attrs.get("Mounts") or []
            if any(str(m.get("Source", "")).startswith(str(state_dir)) for m in mounts):
                ids.append(f"{str(c.id)[:12]} ({c.attrs.get('State')})")
                if remove:
                    with contextlib.suppress(docker.errors.DockerException):
                        client.api.remove_container(c.id, force=True)
        return ids
    finally:
        client.close()


def remove_containers_of(state_dir: Path) -> None:
    """Remove the containers with a mount from ``state_dir`` (replicas leave their
    sessions' running at a stop, for the others): a test's or a bench's own, never
    another server's."""
    _containers_of(state_dir, remove=True)


def wait_nothing_left(state_dir: Path, timeout: float = 10) -> list[str]:
    """:func:`of_state_dir`, once it is empty or ``timeout`` has passed."""
    deadline = time.monotonic() + timeout
    while (left := of_state_dir(state_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
