#!/usr/bin/env bash
# Install what is missing, then serve MCP on the embedded (bubblewrap) backend.
# stdio by default (what Claude Code and Claude Desktop start); any flags are passed on,
# e.g. `scripts/serve.sh --transport http --port 8080`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install.sh"
exec "$root/.venv/bin/mcp-code-sandbox" serve "$@"
