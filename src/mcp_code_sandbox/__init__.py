"""mcp-code-sandbox: an MCP server that runs LLM-written code in isolated, stateful sandboxes."""

#: The package's version: the one place it is written (pyproject.toml reads it from here).
__version__ = "0.1.0"

__all__ = ["__version__"]
