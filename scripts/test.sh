#!/usr/bin/env bash
# Install what is missing, then run the whole check: ruff, mypy (src/ and tests/), and the
# unit, integration (real bubblewrap) and end-to-end (real MCP client) tests. mypy reads
# pyproject's [tool.mypy]: strict on src/, relaxed (unannotated tests allowed) on tests/
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/install.sh --dev
.venv/bin/ruff check src tests bench
.venv/bin/ruff format --check src tests bench
.venv/bin/mypy
.venv/bin/pytest -ra "$@"
