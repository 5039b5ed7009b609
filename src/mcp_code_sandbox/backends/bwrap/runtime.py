"""What ``mcp-code-sandbox setup`` left in the runtime directory, as its readers see it.

The bwrap backend mounts the venv (``<runtime_dir>/venv``) and the node directory
(``<runtime_dir>/node``) into every sandbox and reports their versions; ``doctor`` and
``setup`` say whether they are current. This module only reads (a manifest, a
``versions.json``, a few ``stat`` calls: no subprocess, so it is fast); building them is
build-time work in :mod:`mcp_code_sandbox.provision.venv` and
:mod:`mcp_code_sandbox.provision.node`, which import the lists and formats from here so the
writer and the readers agree. It sits in ``backends/`` because the request path needs it
and must never import build-time code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcp_code_sandbox.errors import BackendUnavailable
from mcp_code_sandbox.settings import Settings

__all__ = [
    "MANIFEST_FORMAT",
    "PACKAGES",
    "BaseInterpreter",
    "NodeRuntime",
    "RuntimeStatus",
    "manifest_mismatch",
    "manifest_path",
    "needs_bind",
    "node_dir",
    "read_manifest",
    "read_node_runtime",
    "runtime_packages",
    "runtime_status",
    "venv_dir",
]

#: DESIGN.md §3: the union of what the seed systems shipped. Unpinned on purpose: the
#: newest wheels for the base interpreter; the manifest records what was installed.
PACKAGES: tuple[str, ...] = (
    "pandas",
    "numpy",
    "matplotlib",
    "seaborn",
    "scipy",
    "openpyxl",
    "reportlab",
    "pyarrow",
    "requests",
    "ipython",
    # The kernel pickles a session's variables with it when the session pauses (functions
    # and classes defined in the session too); stdlib pickle when it is missing.
    "cloudpickle",
)


def runtime_packages(settings: Settings) -> tuple[str, ...]:
    """The Python packages this server's runtime env holds: ``SANDBOX_RUNTIME_PACKAGES``,
    or :data:`PACKAGES` when that is empty (the default)."""
    return tuple(settings.runtime_packages) or PACKAGES


#: Bump when the layout of the runtime changes, to make ``setup`` rebuild.
#: 2: pip in the venv and :data:`SESSION_SITE_PTH` (packages installed at run time).
MANIFEST_FORMAT = 2
#: The runtime's state before its first ``setup`` (``RuntimeStatus.reason``).
NOT_BUILT = "not built yet"


@dataclass(frozen=True)
class NodeRuntime:
    """What ``versions.json`` of a finished node directory says."""

    directory: Path
    node: str
    bun: str
    bun_package: str
    packages: dict[str, str] = field(default_factory=dict)
    #: The build's ``provision.node.NODE_FORMAT`` (0: built before formats were recorded).
    format: int = 0
    #: The npm CLI under ``lib/npm`` ("" in a directory built before it was added).
    npm: str = ""

    def as_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "node": self.node,
            "bun": self.bun,
            "bun_package": self.bun_package,
            "npm": self.npm,
            "packages": dict(self.packages),
        }


def read_node_runtime(directory: Path) -> NodeRuntime | None:
    """The node directory's ``versions.json``; ``None`` when it is missing or incomplete."""
    try:
        data = json.loads((directory / "versions.json").read_text(encoding="utf-8"))
        runtime = NodeRuntime(
            directory,
            node=str(data["node"]),
            bun=str(data["bun"]),
            bun_package=str(data.get("bun_package", "")),
            packages={str(k): str(v) for k, v in dict(data["packages"]).items()},
            format=int(data.get("format", 0)),
            npm=str(data.get("npm", "")),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not all((directory / "bin" / name).is_file() for name in ("node", "bun")):
        return None
    return runtime


@dataclass(frozen=True)
class BaseInterpreter:
    """The interpreter the venv is made from."""

    executable: Path
    #: ``sys.base_prefix`` of that interpreter: its stdlib lives below it.
    prefix: Path
    version: str


@dataclass(frozen=True)
class RuntimeStatus:
    venv_dir: Path
    #: The venv directory exists (it may still be broken or stale: see ``ok``).
    exists: bool
    ok: bool
    #: Why not ``ok``, or a one-line summary when it is; names the venv's host path.
    detail: str
    python_version: str | None = None
    #: Prefix of the base interpreter to bind read-only at its own path in the sandbox;
    #: ``None`` when it is under ``/usr`` (visible anyway) or unknown.
    base_prefix: Path | None = None
    #: Installed versions from the manifest; empty when there is no manifest.
    packages: dict[str, str] = field(default_factory=dict)
    #: Node.js, bun and the npm packages; ``None`` when not built (no npm at ``setup``).
    node: NodeRuntime | None = None
    #: Why not ``ok`` (``NOT_BUILT``, or what changed); ``None`` when ``ok``.
    reason: str | None = None

    @property
    def node_dir(self) -> Path | None:
        """The directory to mount at ``SANDBOX_NODE``; ``None`` when there is none."""
        return self.node.directory if self.node is not None else None

    @property
    def venv(self) -> Path:
        """Alias of ``venv_dir`` (the CLI's name for it)."""
        return self.venv_dir

    def unavailable(self) -> BackendUnavailable:
        """What a call gets while the runtime is not ``ok``: what to do, without its host
        path (which ``detail`` has, for the server's log and ``doctor``)."""
        what = "not built yet" if self.reason == NOT_BUILT else "out of date or broken"
        return BackendUnavailable(
            f"the sandbox runtime environment is {what}: run `mcp-code-sandbox setup` "
            "on the server (`mcp-code-sandbox doctor` shows where it is and what is wrong)"
        )


def venv_dir(settings: Settings) -> Path:
    return settings.runtime_dir / "venv"


def node_dir(settings: Settings) -> Path:
    return settings.runtime_dir / "node"


def manifest_path(settings: Settings) -> Path:
    return settings.runtime_dir / "manifest.json"


def read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def needs_bind(prefix: Path) -> bool:
    return not (prefix == Path("/usr") or Path("/usr") in prefix.parents)


def manifest_mismatch(
    manifest: dict[str, Any] | None,
    base: BaseInterpreter | None,
    packages: tuple[str, ...] = PACKAGES,
) -> str | None:
    """Why ``manifest`` does not describe a usable runtime of ``packages`` built from
    ``base``; ``None`` if it does.

    ``base`` ``None`` skips the comparison with a freshly chosen interpreter (status only).
    """
    if manifest is None:
        return NOT_BUILT
    if manifest.get("format") != MANIFEST_FORMAT:
        return "built by another version of mcp-code-sandbox"
    if list(manifest.get("packages", [])) != list(packages):
        return "the package list changed"
    executable = Path(str(manifest.get("base_executable", "")))
    if not executable.exists():
        return f"its base interpreter {executable} is gone"
    if base is not None and (
        str(base.executable) != str(executable) or base.version != manifest.get("base_version")
    ):
        return f"the base interpreter is now {base.executable} {base.version}"
    return None


def runtime_status(settings: Settings) -> RuntimeStatus:
    """What is there, from the manifest and the venv on disk; no subprocess, so it is fast."""
    venv = venv_dir(settings)
    manifest = read_manifest(manifest_path(settings))
    exists = venv.is_dir()
    node = read_node_runtime(node_dir(settings))
    reason = manifest_mismatch(manifest, None, runtime_packages(settings))
    if reason is None and not (venv / "bin" / "python").exists():
        reason = "the venv's python is missing or its link is broken"
    if manifest is None or reason is not None:
        detail = f"runtime environment at {venv}: {reason}; run `mcp-code-sandbox setup`"
        return RuntimeStatus(venv, exists, False, detail, node=node, reason=reason)
    prefix = Path(str(manifest["base_prefix"]))
    packages = {str(k): str(v) for k, v in dict(manifest.get("installed", {})).items()}
    return RuntimeStatus(
        venv_dir=venv,
        exists=exists,
        ok=True,
        detail=f"Python {manifest['venv_python_version']} with {len(packages)} packages at {venv}",
        python_version=str(manifest["venv_python_version"]),
        base_prefix=prefix if needs_bind(prefix) else None,
        packages=packages,
        node=node,
    )
