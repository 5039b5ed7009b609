"""The MCP layer: the only package that imports ``mcp``."""
