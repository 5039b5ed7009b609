"""Shared fixtures. Tests that need the real sandbox are marked ``bwrap``; they fail (never
skip) when bubblewrap or the runtime environment is missing: run ``mcp-code-sandbox setup``."""
