"""The sandbox runtime environment that ``mcp-code-sandbox setup`` builds for bwrap.

A venv at ``<runtime_dir>/venv`` holding the Python packages of DESIGN.md §3, mounted
read-only at ``SANDBOX_VENV`` inside every sandbox. Its base interpreter is preferably the
system ``/usr/bin/python3``: ``/usr`` is visible in the sandbox anyway. Any other base
(pyenv, a custom build) has its prefix bound read-only at its own path, which
:attr:`RuntimeStatus.base_prefix` reports.

The venv is made with ``python -m venv --without-pip`` (Debian's ``python3-venv`` only
ships ``ensurepip``, which ``--without-pip`` never calls) and filled by the *server's* pip
(``pip --python <venv python> install``), pip itself among the packages (:data:`TOOLS`:
``pip install`` at run time, into the session's packages). It is built
next to its final place and renamed in at the end: a failed build never leaves a
half-filled venv in use. A manifest records what was built; when it matches, ``setup``
returns at once.

Next to the venv, ``<runtime_dir>/node`` holds Node.js, bun and the npm packages
(:mod:`mcp_code_sandbox.provision.node`), fetched with the host's ``npm`` and mounted read-only
at ``SANDBOX_NODE``. It is optional: without npm, ``setup`` builds the Python part, says
how to get JavaScript/TypeScript and succeeds. It is checked and built on its own, so a
runtime from before it existed gains it on the next ``setup`` without a new venv; the
manifest's ``node`` entry (ignored by older versions) repeats its ``versions.json``.

Semantics: progress lines go to the ``progress`` callable (the CLI writes them to stderr);
nothing here writes to stdout, which is the MCP protocol in stdio mode.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from mcp_code_sandbox.backends.bwrap.runtime import (
    MANIFEST_FORMAT,
    BaseInterpreter,
    NodeRuntime,
    RuntimeStatus,
    manifest_mismatch,
    manifest_path,
    node_dir,
    read_manifest,
    read_node_runtime,
    runtime_packages,
    runtime_status,
    venv_dir,
)
from mcp_code_sandbox.errors import BackendUnavailable
from mcp_code_sandbox.layout import SANDBOX_PYTHON
from mcp_code_sandbox.provision.common import Progress, run_streaming, stderr_progress
from mcp_code_sandbox.provision.node import (
    NODE_FORMAT,
    NPM_PACKAGES,
    NodeBuildError,
    build_node_dir,
    bun_package,
    host_cpuinfo,
)
from mcp_code_sandbox.settings import Settings

__all__ = [
    "SESSION_SITE_PTH",
    "TOOLS",
    "build_runtime",
    "choose_base_interpreter",
    "ensure_node",
    "node_mismatch",
]

#: Not part of DESIGN.md §3's list, but in the venv: ``pip install`` inside a sandbox
#: (into the session's packages, ``agent/packages.py``).
TOOLS: tuple[str, ...] = ("pip",)
#: A ``.pth`` file in the venv's site-packages (and the image's): every Python in a
#: sandbox adds the session's site directory, which the agent names in
#: ``MCS_PYTHON_SITE``, after the venv's own. Unset (outside a sandbox): nothing happens.
SESSION_SITE_PTH = (
    "mcs_session_packages.pth",
    "import os, site; p = os.environ.get('MCS_PYTHON_SITE'); p and site.addsitedir(p)\n",
)
SYSTEM_PYTHON = Path("/usr/bin/python3")
MIN_PYTHON = (3, 11)


_PROBE = (
    "import sys, json; print(json.dumps([sys.base_prefix, sys.version_info[:3],"
    " __import__('importlib.util').util.find_spec('venv') is not None]))"
)


def _probe(executable: Path) -> BaseInterpreter | None:
    """Ask ``executable`` for its prefix and version; ``None`` when it is unusable."""
    try:
        out = subprocess.run(
            [str(executable), "-I", "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        prefix, version, has_venv = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    if tuple(version) < MIN_PYTHON or not has_venv:
        return None
    return BaseInterpreter(executable, Path(prefix), ".".join(map(str, version)))


def _current_base_executable() -> Path:
    # The venv the server runs in is not a base: take its base prefix's python3.X.
    name = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    return Path(sys.base_prefix) / "bin" / name


def choose_base_interpreter(
    candidates: Sequence[Path] | None = None,
    probe: Callable[[Path], BaseInterpreter | None] = _probe,
) -> BaseInterpreter:
    """The first usable candidate: the system python3 (under ``/usr``), else the server's base."""
    tried = (
        list(candidates) if candidates is not None else [SYSTEM_PYTHON, _current_base_executable()]
    )
    for executable in tried:
        if executable.exists() and (base := probe(executable)) is not None:
            return base
    raise BackendUnavailable(
        "no usable Python >= {}.{} for the sandbox runtime (tried {}); install python3 "
        "(apt-get install python3)".format(*MIN_PYTHON, ", ".join(map(str, tried)))
    )


