#!/usr/bin/env bash
# Install what is missing, then serve MCP on the embedded (bubblewrap) backend.
# stdio by default (what Claude Code and Claude Desktop start); any flags are passed on,
# e.g. `scripts/serve.sh --transport http --http-port 8080`.
# The sandbox runtime environment is not built here: a first start answers its client at
# once and builds it in the background, telling waiting calls its progress (as
# `uvx mcp-code-sandbox` does), so a client's start-up timeout never sees a failed server.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install.sh" --no-runtime
exec "$root/.venv/bin/mcp-code-sandbox" serve "$@"
