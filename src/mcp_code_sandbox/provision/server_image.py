"""The server's own image: ``mcp-code-sandbox image build --server``.

``images/server.Dockerfile`` installs this project into a venv and serves MCP over HTTP
on the docker backend; ``deploy/compose.yaml`` runs it beside a Docker engine, whose
socket it mounts. :func:`.image.build_image` builds it exactly as it builds the
sandbox image (the same choice of base, local or bootstrapped with debootstrap, and the
same CA bundle handling), from the context :func:`prepare_server_context` assembles:

``requirements.txt``  the project's dependencies from ``pyproject.toml``, installed in a
                      layer of their own, so a change of code rebuilds only the last one
``project/``          ``pyproject.toml``, ``README.md``, ``src/`` and ``images/`` of this
                      checkout (no byte code), installed with ``pip install --no-deps``
``build-ca/``         empty, or ``ca.pem``: used by pip in the build stage only

It needs a source checkout: an installed wheel carries no ``pyproject.toml`` to build
the package again from.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

from mcp_code_sandbox.errors import BackendUnavailable
from mcp_code_sandbox.provision.common import copy_ca_bundle, copy_tree

__all__ = [
    "SERVER_DOCKERFILE",
    "SERVER_TAG",
    "dependencies",
    "prepare_server_context",
    "source_root",
]

SERVER_TAG = "mcp-code-sandbox-server:latest"
SERVER_DOCKERFILE = "images/server.Dockerfile"


def source_root(start: Path | None = None) -> Path:
    """The checkout this package runs from (an editable install), or an error."""
    root = (start or Path(__file__)).resolve().parents[3]  # src/mcp_code_sandbox/provision/
    if not (root / "pyproject.toml").is_file() or not (root / SERVER_DOCKERFILE).is_file():
        raise BackendUnavailable(
            "building the server image needs the project's source checkout "
            f"(pyproject.toml and {SERVER_DOCKERFILE} beside src/); this installation "
            f"at {root} has none: run it from a clone (scripts/install.sh)"
        )
    return root


def dependencies(pyproject_text: str) -> list[str]:
    """``[project].dependencies`` of a ``pyproject.toml``."""
    project = tomllib.loads(pyproject_text).get("project", {})
    found = project.get("dependencies", [])
    if not isinstance(found, list) or not all(isinstance(d, str) for d in found):
        raise BackendUnavailable("pyproject.toml: [project].dependencies is not a list of strings")
    return found


def extra(pyproject_text: str, name: str) -> list[str]:
    """``[project.optional-dependencies].<name>`` of a ``pyproject.toml`` (none: empty)."""
    extras = tomllib.loads(pyproject_text).get("project", {}).get("optional-dependencies", {})
    found = extras.get(name, []) if isinstance(extras, dict) else []
    if not isinstance(found, list) or not all(isinstance(d, str) for d in found):
        raise BackendUnavailable(f"pyproject.toml: the {name} extra is not a list of strings")
    return found


def prepare_server_context(context: Path, ca_bundle: Path | None, root: Path | None = None) -> None:
    """Fill ``context`` (emptied first) with what ``images/server.Dockerfile`` copies."""
    root = root or source_root()
    shutil.rmtree(context, ignore_errors=True)
    context.mkdir(parents=True)
    shutil.copyfile(root / SERVER_DOCKERFILE, context / "Dockerfile")
    pyproject = (root / "pyproject.toml").read_text(encoding="utf-8")
    # With the ``otel`` extra: a deployment exports traces by setting OTEL_* alone; and
    # ``kubernetes``: the image is what deploy/kubernetes/ runs.
    wanted = dependencies(pyproject) + extra(pyproject, "otel") + extra(pyproject, "kubernetes")
    requirements = "".join(f"{dep}\n" for dep in wanted)
    (context / "requirements.txt").write_text(requirements, encoding="utf-8")
    project = context / "project"
    project.mkdir(mode=0o755)
    for name in ("pyproject.toml", "README.md"):
        (project / name).write_bytes((root / name).read_bytes())
        (project / name).chmod(0o644)
    copy_tree(root / "src", project / "src")
    # The wheel carries the sandbox image's Dockerfile (pyproject's force-include).
    (project / "images").mkdir(mode=0o755)
    (project / "images" / "Dockerfile").write_bytes((root / "images" / "Dockerfile").read_bytes())
    (project / "images" / "Dockerfile").chmod(0o644)
    copy_ca_bundle(context, ca_bundle)
