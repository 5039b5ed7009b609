"""Packages a session installs at run time: where pip, npm and bun put them, and how code
finds them afterwards.

They live in the workspace, under ``.packages/`` (:data:`PACKAGES_DIR`), because the
workspace is what a session keeps: they survive every call and every sandbox restart
(a network switch, a crash), count towards the session's quota, and vanish with it. The
host leaves ``.packages/`` out of artifacts and listings, so they never show up as the
session's files::

    .packages/python   pip's --prefix: lib/pythonX.Y/site-packages, bin/
    .packages/node     npm's and bun's project: package.json, node_modules/

How each tool gets there, set once in the agent's environment (inherited by the kernel,
every program and every shell):

- pip: ``PIP_PREFIX``. Python finds the packages through ``MCS_PYTHON_SITE``, which a
  ``.pth`` file in the runtime venv hands to ``site.addsitedir``: after the venv's own
  site-packages (a package installed here never shadows the standard library), with the
  installed packages' own ``.pth`` files processed. The kernel picks up a site directory
  that appeared since it started (:func:`refresh_import_path`), so ``%pip install x``
  then ``import x`` works in one session without a restart.
- npm and bun: the ``npm``/``bun`` shims of the node runtime (``provision.node.SHIMS``) install
  into ``MCS_NODE_PACKAGES`` unless the current directory is a project of its own. Code
  resolves them through ``NODE_PATH`` (``require``, bun) and the ``node_modules`` links
  that ES modules walk up to: the scratch directory's (:mod:`.languages`) and
  ``/mnt/node_modules``, which the backends point here.
- console scripts (``bin/``, ``node_modules/.bin``) go first on ``PATH``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

__all__ = ["PACKAGES_DIR", "environ", "node_modules", "refresh_import_path"]

#: Relative to the workspace. The host's workspace code names it too (``PACKAGES_DIR``).
PACKAGES_DIR = ".packages"


def node_modules(workdir: str) -> str:
    return os.path.join(workdir, PACKAGES_DIR, "node", "node_modules")


def environ(workdir: str, current: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``current`` (the agent's environment) for ``workdir``."""
    python = os.path.join(workdir, PACKAGES_DIR, "python")
    node = os.path.join(workdir, PACKAGES_DIR, "node")
    # pip's scheme for --prefix inside a venv ("venv"): the same layout for every Python.
    version = "python{}.{}".format(*sys.version_info[:2])
    site = os.path.join(python, "lib", version, "site-packages")
    bins = [os.path.join(python, "bin"), os.path.join(node, "node_modules", ".bin")]
    node_path = [node_modules(workdir)]
    return {
        "PIP_PREFIX": python,
        "MCS_PYTHON_SITE": site,
        "MCS_NODE_PACKAGES": node,
        "PATH": os.pathsep.join([*bins, current.get("PATH", "")]).rstrip(os.pathsep),
        "NODE_PATH": os.pathsep.join([*node_path, current.get("NODE_PATH", "")]).rstrip(os.pathsep),
        # Quiet, and caches on the private /tmp rather than in the workspace.
        "PIP_NO_CACHE_DIR": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_WARN_SCRIPT_LOCATION": "1",
        "npm_config_cache": "/tmp/.npm",  # noqa: S108 - the sandbox's private tmpfs
        "npm_config_update_notifier": "false",
        "npm_config_fund": "false",
        "npm_config_audit": "false",
        "BUN_INSTALL_CACHE_DIR": "/tmp/.bun-cache",  # noqa: S108 - as above
    }


def refresh_import_path() -> None:
    """Forget that a ``sys.path`` directory was missing, once it exists.

    Python caches ``None`` for a path entry that was not a directory when an import
    first looked; the session's site directory is such an entry until the first
    ``pip install``. Cheap: one dict scan, a stat only for the missing entries."""
    cache = sys.path_importer_cache
    for entry in sys.path:
        if entry in cache and cache[entry] is None and os.path.isdir(entry):
            del cache[entry]