def _make_venv(base: BaseInterpreter, target: Path, progress: Progress) -> None:
    progress(f"creating venv with {base.executable} (Python {base.version})")
    try:
        run_streaming(
            [str(base.executable), "-m", "venv", "--without-pip", str(target)],
            progress,
            "python3 -m venv",
        )
    except BackendUnavailable as exc:
        raise BackendUnavailable(
            f"{exc.message}\nOn Debian/Ubuntu the venv module may need the python3-venv "
            "package: apt-get install python3-venv"
        ) from None


def _pip_install(target: Path, packages: tuple[str, ...], progress: Progress) -> None:
    progress(f"installing {', '.join(packages)} with the server's pip")
    argv = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(target / "bin" / "python"),
        "install",
        "--no-input",
        "--progress-bar",
        "off",
        "--no-warn-script-location",
        *packages,
        *TOOLS,
    ]
    run_streaming(argv, progress, "pip install")


def _write_site_pth(target: Path) -> None:
    name, text = SESSION_SITE_PTH
    for site_packages in (target / "lib").glob("python3*/site-packages"):
        (site_packages / name).write_text(text, encoding="utf-8")


def _fix_shebangs(target: Path, final: Path) -> None:
    # Console scripts (ipython, f2py...) name the venv's host path; inside the sandbox
    # the venv lives at SANDBOX_VENV, so point them there.
    prefixes = (f"#!{target}/bin/python".encode(), f"#!{final}/bin/python".encode())
    for script in (target / "bin").iterdir():
        if script.is_symlink() or not script.is_file():
            continue
        data = script.read_bytes()
        first, sep, rest = data.partition(b"\n")
        if any(first.startswith(p) for p in prefixes):
            script.write_bytes(f"#!{SANDBOX_PYTHON}".encode() + sep + rest)


