"""The operator's view: ``/ui``, a few server-rendered pages (see :mod:`.pages`)."""

from mcp_code_sandbox.server.ui.pages import ui_routes

__all__ = ["ui_routes"]
