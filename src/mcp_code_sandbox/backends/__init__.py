"""Backends: how sandboxes are started, connected to, stopped and listed.

``create_backend`` picks one from the settings (``auto``: Docker when an engine answers
and the image exists — once that backend lands —, else bubblewrap, else a clear error).
"""

from __future__ import annotations

from mcp_code_sandbox.backends.base import Backend
from mcp_code_sandbox.errors import BackendUnavailable
from mcp_code_sandbox.settings import Settings

__all__ = ["create_backend"]


def create_backend(settings: Settings) -> Backend:
    if settings.backend == "docker":
        raise BackendUnavailable(
            "the docker backend is not available in this version; use SANDBOX_BACKEND=bwrap"
        )
    from mcp_code_sandbox.backends.bwrap import BwrapBackend

    return BwrapBackend(settings)
