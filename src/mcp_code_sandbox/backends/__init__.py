"""Backends: how sandboxes are started, connected to, stopped and listed.

``create_backend`` picks one from the settings. ``auto``: Docker when an engine answers at
``DOCKER_HOST`` and has the sandbox image, else bubblewrap (whose own checks say what to
install when it cannot run either).
"""

from __future__ import annotations

from mcp_code_sandbox.backends.base import Backend
from mcp_code_sandbox.settings import Settings, docker_environ

__all__ = ["create_backend"]


def create_backend(settings: Settings) -> Backend:
    if settings.backend in ("docker", "auto"):
        from mcp_code_sandbox.backends.docker.backend import DockerBackend, engine_ready

        environment = docker_environ()
        if settings.backend == "docker" or engine_ready(environment, settings.image):
            return DockerBackend(settings, environment)
    from mcp_code_sandbox.backends.bwrap.backend import BwrapBackend

    return BwrapBackend(settings)
