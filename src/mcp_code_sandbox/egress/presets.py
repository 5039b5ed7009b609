"""The allowlist's named presets, ``pypi`` and ``npm``: the hosts ``pip install`` and
``npm install`` download from by default, as pip and npm themselves say.

No registry's name is written in this project: pip's is read from pip (a dependency of
the server: its ``PyPI`` index, and the host its files are served from), npm's from npm's
own default configuration (``npm config get registry`` with empty user and global config
files, so that no mirror the host's npm is configured with stands in for it). Each is
learnt once per process. An operator whose sandboxes use a mirror names the mirror's host
instead. Both are learnt when the server starts (:func:`learn_presets`, in a worker
thread), never on the event loop.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from urllib.parse import urlsplit

__all__ = ["PRESETS", "learn_presets", "preset_hosts"]

_NPM_TIMEOUT_S = 20.0


def _pypi() -> tuple[str, ...]:
    # pip's own description of the public index: where ``pip install`` goes by default.
    from pip._internal.models.index import PyPI

    return (str(PyPI.netloc), str(PyPI.file_storage_domain))


def _npm() -> tuple[str, ...]:
    npm = shutil.which("npm")
    if npm is None:
        raise ValueError(
            "the npm preset asks npm for its default registry, and npm is not on the "
            "server's PATH: name the registry's host instead"
        )
    with tempfile.TemporaryDirectory(prefix="mcs-npm-") as empty:
        user, machine = os.path.join(empty, "user"), os.path.join(empty, "global")
        for path in (user, machine):
            open(path, "w").close()
        # npm's own directory first: its node is usually beside it.
        path = os.pathsep.join([os.path.dirname(npm), "/usr/local/bin", "/usr/bin", "/bin"])
        env = {"PATH": path, "HOME": empty,
               "NPM_CONFIG_USERCONFIG": user, "NPM_CONFIG_GLOBALCONFIG": machine}  # fmt: skip
        try:
            out = subprocess.run(
                [npm, "config", "get", "registry"],
                env=env, cwd=empty, capture_output=True, text=True, timeout=_NPM_TIMEOUT_S,
                check=True,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:
            raise ValueError(f"the npm preset: npm did not say its registry ({exc})") from None
    host = urlsplit(out.stdout.strip()).hostname
    if not host:
        raise ValueError(f"the npm preset: npm's registry {out.stdout.strip()!r} has no host")
    return (host,)


#: Preset name → how its hosts are learnt.
PRESETS: dict[str, Callable[[], tuple[str, ...]]] = {"pypi": _pypi, "npm": _npm}


@functools.cache
def _learnt(name: str) -> tuple[str, ...] | str:
    """The preset's hosts, or why they cannot be learnt: a failure is kept too, so npm
    runs at most once per process whatever the calls name."""
    try:
        return PRESETS[name]()
    except ValueError as exc:
        return str(exc)


def learn_presets() -> None:
    """Learn every preset now (blocking: npm runs once). Called at start in a worker
    thread (``sessions.egress``), so that a call naming a preset only reads the cache."""
    for name in PRESETS:
        _learnt(name)


def preset_hosts(name: str) -> tuple[str, ...]:
    """The hosts of preset ``name`` (a key of :data:`PRESETS`). Raises ValueError when
    they cannot be learnt here (npm missing): the entry is then refused like a typo."""
    learnt = _learnt(name)
    if isinstance(learnt, str):
        raise ValueError(learnt)
    return learnt