def _installed_versions(target: Path, packages: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    code = (
        "import json, sys, importlib.metadata as m; print(json.dumps(['%d.%d.%d' % "
        f"sys.version_info[:3], {{p: m.version(p) for p in {list(packages)!r}}}]))"
    )
    try:
        out = subprocess.run(
            [str(target / "bin" / "python"), "-I", "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        version, installed = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise BackendUnavailable(f"the new runtime environment does not work: {exc}") from None
    return str(version), {str(k): str(v) for k, v in installed.items()}


def _build_venv(settings: Settings, base: BaseInterpreter, progress: Progress) -> None:
    final = venv_dir(settings)
    building = settings.runtime_dir / "venv.building"
    manifest_file = manifest_path(settings)
    packages = runtime_packages(settings)
    try:
        settings.runtime_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(building, ignore_errors=True)
        _make_venv(base, building, progress)
        _pip_install(building, packages, progress)
        _write_site_pth(building)
        _fix_shebangs(building, final)
        version, installed = _installed_versions(building, packages)
        progress(f"installed into {final}")
        manifest_file.unlink(missing_ok=True)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(building, final)
        manifest = {
            "format": MANIFEST_FORMAT,
            "packages": list(packages),
            "base_executable": str(base.executable),
            "base_prefix": str(base.prefix),
            "base_version": base.version,
            "venv_python_version": version,
            "installed": installed,
        }
        manifest_file.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise BackendUnavailable(f"cannot build the runtime environment: {exc}") from None


def _record_node(settings: Settings, node: NodeRuntime) -> None:
    """Repeat ``node``'s versions in the manifest (a venv build rewrites it without them)."""
    path = manifest_path(settings)
    manifest = read_manifest(path)
    if manifest is None or manifest.get("node") == node.as_json():
        return
    manifest["node"] = node.as_json()
    path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def node_mismatch(runtime: NodeRuntime | None, cpuinfo: str) -> str | None:
    """Why ``runtime`` must be rebuilt for this machine; ``None`` when it is current."""
    if runtime is None:
        return "not built yet"
    if runtime.format != NODE_FORMAT:
        return "built by another version of mcp-code-sandbox"
    if sorted(runtime.packages) != sorted(NPM_PACKAGES):
        return "the npm package list changed"
    if runtime.bun_package != bun_package(cpuinfo):
        return f"this CPU needs {bun_package(cpuinfo)}"
    return None


def ensure_node(
    settings: Settings,
    *,
    npm: str | None,
    force: bool = False,
    progress: Progress = stderr_progress,
    cpuinfo: str | None = None,
) -> NodeRuntime | None:
    """Build ``<runtime_dir>/node`` with ``npm`` unless it is current; ``None`` without it.

    Never raises for npm's failures: Python works without JavaScript, so they are
    reported through ``progress`` and the sandbox simply offers no node or bun.
    """
    cpuinfo = host_cpuinfo() if cpuinfo is None else cpuinfo
    current = read_node_runtime(node_dir(settings))
    reason = "rebuild asked for" if force else node_mismatch(current, cpuinfo)
    if current is not None and reason is None:
        progress(f"Node.js {current.node} and bun {current.bun} are up to date")
    elif npm is None:
        progress(
            "JavaScript and TypeScript are not available: npm is not installed. Install "
            "it (apt-get install npm) and run `mcp-code-sandbox setup` again."
        )
        return current
    else:
        progress(f"Node.js and bun at {node_dir(settings)}: {reason}")
        try:
            build_node_dir(npm, node_dir(settings), progress, cpuinfo=cpuinfo)
        except NodeBuildError as exc:
            progress(f"warning: JavaScript and TypeScript are not available: {exc}")
            return read_node_runtime(node_dir(settings))
        current = read_node_runtime(node_dir(settings))
        if current is None:
            progress(f"warning: {node_dir(settings)} is incomplete after its build")
            return None
        progress(f"installed Node.js {current.node} and bun {current.bun}")
    try:
        _record_node(settings, current)
    except OSError as exc:
        raise BackendUnavailable(f"cannot update the runtime manifest: {exc}") from None
    return current


def build_runtime(
    settings: Settings,
    *,
    force: bool = False,
    progress: Progress = stderr_progress,
    node: bool = True,
) -> RuntimeStatus:
    """Build (or keep) the runtime environment; idempotent and fast when it is current.

    ``node`` False: the Python part only (the first ``serve`` builds it first, so Python
    runs sooner, and Node.js after it). One build at a time per runtime dir (a lock file
    in it): two servers started at once on a new machine, or ``setup`` beside a first
    ``serve``, take turns; the second then finds the first's result current."""
    with _build_lock(settings.runtime_dir, progress):
        base = choose_base_interpreter()
        status = runtime_status(settings)
        manifest = read_manifest(manifest_path(settings))
        packages = runtime_packages(settings)
        if not force and status.ok and manifest_mismatch(manifest, base, packages) is None:
            progress(f"runtime environment is up to date: {status.detail}")
        else:
            _build_venv(settings, base, progress)
        if node:
            ensure_node(settings, npm=shutil.which("npm"), force=force, progress=progress)
    return runtime_status(settings)


@contextlib.contextmanager
def _build_lock(runtime_dir: Path, progress: Progress) -> Iterator[None]:
    """Hold ``<runtime_dir>/.build.lock`` (``flock``: released when this process ends,
    however it ends), saying so when another build holds it."""
    try:
        runtime_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(runtime_dir / ".build.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise BackendUnavailable(f"cannot build the runtime environment: {exc}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another build of the runtime environment in {runtime_dir}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
