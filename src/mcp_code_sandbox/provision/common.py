"""Helpers the build-time modules share: progress lines, streamed commands, context copies.

:mod:`.venv` (``setup``), :mod:`.image` and :mod:`.server_image` (``image build``) use them.
:mod:`.node` does not: it is also copied into the sandbox image and run there on its own,
so it imports nothing of this package.

Semantics: progress lines go to a ``progress`` callable (the CLI writes them to stderr);
nothing here writes to stdout, which is the MCP protocol in stdio mode.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from mcp_code_sandbox.errors import BackendUnavailable

__all__ = ["Progress", "copy_ca_bundle", "copy_tree", "run_streaming", "stderr_progress"]

#: Receives one human-readable line at a time while something is built.
Progress = Callable[[str], None]


def stderr_progress(line: str) -> None:
    """The default :data:`Progress` of ``setup`` and ``image build``: one line to stderr."""
    print(line, file=sys.stderr, flush=True)


def run_streaming(argv: list[str], progress: Progress, what: str) -> None:
    """Run ``argv`` streaming its output lines to ``progress``; raise naming ``what``.

    Called by the venv build (``venv``, ``pip install``) and the image build
    (``debootstrap``), whose output the operator watches while it runs.
    """
    tail: list[str] = []
    try:
        with subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                progress("  " + line.rstrip())
                tail = [*tail[-19:], line.rstrip()]
            code = proc.wait()
    except OSError as exc:
        raise BackendUnavailable(f"{what} failed: {exc}") from None
    if code != 0:
        raise BackendUnavailable(f"{what} failed (exit {code}):\n" + "\n".join(tail))


def copy_tree(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` without byte code, with fixed modes (0755, 0644).

    Called while a build context is assembled (the agent package, the server's sources).
    """
    # Fixed modes: the layer's cache key must not depend on the checkout's umask.
    target.mkdir(mode=0o755)
    for entry in sorted(source.iterdir()):
        if entry.name == "__pycache__" or entry.suffix == ".pyc":
            continue
        if entry.is_dir():
            copy_tree(entry, target / entry.name)
        else:
            (target / entry.name).write_bytes(entry.read_bytes())
            (target / entry.name).chmod(0o644)


def copy_ca_bundle(context: Path, ca_bundle: Path | None) -> None:
    """``context/build-ca/``: empty, or holding ``ca.pem`` (the Dockerfiles test ``-s``)."""
    (context / "build-ca").mkdir()
    if ca_bundle is not None:
        try:
            shutil.copyfile(ca_bundle, context / "build-ca" / "ca.pem")
        except OSError as exc:
            raise BackendUnavailable(f"cannot read the CA bundle {ca_bundle}: {exc}") from None
