"""mcp-code-sandbox: an MCP server that runs LLM-written code in isolated, stateful sandboxes."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mcp-code-sandbox")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"

__all__ = ["__version__"]
