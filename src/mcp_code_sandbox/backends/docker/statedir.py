"""Where the engine finds the server's state dir: the sources of a sandbox's mounts.

A sandbox container mounts three directories of the server's state dir: its workspace,
its run dir (the agent's socket) and, with network, its egress proxy's dir (the proxy's
socket). The engine resolves a mount's source in its own file system, so the server must
name each directory as the *engine* sees it. :class:`StateDir` is that view, decided once
per server by :func:`locate`:

``same path``   the server runs on the engine's host (or in a container the engine does
                not know, which must then see the state dir at the same path): every
                source is the server's own path.
``host dir``    the state dir is a bind mount of a directory of the engine's host
                (``deploy/compose.yaml``): sources are that directory's paths, from
                ``SANDBOX_DOCKER_HOST_STATE_DIR``, or else read from the server's own
                container.
``volume``      the state dir is a named volume (the appliance: ``docker run -i -v
                mcp-code-sandbox:/var/lib/mcp-code-sandbox ...``, on a Mac whose engine
                runs in a VM): every source is a sub-directory of that volume, which
                lives in the engine's VM and never on the client's machine. An engine
                with API 1.45 or later (Docker 26) mounts it as the volume with a
                ``Subpath``; an older one binds the volume's directory in the engine's
                file system (its ``Mountpoint``) instead: the same files either way.

Unix sockets cross any of the three: the server binds one in its view of the directory
and the sandbox connects to the same inode through its mount (gVisor: runsc's
``--host-uds=open``).

How the server finds its own container: Docker binds ``/etc/hostname`` (and hosts,
resolv.conf) from ``<data-root>/containers/<id>/``, which ``/proc/self/mountinfo`` shows;
the engine's inspect of that id then says what is mounted at the state dir. Nothing
here talks to the engine (:mod:`.backend` does, once): all of it is unit-tested without
one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from docker.types import Mount

from mcp_code_sandbox.errors import BackendUnavailable
from mcp_code_sandbox.settings import Settings

__all__ = [
    "SUBPATH_API",
    "StateDir",
    "api_at_least",
    "locate",
    "own_container_id",
]

#: The first engine API whose volume mounts take a ``Subpath`` (Docker Engine 26).
SUBPATH_API = (1, 45)
_CONTAINER_DIR = re.compile(r"/containers/([0-9a-f]{64})/")


@dataclass(frozen=True)
class StateDir:
    """The server's state dir (``server_dir``) as the engine sees it (``engine_dir``: a
    directory of the engine's file system), and, when it is a named volume, that volume
    (``volume``; ``subpath``: mounted by its sub-directories rather than by binds of
    ``engine_dir``'s)."""

    server_dir: Path
    engine_dir: Path
    volume: str | None = None
    subpath: bool = False
    #: Where the state dir is inside ``volume`` ("." : its root).
    in_volume: Path = Path()

    @classmethod
    def of_settings(cls, settings: Settings) -> StateDir:
        """The view the settings give: the same path, or SANDBOX_DOCKER_HOST_STATE_DIR."""
        return cls(settings.state_dir, settings.docker_host_state_dir or settings.state_dir)

    @property
    def mapped(self) -> bool:
        """Does the engine see the state dir elsewhere than the server (in a container)?"""
        return self.volume is not None or self.engine_dir != self.server_dir

    def engine_path(self, path: Path) -> Path:
        """``path`` (in the server's state dir) as the engine sees it. Raises
        ``ValueError`` for a path outside the state dir when mapped: the engine could not
        find it, and binding whatever it names instead would be worse."""
        if not self.mapped:
            return path
        return self.engine_dir / path.relative_to(self.server_dir)

    def server_path(self, source: Path) -> Path | None:
        """A mount source the engine reports, as this server sees it; ``None`` when it is
        outside the engine's view of the state dir (another server's: nothing of ours)."""
        if not self.mapped:
            return source
        try:
            return self.server_dir / source.relative_to(self.engine_dir)
        except ValueError:
            return None

    def mount(self, target: str, path: Path, *, read_only: bool) -> Mount:
        """The mount of ``path`` (a directory of the state dir) at ``target``."""
        if self.volume is not None and self.subpath:
            return Mount(
                target,
                self.volume,
                type="volume",
                read_only=read_only,
                no_copy=True,
                subpath=str(self.in_volume / path.relative_to(self.server_dir)),
            )
        return Mount(target, str(self.engine_path(path)), type="bind", read_only=read_only)

    def describe(self) -> str:
        """One line for ``doctor`` and the start-up log."""
        if self.volume is not None:
            how = (
                "mounted by sub-directory (volume subpath)"
                if self.subpath
                else f"bound from the engine's {self.engine_dir}"
            )
            return f"in the named volume {self.volume!r}, which sandboxes see {how}"
        if self.mapped:
            return f"a bind mount of the engine host's {self.engine_dir}"
        return f"{self.server_dir}, at the same path for the engine"


def own_container_id(mountinfo: str) -> str | None:
    """The id of the Docker container this process runs in, from ``/proc/self/mountinfo``
    (the roots of the files Docker binds from ``<data-root>/containers/<id>/``); ``None``
    outside one."""
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4:
            found = _CONTAINER_DIR.search(fields[3] + "/")
            if found:
                return found.group(1)
    return None


def api_at_least(version: str, wanted: tuple[int, int] = SUBPATH_API) -> bool:
    """Is the engine API ``version`` (``"1.45"``) at least ``wanted``?"""
    major, _, minor = version.partition(".")
    if not major.isdigit() or not minor.isdigit():
        return False
    return (int(major), int(minor)) >= wanted


def locate(settings: Settings, attrs: Mapping[str, Any] | None, api_version: str) -> StateDir:
    """The engine's view of the state dir, from the server's own container's inspect
    ``attrs`` (``None``: the server runs in no container this engine knows) and the
    engine's API version.

    SANDBOX_DOCKER_HOST_STATE_DIR, when set, decides. Raises ``BackendUnavailable`` when
    the server's container has its state dir in its own layer: no sandbox could see it.
    """
    state = settings.state_dir
    if settings.docker_host_state_dir is not None or attrs is None:
        return StateDir.of_settings(settings)
    for mount in attrs.get("Mounts") or []:
        destination = Path(str(mount.get("Destination") or "/nonexistent"))
        source = mount.get("Source")
        if not source or not (state == destination or destination in state.parents):
            continue
        inside = state.relative_to(destination)
        engine_dir = Path(str(source)) / inside
        if mount.get("Type") == "volume" and mount.get("Name"):
            return StateDir(
                state,
                engine_dir,
                volume=str(mount["Name"]),
                subpath=api_at_least(api_version) and mount.get("Driver") in (None, "local"),
                in_volume=inside,
            )
        if mount.get("Type") == "bind":
            return StateDir(state, engine_dir)
    raise BackendUnavailable(
        f"the server runs in a container whose state dir {state} is in the container's "
        "own file system, which sandbox containers cannot mount: give it a volume, e.g. "
        f"docker run -v mcp-code-sandbox:{state} ..."
    )
