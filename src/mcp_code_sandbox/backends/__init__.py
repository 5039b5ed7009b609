"""Backends: how sandboxes are started, connected to, stopped and listed.

``choose_backend`` picks one from the settings, and says why. ``auto``: Docker when an
engine answers at ``DOCKER_HOST`` and has the sandbox image, else bubblewrap (whose own
checks say what to install when it cannot run either).
"""

from __future__ import annotations

from mcp_code_sandbox.backends.base import Backend
from mcp_code_sandbox.settings import Settings, docker_environ

__all__ = ["choose_backend", "create_backend"]


def create_backend(settings: Settings) -> Backend:
    return choose_backend(settings)[0]


def choose_backend(settings: Settings) -> tuple[Backend, str]:
    """The backend for ``settings``, and why it, in words for the server's start line:
    "docker (runc), because SANDBOX_BACKEND=auto and the Docker engine at ... has ..."."""
    if settings.backend == "kubernetes":
        from mcp_code_sandbox.backends.kubernetes.backend import from_settings

        namespace = settings.kubernetes_namespace
        return from_settings(settings), f"kubernetes (pods in namespace {namespace})"
    if settings.backend in ("docker", "auto"):
        from mcp_code_sandbox.backends.docker.backend import DockerBackend
        from mcp_code_sandbox.backends.docker.derived import sandbox_image
        from mcp_code_sandbox.backends.docker.engine import engine_missing

        environment = docker_environ()
        docker = f"docker ({settings.docker_runtime}), because SANDBOX_BACKEND={settings.backend}"
        if settings.backend == "docker":
            return DockerBackend(settings, environment), docker
        image = sandbox_image(settings)  # with SANDBOX_RUNTIME_PACKAGES, if any
        why_not = engine_missing(environment, image)
        if why_not is None:
            host = environment.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
            found = f"the Docker engine at {host} has the image {image}"
            return DockerBackend(settings, environment), f"{docker} and {found}"
        why = f"SANDBOX_BACKEND=auto and {why_not}"
    else:
        why = "SANDBOX_BACKEND=bwrap"
    from mcp_code_sandbox.backends.bwrap.backend import BwrapBackend

    return BwrapBackend(settings), f"bwrap, because {why}"
