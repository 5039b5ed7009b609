"""``mcp-code-sandbox doctor``: what the host enforces, check by check."""
